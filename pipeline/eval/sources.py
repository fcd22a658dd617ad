"""What ``plm eval --models SOURCE ...`` evaluates: each SOURCE as the checkpoints it names.

- a pretraining run's folder (``train.out_dir``): every complete checkpoint in it;
- a checkpoint folder (``RUN/checkpoints/stepNNNNNNNN``): that one;
- a run or checkpoint on a store (``s3://...``): mirrored first (``store_run``);
- a bundle folder, ``models:/NAME@ALIAS``, ``models:/NAME/VERSION`` or ``runs:/ID/model``;
- ``random``: the architecture of the other sources, freshly initialised (the baseline).

A checkpoint is evaluated through its bundle: the one training wrote beside it
(``bundles/<tag>``), else one made here (``checkpoint_bundle``) into the suite's work
dir, so training never pays for it. Everything is resolved before any cell runs, so a
source that does not exist is one ``plm:`` line, not a failed Ray task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from pipeline.eval.checkpoint_bundle import bundle_from_checkpoint, checkpoint_meta
from pipeline.eval.suite import EvalError
from pipeline.models.bundle import own_file
from pipeline.storage import is_uri

RANDOM = "random"


@dataclass
class Candidate:
    """One model the suite scores: a checkpoint of a pretraining run, a bundle, or the
    random-init baseline (``init == "random"``, ``bundle`` the architecture's source)."""

    label: str  # how the table names it: the checkpoint's tag, the URI, "random"
    bundle: Path | None
    step: int | None = None  # the pretraining step (random: 0)
    init: str = "pretrained"
    checkpoint: str | None = None  # where the checkpoint lives
    run_dir: Path | None = None
    run_id: str | None = None  # the pretraining MLflow run
    model_name: str | None = None  # the pretraining config's name: the registered model's
    losses: dict[str, float] = field(default_factory=dict)  # metrics.jsonl at that step
    data: dict[str, str] = field(default_factory=dict)  # {uri, fingerprint} of its data

    @property
    def arch(self) -> str:
        return read_arch(self.bundle) if self.bundle else "?"


def read_arch(bundle: Path) -> str:
    config = own_file(bundle, "config.yaml")  # a link out of the bundle is refused
    return str(yaml.safe_load(config.read_text(encoding="utf-8"))["arch"])


def _is_bundle(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "tokenizer.json").is_file()


def losses_at(run_dir: Path, step: int) -> dict[str, float]:
    """The losses metrics.jsonl holds for ``step`` (train *_loss, eval_loss): the last row
    of that step wins, as in MLflow's chart."""
    path = run_dir / "metrics.jsonl"
    out: dict[str, float] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("step") == step:
            out |= {k: float(v) for k, v in row.items() if k.endswith("loss")}
    return out


def _run_facts(run_dir: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    from pipeline.train.tracking import RUN_ID_FILE

    id_file = run_dir / RUN_ID_FILE
    data = cfg.get("data", {})
    path = data.get("path") or (data.get("sources") or [{}])[0].get("path")
    return {
        "run_id": id_file.read_text().strip() if id_file.is_file() else None,
        "model_name": cfg.get("name"),
        "data_path": str(path) if path else None,
    }


@lru_cache(maxsize=16)  # every checkpoint of a run names the same data dir: read it once
def _data_facts(data_path: str | None) -> tuple[dict[str, str], Path | None]:
    """({uri, fingerprint} of the run's data dir, its tokenizer folder); empty when the
    data dir is gone (a bundle beside the checkpoint still carries the tokenizer)."""
    if not data_path:
        return {}, None
    from pipeline.data.shards import DataDir
    from pipeline.train.fingerprint import data_fingerprint

    try:
        data = DataDir(data_path)
        facts = {"uri": str(data_path), "fingerprint": data_fingerprint(data.manifest)}
        return facts, data.tokenizer_path.parent
    except Exception:  # gone or unreadable: the facts are a convenience
        return {}, None


def checkpoint_candidate(ckpt_dir: Path, work_dir: Path) -> Candidate:
    """A checkpoint folder as a Candidate: its bundle found beside it or made."""
    meta = checkpoint_meta(ckpt_dir)
    run_dir = ckpt_dir.parent.parent
    cfg = yaml.safe_load((ckpt_dir / "config.yaml").read_text(encoding="utf-8"))
    facts = _run_facts(run_dir, cfg)
    data, tokenizer = _data_facts(facts["data_path"])
    step = int(meta["step"])
    bundle = run_dir / "bundles" / ckpt_dir.name
    if not _is_bundle(bundle):
        bundle = work_dir / "bundles" / f"{cfg.get('name', 'run')}-{ckpt_dir.name}"
        if not _is_bundle(bundle):
            if tokenizer is None:
                raise EvalError(
                    f"checkpoint {ckpt_dir}: its data dir {facts['data_path']} (the tokenizer "
                    "a bundle needs) cannot be read; make it readable again, or evaluate a "
                    "bundle of the run instead"
                )
            bundle_from_checkpoint(ckpt_dir, bundle, tokenizer)
    return Candidate(
        label=ckpt_dir.name,
        bundle=bundle,
        step=step,
        checkpoint=str(ckpt_dir),
        run_dir=run_dir,
        run_id=facts["run_id"],
        model_name=facts["model_name"],
        losses=losses_at(run_dir, step),
        data=data,
    )


def run_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "COMPLETE").is_file())


