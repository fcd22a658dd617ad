"""Export to transformers: the exported model gives our logits (fp32, 1e-4) and
AutoTokenizer loads the folder offline and encodes like our tokenizer."""

import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.export.hf import export_to_hf
from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import save_bundle

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # importing transformers' model code alone takes ~6 s of CPU

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "exported models must give the same logits as ours",
    "tokenizers do not add special tokens on encode",
] * 4


def _write(tok: Tokenizer, out, kind: str, roles: dict[str, str], specials: list[str]):
    tok.save(str(out / "tokenizer.json"))
    meta = {
        "kind": kind,
        "vocab_size": tok.get_vocab_size(),
        "lowercase": False,
        "special_tokens": {s: tok.token_to_id(s) for s in specials},
        "roles": {role: tok.token_to_id(s) for role, s in roles.items()},
        "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "spec": {},
    }
    (out / "tokenizer_meta.json").write_text(json.dumps(meta, sort_keys=True))
    return out


def wordpiece_dir(out):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOD]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        SENTENCES, trainers.WordPieceTrainer(vocab_size=150, special_tokens=specials)
    )
    roles = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]",
             "bos": "[CLS]", "eos": "[SEP]", "eod": "[EOD]"}  # fmt: skip
    return _write(tok, out, "wordpiece", roles, specials)


def bytelevel_bpe_dir(out):
    specials = ["<|endoftext|>", "<pad>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    roles = {"pad": "<pad>", "unk": "<unk>", "cls": "<|endoftext|>", "sep": "<|endoftext|>",
             "mask": "<mask>", "bos": "<|endoftext|>", "eos": "<|endoftext|>",
             "eod": "<|endoftext|>"}  # fmt: skip
    return _write(tok, out, "bpe", roles, specials)


