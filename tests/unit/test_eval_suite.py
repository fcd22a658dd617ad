"""The evaluation suite without a model run: the suite's validation, the checks that run
before any Ray task (`plm eval` exits 2 with one `plm:` line), the table, the selection
rule, and the official GLUE / CLUE metrics as the fine-tuning stage computes them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.cli import main
from pipeline.eval.cells import CellSpec
from pipeline.eval.plan import TaskPlan, plan_tasks
from pipeline.eval.results import format_table, select_best, summarize
from pipeline.eval.runner import CellResult
from pipeline.eval.sources import Candidate
from pipeline.eval.suite import EvalError, validate_suite
from pipeline.finetune.config import TaskSection
from pipeline.finetune.infer import score

TEXTS = ["the cat reads a book", "a dog sees the tree", "our model builds a list",
         "the parser checks the file", "a student likes the sky", "the river runs slowly"]  # fmt: skip


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def topic_files(tmp_path: Path, test_labels=("a", "b")) -> tuple[str, str]:
    train = jsonl(tmp_path / "train.jsonl", [{"text": t, "label": "ab"[i % 2]}
                                             for i, t in enumerate(TEXTS)])  # fmt: skip
    test = jsonl(tmp_path / "test.jsonl", [{"text": t, "label": test_labels[i % 2]}
                                           for i, t in enumerate(TEXTS)])  # fmt: skip
    return train, test


def suite_raw(tmp_path: Path, **task) -> dict:
    train, test = topic_files(tmp_path)
    t = {"kind": "finetune", "task": {"type": "classification"},
         "data": {"train": train, "test": test}} | task  # fmt: skip
    return {"name": "s", "tasks": {"topic": t}, "work_dir": str(tmp_path / "work")}


def plm_line(capsys, *argv: str) -> str:
    """The `plm:` message of a refused command (a config error's lines: the file, then the
    key, as every stage prints them), exit 2, no traceback."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plm: ") and "Traceback" not in err, err
    return " ".join(err.splitlines())


# --- the suite's own checks ------------------------------------------------------------


def test_a_misspelled_key_is_named(tmp_path):
    raw = suite_raw(tmp_path)
    raw["tasks"]["topic"]["seedz"] = [1]
    with pytest.raises(EvalError, match="seedz"):
        validate_suite(raw)


def test_a_metric_the_task_does_not_report_is_refused(tmp_path):
    with pytest.raises(EvalError, match="entity_f1.*accuracy"):
        validate_suite(suite_raw(tmp_path, metric="entity_f1"))


def test_select_names_a_task_of_the_suite(tmp_path):
    raw = suite_raw(tmp_path) | {"select": {"task": "topik"}}
    with pytest.raises(EvalError, match="topik.*topic"):
        validate_suite(raw)


def test_a_benchmark_task_needs_the_benchmark_folder(tmp_path):
    raw = suite_raw(tmp_path)
    raw["tasks"]["sst2"] = {"kind": "glue", "benchmark_task": "SST-2"}
    with pytest.raises(EvalError, match="benchmarks.glue"):
        validate_suite(raw)


def test_an_unknown_fine_tuning_key_in_the_budget_is_named(tmp_path):
    with pytest.raises(EvalError, match="epochz"):
        validate_suite(suite_raw(tmp_path) | {"budget": {"epochz": 3}})


def test_the_alias_defaults_to_best_even_with_an_mlflow_section(tmp_path):
    raw = suite_raw(tmp_path) | {"mlflow": {"tracking_uri": "sqlite:///x.db"}}
    assert validate_suite(raw).mlflow.alias == "best"


def test_seeds_per_task_override_the_suite_and_perplexity_has_one(tmp_path):
    raw = suite_raw(tmp_path, seeds=[5, 6]) | {"seeds": [0, 1, 2]}
    text = tmp_path / "held.txt"
    text.write_text("a line\n")
    raw["tasks"]["ppl"] = {"kind": "perplexity", "data": {"test": str(text)}}
    suite = validate_suite(raw)
    assert suite.seeds_of("topic") == [5, 6]
    assert suite.seeds_of("ppl") == [0]


# --- bad input: one plm: line, exit 2, before Ray ----------------------------------------


