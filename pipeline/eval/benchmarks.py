"""GLUE and CLUE as their users have them on disk, read into the rows fine-tuning trains on,
with each task's official metrics.

``benchmark_task("glue", "MRPC", "glue_data", "runs/eval")`` reads ``glue_data/MRPC/train.tsv``
and ``dev.tsv`` (the layout GLUE's download_glue_data.py writes), checks every row and writes
``runs/eval/glue/MRPC/train.jsonl`` and ``dev.jsonl``: one ``{"text", "text_pair", "label"}``
object a line (no ``text_pair`` for single-sentence tasks; labels as strings, STS-B's score a
float), which ``plm finetune`` reads with task.text_column=text, task.text_pair_column=text_pair.
CLUE's folder holds one subfolder per task (``afqmc/``, ..., ``cluewsc2020/``) with
``train.json`` and ``dev.json``, one JSON object a line (as CLUE's download_clue_data.py
writes it). The column positions and field names are those of the official loaders
(GLUE's processors in ``transformers``, CLUE's baselines).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.finetune.config import FinetuneError

GLUE_TASKS = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI")
# CLUE's classification tasks (its span QA CMRC2018 and the cloze / multiple-choice ones are not)
CLUE_TASKS = ("AFQMC", "TNEWS", "IFLYTEK", "CMNLI", "OCNLI", "CSL", "WSC")
BENCHMARKS: dict[str, tuple[str, ...]] = {"glue": GLUE_TASKS, "clue": CLUE_TASKS}

# Tasks of the benchmarks that are not here: asking for one says why instead of "unknown".
_NOT_INCLUDED = {
    "glue": {"AX": "a diagnostic test set without training data"},
    "clue": {"CMRC2018": "span QA", "CHID": "an idiom cloze", "C3": "multiple choice"},
}
_ALIASES = {"clue": {"CLUEWSC2020": "WSC"}}  # CLUE's own name of its WSC release

_LAYOUT = {
    "glue": "glue_data/ as download_glue_data.py writes it: CoLA/, SST-2/, MRPC/, ... each "
    "with train.tsv and dev.tsv (MNLI/: dev_matched.tsv, dev_mismatched.tsv)",
    "clue": "a folder with one subfolder per task as CLUE distributes them: afqmc/, tnews/, "
    "iflytek/, cmnli/, ocnli/, csl/, cluewsc2020/, each with train.json and dev.json",
}


@dataclass(frozen=True)
class BenchmarkTask:
    """One benchmark task read and normalized: what fine-tuning trains on and what to report.

    ``skipped``: for every file read (its path under the benchmark folder, e.g.
    ``QQP/train.tsv``), the rows left out as the official loaders leave them out: QQP rows
    with other than its 6 fields (a few lines of the distributed files are broken) and CMNLI /
    OCNLI rows whose label is "-" (the annotators reached no majority); 0 where none were.
    """

    benchmark: str  # "glue" | "clue"
    name: str  # the task's official name: "CoLA", "SST-2", "MNLI", "AFQMC", ...
    type: str  # fine-tuning task type: "classification" | "regression"
    text_column: str  # column names in the written rows
    text_pair_column: str | None
    label_column: str
    positive_label: str | None  # the class whose F1 is reported (MRPC, QQP: "1"), else None
    metrics: tuple[str, ...]  # official metrics, the first the main one
    train: Path  # normalized jsonl written under out_dir
    evals: dict[str, Path]  # evaluation sets by name: {"dev": ...}; MNLI matched / mismatched
    skipped: dict[str, int]


# ----------------------------------------------------------------------------- the layouts


@dataclass(frozen=True)
class _Tsv:
    """Where a GLUE task's fields are: (column, its header name); column -1 is the last."""

    text: tuple[int, str]
    pair: tuple[int, str] | None
    label: tuple[int, str]
    header: bool = True
    type: str = "classification"
    width: int | None = None  # rows of another width are skipped, not an error (QQP)
    evals: tuple[tuple[str, str], ...] = (("dev", "dev.tsv"),)


_GLUE = {
    # CoLA: no header; source, label, the original acceptability mark, sentence
    "CoLA": _Tsv((3, "sentence"), None, (1, "label"), header=False),
    "SST-2": _Tsv((0, "sentence"), None, (1, "label")),
    "MRPC": _Tsv((3, "#1 String"), (4, "#2 String"), (0, "Quality")),
    "STS-B": _Tsv((7, "sentence1"), (8, "sentence2"), (-1, "score"), type="regression"),
    "QQP": _Tsv((3, "question1"), (4, "question2"), (5, "is_duplicate"), width=6),
    # MNLI: train has label1 then gold_label, dev label1..label5 then gold_label
    "MNLI": _Tsv(
        (8, "sentence1"),
        (9, "sentence2"),
        (-1, "gold_label"),
        evals=(("matched", "dev_matched.tsv"), ("mismatched", "dev_mismatched.tsv")),
    ),
    "QNLI": _Tsv((1, "question"), (2, "sentence"), (3, "label")),
    "RTE": _Tsv((1, "sentence1"), (2, "sentence2"), (3, "label")),
    "WNLI": _Tsv((1, "sentence1"), (2, "sentence2"), (3, "label")),
}


