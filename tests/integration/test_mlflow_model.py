"""The final bundle is an MLflow model: a LoggedModel with a pyfunc flavour (embeddings or
logits), registered with its alias; `plm` commands still find the bundle through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def test_the_registered_model_is_a_pyfunc_logged_model(tiny_data, tmp_path):
    import mlflow
    from mlflow import MlflowClient
    from tokenizers import Tokenizer

    from pipeline.models.bundle import fetch_bundle, load_bundle

    run_dir = tmp_path / "run"
    plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        "train.max_steps=3", "train.eval_every=0", cwd=tmp_path)  # fmt: skip
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    experiment = client.get_experiment_by_name("bert-tiny").experiment_id
    [logged] = client.search_logged_models(experiment_ids=[experiment])
    assert logged.name == "bert-tiny" and logged.source_run_id == run_id
    names = {a.path for a in client.list_artifacts(run_id, "model")}  # the bundle folder
    assert "model/config.yaml" in names
    version = client.get_model_version_by_alias("bert-tiny", "current")
    assert version.source == f"models:/{logged.model_id}" and version.run_id == run_id
    assert version.tags["arch"] == "bert"

    texts = ["The cat reads the book today.", "A dog"]
    model = mlflow.pyfunc.load_model("models:/bert-tiny@current")
    emb = model.predict(texts)
    assert emb.shape == (2, 64) and emb.dtype == np.float32 and np.isfinite(emb).all()
    logits = model.predict(texts, params={"output": "logits"})

    # The same numbers as the bundle itself: mean of the last hidden states over tokens.
    ours, config = load_bundle(run_dir / "bundles" / "final")
    tok = Tokenizer.from_file(str(run_dir / "bundles" / "final" / "tokenizer.json"))
    for i, text in enumerate(texts):
        ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
        with torch.no_grad():
            out = ours(ids, attention_mask=torch.ones_like(ids))
        expect = out["hidden_states"][0].mean(0).numpy()
        np.testing.assert_allclose(emb[i], expect, rtol=1e-4, atol=1e-5)
        vocab = config["model"]["vocab_size"]
        assert logits[i].shape == (ids.shape[1], vocab)

    # plm's own loaders find the bundle inside the MLflow model.
    folder = fetch_bundle("models:/bert-tiny@current", uri, tmp_path / "fetched")
    assert (folder / "config.yaml").is_file() and (folder / "model.safetensors").is_file()
