"""`plm data prepare` with a real (local) Ray: the `web` preset keeps English only and the
manifest counts what each filter skipped for its languages; a refused prepare leaves
the output folder as it found it."""

import json

import pytest
from conftest import GOOD_DOC as GOOD

from pipeline.cli import main
from pipeline.data.shards import DataDir
from pipeline.prepare.config import load_prepare_config
from pipeline.prepare.prepare import run_prepare
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

pytestmark = pytest.mark.slow

LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua {i}. Ut enim ad minim veniam, quis "
    "nostrud exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. Duis "
    "aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu fugiat."
)
WEB = ["gopher_repetition", "gopher_quality", "c4", "fineweb"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    docs = [GOOD.format(i=i) for i in range(20)] + [LOREM.format(i=i) for i in range(100)]
    lines = [json.dumps({"text": d}) for d in docs]
    (root / "web.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = TokenizerSpec(kind="wordpiece", vocab_size=400, sample_docs=1000)
    tok = train_tokenizer([str(root / "web.jsonl")], spec, root / "wp")
    return root / "web.jsonl", tok


def test_web_preset_removes_lorem_ipsum_pages_and_counts_language_skips(
    ray_local, inputs, tmp_path
):
    corpus, tok = inputs
    base = {"inputs": [str(corpus)], "tokenizer": str(tok), "valid_fraction": 0.0}
    cfg = load_prepare_config("configs/data/web.yaml", {**base, "output": str(tmp_path / "d")})
    m = DataDir(run_prepare(cfg)).manifest
    assert m["rejected"] == {"language": 100}  # every lorem ipsum page: Latin
    assert {e["detail"] for e in m["reject_examples"]["language"]} == {"la"}
    assert m["totals"]["languages"] == {"en": 20}
    assert m["filter_language_skips"] == {}  # every kept page was English: all judged

    # `--languages all`: every language kept; the English rules skip the Latin pages, and
    # the manifest says so per filter and language.
    out = tmp_path / "all"
    assert main(["data", "prepare", "--config", "configs/data/web.yaml", "--input",
                 str(corpus), "--tokenizer", str(tok), "--output", str(out),
                 "--valid-fraction", "0", "--languages", "all"]) == 0  # fmt: skip
    m = DataDir(out).manifest
    assert m["totals"]["languages"] == {"en": 20, "la": 100}
    assert m["filter_language_skips"] == {name: {"la": 100} for name in WEB}
    assert m["data_config"]["languages"] == ["*"]


def _listing(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("before", ["absent", "empty", "foreign"])
def test_a_refused_prepare_leaves_the_output_as_it_found_it(
    ray_local, inputs, tmp_path, capsys, before
):
    """Input that gives no document: one `plm:` line, exit 2, and no folder, file or
    empty split folder left behind (tokenizer/ train/ units/ valid/ were)."""
    _, tok = inputs
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    out = tmp_path / "out"
    args = ["data", "prepare", "--input", str(empty), "--tokenizer", str(tok),
            "--output", str(out)]  # fmt: skip
    if before != "absent":
        out.mkdir()
    if before == "foreign":
        (out / "notes.txt").write_text("mine")
        args.append("--force")  # prepare may write next to foreign files
    found = _listing(out) if out.exists() else None
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no data dir was written" in err
    if before == "absent":
        assert not out.exists()
    else:
        assert _listing(out) == found
