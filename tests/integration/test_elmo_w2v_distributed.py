"""ELMo and word2vec: 2 ranks on the CPU through the real `deepspeed` launcher (ZeRO-2;
the session's ``family_runs``), a falling loss, validation perplexity in the metrics, a
bundle, `plm neighbors` on the run's MLflow artifact."""

from __future__ import annotations

import pytest
from conftest import falls, metrics_rows, plm, step_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("config", ["elmo", "word2vec"])
def test_two_ranks_zero2_loss_falls_and_reports_validation(tiny_data, family_runs, config):
    run_dir = family_runs[config]
    rows = metrics_rows(run_dir)
    losses = step_losses(run_dir)
    assert len(losses) == 10 and falls(losses), losses
    evals = [r for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    bundle = run_dir / "bundles" / "final"
    assert (bundle / "model.safetensors").is_file()
    if config == "elmo":  # both directions' perplexities, from the shared softmax
        assert {"eval_fwd_ppl", "eval_bwd_ppl", "eval_ppl"} <= set(evals[1])
        assert evals[1]["eval_ppl"] < 300  # the vocabulary has 300 tokens
        import torch

        from pipeline.data.shards import DataDir
        from pipeline.models.bundle import load_bundle
        from pipeline.models.elmo import build_char_table

        model, _ = load_bundle(bundle)  # the table built from the data's tokenizer
        table = build_char_table(DataDir(tiny_data).tokenizer_path.parent, model.config)
        assert torch.equal(model.char_ids, table)
    else:  # the model served from MLflow: nearest words by cosine
        run_id = (run_dir / "mlflow_run_id").read_text().strip()
        # the launch's working directory holds the MLflow store (./mlflow.db)
        proc = plm("neighbors", f"runs:/{run_id}/model", "cat", "--k", "5", cwd=run_dir.parent)
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 5 and all(len(line.split()) == 3 for line in lines)
