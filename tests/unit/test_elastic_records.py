"""The records of an elastic resume agree: the run's `elastic_resume` tag and the
`elastic/change_N` tag name the same grad_accum change, the checkpoint's -> this run's
(issue 40: the tag said "3 -> 3" where the change said "2 -> 3")."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from pipeline.config import validate_dict, with_global_batch
from pipeline.train.trainer import Trainer, elastic_resume_tag


class Checkpoints:
    """A checkpoint folder's answers (checkpoint.py is tested on its own)."""

    def __init__(self, root: Path, meta: dict):
        self.root, self._meta = root, meta

    def latest(self) -> str:
        return "step00000020"

    def meta(self, tag: str) -> dict:
        return self._meta

    def to_universal(self, tag: str) -> float:
        return 0.0

    def where(self, tag: str = "") -> str:
        return str(self.root / tag)


def test_the_resume_tag_and_the_change_tag_name_the_same_grad_accum(tmp_path):
    # Written by 3 ranks at grad_accum 2 (8 x 2 x 3 = 48); resumed on 2 ranks: 3.
    cfg = validate_dict({"name": "t", "model": {"arch": "bert"}, "data": {"path": "x"},
                         "train": {"micro_batch_size": 8, "grad_accum": 2, "global_batch": 48,
                                   "max_steps": 40, "resume": "auto"},
                         "deepspeed": "configs/deepspeed/zero0.json"})  # fmt: skip
    world = 2
    cfg = with_global_batch(cfg, world)  # what Trainer.__init__ does first: grad_accum 3
    assert cfg.train.grad_accum == 3
    meta = {"world_size": 3, "grad_accum": 2, "micro_batch_size": 8, "global_batch": 48}
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.world, trainer.rank, trainer.step = cfg, world, 0, 20
    trainer.ckpt = Checkpoints(tmp_path / "checkpoints", meta)
    trainer.data = SimpleNamespace(manifest={})
    trainer.run_dir = tmp_path
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 20, "step_loss": 1.0,
                                                        "time": 1.0}) + "\n")  # fmt: skip
    cfg, plan = trainer.plan_elastic_resume(cfg)
    trainer.cfg, trainer.resumed_from = cfg, "step00000020"
    change = trainer.membership_change()
    assert change["grad_accum"] == (2, 3)
    tag = elastic_resume_tag(plan, world)
    assert "3 -> 2 ranks" in tag and "grad_accum 2 -> 3" in tag, tag


def test_the_elastic_page_says_what_the_lines_after_the_plm_line_mean():
    """What follows a rank's `plm:` line comes from torch, not plm: the agent's log of the
    rank's exit code (kept: bench/bench_elastic_cluster.py times detection by it) and
    c10d's warning about a peer address without a name. docs/elastic.md says what each
    means, with the exit code plm really uses."""
    from pipeline.train.faults import EXIT_PEER_LOST

    page = (Path(__file__).resolve().parents[2] / "docs" / "elastic.md").read_text()
    section = page.split("## Messages a person can act on", 1)[1].split("\n## ", 1)[0]
    assert f"failed (exitcode: {EXIT_PEER_LOST})" in section
    assert "The hostname of the client socket cannot be retrieved. err=-3" in section
    assert "/etc/hosts" in section  # how to make the c10d warning go away
