"""Export of ELECTRA, DistilBERT and ERNIE to transformers: the loaded models give our
logits (fp32, 1e-4), tokenizers load offline."""

import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.export.hf import export_to_hf
from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import save_bundle

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # importing transformers' model code takes seconds of CPU

SENTENCES = ["the quick brown fox jumps over the lazy dog", "same logits as ours"] * 4
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tokenizer_dir(out):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        SENTENCES, trainers.WordPieceTrainer(vocab_size=120, special_tokens=SPECIALS)
    )
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    roles = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
    meta = {
        "kind": "wordpiece",
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {s: tok.token_to_id(s) for s in SPECIALS},
        "roles": {r: tok.token_to_id(s) for r, s in roles.items()},
        "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (out / "tokenizer_meta.json").write_text(json.dumps(meta))
    return out


def make_bundle(tmp_path, arch, preset):
    tok = tokenizer_dir(tmp_path / "tok")
    vocab = json.loads((tok / "tokenizer_meta.json").read_text())["vocab_size"]
    cfg = resolve_model_config({"arch": arch, "preset": preset}, vocab)
    assert cfg.padded_vocab_size > vocab
    torch.manual_seed(0)
    model = build_model(arch, cfg).eval()
    with torch.no_grad():  # random biases and LayerNorms too, so a mixed-up mapping shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model, save_bundle(tmp_path / "bundle", arch, cfg, model.state_dict(), tok)


def inputs(V, segments=True):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, V, (3, 20), generator=g)
    mask = torch.ones_like(x)
    mask[1, 14:] = 0
    mask[2, 5:] = 0
    tt = torch.zeros_like(x)
    tt[:, 9:] = 1
    return x, (tt if segments else None), mask


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_electra_exports_discriminator_and_generator(tmp_path):
    model, bundle = make_bundle(tmp_path, "electra", "electra-tiny")
    out = export_to_hf(bundle, tmp_path / "hf")
    disc = transformers.ElectraForPreTraining.from_pretrained(out).eval()
    gen = transformers.ElectraForMaskedLM.from_pretrained(out / "generator").eval()
    V = model.config.vocab_size
    assert disc.config.hidden_size == 64 and gen.config.hidden_size == 16
    assert gen.generator_lm_head.weight.data_ptr() == (
        gen.electra.embeddings.word_embeddings.weight.data_ptr()
    )
    x, tt, mask = inputs(V)
    real = mask.bool()
    with torch.no_grad():
        ours = model(x, token_type_ids=tt, attention_mask=mask)
        ours_gen = model.generator_logits(x, tt, mask)
        theirs = disc(input_ids=x, token_type_ids=tt, attention_mask=mask).logits
        theirs_gen = gen(input_ids=x, token_type_ids=tt, attention_mask=mask).logits
    close(theirs[real], ours["rtd_logits"][real])
    close(theirs_gen[real], ours_gen[..., :V][real])
    tok = transformers.AutoTokenizer.from_pretrained(out / "generator")
    assert tok("the fox")["input_ids"][0] == tok.cls_token_id


def test_distilbert_exports_masked_lm(tmp_path):
    model, bundle = make_bundle(tmp_path, "distilbert", "distilbert-tiny")
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.DistilBertForMaskedLM.from_pretrained(out).eval()
    V = model.config.vocab_size
    assert hf.vocab_projector.weight.data_ptr() == (
        hf.distilbert.embeddings.word_embeddings.weight.data_ptr()
    )
    x, _, mask = inputs(V, segments=False)
    with torch.no_grad():
        ours = model(x, attention_mask=mask)["mlm_logits"][..., :V]
        theirs = hf(input_ids=x, attention_mask=mask).logits
    close(theirs[mask.bool()], ours[mask.bool()])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok("the fox", "lazy dog")
    assert "token_type_ids" not in enc and enc["input_ids"][0] == tok.cls_token_id


def test_ernie_exports_pretraining_heads(tmp_path):
    model, bundle = make_bundle(tmp_path, "ernie", "ernie-tiny")
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.ErnieForPreTraining.from_pretrained(out).eval()
    V = model.config.vocab_size
    x, tt, mask = inputs(V)
    with torch.no_grad():
        ours = model(x, token_type_ids=tt, attention_mask=mask)
        theirs = hf(input_ids=x, token_type_ids=tt, attention_mask=mask)
    real = mask.bool()
    close(theirs.prediction_logits[real], ours["mlm_logits"][..., :V][real])
    close(theirs.seq_relationship_logits, ours["nsp_logits"])