def make_bundle(tmp_path, arch, max_shard_bytes=None, **overrides):
    tok_dir = (tmp_path / "tok").resolve()
    tok_dir.mkdir()
    (wordpiece_dir if arch == "bert" else bytelevel_bpe_dir)(tok_dir)
    vocab = json.loads((tok_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    preset = {"bert": "bert-tiny", "gpt2": "gpt2-tiny"}[arch]
    cfg = resolve_model_config({"arch": arch, "preset": preset, **overrides}, vocab)
    assert cfg.padded_vocab_size > vocab  # the padding really is exercised
    torch.manual_seed(0)
    model = build_model(arch, cfg).eval()
    with torch.no_grad():  # random biases and LayerNorms too, so a mixed-up mapping shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    shard = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    bundle = save_bundle(tmp_path / "bundle", arch, cfg, model.state_dict(), tok_dir, **shard)
    return model, bundle, tok_dir


def test_bert_export_matches_logits_and_tokenizer(tmp_path):
    model, bundle, tok_dir = make_bundle(tmp_path, "bert")
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.BertForPreTraining.from_pretrained(out).eval()
    V = model.config.vocab_size
    assert hf.config.vocab_size == V
    assert (
        hf.cls.predictions.decoder.weight.data_ptr()
        == hf.bert.embeddings.word_embeddings.weight.data_ptr()
    )

    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, V, (3, 20), generator=g)
    tt = torch.zeros_like(x)
    tt[:, 9:] = 1
    mask = torch.ones_like(x)
    mask[1, 14:] = 0  # padding in one row
    mask[2, 5:] = 0
    ours = model(x, token_type_ids=tt, attention_mask=mask)
    with torch.no_grad():
        theirs = hf(input_ids=x, token_type_ids=tt, attention_mask=mask)
    real = mask.bool()  # padded positions are garbage in both; compare the real ones
    torch.testing.assert_close(
        theirs.prediction_logits[real], ours["mlm_logits"][..., :V][real], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        theirs.seq_relationship_logits, ours["nsp_logits"], atol=1e-4, rtol=1e-4
    )

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    meta = json.loads((tok_dir / "tokenizer_meta.json").read_text())
    cls, sep = meta["roles"]["cls"], meta["roles"]["sep"]
    enc = tok("the quick fox", "same logits")
    a, b = ref.encode("the quick fox").ids, ref.encode("same logits").ids
    assert enc["input_ids"] == [cls, *a, sep, *b, sep]
    assert enc["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert (tok.pad_token_id, tok.mask_token_id) == (meta["roles"]["pad"], meta["roles"]["mask"])


def test_one_segment_type_export_gives_pairs_segment_b_type_0(tmp_path):
    """type_vocab_size 1: the exported tokenizer's pairs have segment B type 0 (type 1 was
    an IndexError in the exported model and ours), and both models agree on them."""
    model, bundle, _ = make_bundle(tmp_path, "bert", type_vocab_size=1)
    out = export_to_hf(bundle, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok("the quick fox", "same logits", return_tensors="pt")
    assert (enc["token_type_ids"] == 0).all()
    hf = transformers.BertForPreTraining.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(**enc).prediction_logits
    ours = model.eval()(enc["input_ids"], token_type_ids=enc["token_type_ids"])["mlm_logits"]
    V = model.config.vocab_size
    torch.testing.assert_close(theirs, ours[..., :V], atol=1e-4, rtol=1e-4)


def test_gpt2_export_matches_logits_and_tokenizer(tmp_path):
    model, bundle, tok_dir = make_bundle(tmp_path, "gpt2")
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    V = model.config.vocab_size
    assert hf.config.vocab_size == V
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()

    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, model(x)["logits"][..., :V], atol=1e-4, rtol=1e-4)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = "the lazy dog exports logits"
    assert tok(text)["input_ids"] == ref.encode(text).ids  # no special tokens added
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<pad>"


@pytest.mark.parametrize("arch,text", [("bert", "the [MASK] fox [SEP] [CLS]"),
                                       ("gpt2", "the <s> fox<|endoftext|> <mask> dog")])  # fmt: skip
def test_special_token_text_in_the_export_is_hfs_by_default_ours_on_request(tmp_path, arch, text):
    """ "[MASK]" typed in a prompt is the mask token in the exported tokenizer, as in every
    HF tokenizer (fill-mask needs it), and plain text, as in our load_tokenizer (training
    data cannot inject control tokens), with split_special_tokens=True: on the call, or
    saved by export_to_hf(..., split_special_tokens=True)."""
    from pipeline.prepare.tokenizer import load_tokenizer

    _, bundle, tok_dir = make_bundle(tmp_path, arch)
    ours, meta = load_tokenizer(tok_dir)
    want = ours.encode(text).ids
    specials = set(meta["special_tokens"].values()) - {meta["roles"]["unk"]}  # unknown chars
    assert not specials & set(want)  # our encoding: no control token from the text
    mask = meta["roles"]["mask"]

    tok = transformers.AutoTokenizer.from_pretrained(export_to_hf(bundle, tmp_path / "hf"))
    assert mask in tok(text, add_special_tokens=False)["input_ids"]  # HF's convention
    assert tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == want

    out = export_to_hf(bundle, tmp_path / "hf-plain", split_special_tokens=True)
    plain = transformers.AutoTokenizer.from_pretrained(out)
    assert plain(text, add_special_tokens=False)["input_ids"] == want
    if arch == "bert":  # the template's [CLS]/[SEP] are still the control tokens
        cls, sep = meta["roles"]["cls"], meta["roles"]["sep"]
        assert plain(text)["input_ids"] == [cls, *want, sep]
    asked = plain(text, add_special_tokens=False, split_special_tokens=False)["input_ids"]
    assert mask in asked  # on request, the mask text is the mask token


def test_the_bert_export_works_in_transformers_fill_mask_pipeline(tmp_path):
    """The first thing most users try, on the exported folder as it is: it was "No
    mask_token found" while the export saved split_special_tokens=True."""
    _, bundle, _ = make_bundle(tmp_path, "bert")
    out = export_to_hf(bundle, tmp_path / "hf")
    fill = transformers.pipeline("fill-mask", model=str(out), device="cpu")
    got = fill("Set the [MASK] property.")
    assert len(got) == 5 and all(set(p) >= {"score", "token", "token_str", "sequence"} for p in got)
    assert sum(p["score"] for p in got) <= 1.0 + 1e-6


def test_export_replaces_and_rejects_non_bundles(tmp_path):
    _, bundle, _ = make_bundle(tmp_path, "gpt2")
    out = export_to_hf(bundle, tmp_path / "hf")
    export_to_hf(bundle, out)  # again over the existing folder
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(FileNotFoundError, match="not a model bundle"):
        export_to_hf(tmp_path, tmp_path / "hf2")


def test_a_sharded_bundle_exports_sharded_weights_transformers_and_safetensors_read(tmp_path):
    """A bundle written in shards exports as transformers' sharded layout, cut at the
    bundle's shard size (unless told another): every file is a safetensors file the
    safetensors library reads, the index names each tensor's file, and from_pretrained
    gives our logits."""
    from safetensors import safe_open

    limit = 150_000
    model, bundle, _ = make_bundle(tmp_path, "bert", max_shard_bytes=limit)
    assert (bundle / "model.safetensors.index.json").is_file()
    out = export_to_hf(bundle, tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    seen, total = {}, 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = list(f.keys())
            sizes = [f.get_tensor(k).nbytes for k in keys]
        assert len(keys) == 1 or sum(sizes) <= limit  # a bigger tensor alone in its file
        seen |= dict.fromkeys(keys, name)
        total += sum(sizes)
    assert seen == index["weight_map"] and total == index["metadata"]["total_size"]

    hf = transformers.BertForPreTraining.from_pretrained(out).eval()
    V = model.config.vocab_size
    x = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs = hf(input_ids=x).prediction_logits
    torch.testing.assert_close(theirs, model(x)["mlm_logits"][..., :V], atol=1e-4, rtol=1e-4)

    one = export_to_hf(bundle, tmp_path / "hf1", max_shard_bytes=2**30)  # told another size
    assert sorted(p.name for p in one.glob("model*")) == ["model.safetensors"]


def test_plm_export_takes_a_run_folder_or_points_at_its_final_bundle(tmp_path, capsys):
    """`plm export --to hf RUN_DIR OUT` exports RUN_DIR/bundles/final; a run without it (not
    finished) and a folder that is neither say what to give: one `plm:` line, exit 2."""
    import shutil

    from pipeline.cli import main

    _, bundle, _ = make_bundle(tmp_path, "gpt2")
    run = tmp_path / "run"
    (run / "bundles").mkdir(parents=True)
    shutil.copytree(bundle, run / "bundles" / "step00000010")
    shutil.move(bundle, run / "bundles" / "final")
    assert main(["export", "--to", "hf", str(run), str(tmp_path / "hf")]) == 0
    assert f"(from {run / 'bundles' / 'final'})" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").is_file()

    shutil.rmtree(run / "bundles" / "final")  # a run stopped before its end
    (run / "checkpoints").mkdir()
    assert main(["export", "--to", "hf", str(run), str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plm: export: "), err
    assert str(run / "bundles" / "final") in err[0] and "step00000010" in err[0]

    assert main(["export", "--to", "hf", str(tmp_path / "tok"), str(tmp_path / "hf3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RUN_DIR/bundles/final" in err[0], err
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "hf3").exists()
