import json
import re
from pydoc_data.topics import topics

import pytest

from pipeline.cli import main
from pipeline.prepare.clean import CleanConfig
from pipeline.prepare.readers import CORPORA_DIR, InputError, resolve_inputs
from pipeline.prepare.tokenizer import (
    ROLES,
    TokenizerSpec,
    load_tokenizer,
    sample_documents,
    train_tokenizer,
)

ZH = (CORPORA_DIR / "zh_sample.txt").read_text(encoding="utf-8").split("\n\n")
EN = [topics[k] for k in sorted(topics)[:20]]
EXPECTED_SPECIALS = {
    "wordpiece": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "bpe": ["<s>", "<pad>", "</s>", "<unk>", "<mask>", "<|endoftext|>"],
    "unigram": ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]", "<eod>"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "en.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in EN))
    (root / "zh.txt").write_text("\n\n".join(ZH), encoding="utf-8")
    return root


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_training_twice_gives_identical_bytes_and_a_complete_meta(corpus, tmp_path, kind):
    spec = TokenizerSpec(kind=kind, vocab_size=1500, text_field="body", sample_docs=50)
    a = train_tokenizer([str(corpus)], spec, tmp_path / "a")
    b = train_tokenizer([str(corpus)], spec, tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    tok, meta = load_tokenizer(a)
    assert set(meta) == {
        "kind", "vocab_size", "lowercase", "special_tokens", "roles", "sha256", "spec"
    }  # fmt: skip
    assert meta["kind"] == kind and meta["lowercase"] is False
    assert meta["vocab_size"] == tok.get_vocab_size() and 500 < meta["vocab_size"] <= 1500
    assert meta["special_tokens"] == {t: i for i, t in enumerate(EXPECTED_SPECIALS[kind])}
    assert set(meta["roles"]) == set(ROLES)
    for role, token_id in meta["roles"].items():
        assert token_id in meta["special_tokens"].values(), role
    assert meta["spec"] == spec.model_dump()
    # Encoding adds no special tokens: the objectives do.
    ids = tok.encode("Hello world. 你好。").ids
    assert ids and not set(ids) & set(meta["special_tokens"].values())


def test_roles_per_kind(corpus, tmp_path):
    wp = TokenizerSpec(kind="wordpiece", vocab_size=1000, text_field="body", sample_docs=20)
    _, meta = load_tokenizer(train_tokenizer([str(corpus / "en.jsonl")], wp, tmp_path / "w"))
    assert meta["roles"] == {
        "pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 3
    }  # fmt: skip
    bpe = TokenizerSpec(kind="bpe", vocab_size=1000, text_field="body", sample_docs=20)
    _, meta = load_tokenizer(train_tokenizer([str(corpus / "en.jsonl")], bpe, tmp_path / "b"))
    assert meta["roles"] == {
        "pad": 1, "unk": 3, "cls": 0, "sep": 2, "mask": 4, "bos": 0, "eos": 2, "eod": 5
    }  # fmt: skip


def test_kinds_tokenize_as_their_families_do(corpus, tmp_path):
    def train(kind, **kw):
        spec = TokenizerSpec(kind=kind, vocab_size=2000, text_field="body", **kw)
        return load_tokenizer(train_tokenizer([str(corpus)], spec, tmp_path / kind))[0]

    wp = train("wordpiece", lowercase=True)
    assert wp.encode("杭州西湖").tokens == ["杭", "州", "西", "湖"]  # CJK -> characters
    assert wp.encode("HELLO World").ids == wp.encode("hello world").ids
    bpe = train("bpe")
    assert bpe.encode(" the").tokens == ["Ġthe"]  # byte-level, space marker
    assert bpe.decode(bpe.encode("naïve 字节 ok").ids) == "naïve 字节 ok"  # lossless
    uni = train("unigram")
    assert uni.encode("the object").tokens[0].startswith("▁")  # Metaspace


def test_sample_is_seeded_and_independent_of_input_order(corpus):
    sources = resolve_inputs([str(corpus)], text_field="body")
    rev = list(reversed(sources))
    a = list(sample_documents(sources, 15, seed=1))
    assert len(a) == 15
    assert a == list(sample_documents(sources, 15, seed=1))
    assert set(a) == set(sample_documents(rev, 15, seed=1))  # a bottom-k hash sample
    assert set(a) != set(sample_documents(sources, 15, seed=2))
    everything = list(sample_documents(sources, 10_000, seed=1, cfg=CleanConfig()))
    assert len(everything) == len(EN) + len(ZH)  # n larger than the corpus: all, in order
    assert [d for d in everything if d in set(a)] == a  # yielded in corpus order


def test_a_different_seed_changes_the_tokenizer(corpus, tmp_path):
    def train(seed, out):
        spec = TokenizerSpec(
            kind="bpe", vocab_size=1200, text_field="body", sample_docs=10, seed=seed
        )
        return (
            train_tokenizer([str(corpus)], spec, tmp_path / out) / "tokenizer.json"
        ).read_bytes()

    assert train(1, "a") != train(2, "b")


def test_load_tokenizer_catches_a_swapped_file(corpus, tmp_path):
    spec = TokenizerSpec(kind="wordpiece", vocab_size=1000, text_field="body", sample_docs=10)
    out = train_tokenizer([str(corpus / "en.jsonl")], spec, tmp_path / "t")
    data = (out / "tokenizer.json").read_text()
    (out / "tokenizer.json").write_text(data.replace('"##s"', '"##z"', 1))
    with pytest.raises(InputError, match="sha256"):
        load_tokenizer(out)
    with pytest.raises(InputError, match="not found"):
        load_tokenizer(tmp_path / "nowhere")


def test_spec_validation():
    with pytest.raises(ValueError):
        TokenizerSpec(kind="sentencepiece", vocab_size=100)
    with pytest.raises(ValueError):
        TokenizerSpec(kind="bpe", vocab_size=100, vocab=3)


def test_no_usable_documents_is_an_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("a\n\nb\n")  # both shorter than min_chars
    with pytest.raises(InputError, match="no usable document"):
        train_tokenizer(
            [str(tmp_path / "tiny.txt")], TokenizerSpec(kind="bpe", vocab_size=300), tmp_path / "o"
        )


def test_cli_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    argv = ["data", "tokenizer", "--input", str(corpus / "zh.txt"), f"file://{corpus}/en.jsonl"]
    argv += ["--kind", "unigram", "--vocab-size", "1000", "--output", str(out)]
    argv += ["--sample-docs", "40", "--seed", "7", "--text-field", "body"]
    assert main(argv) == 0
    said = capsys.readouterr()
    assert str(out) in said.out
    # never silent: a line per stage on stderr, with the time since the start
    stages = [x for x in said.err.splitlines() if x.startswith("tokenizer: ")]
    assert [x.split(" ")[1] for x in stages] == ["sampling", "training", "rescoring"], said.err
    assert all(re.search(r"\(\d+ s\)$", x) for x in stages), stages
    tok, meta = load_tokenizer(out)
    assert meta["spec"]["seed"] == 7 and meta["spec"]["sample_docs"] == 40
    assert tok.encode("西湖").ids

    missing = tmp_path / "missing.jsonl"
    argv = ["data", "tokenizer", "--input", str(missing), "--kind", "bpe"]
    assert main(argv + ["--vocab-size", "500", "--output", str(tmp_path / "x")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
