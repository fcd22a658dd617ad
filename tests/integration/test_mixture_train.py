"""`plm train` on a mixture of two prepared data dirs: dry-run plan, per-source metrics,
the mixture in MLflow, exact resume (real DeepSpeed on the CPU, real MLflow, real Ray
prepare for the second corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, deepspeed_launch, metrics_rows, plm, synthetic_corpus
from test_train import train_in_process

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


@pytest.fixture(scope="module")
def second_data(tiny_data, tmp_path_factory) -> Path:
    """Another corpus prepared with tiny_data's tokenizer (a mixture needs one tokenizer)."""
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.prepare import run_prepare

    root = tmp_path_factory.mktemp("second")
    corpus = root / "corpus.txt"
    corpus.write_text(synthetic_corpus(n_docs=120, seed=99), encoding="utf-8")
    cfg = PrepareConfig(
        inputs=[str(corpus)], tokenizer=str(tiny_data / "tokenizer"), output=str(root / "data"),
        valid_fraction=0.1, shard_docs=40, max_doc_tokens=128, num_cpus=1,
    )  # fmt: skip
    return Path(run_prepare(cfg))


def mixture(tiny_data, second_data) -> list[str]:
    return [
        "data.path=null",
        f"data.sources=[{{path: {tiny_data}, weight: 3, name: en}}, "
        f"{{path: {second_data}, name: other}}]",
    ]


def test_dry_run_shows_the_mixture(tiny_data, second_data, tmp_path):
    out = plm("train", BERT, *mixture(tiny_data, second_data), "train.max_steps=400",
              "--dry-run", cwd=tmp_path)  # fmt: skip
    assert "mixture of 2 sources" in out.stdout, out.stdout
    en = next(line for line in out.stdout.splitlines() if line.strip().startswith("en "))
    other = next(line for line in out.stdout.splitlines() if line.strip().startswith("other "))
    assert "weight 0.750" in en and "weight 0.250" in other
    assert "epochs (repeats, each reshuffled)" in en  # 400 steps x 16: many epochs of tiny data
    assert "sampled" in en and "natural share" in other
    out = plm("train", BERT, f"data.path={tiny_data}", *mixture(tiny_data, second_data)[1:],
              "--dry-run", cwd=tmp_path, check=False)  # fmt: skip
    assert out.returncode == 2 and "not both" in out.stderr


def test_mixed_run_logs_per_source_and_resumes_exactly(tiny_data, second_data, tmp_path):
    from mlflow import MlflowClient

    common = [*mixture(tiny_data, second_data), "train.max_steps=8", "train.eval_every=4",
              "train.save_every=4", "train.log_every=1", "mlflow.register=false"]  # fmt: skip
    train_in_process(tmp_path, BERT, None, *common, f"train.out_dir={tmp_path / 'full'}")
    train_in_process(tmp_path, BERT, 4, *common, f"train.out_dir={tmp_path / 'cut'}")
    train_in_process(tmp_path, BERT, None, *common, f"train.out_dir={tmp_path / 'cut'}")

    full, cut = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "cut")
    last = [r for r in full if "tokens_seen/en" in r][-1]
    en, other = last["tokens_seen/en"], last["tokens_seen/other"]
    assert en + other == last["tokens_seen"]
    assert 0.6 < en / (en + other) < 0.9  # 3:1 by examples; tokens per example vary
    evals = [r for r in full if "eval_loss" in r]
    assert evals and all("eval_loss/en" in r and "eval_loss/other" in r for r in evals)
    for r in evals:  # the unsuffixed metric is the weighted mean of the sources'
        assert r["eval_loss"] == pytest.approx(
            0.75 * r["eval_loss/en"] + 0.25 * r["eval_loss/other"]
        )
    # the interrupted run continues the same stream: same losses and per-source tokens
    step8 = [r for r in cut if r.get("step") == 8 and "tokens_seen/en" in r][-1]
    assert step8["tokens_seen/en"] == en and step8["step_loss"] == last["step_loss"]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((tmp_path / "full" / "mlflow_run_id").read_text().strip())
    assert run.data.params["data_mixture"] == "en:0.750, other:0.250"
    assert run.data.tags["data_fingerprint/en"] and run.data.tags["data_fingerprint/other"]
    assert "en:3:" in run.data.tags["data_fingerprint"]


@pytest.mark.distributed
def test_two_ranks_through_the_deepspeed_launcher_read_the_mixture(
    tiny_data, second_data, tmp_path
):
    """The deepspeed launch path: both ranks read their share of the same mixture."""
    out = tmp_path / "two"
    proc = deepspeed_launch(
        ["--module", "pipeline.cli", "train", BERT, *mixture(tiny_data, second_data),
         "train.max_steps=6", "train.eval_every=6", "train.save_every=6",
         "mlflow.register=false", f"train.out_dir={out}",
         f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=tmp_path,
    )  # fmt: skip
    assert "world size 2" in proc.stdout
    rows = metrics_rows(out)
    last = [r for r in rows if "tokens_seen/en" in r][-1]
    assert last["step"] == 6
    # the token counts are summed over both ranks, and split 3:1 by examples
    assert last["tokens_seen/en"] + last["tokens_seen/other"] == last["tokens_seen"]
    assert 0.6 < last["tokens_seen/en"] / last["tokens_seen"] < 0.9
    assert any("eval_loss/en" in r and "eval_loss/other" in r for r in rows)