def write_suite(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_missing_data_file_is_one_line(tmp_path, capsys):
    raw = suite_raw(tmp_path)
    raw["tasks"]["topic"]["data"]["test"] = str(tmp_path / "nope.jsonl")
    line = plm_line(capsys, "eval", write_suite(tmp_path, raw), "--models", "random", "--no-ray")
    assert "nope.jsonl" in line and "does not exist" in line


def test_a_missing_column_is_one_line(tmp_path, capsys):
    raw = suite_raw(tmp_path, task={"type": "classification", "text_column": "sentence"})
    line = plm_line(capsys, "eval", write_suite(tmp_path, raw), "--models", "random", "--no-ray")
    assert "sentence" in line and "train.jsonl" in line


def test_a_test_label_absent_from_train_is_one_line(tmp_path, capsys):
    raw = suite_raw(tmp_path)
    _, test = topic_files(tmp_path / "..", test_labels=("a", "c"))
    raw["tasks"]["topic"]["data"]["test"] = test
    line = plm_line(capsys, "eval", write_suite(tmp_path, raw), "--models", "random", "--no-ray")
    assert "'c'" in line and "row 2" in line and "training data" in line


def test_a_typo_in_the_suite_is_one_line(tmp_path, capsys):
    raw = suite_raw(tmp_path) | {"seeeds": [1]}
    line = plm_line(capsys, "eval", write_suite(tmp_path, raw), "--models", "random")
    assert "seeeds" in line


def test_a_checkpoint_that_no_longer_exists_is_one_line(tmp_path, capsys):
    gone = tmp_path / "run" / "checkpoints" / "step00000100"
    gone.mkdir(parents=True)  # its folder left, its COMPLETE gone (keep_last pruned it)
    line = plm_line(capsys, "eval", write_suite(tmp_path, suite_raw(tmp_path)), "--models",
                    str(gone), "--no-ray")  # fmt: skip
    assert "step00000100" in line and "COMPLETE" in line


def test_a_source_that_is_not_there_is_one_line(tmp_path, capsys):
    line = plm_line(capsys, "eval", write_suite(tmp_path, suite_raw(tmp_path)), "--models",
                    str(tmp_path / "no-run"), "--no-ray")  # fmt: skip
    assert "no-run" in line


def test_random_alone_is_one_line(tmp_path, capsys):
    line = plm_line(capsys, "eval", write_suite(tmp_path, suite_raw(tmp_path)), "--models",
                    "random", "--no-ray")  # fmt: skip
    assert "random needs another source" in line


@pytest.fixture(scope="module")
def bert_bundle(tmp_path_factory) -> Path:
    import torch

    from pipeline.models.bundle import save_bundle
    from pipeline.models.registry import build_model, resolve_model_config
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("eval_bundle")
    (root / "c.txt").write_text("\n".join(TEXTS * 20))
    tok = train_tokenizer([str(root / "c.txt")], TokenizerSpec(kind="wordpiece", vocab_size=80),
                          root / "tok")  # fmt: skip
    meta = json.loads((Path(tok) / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, meta["vocab_size"])
    torch.manual_seed(0)
    return save_bundle(root / "bert", "bert", cfg, build_model("bert", cfg).state_dict(), tok)


def test_a_task_the_architecture_cannot_do_is_one_line(tmp_path, capsys, bert_bundle):
    raw = suite_raw(tmp_path)
    (tmp_path / "held.txt").write_text("the cat reads\n")
    raw["tasks"]["ppl"] = {"kind": "perplexity", "data": {"test": str(tmp_path / "held.txt")}}
    line = plm_line(capsys, "eval", write_suite(tmp_path, raw), "--models", str(bert_bundle),
                    "--no-ray")  # fmt: skip
    assert "perplexity" in line and "'bert'" in line and "gpt2" in line


# --- the table and the selection rule ------------------------------------------------------


def result(cand: int, task: str, seed: int, scores: dict | None) -> CellResult:
    spec = CellSpec(cand, task, seed, "finetune", "b", "pretrained", "s")
    return CellResult(spec, scores, None if scores else "ValueError: boom")


def cands(*steps) -> list[Candidate]:
    out = [Candidate("random", None, 0, "random")]
    return out + [Candidate(f"step{s}", None, s) for s in steps]


PLANS = {"a": TaskPlan("a", "finetune", "accuracy", []),
         "p": TaskPlan("p", "perplexity", "perplexity", [])}  # fmt: skip


def test_mean_and_spread_over_seeds_and_failed_cells_counted():
    rows = summarize([result(1, "a", 0, {"accuracy": 0.5}), result(1, "a", 1, {"accuracy": 0.7}),
                      result(1, "a", 2, None)])  # fmt: skip
    (row,) = rows
    assert row.mean == pytest.approx(0.6) and row.std == pytest.approx(np.std([0.5, 0.7], ddof=1))
    assert row.failed == 1 and row.seeds == [0, 1]


def test_a_cell_whose_every_seed_failed_shows_failed():
    rows = summarize([result(1, "a", 0, None), result(2, "a", 0, {"accuracy": 1.0})])
    table = format_table(rows, cands(10, 20), {"a": PLANS["a"]})
    line = next(x for x in table.splitlines() if x.startswith("step10"))
    assert "failed (1)" in line
    assert math.isnan(rows[0].mean)


def test_the_best_is_ranked_over_tasks_lower_perplexity_better_random_excluded():
    results = [
        result(0, "a", 0, {"accuracy": 0.9}), result(0, "p", 0, {"perplexity": 1.0}),  # random
        result(1, "a", 0, {"accuracy": 0.6}), result(1, "p", 0, {"perplexity": 50.0}),
        result(2, "a", 0, {"accuracy": 0.7}), result(2, "p", 0, {"perplexity": 40.0}),
        result(3, "a", 0, {"accuracy": 0.8}), result(3, "p", 0, {"perplexity": 45.0}),
    ]  # fmt: skip
    rows, c = summarize(results), cands(10, 20, 30)
    # step20: ranks 2 and 1 (mean 1.5); step30: 1 and 2 (1.5); tie -> the later checkpoint
    assert select_best(rows, PLANS, c, None) == 3
    assert select_best(rows, PLANS, c, "p") == 2  # the lowest perplexity alone
    assert select_best(rows, PLANS, c, "a") == 3


def test_ties_share_a_rank_and_go_to_the_later_checkpoint():
    results = [result(i, "a", 0, {"accuracy": 0.5}) for i in (1, 2, 3)]
    assert select_best(summarize(results), {"a": PLANS["a"]}, cands(10, 20, 30), None) == 3


# --- GLUE / CLUE through the suite: the official metric of each task ----------------------


def test_every_glue_task_is_planned_with_its_official_metric(tmp_path):
    """Rows in the distribution's format -> the suite's plan: the task section, the metric
    that ranks, the files its digest covers."""
    from tests.unit.test_eval_benchmarks import GLUE, write_task

    glue = tmp_path / "glue_data"
    for task, (files, _) in GLUE.items():
        write_task(glue, task, files)
    raw = {"name": "g", "benchmarks": {"glue": str(glue)}, "work_dir": str(tmp_path / "w"),
           "tasks": {t.replace("-", "").lower(): {"kind": "glue", "benchmark_task": t}
                     for t in GLUE}}  # fmt: skip
    plans = plan_tasks(validate_suite(raw), tmp_path / "w")
    want = {"cola": "mcc", "sst2": "accuracy", "mrpc": "f1", "stsb": "pearson", "qqp": "f1",
            "mnli": "matched_accuracy", "qnli": "accuracy", "rte": "accuracy", "wnli": "accuracy"}  # fmt: skip
    assert {n: p.metric for n, p in plans.items()} == want
    assert plans["mrpc"].task["positive_label"] == "1"
    assert plans["stsb"].task["type"] == "regression"
    assert list(plans["mnli"].evals) == ["matched", "mismatched"]
    assert all(len(p.digest) == 64 for p in plans.values())


def _rows(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_cola_scores_matthews_correlation_by_hand():
    task = TaskSection(type="classification")
    gold = ["1", "1", "1", "0", "0", "1", "0", "1"]
    pred = ["1", "0", "1", "0", "1", "1", "0", "1"]
    rows = [{"text": "x", "label": g} for g in gold]
    got = score([{"prediction": p} for p in pred], rows, task, ["0", "1"])
    tp, tn, fp, fn = 4, 2, 1, 1  # positive "1"
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert got["mcc"] == pytest.approx(mcc)
    assert "f1" not in got  # no positive_label: no binary F1


def test_mrpc_scores_the_f1_of_the_paraphrase_class_by_hand():
    task = TaskSection(type="classification", text_pair_column="text_pair", positive_label="1")
    gold = ["1", "0", "1", "1", "0", "0"]
    pred = ["1", "1", "0", "1", "0", "0"]
    rows = [{"text": "x", "text_pair": "y", "label": g} for g in gold]
    got = score([{"prediction": p} for p in pred], rows, task, ["0", "1"])
    tp, fp, fn = 2, 1, 1
    assert got["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert got["accuracy"] == pytest.approx(4 / 6)


def test_stsb_scores_pearson_and_spearman_by_hand():
    task = TaskSection(type="regression", text_pair_column="text_pair")
    gold, pred = [0.0, 1.5, 3.0, 4.8], [0.5, 1.0, 3.5, 4.0]
    rows = [{"text": "x", "text_pair": "y", "label": g} for g in gold]
    got = score([{"prediction": p} for p in pred], rows, task, [])
    g, p = np.array(gold), np.array(pred)
    r = ((g - g.mean()) * (p - p.mean())).sum() / math.sqrt(
        ((g - g.mean()) ** 2).sum() * ((p - p.mean()) ** 2).sum()
    )
    assert got["pearson"] == pytest.approx(r)
    assert got["spearman"] == pytest.approx(1.0)  # the same order


def test_a_clue_task_is_planned_from_its_jsonl_layout(tmp_path):
    from tests.unit.test_eval_benchmarks import CLUE, write_task

    clue = tmp_path / "clue"
    for folder, files, _ in CLUE.values():
        write_task(clue, folder, files)
    raw = {"name": "c", "benchmarks": {"clue": str(clue)}, "work_dir": str(tmp_path / "w"),
           "tasks": {t.lower(): {"kind": "clue", "benchmark_task": t} for t in CLUE}}  # fmt: skip
    plans = plan_tasks(validate_suite(raw), tmp_path / "w")
    assert all(p.metric == "accuracy" for p in plans.values())
    afqmc = _rows(plans["afqmc"].data["train"])
    assert set(afqmc[0]) >= {"text", "text_pair", "label"}
