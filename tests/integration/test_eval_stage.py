"""`plm eval` end to end on a real pretraining run (bert-tiny, 3 checkpoints, one with the
bundle training wrote beside it, two turned into bundles here): the suite on a local Ray
and in one process gives the same table; every checkpoint becomes an MLflow LoggedModel of
its run with its scores linked to the task's data set; the pretraining run charts
eval/* at the checkpoints' steps; the best checkpoint is models:/NAME@best; a cell that
fails is a failed cell and the others go on; the same run on a store (moto's S3 server)
gives the same table, and is watched there."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

VERBS = ("reads", "writes")
SUBJECTS = ["the cat", "a dog", "the parser", "our model", "a student"]
OBJECTS = ["the book", "a tree", "the token", "a list", "the file"]


def sentence(rng: random.Random, verb: str) -> str:
    return f"{rng.choice(SUBJECTS)} {verb} {rng.choice(OBJECTS)} today"


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def tasks(root: Path) -> dict[str, dict]:
    """A classification task (which verb) and a pair task (the same verb?), real files."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n, seed in (("train", 24, 1), ("test", 16, 2)):
        rng = random.Random(seed)
        verb = [{"text": sentence(rng, VERBS[i % 2]), "label": VERBS[i % 2]} for i in range(n)]
        pair = []
        for i in range(n):
            a, b = VERBS[i % 2], VERBS[(i // 2) % 2]
            pair.append({"text": sentence(rng, a), "text_pair": sentence(rng, b),
                         "label": "same" if a == b else "different"})  # fmt: skip
        out.setdefault("verb", {})[split] = write_jsonl(root / f"verb-{split}.jsonl", verb)
        out.setdefault("pair", {})[split] = write_jsonl(root / f"pair-{split}.jsonl", pair)
    return out


@pytest.fixture(scope="module", autouse=True)
def _module_environment():
    """The module's in-process training and fine-tuning set a rank's variables (RANK,
    MASTER_PORT, ...) before the per-test restore saves them; without this, every later
    `plm train` subprocess on this worker inherits them and meets a taken port."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def pretrained(tiny_data, tmp_path_factory) -> dict:
    """15 steps of bert-tiny, checkpoints at 5, 10, 15, a bundle beside the second only."""
    from pipeline.config import load_config
    from pipeline.train.trainer import train

    root = tmp_path_factory.mktemp("eval_stage")
    store = f"sqlite:///{root / 'mlflow.db'}"
    cfg = load_config(
        REPO / "configs/test/bert-tiny.yaml",
        [f"data.path={tiny_data}", f"train.out_dir={root / 'run'}", "train.max_steps=15",
         "train.save_every=5", "train.keep_last=3", "train.bundle_every=2",
         "train.eval_every=5", "train.log_every=5", f"mlflow.tracking_uri={store}"],
    )  # fmt: skip
    result = train(cfg)
    files = tasks(root / "tasks")
    suite = {
        "name": "stage",
        "seeds": [0, 1],
        "budget": {"epochs": 2, "micro_batch_size": 8, "lr": 1.0e-3},
        "tasks": {
            "verb": {"kind": "finetune", "task": {"type": "classification", "max_length": 32},
                     "data": {"train": files["verb"]["train"], "test": files["verb"]["test"]}},
            "pair": {"kind": "finetune", "task": {"type": "classification", "max_length": 48,
                                                  "text_pair_column": "text_pair"},
                     "data": {"train": files["pair"]["train"], "test": files["pair"]["test"]}},
        },
        "work_dir": str(root / "work"),
        "workers": {"cpus": 1},
        "mlflow": {"tracking_uri": store},
    }  # fmt: skip
    path = root / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return {"root": root, "run": root / "run", "store": store, "suite": path,
            "run_id": result.run_id}  # fmt: skip


def test_a_bundle_made_from_a_checkpoint_equals_the_one_training_wrote(pretrained, tmp_path):
    import torch

    from pipeline.eval.checkpoint_bundle import bundle_from_checkpoint
    from pipeline.models.bundle import read_bundle_config, read_tensors

    run = pretrained["run"]
    tag = "step00000010"
    assert (run / "bundles" / tag).is_dir()  # train.bundle_every=2: the second checkpoint's
    tokenizer = run / "bundles" / tag  # the tokenizer files travel in every bundle
    made = bundle_from_checkpoint(run / "checkpoints" / tag, tmp_path / "b", tokenizer)
    ours, theirs = dict(read_tensors(made)), dict(read_tensors(run / "bundles" / tag))
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert read_bundle_config(made)["meta"]["step"] == 10


@pytest.fixture(scope="module")
def evaluated(pretrained, ray_local) -> dict:
    """The suite on Ray (tracked) and in one process (untracked), same seeds."""
    from pipeline.eval.evaluate import evaluate
    from pipeline.eval.suite import load_suite

    suite = load_suite(pretrained["suite"])
    sources = ["random", str(pretrained["run"])]
    on_ray = evaluate(suite, sources, use_ray=True)
    alone = evaluate(suite, sources, use_ray=False, track=False)
    return {"ray": on_ray, "alone": alone, "suite": suite}


def _scores(result) -> dict:
    return {(r.cell.candidate, r.cell.task, r.cell.seed): r.scores for r in result.results}


def test_ray_gives_the_table_of_one_process(evaluated):
    ray_scores, alone = _scores(evaluated["ray"]), _scores(evaluated["alone"])
    assert len(ray_scores) == 4 * 2 * 2  # random + 3 checkpoints, 2 tasks, 2 seeds
    assert all(v is not None for v in ray_scores.values())
    assert ray_scores == alone  # same seeds, equal metrics
    labels = [c.label for c in evaluated["ray"].candidates]
    assert labels == ["random", "step00000005", "step00000010", "step00000015"]
    assert [c.step for c in evaluated["ray"].candidates] == [0, 5, 10, 15]


def test_every_checkpoint_is_a_logged_model_of_its_run_with_its_scores(pretrained, evaluated):
    from mlflow import MlflowClient

    client = MlflowClient(pretrained["store"])
    run = client.get_run(pretrained["run_id"])
    models = client.search_logged_models([run.info.experiment_id])
    ckpts = {m.name: m for m in models if m.model_type == "plm-checkpoint"}
    assert set(ckpts) == {f"bert-tiny-step0000000{s}" if s < 10 else f"bert-tiny-step000000{s}"
                          for s in (5, 10, 15)}  # fmt: skip
    m = ckpts["bert-tiny-step00000010"]
    assert m.source_run_id == pretrained["run_id"]
    assert m.tags["plm.step"] == "10" and m.tags["plm.checkpoint"].endswith("step00000010")
    assert m.tags["plm.data_fingerprint"]
    assert "eval_loss" in m.params and "mlm_loss" in m.params  # the losses at that step
    linked = {(x.key, x.step, x.dataset_name) for x in m.metrics}
    assert {("verb/accuracy", 10, "verb"), ("pair/accuracy", 10, "pair")} <= linked
    # the run's data set under "Datasets", by its fingerprint; the final model at its step
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.digest and inp.tags[0].value == "training"
    assert [o.step for o in run.outputs.model_outputs] == [15]


def test_the_pretraining_run_charts_the_scores_at_the_checkpoints_steps(pretrained, evaluated):
    from mlflow import MlflowClient

    client = MlflowClient(pretrained["store"])
    history = client.get_metric_history(pretrained["run_id"], "eval/verb/accuracy")
    assert sorted(h.step for h in history) == [0, 5, 10, 15]  # random at step 0
    table = evaluated["ray"].table
    assert table.is_file() and "verb" in table.read_text()
    eval_run = client.get_run(evaluated["ray"].run_id)
    assert eval_run.data.tags["stage"] == "eval" and eval_run.info.status == "FINISHED"
    files = {f.path for f in client.list_artifacts(eval_run.info.run_id, "eval")}
    assert {"eval/table.csv", "eval/cells.csv", "eval/scores.png", "eval/suite.json"} <= files
    assert {d.dataset.name for d in eval_run.inputs.dataset_inputs} == {"verb", "pair"}


def test_the_best_checkpoint_is_registered_as_best_and_loads(pretrained, evaluated, tmp_path):
    from pipeline.finetune.source import resolve_source

    best = evaluated["ray"].best
    assert evaluated["ray"].registered == "models:/bert-tiny@best"
    src = resolve_source("models:/bert-tiny@best", pretrained["store"], tmp_path / "dl")
    meta = yaml.safe_load((src.path / "config.yaml").read_text())["meta"]
    assert meta["step"] == best.step


def test_report_prints_the_table_of_the_newest_evaluation(pretrained, evaluated, capsys):
    from pipeline.cli import main

    assert main(["eval", "--report", pretrained["run_id"], "--tracking-uri",
                 pretrained["store"]]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert evaluated["ray"].run_id in out
    assert out.count("step00000010") >= 2 and "random" in out  # both tasks' rows


def test_a_failed_cell_is_a_failed_cell_and_the_others_go_on(pretrained, evaluated, ray_local):
    from pipeline.eval.runner import run_on_ray

    suite = evaluated["suite"]
    cells = [r.cell for r in evaluated["ray"].results[:3]]
    broken = replace(cells[1], bundle="/nonexistent", finetune={
        **cells[1].finetune, "model": {"source": "/nonexistent", "init": "pretrained"}})  # fmt: skip
    got = run_on_ray([cells[0], broken, cells[2]], suite.workers, None)
    assert got[0].scores and got[2].scores
    assert got[1].scores is None and "nonexistent" in got[1].error


def test_watch_scores_each_checkpoint_as_training_writes_it(pretrained, tiny_data, tmp_path):
    """`plm train` in its own process, `--watch` beside it (this process, one task, one
    seed): every checkpoint it wrote is scored, with the random baseline, by the end."""
    import os
    import subprocess
    import sys

    from pipeline.eval.evaluate import watch
    from pipeline.eval.runner import LAUNCHER_VARIABLES
    from pipeline.eval.suite import load_suite

    # this process trained in-process (the fixture): its rank's variables are not the run's
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}

    run = tmp_path / "run"
    log = open(tmp_path / "train.log", "w")  # noqa: SIM115 (a pipe unread would block it)
    train = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", str(REPO / "configs/test/bert-tiny.yaml"),
         f"data.path={tiny_data}", f"train.out_dir={run}", "train.max_steps=20",
         "train.save_every=5", "train.keep_last=4", "train.eval_every=0",
         "train.log_every=5", f"mlflow.tracking_uri={pretrained['store']}",
         "mlflow.register=false"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    suite = load_suite(pretrained["suite"], ["seeds=[0]", f"work_dir={tmp_path / 'w'}"])
    suite.tasks.pop("pair")  # one task: the watcher keeps up with a 20-step run
    # done when training's process ended (a run that failed ends the watch too)
    result = watch(suite, str(run), ["random"], use_ray=False, poll_s=0.5,
                   done=lambda _: train.poll() is not None)  # fmt: skip
    assert train.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-3000:]
    labels = [c.label for c in result.candidates]
    assert labels == ["random", "step00000005", "step00000010", "step00000015", "step00000020"]
    assert all(r.scores for r in result.results) and not result.skipped
    assert result.run_id  # one evaluation run holds them all


def test_a_checkpoint_pruned_before_its_turn_is_skipped_not_a_crash(pretrained, tmp_path,
                                                                    monkeypatch, capsys):  # fmt: skip
    from pipeline.eval import evaluate as ev
    from pipeline.eval.suite import load_suite

    run = pretrained["run"]
    gone = run / "checkpoints" / "step00000001"  # listed, then deleted by keep_last
    listed = [gone, run / "checkpoints" / "step00000015"]
    monkeypatch.setattr(ev, "run_checkpoints", lambda r: listed)
    session = ev.Session(load_suite(pretrained["suite"], [f"work_dir={tmp_path}"]), None,
                         use_ray=False, track=False)  # fmt: skip
    skipped: list[str] = []
    new = ev._new_checkpoints(run, set(), session, skipped)
    assert skipped == ["step00000001"] and [c.label for c in new] == ["step00000015"]
    assert (
        "skipped step00000001: deleted (train.keep_last) before its turn" in capsys.readouterr().out
    )


# --- a run on a store (train.out_dir=s3://...) -------------------------------------------


def _put_tree(s3, local: Path, uri: str, skip: str = "") -> None:
    """Every file under ``local`` to ``uri`` (the layout training writes there), in order,
    the files named ``skip`` left out."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        if path.name != skip:
            s3.put(f"{uri}/{path.relative_to(local).as_posix()}", path.read_bytes())


def test_a_run_on_a_store_gives_the_table_of_its_local_folder(pretrained, evaluated, s3,
                                                              tmp_path):  # fmt: skip
    from pipeline.eval.evaluate import evaluate
    from pipeline.eval.suite import load_suite

    uri = s3.upload(pretrained["run"], "run")
    suite = load_suite(pretrained["suite"], ["seeds=[0]", f"work_dir={tmp_path / 'w'}"])
    suite.tasks.pop("pair")
    got = evaluate(suite, [uri], use_ray=False, track=False)
    assert [c.checkpoint for c in got.candidates] == [
        f"{uri}/checkpoints/step0000000{s}" if s < 10 else f"{uri}/checkpoints/step000000{s}"
        for s in (5, 10, 15)
    ]
    local = _scores(evaluated["alone"])  # candidate 0 there is random: shift by one
    assert _scores(got) == {(i - 1, t, s): v for (i, t, s), v in local.items()
                            if i > 0 and t == "verb" and s == 0}  # fmt: skip
    mirror = next((tmp_path / "w" / "store").iterdir())
    assert not list(mirror.rglob("*.pt"))  # each checkpoint's weights dropped once bundled
    assert (mirror / "bundles" / "step00000010" / "config.yaml").is_file()  # training's own
    made = sorted(p.name for p in (tmp_path / "w" / "bundles").iterdir())
    assert made == ["bert-tiny-step00000005", "bert-tiny-step00000015"]

    one = evaluate(suite, [f"{uri}/checkpoints/step00000015"], use_ray=False, track=False)
    assert [c.label for c in one.candidates] == ["step00000015"]


def test_watch_of_a_run_on_a_store_scores_each_checkpoint_once_complete(pretrained, s3,
                                                                        tmp_path):  # fmt: skip
    """Checkpoints reach the store one after the other, each COMPLETE last as training
    writes them; the watcher takes each once complete and ends at the final bundle."""
    import threading
    import time

    from pipeline.eval.evaluate import watch
    from pipeline.eval.suite import load_suite

    run, uri = pretrained["run"], s3.prefix("run")
    suite = load_suite(pretrained["suite"], ["seeds=[0]", f"work_dir={tmp_path / 'w'}"])
    suite.tasks.pop("pair")

    def training() -> None:
        for name in ("metrics.jsonl", "mlflow_run_id"):
            s3.put(f"{uri}/{name}", (run / name).read_bytes())
        for tag in ("step00000005", "step00000010", "step00000015"):
            if (run / "bundles" / tag).is_dir():
                _put_tree(s3, run / "bundles" / tag, f"{uri}/bundles/{tag}")
            _put_tree(s3, run / "checkpoints" / tag, f"{uri}/checkpoints/{tag}", skip="COMPLETE")
            time.sleep(1.0)  # a watcher's look now sees the checkpoint without COMPLETE
            s3.put(f"{uri}/checkpoints/{tag}/COMPLETE",
                   (run / "checkpoints" / tag / "COMPLETE").read_bytes())  # fmt: skip
        _put_tree(s3, run / "bundles" / "final", f"{uri}/bundles/final")

    writer = threading.Thread(target=training)
    writer.start()
    try:
        result = watch(suite, uri, ["random"], use_ray=False, poll_s=0.3)
    finally:
        writer.join()
    labels = [c.label for c in result.candidates]
    assert labels == ["random", "step00000005", "step00000010", "step00000015"]
    assert all(r.scores for r in result.results) and not result.skipped
    assert result.candidates[1].checkpoint == f"{uri}/checkpoints/step00000005"


def test_a_store_checkpoint_deleted_while_fetched_is_skipped(pretrained, s3, tmp_path, capsys):
    from pipeline.eval.store_run import StoreMirror

    uri = s3.upload(pretrained["run"], "run")
    mirror = StoreMirror(uri, tmp_path)
    listing = mirror._files

    def pruned_midway(rel: str, recursive: bool = True):
        files = listing(rel, recursive)
        if rel == "checkpoints/step00000005":  # keep_last deletes it as it is fetched
            s3.delete(f"{uri}/checkpoints/step00000005/COMPLETE")
            for p, _ in files:
                if p.endswith(".pt"):
                    s3.delete(f"{uri}/{p}")
        return files

    mirror._files = pruned_midway
    assert mirror.sync() == ["step00000010", "step00000015"]
    assert mirror.skipped == ["step00000005"]
    assert "skipped step00000005: deleted from" in capsys.readouterr().out


def test_a_store_that_is_not_there_is_one_line(pretrained, s3, tmp_path, capsys):
    from pipeline.cli import main

    assert main(["eval", str(pretrained["suite"]), "--models", "s3://no-such-bucket/run",
                 "--no-ray"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("plm: --models=s3://no-such-bucket/run") and "not found" in err, err
    assert "Traceback" not in err


def test_the_mlflow_ui_charts_the_scores_and_lists_a_model_per_checkpoint(pretrained, evaluated,
                                                                          tmp_path):  # fmt: skip
    """Issue 48: the MLflow UI itself, in headless Chromium against a real `mlflow server`
    on the run's store. The pretraining run's "Model metrics" tab draws a chart per
    eval/<task>/<metric>, a point at each checkpoint's step (and the random baseline's 0);
    the experiment's "Models" tab has one row per checkpoint, from this run, with its
    scores. Screenshots (and the pages' HTML): run.png, models.png under tmp_path."""
    import mlflow_ui as ui

    if reason := ui.browser_missing():
        pytest.skip(reason)
    from mlflow import MlflowClient

    run_id = pretrained["run_id"]
    client = MlflowClient(pretrained["store"])
    experiment_id = client.get_run(run_id).info.experiment_id
    steps = [0, 5, 10, 15]  # random, then the three checkpoints
    names = [f"bert-tiny-step{s:08d}" for s in (5, 10, 15)]

    with ui.mlflow_server(pretrained["store"], tmp_path) as base, ui.chromium(tmp_path) as driver:
        ui.close_assistant(driver, base)
        with ui.page(driver, base, f"/experiments/{experiment_id}/runs/{run_id}/model-metrics",
                     tmp_path / "run.png"):  # fmt: skip
            for key in ("eval/verb/accuracy", "eval/pair/accuracy"):
                # every logged point (the module's other evaluations log to this run too)
                logged = client.get_metric_history(run_id, key)
                assert {h.step for h in logged} >= set(steps), key
                assert ui.chart_points(driver, key, len(logged)) == len(logged), key
        with ui.page(driver, base, f"/experiments/{experiment_id}/models", tmp_path / "models.png"):
            for name in names:
                model_id = ui.logged_model_row(driver, name, run_id)
                stored = {m.key: m.value for m in client.get_logged_model(model_id).metrics}
                for key in ("verb/accuracy", "pair/accuracy"):
                    shown = ui.logged_model_metric(driver, model_id, key)
                    assert shown == pytest.approx(stored[key], abs=1e-3), (name, key, shown)
