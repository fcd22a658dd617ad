"""Export of a `gpt` bundle to transformers' OpenAIGPTLMHeadModel: the same logits (fp32,
1e-4), the LM head tied, the tokenizer loads offline; configs HF cannot express refused."""

import json

import pytest
import torch
from test_export_hf import bytelevel_bpe_dir

from pipeline.export.hf import export_to_hf
from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import save_bundle

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # importing transformers' model code alone takes ~6 s of CPU


def gpt_bundle(tmp_path, **overrides):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir(exist_ok=True)
    bytelevel_bpe_dir(tok_dir)
    vocab = json.loads((tok_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    cfg = resolve_model_config({"arch": "gpt", "preset": "gpt-tiny", **overrides}, vocab)
    assert cfg.padded_vocab_size > vocab  # the padding really is exercised
    torch.manual_seed(0)
    model = build_model("gpt", cfg).eval()
    with torch.no_grad():  # random biases and LayerNorms too, so a mixed-up mapping shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    bundle = save_bundle(tmp_path / "bundle", "gpt", cfg, model.state_dict(), tok_dir)
    return model, bundle


def test_gpt_export_matches_logits(tmp_path):
    model, bundle = gpt_bundle(tmp_path)
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.OpenAIGPTLMHeadModel.from_pretrained(out).eval()
    V = model.config.vocab_size
    assert hf.config.vocab_size == V and hf.config.n_positions == model.config.max_positions
    assert hf.lm_head.weight.data_ptr() == hf.transformer.tokens_embed.weight.data_ptr()

    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(24).repeat(2, 1) % 7  # position ids are passed through as well
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
        theirs_pos = hf(input_ids=x, position_ids=pos).logits
    torch.testing.assert_close(theirs, model(x)["logits"][..., :V], atol=1e-4, rtol=1e-4)
    ours_pos = model(x, position_ids=pos)["logits"][..., :V]
    torch.testing.assert_close(theirs_pos, ours_pos, atol=1e-4, rtol=1e-4)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the lazy dog exports logits"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_gpt_configs_transformers_cannot_hold_are_refused(tmp_path):
    _, bundle = gpt_bundle(tmp_path, intermediate_size=200)
    with pytest.raises(ValueError, match="intermediate_size=200"):
        export_to_hf(bundle, tmp_path / "hf")