@dataclass(frozen=True)
class _Json:
    dirs: tuple[str, ...]  # the task's folder names in CLUE's releases
    fields: tuple[str, ...]  # the fields of its rows (named when one is missing)
    text: str = "sentence"
    pair: str | None = None  # the field the pair comes from (CSL: the keywords, WSC: the spans)
    drop_dash: bool = False  # label "-": no gold consensus, left out as CLUE's loaders do


_CLUE = {
    "AFQMC": _Json(("afqmc",), ("sentence1", "sentence2", "label"), "sentence1", "sentence2"),
    "TNEWS": _Json(("tnews",), ("label", "label_desc", "sentence", "keywords")),
    "IFLYTEK": _Json(("iflytek",), ("label", "label_des", "sentence")),
    "CMNLI": _Json(("cmnli",), ("sentence1", "sentence2", "label"), "sentence1", "sentence2", True),
    "OCNLI": _Json(("ocnli",), ("sentence1", "sentence2", "label"), "sentence1", "sentence2", True),
    "CSL": _Json(("csl",), ("id", "abst", "keyword", "label"), "abst", "keyword"),
    "WSC": _Json(
        ("wsc", "cluewsc2020", "cluewsc"), ("target", "idx", "label", "text"), "text", "target"
    ),
}

_METRICS = {
    "CoLA": ("mcc",),
    "MRPC": ("f1", "accuracy"),
    "QQP": ("f1", "accuracy"),
    "STS-B": ("pearson", "spearman"),
}
_POSITIVE = {"MRPC": "1", "QQP": "1"}


# ----------------------------------------------------------------------------- the entry


def benchmark_task(
    benchmark: str, name: str, folder: str | Path, out_dir: str | Path
) -> BenchmarkTask:
    """Read task ``name`` of ``benchmark`` from the user's copy ``folder``, check it, write its
    normalized jsonl under ``out_dir/<benchmark>/<name>/`` and say how to train and score it."""
    bench = _benchmark(benchmark)
    task = _task_name(bench, name)
    root = Path(folder)
    if not root.is_dir():
        state = "is not a folder" if root.exists() else "does not exist"
        raise FinetuneError(
            f"{bench.upper()} folder {root} {state}; point it at your copy of the benchmark as "
            f"distributed: {_LAYOUT[bench]}"
        )
    tdir = _task_dir(bench, task, root)
    if bench == "glue":
        spec = _GLUE[task]
        files = [("train", "train.tsv"), *spec.evals]
        kind, pair_col = spec.type, spec.pair
    else:
        jspec = _CLUE[task]
        files = [("train", "train.json"), ("dev", "dev.json")]
        kind, pair_col = "classification", jspec.pair
    for _, fname in files:
        if not (tdir / fname).is_file():
            raise FinetuneError(
                f"{tdir / fname} is missing: the {bench.upper()} layout has "
                f"{', '.join(f for _, f in files)} in {tdir} (re-extract {task} from the "
                "benchmark's download)"
            )

    splits: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    skipped: dict[str, int] = {}
    for split, fname in files:
        path = tdir / fname
        if bench == "glue":
            rows, skips = _read_tsv(path, task, _GLUE[task])
        else:
            rows, skips = _read_jsonl(path, task, _CLUE[task])
        skipped[f"{tdir.name}/{fname}"] = skips
        splits[split] = rows
    if kind == "classification":
        _check_eval_labels(splits, files, tdir)

    dest = Path(out_dir) / bench / task
    written = {split: _write(dest / f"{split}.jsonl", rows) for split, rows in splits.items()}
    return BenchmarkTask(
        benchmark=bench,
        name=task,
        type=kind,
        text_column="text",
        text_pair_column="text_pair" if pair_col else None,
        label_column="label",
        positive_label=_POSITIVE.get(task),
        metrics=_METRICS.get(task, ("accuracy",)),
        train=written.pop("train"),
        evals=written,
        skipped=skipped,
    )


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _benchmark(benchmark: str) -> str:
    bench = str(benchmark).lower()
    if bench not in BENCHMARKS:
        raise FinetuneError(f"unknown benchmark {benchmark!r}; use one of {', '.join(BENCHMARKS)}")
    return bench


