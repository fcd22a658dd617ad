"""The pyfunc model of a bundle (pipeline/models/pyfunc.py) on several architectures,
without MLflow's logging: embeddings [n, hidden] and per-text logits [tokens, vocab]."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from test_export_hf import bytelevel_bpe_dir

from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import save_bundle
from pipeline.models.pyfunc import BundleModel

pytestmark = pytest.mark.slow  # builds several models


@pytest.mark.parametrize(
    "arch,preset",
    [("bert", "bert-tiny"), ("gpt2", "gpt2-tiny"), ("xlnet", "xlnet-tiny"),
     ("transformer-xl", "transformer-xl-tiny"), ("word2vec", "word2vec-tiny")],
)  # fmt: skip
def test_embeddings_and_logits_for_each_architecture(tmp_path, arch, preset):
    tok = tmp_path / "tok"
    tok.mkdir()
    bytelevel_bpe_dir(tok)
    vocab = json.loads((tok / "tokenizer_meta.json").read_text())["vocab_size"]
    cfg = resolve_model_config({"arch": arch, "preset": preset}, vocab)
    torch.manual_seed(0)
    bundle = save_bundle(tmp_path / "b", arch, cfg, build_model(arch, cfg).state_dict(), tok)
    model = BundleModel()
    model.load_context(SimpleNamespace(artifacts={"bundle": str(bundle)}))
    texts = ["the lazy dog exports logits", "a"]
    emb = model.predict(None, pd.DataFrame({"text": texts}))
    assert emb.shape[0] == 2 and emb.dtype == np.float32 and np.isfinite(emb).all()
    assert np.allclose(emb, model.predict(None, texts))  # a list works as well
    if arch == "word2vec":  # vectors only
        with pytest.raises(ValueError, match="word2vec bundle has no logits"):
            model.predict(None, texts, params={"output": "logits"})
    else:
        logits = model.predict(None, texts, params={"output": "logits"})
        assert [x.shape[1] for x in logits] == [vocab, vocab]
        assert logits[1].shape[0] == 1
    with pytest.raises(ValueError, match="'embeddings' or 'logits'"):
        model.predict(None, texts, params={"output": "probabilities"})
