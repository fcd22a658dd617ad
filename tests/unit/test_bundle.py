"""Model bundles: round trip, tied weights stored once, determinism, atomic replace, errors."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import load_bundle, save_bundle

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a model bundle holds the weights, the config and the tokenizer",
    "pretraining turns raw text into language models",
] * 4
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOD]"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny WordPiece tokenizer + meta in the INTERFACES.md format."""
    out = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        SENTENCES, trainers.WordPieceTrainer(vocab_size=120, special_tokens=SPECIALS)
    )
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    meta = {
        "kind": "wordpiece",
        "vocab_size": tok.get_vocab_size(),
        "lowercase": True,
        "special_tokens": ids,
        "roles": {
            "pad": ids["[PAD]"],
            "unk": ids["[UNK]"],
            "cls": ids["[CLS]"],
            "sep": ids["[SEP]"],
            "mask": ids["[MASK]"],
            "bos": ids["[CLS]"],
            "eos": ids["[SEP]"],
            "eod": ids["[EOD]"],
        },
        "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "spec": {},
    }
    (out / "tokenizer_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


def tiny_bert(vocab_size):
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, vocab_size)
    torch.manual_seed(0)
    return build_model("bert", cfg)


def vocab_of(tokenizer_dir):
    return json.loads((tokenizer_dir / "tokenizer_meta.json").read_text())["vocab_size"]


def test_round_trip_gives_identical_outputs(tmp_path, tokenizer_dir):
    model = tiny_bert(vocab_of(tokenizer_dir)).eval()
    out = save_bundle(
        tmp_path / "b",
        "bert",
        model.config,
        model.state_dict(),
        tokenizer_dir,
        extra_meta={"tokens_seen": 123},
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_meta.json",
    ]
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    loaded, config = load_bundle(out)
    assert not loaded.training
    assert config["arch"] == "bert" and config["meta"] == {"tokens_seen": 123}
    assert config["vocab"]["padded_vocab_size"] == model.config.padded_vocab_size
    assert config["vocab"]["roles"]["mask"] == 4
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    torch.testing.assert_close(loaded(x)["mlm_logits"], model(x)["mlm_logits"], rtol=0, atol=0)
    # the tied decoder is the embedding matrix after loading too
    assert (
        loaded.embeddings.word.weight.data_ptr()
        == loaded.state_dict()["embeddings.word.weight"].data_ptr()
    )


def test_tied_weight_stored_once_even_if_aliased(tmp_path, tokenizer_dir):
    model = tiny_bert(vocab_of(tokenizer_dir))
    state = dict(model.state_dict())
    # a wrapper that registers the tied matrix a second time (shares storage)
    state["lm_head.weight"] = state["embeddings.word.weight"]
    out = save_bundle(tmp_path / "b", "bert", model.config, state, tokenizer_dir)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "embeddings.word.weight" in keys
    assert keys == set(model.state_dict())
    load_bundle(out)


def test_bytes_are_deterministic_and_replace_is_atomic(tmp_path, tokenizer_dir):
    model = tiny_bert(vocab_of(tokenizer_dir))
    a = save_bundle(tmp_path / "a", "bert", model.config, model.state_dict(), tokenizer_dir)
    b = save_bundle(tmp_path / "b", "bert", model.config, model.state_dict(), tokenizer_dir)
    for name in ("config.yaml", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # saving over an existing bundle replaces it and leaves no temp folders behind
    with torch.no_grad():
        model.pooler.bias.fill_(1.0)
    save_bundle(a, "bert", model.config, model.state_dict(), tokenizer_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert (load_bundle(a)[0].pooler.bias == 1.0).all()


def test_mismatched_state_or_tokenizer_fails_before_writing(tmp_path, tokenizer_dir):
    model = tiny_bert(vocab_of(tokenizer_dir))
    state = dict(model.state_dict())
    del state["pooler.bias"]
    with pytest.raises(ValueError, match=r"missing \['pooler.bias'\]"):
        save_bundle(tmp_path / "x", "bert", model.config, state, tokenizer_dir)
    other = tiny_bert(vocab_of(tokenizer_dir) + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        save_bundle(tmp_path / "x", "bert", other.config, other.state_dict(), tokenizer_dir)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        save_bundle(tmp_path / "x", "bert", model.config, model.state_dict(), tmp_path)
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(FileNotFoundError, match="not a model bundle"):
        load_bundle(tmp_path)


def test_a_large_bundle_is_sharded_with_an_index_and_reads_back_exactly(tokenizer_dir, tmp_path):
    """Above max_shard_bytes the weights go to model-0000K-of-0000N.safetensors files and an
    index (transformers' layout); each file is a valid safetensors file (read by the
    library itself), and the bundle loads back to the same weights."""
    from safetensors.torch import load_file

    from pipeline.models.bundle import INDEX_FILE, read_tensors, weight_files

    vocab = json.loads((tokenizer_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    model = tiny_bert(vocab)
    state = model.state_dict()
    out = save_bundle(
        tmp_path / "b", "bert", model.config, state, tokenizer_dir, max_shard_bytes=64 * 1024
    )
    files = weight_files(out)
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    read = {}
    for f in files:
        part = load_file(str(f))
        assert all(index["weight_map"][n] == f.name for n in part)
        read.update(part)
    assert set(read) == set(state)
    assert all(torch.equal(read[n], state[n]) for n in state)
    assert [n for n, _ in read_tensors(out)] != []
    loaded, _ = load_bundle(out)
    assert all(torch.equal(loaded.state_dict()[n], state[n]) for n in state)
    # one file per tensor at most; a tensor larger than the limit has a file of its own
    tiny = save_bundle(
        tmp_path / "c", "bert", model.config, state, tokenizer_dir, max_shard_bytes=1
    )
    assert len(weight_files(tiny)) == len(state)


def test_a_bundle_writer_left_on_an_error_leaves_nothing(tokenizer_dir, tmp_path):
    from pipeline.models.bundle import BundleWriter

    vocab = json.loads((tokenizer_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    model = tiny_bert(vocab)
    state = model.state_dict()
    with pytest.raises(ValueError, match="out of order"):
        with BundleWriter(tmp_path / "b", "bert", model.config, tokenizer_dir) as w:
            w.add(w.names[1], state[w.names[1]])
    with pytest.raises(ValueError, match="missing"):
        with BundleWriter(tmp_path / "b", "bert", model.config, tokenizer_dir) as w:
            w.add(w.names[0], state[w.names[0]])
    assert list(tmp_path.iterdir()) == []
