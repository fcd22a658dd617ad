"""`plm data inspect` explains its counts: the documents kept against the shards' docs
(a long document is cut into pieces), the text of too_short and duplicate examples, and
what to do with a corpus that is not UTF-8 (issue 52, frictions). A real `plm data
prepare` (local Ray, a real tokenizer) on a corpus that has all of these."""

import re

import numpy as np
import pytest

from pipeline.data.shards import DataDir
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.inspect import inspect_data
from pipeline.prepare.prepare import run_prepare
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

pytestmark = pytest.mark.slow

WORDS = (
    "the model reads text and learns which word comes next while the data stage "
    "writes shards that every objective can use again and again without a new pass"
).split()


def paragraph(i: int, n_sent: int = 3) -> str:
    rng = np.random.default_rng(i)
    sents = []
    for _ in range(n_sent):
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), 8)]
        sents.append(" ".join(words).capitalize() + f" number {i}.")
    return " ".join(sents)


LATIN = "Le café de la gare est très bon, même le matin, dit la fenêtre numéro {}."


@pytest.fixture(scope="module")
def prepared(ray_local, tmp_path_factory):
    """A data dir from: a.txt (20 short paragraphs, 3 long ones, one too short, one
    repeat of paragraph 0) and latin.txt (4 paragraphs in Latin-1)."""
    root = tmp_path_factory.mktemp("inspect")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(paragraph(i) for i in range(200)), encoding="utf-8")
    spec = TokenizerSpec(kind="wordpiece", vocab_size=300, sample_docs=1000)
    tok = train_tokenizer([str(corpus)], spec, root / "tok")
    src = root / "src"
    src.mkdir()
    docs = [paragraph(i) for i in range(20)] + [paragraph(100 + i, 12) for i in range(3)]
    docs += ["Hi there.", paragraph(0)]  # too short (under 16 characters), a repeat
    (src / "a.txt").write_text("\n\n".join(docs) + "\n", "utf-8")
    latin = "\n\n".join(LATIN.format(i) for i in range(4)) + "\n"
    (src / "latin.txt").write_bytes(latin.encode("latin-1"))
    cfg = PrepareConfig(
        inputs=[str(src)], tokenizer=str(tok), output=str(root / "data"),
        shard_docs=7, valid_fraction=0.2, max_doc_tokens=64,
    )  # fmt: skip
    return DataDir(run_prepare(cfg)), src


def shown(data: DataDir, capsys) -> str:
    capsys.readouterr()
    assert inspect_data(data.root) == 0
    return capsys.readouterr().out


def test_the_kept_documents_and_the_shards_docs_are_told_apart(prepared, capsys):
    """'14,275 docs' next to 'languages other 14,219': the languages count documents,
    the shards hold pieces; inspect says how many of each and why they differ."""
    data, _ = prepared
    totals = data.manifest["totals"]
    kept, n_docs = totals["documents_kept"], totals["n_docs"]
    assert kept == 20 + 3 == sum(totals["languages"].values())  # a.txt's, less 2 rejects
    assert n_docs > kept  # the 3 long paragraphs are cut at 64 tokens
    out = shown(data, capsys)
    line = next(x for x in out.splitlines() if x.startswith("kept "))
    assert line.startswith(f"kept         {kept:,} documents of {totals['documents_read']} read")
    assert f"{n_docs:,} docs in the shards ({n_docs - kept:,} more)" in line, line
    assert "over max_doc_tokens (64 tokens) is cut into pieces" in line, line
    assert f"languages    other {kept} (100.0%)" in out


def test_too_short_and_duplicate_examples_show_the_start_of_their_text(prepared, capsys):
    data, _ = prepared
    out = shown(data, capsys)
    short = next(x for x in out.splitlines() if " too_short " in x)
    assert re.search(r"a\.txt#23 line \d+ 'Hi there\.'$", short), short
    dup = next(x for x in out.splitlines() if " duplicate " in x)
    assert re.search(r"a\.txt#24 line \d+ '" + re.escape(paragraph(0)[:20]), dup), dup


def test_a_latin1_file_gets_the_byte_and_the_iconv_hint(prepared, capsys):
    data, _ = prepared
    assert data.manifest["rejected"]["invalid_utf8"] == 4
    out = shown(data, capsys)
    bad = next(x for x in out.splitlines() if " invalid_utf8 " in x)
    assert "latin.txt#0 line 1 [invalid continuation byte at byte 6 (0xe9, 'é' in Latin-1)]" in bad
    hint = next(x for x in out.splitlines() if x.startswith("  invalid_utf8: "))
    assert "iconv -f latin1 -t utf-8 IN > OUT" in hint, hint


def test_a_source_changed_since_prepare_shows_no_text(prepared, capsys, tmp_path):
    """The text is read back from the source: a file that is no longer the one prepared
    (another size) gives no text rather than the wrong one."""
    data, src = prepared
    a = src / "a.txt"
    before = a.read_bytes()
    try:
        a.write_bytes(before.replace(b"Hi there.", b"Hello there, friend."))
        out = shown(data, capsys)
    finally:
        a.write_bytes(before)
    short = next(x for x in out.splitlines() if " too_short " in x)
    assert re.search(r"a\.txt#23 line \d+$", short), short