def _task_name(bench: str, name: str) -> str:
    tasks, upper = BENCHMARKS[bench], str(name).upper()
    for t in tasks:
        if t.upper() == upper:
            return t
    if upper in _ALIASES.get(bench, {}):
        return _ALIASES[bench][upper]
    known = f"the {bench.upper()} tasks: {', '.join(tasks)}"
    for other, other_tasks in BENCHMARKS.items():
        if other != bench and any(_key(t) == _key(name) for t in other_tasks):
            raise FinetuneError(
                f"{name!r} is a {other.upper()} task, not a {bench.upper()} one: use benchmark "
                f"{other} ({known})"
            )
    for t, why in _NOT_INCLUDED[bench].items():
        if _key(t) == _key(name):
            raise FinetuneError(f"{bench.upper()}'s {t} is not included here ({why}); {known}")
    # "SST2" / "sts_b": the same letters as a task; else the closest spelling
    by_key = {_key(t): t for t in tasks}
    close = [by_key[_key(name)]] if _key(name) in by_key else []
    close = close or [by_key[k] for k in difflib.get_close_matches(_key(name), by_key, 1, 0.6)]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise FinetuneError(f"unknown {bench.upper()} task {name!r}{hint} ({known})")


def _task_dir(bench: str, task: str, root: Path) -> Path:
    """The task's folder: GLUE's are named as the task; CLUE's lower-case (upper-case and the
    zip's ``<name>_public`` accepted), WSC's also ``cluewsc2020``."""
    names = [task] if bench == "glue" else []
    if bench == "clue":
        for d in _CLUE[task].dirs:
            names += [d, d.upper(), f"{d}_public"]
    for n in names:
        if (root / n).is_dir():
            return root / n
    data = "train.tsv" if bench == "glue" else "train.json"
    hint = ""
    if (root / data).is_file():
        hint = f" ({root} holds a {data} itself: pass its parent, the folder of every task)"
    alts = "".join(f", nor {d}/" for d in (_CLUE[task].dirs[1:] if bench == "clue" else ()))
    raise FinetuneError(
        f"{root} has no {names[0]}/ folder{alts}: the {bench.upper()} layout expects "
        f"{root / names[0]}/ with the task's files ({_LAYOUT[bench]}){hint}"
    )


# ----------------------------------------------------------------------------- reading


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of a UTF-8 text file; blank lines left out."""
    if path.stat().st_size == 0:
        raise FinetuneError(f"{path} is empty; re-extract it from the benchmark's download")
    try:
        # utf-8-sig: MRPC's header starts with a byte-order mark. newline="\n": lines end at
        # "\n" only; a lone "\r" inside a GLUE sentence stays in it.
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            for i, line in enumerate(f, 1):
                line = line.rstrip("\n").rstrip("\r")
                if line.strip():
                    yield i, line
    except UnicodeDecodeError as err:
        raise FinetuneError(
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    except OSError as err:
        raise FinetuneError(f"cannot read {path}: {err.strerror or err}") from None


def _read_tsv(path: Path, task: str, spec: _Tsv) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    # Split on tabs only, no quote processing: GLUE's sentences hold raw, unmatched quotes.
    columns = [c for c in (spec.text, spec.pair, spec.label) if c is not None]
    names = ", ".join(n for _, n in columns)
    need = max(c for c, _ in columns) + 1
    if spec.label[0] == -1:  # the last column, after the texts
        need = max(spec.text[0], spec.pair[0] if spec.pair else 0) + 2
    rows: list[tuple[int, dict[str, Any]]] = []
    skipped, header_seen = 0, not spec.header
    for i, line in _lines(path):
        fields = line.split("\t")
        if not header_seen:
            header_seen = True
            wrong = [
                f"column {'last' if col == -1 else col + 1} should be {name!r}"
                for col, name in columns
                if len(fields) <= col or fields[col].strip() != name
            ]
            if wrong:
                raise FinetuneError(
                    f"{path}:{i}: not GLUE's {task} header ({', '.join(wrong)}; the line starts "
                    f"{line[:60]!r}); is this {task}'s file from glue_data/?"
                )
            continue
        if spec.width and len(fields) != spec.width:
            skipped += 1  # QQP: the official loaders skip its broken lines
            continue
        if len(fields) < need:
            raise FinetuneError(
                f"{path}:{i}: {len(fields)} tab-separated field(s), GLUE's {task} rows have at "
                f"least {need} ({names} in columns "
                f"{', '.join('last' if c == -1 else str(c + 1) for c, _ in columns)}); fix or "
                "remove the line"
            )
        label = fields[spec.label[0]].strip()
        if not label:
            raise FinetuneError(f"{path}:{i}: the {spec.label[1]} field is empty")
        row: dict[str, Any] = {"text": fields[spec.text[0]]}
        if spec.pair:
            row["text_pair"] = fields[spec.pair[0]]
        row["label"] = _score(label, path, i) if spec.type == "regression" else label
        rows.append((i, row))
    if not rows:
        _no_rows(path, skipped, "with other than 6 fields")
    return rows, skipped


def _score(value: str, path: Path, line: int) -> float:
    """STS-B's similarity score, a number in [0, 5]."""
    try:
        v = float(value)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or not 0.0 <= v <= 5.0:
        raise FinetuneError(
            f"{path}:{line}: STS-B score {value!r} (the last column) is not a number in [0, 5]"
        )
    return v