def _mlflow_candidate(uri: str, tracking_uri: str | None, work_dir: Path) -> Candidate:
    from pipeline.finetune.source import resolve_source

    safe = "".join(c if c.isalnum() else "_" for c in uri)
    src = resolve_source(uri, tracking_uri, work_dir / "downloads" / safe)
    config = own_file(src.path, "config.yaml")
    meta = yaml.safe_load(config.read_text(encoding="utf-8")).get("meta", {})
    step = meta.get("step")
    return Candidate(
        label=uri,
        bundle=src.path,
        step=int(step) if step is not None else None,
        run_id=src.run_id,
        model_name=src.model_name or meta.get("experiment"),
        data={"fingerprint": str(meta.get("data_fingerprint", ""))},
    )


def resolve_candidates(
    sources: list[str], work_dir: Path, tracking_uri: str | None
) -> list[Candidate]:
    """Every SOURCE as its Candidates, in the order given (a run's by step); ``random``
    takes the architecture of the first other source."""
    out: list[Candidate] = []
    wants_random = False
    for src in sources:
        if src == RANDOM:
            wants_random = True
        elif src.startswith(("models:/", "runs:/")):
            out.append(_mlflow_candidate(src, tracking_uri, work_dir))
        elif is_uri(src):
            out += store_candidates(src, work_dir)
        else:
            out += _local_candidates(Path(src), work_dir)
    if wants_random:
        if not out:
            raise EvalError("--models random needs another source: its architecture and tokenizer")
        base = out[0]
        out.insert(0, Candidate(label=RANDOM, bundle=base.bundle, step=0, init=RANDOM,
                                run_id=base.run_id, model_name=base.model_name))  # fmt: skip
    return out


def store_candidates(uri: str, work_dir: Path) -> list[Candidate]:
    """A run or checkpoint on a store: mirrored (``store_run``), each checkpoint's bundle
    made, its weights dropped again."""
    from pipeline.eval.store_run import StoreMirror

    mirror = StoreMirror(uri, work_dir)
    tags = mirror.sync()
    if not tags:
        raise EvalError(f"--models {mirror.shown}: no complete checkpoint there"
                        + (f" named {mirror.only}" if mirror.only else ""))  # fmt: skip
    return [mirrored_candidate(mirror, tag, work_dir) for tag in tags]


def mirrored_candidate(mirror, tag: str, work_dir: Path) -> Candidate:
    cand = checkpoint_candidate(mirror.local / "checkpoints" / tag, work_dir)
    cand.checkpoint = mirror.where(tag)  # where its files live for good
    mirror.release(tag)
    return cand


def _local_candidates(path: Path, work_dir: Path) -> list[Candidate]:
    if not path.exists():
        raise EvalError(
            f"--models {path}: no such folder (give a run's train.out_dir, a checkpoint "
            "folder, a bundle folder, models:/NAME@ALIAS or random)"
        )
    if path.parent.name == "checkpoints" or (path / "COMPLETE").is_file():  # one checkpoint
        return [checkpoint_candidate(path, work_dir)]
    if (path / "checkpoints").is_dir():
        tags = run_checkpoints(path)
        if not tags:
            raise EvalError(f"--models {path}: the run has no complete checkpoint yet")
        return [checkpoint_candidate(t, work_dir) for t in tags]
    if _is_bundle(path):
        config = own_file(path, "config.yaml")
        meta = yaml.safe_load(config.read_text(encoding="utf-8")).get("meta", {})
        step = meta.get("step")
        return [Candidate(label=str(path), bundle=path,
                          step=int(step) if step is not None else None,
                          model_name=meta.get("experiment"))]  # fmt: skip
    raise EvalError(
        f"--models {path}: neither a run folder (checkpoints/), a checkpoint (COMPLETE) "
        "nor a bundle (config.yaml + tokenizer.json)"
    )
