"""`plm finetune` / `plm predict` end to end: a real `plm train` run registers a tiny BERT in
a sqlite MLflow store, fine-tuning starts from ``models:/NAME@ALIAS``, prediction from the
registered fine-tuned model; and one 2-rank run through the real `deepspeed` launcher."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
from conftest import REPO, deepspeed_launch, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")
VERBS = {"reads": "read", "writes": "write", "builds": "build"}  # label = the verb's stem


def task_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Sentences in the tiny corpus' vocabulary; the label is which verb the sentence uses."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the parser", "our model", "a student"]
    objects = ["the book", "a tree", "the token", "a list", "the file"]
    rows = []
    for i in range(n):
        verb = list(VERBS)[i % len(VERBS)]
        text = f"{rng.choice(subjects)} {verb} {rng.choice(objects)} today"
        rows.append({"text": text, "label": VERBS[verb]})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_task(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    return {
        split: write_jsonl(root / f"{split}.jsonl", task_rows(n, seed))
        for split, n, seed in (("train", 48, 1), ("valid", 12, 2), ("test", 12, 3))
    }


def ft_config(path: Path, source: str, task: dict[str, Path], out_dir: Path, **train) -> Path:
    import yaml

    cfg = {
        "name": "bert-tiny-verb",
        "model": {"source": source},
        "task": {"type": "classification", "max_length": 32},
        "data": {k: str(v) for k, v in task.items()},
        "train": {"epochs": 2, "micro_batch_size": 8, "lr": 1.0e-3, "out_dir": str(out_dir)}
        | train,
    }
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pretrained(tiny_data, tmp_path_factory) -> tuple[Path, str]:
    """(working dir whose ./mlflow.db holds models:/bert-tiny@current, the training run id)."""
    cwd = tmp_path_factory.mktemp("ft_registry")
    run_dir = cwd / "pretrain"
    plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        "train.max_steps=10", "train.save_every=0", "train.eval_every=0", cwd=cwd,
    )  # fmt: skip
    return cwd, (run_dir / "mlflow_run_id").read_text().strip()


def test_finetune_from_registry_then_predict(pretrained, tmp_path):
    from mlflow import MlflowClient

    cwd, pretrain_run = pretrained
    task = write_task(tmp_path / "task")
    out_dir = tmp_path / "ft"
    config = ft_config(tmp_path / "ft.yaml", "models:/bert-tiny@current", task, out_dir)
    proc = plm("finetune", str(config), cwd=cwd)
    assert "registered model bert-tiny-verb version 1 alias @current" in proc.stdout
    assert "test: accuracy" in proc.stdout

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    run = client.get_run((out_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["stage"] == "finetune" and tags["task"] == "classification"
    assert tags["pretraining_run_id"] == pretrain_run
    assert tags["source_model"] == "bert-tiny" and tags["source_model_version"] == "1"
    assert tags["source_uri"] == "models:/bert-tiny@current"
    for key in ("valid_accuracy", "valid_macro_f1", "test_accuracy", "train_loss"):
        assert key in run.data.metrics, key
    mv = client.get_model_version_by_alias("bert-tiny-verb", "current")
    assert str(mv.version) == "1" and mv.run_id == run.info.run_id
    assert mv.tags["pretraining_run_id"] == pretrain_run

    # the saved folder records its provenance and label map
    meta = json.dumps(
        __import__("yaml").safe_load((out_dir / "model" / "finetune.yaml").read_text())
    )
    assert pretrain_run in meta and '"labels": ["build", "read", "write"]' in meta

    # plm predict from the registry: jsonl in, csv out, without labels in the input
    rows = [{"text": r["text"]} for r in task_rows(7, seed=9)]
    inp = write_jsonl(tmp_path / "new.jsonl", rows)
    out = tmp_path / "preds.csv"
    proc = plm(
        "predict", "models:/bert-tiny-verb@current", "--input", str(inp), "--output", str(out),
        cwd=cwd,
    )  # fmt: skip
    with open(out, newline="", encoding="utf-8") as f:
        preds = list(csv.DictReader(f))
    assert len(preds) == 7
    assert [p["text"] for p in preds] == [r["text"] for r in rows]
    assert {p["prediction"] for p in preds} <= {"build", "read", "write"}
    assert all(0.0 < float(p["probability"]) <= 1.0 for p in preds)

    # csv in, jsonl out, from the local folder (the default output name next to the input)
    with open(tmp_path / "new.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["id", "text"])
        w.writeheader()
        w.writerows({"id": i, "text": r["text"]} for i, r in enumerate(rows))
    plm("predict", str(out_dir / "model"), "--input", str(tmp_path / "new.csv"), cwd=cwd)
    lines = (tmp_path / "new.predictions.jsonl").read_text().splitlines()
    got = [json.loads(x) for x in lines]
    assert len(got) == 7 and [g["id"] for g in got] == [str(i) for i in range(7)]
    assert {g["prediction"] for g in got} <= {"build", "read", "write"}
    # same model, same rows: the same predictions whichever way it was loaded
    assert [g["prediction"] for g in got] == [p["prediction"] for p in preds]

    # The registered version is an MLflow LoggedModel (the UI's "Logged models") whose
    # pyfunc flavour predicts what `plm predict` does, from a DataFrame or a list of rows.
    import mlflow
    import pandas as pd

    [logged] = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                           filter_string="name = 'bert-tiny-verb'")  # fmt: skip
    assert logged.source_run_id == run.info.run_id and mv.source == f"models:/{logged.model_id}"
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/bert-tiny-verb@current")
    frame = model.predict(pd.DataFrame(rows))
    assert list(frame["prediction"]) == [p["prediction"] for p in preds]
    assert frame["probability"].tolist() == pytest.approx([float(p["probability"]) for p in preds])
    assert list(model.predict(rows)["prediction"]) == list(frame["prediction"])


def test_finetune_bad_source_and_predict_bad_input_exit_2(pretrained, tmp_path):
    cwd, _ = pretrained
    task = write_task(tmp_path / "task")
    config = ft_config(tmp_path / "ft.yaml", "models:/no-such-model@current", task, tmp_path)
    proc = plm("finetune", str(config), cwd=cwd, check=False)
    assert proc.returncode == 2
    assert "models:/no-such-model@current" in proc.stderr and "does not exist" in proc.stderr
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"sentence": "a dog"}])
    proc = plm("predict", "models:/bert-tiny@current", "--input", str(bad), cwd=cwd, check=False)
    assert proc.returncode == 2
    assert "not a fine-tuned model" in proc.stderr or "fine-tuned" in proc.stderr


@pytest.mark.distributed
def test_two_ranks_deepspeed_launcher(pretrained, tmp_path):
    """2 ranks, ZeRO-2, through the real launcher: every rank reads the registry itself."""
    cwd, pretrain_run = pretrained
    task = write_task(tmp_path / "task")
    out_dir = tmp_path / "ft2"
    config = ft_config(
        tmp_path / "ft.yaml", "models:/bert-tiny@current", task, out_dir, micro_batch_size=4
    )
    proc = deepspeed_launch(
        ["--module", "pipeline.cli", "finetune", str(config),
         f"deepspeed={REPO}/configs/deepspeed/zero2.json", "mlflow.register=false"],
        cwd=cwd,
    )  # fmt: skip
    assert "world size 2" in proc.stdout
    assert "test: accuracy" in proc.stdout
    meta = __import__("yaml").safe_load((out_dir / "model" / "finetune.yaml").read_text())
    # 48 examples, 4 per rank and step, 2 ranks: 6 steps per epoch
    assert meta["steps"] == 12 and meta["source"]["run_id"] == pretrain_run
    assert (out_dir / "model" / "backbone" / "model.safetensors").is_file()