def _read_jsonl(path: Path, task: str, spec: _Json) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    rows: list[tuple[int, dict[str, Any]]] = []
    skipped = 0
    for i, line in _lines(path):
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise FinetuneError(
                f"{where}: not valid JSON ({err.msg}); CLUE's files hold one JSON object a line"
            ) from None
        if not isinstance(obj, dict):
            raise FinetuneError(f"{where}: a JSON object per line expected")
        row = _clue_row(task, spec, obj, where)
        if spec.drop_dash and row["label"] == "-":
            skipped += 1
            continue
        rows.append((i, row))
    if not rows:
        _no_rows(path, skipped, 'with label "-"')
    return rows, skipped


def _clue_row(task: str, spec: _Json, obj: dict[str, Any], where: str) -> dict[str, Any]:
    def get(key: str, within: dict[str, Any] | None = None, what: str = "") -> Any:
        within = obj if within is None else within
        if key not in within:
            extra = " (target: span1_text, span1_index, span2_text, span2_index)" if what else ""
            raise FinetuneError(
                f"{where}: no {what}{key!r} field; CLUE's {task} rows have "
                f"{', '.join(spec.fields)}{extra}"
            )
        return within[key]

    def text(key: str, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise FinetuneError(f"{where}: {key} must be a string, not {type(value).__name__}")

    label_key = "label"
    if task == "CMNLI" and "label" not in obj and "gold_label" in obj:
        label_key = "gold_label"  # CMNLI's first release named it so
    raw = get(label_key)
    if isinstance(raw, bool):  # WSC's "true" / "false" written as JSON booleans
        label = "true" if raw else "false"
    elif isinstance(raw, str | int):
        label = str(raw).strip()
    else:
        raise FinetuneError(f"{where}: label must be a string, not {type(raw).__name__}")
    if not label:
        raise FinetuneError(f"{where}: the label is empty")
    row: dict[str, Any] = {"text": text(spec.text, get(spec.text))}
    if task == "CSL":  # the abstract and its keywords (a list), which the label says are real
        kw = get("keyword")
        kw = [kw] if isinstance(kw, str) else kw
        if not isinstance(kw, list):
            raise FinetuneError(f"{where}: keyword must be a list of strings")
        row["text_pair"] = "，".join(text("keyword", k) for k in kw)
    elif task == "WSC":
        target = get("target")
        if not isinstance(target, dict):
            raise FinetuneError(f"{where}: target must be an object with span1_text, span2_text")
        span1 = text("span1_text", get("span1_text", target, "target."))
        span2 = text("span2_text", get("span2_text", target, "target."))
        # The question as a sentence of its own, the text unchanged: "<pronoun>指的是<noun>"
        # ("<pronoun> refers to <noun>"), e.g. "它指的是床"; label "true" when it does.
        row["text_pair"] = f"{span2}指的是{span1}"
    elif spec.pair:
        row["text_pair"] = text(spec.pair, get(spec.pair))
    row["label"] = label
    return row


def _no_rows(path: Path, skipped: int, why: str) -> None:
    if skipped:
        raise FinetuneError(f"{path} has no usable rows: all {skipped} were skipped ({why})")
    raise FinetuneError(f"{path} has no rows; re-extract it from the benchmark's download")


def _check_eval_labels(
    splits: dict[str, list[tuple[int, dict[str, Any]]]], files: list[tuple[str, str]], tdir: Path
) -> None:
    """An evaluation label train never has cannot be predicted: the wrong file or version."""
    known = sorted({row["label"] for _, row in splits["train"]})
    names = dict(files)
    for split, rows in splits.items():
        if split == "train":
            continue
        for line, row in rows:
            if row["label"] not in known:
                raise FinetuneError(
                    f"{tdir / names[split]}:{line}: label {row['label']!r} never occurs in "
                    f"{tdir / names['train']} (its labels: {', '.join(known)}); are both files "
                    "from the same task and release?"
                )


def _write(path: Path, rows: list[tuple[int, dict[str, Any]]]) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for _, row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as err:
        raise FinetuneError(f"cannot write {path}: {err.strerror or err}") from None
    return path
