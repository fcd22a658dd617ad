"""Test driver for resuming on another number of ranks, run on every rank (by the
`deepspeed` launcher, or as one plain process for world size 1):

    [deepspeed --num_gpus 2] elastic_driver.py PLAN.json

PLAN.json: a list of {"config", "overrides", "stop_after": int|null, "dump": path|null,
"resume_only": bool}. Each entry builds a Trainer; ``resume_only`` loads the latest
checkpoint and trains nothing, otherwise it trains (to ``stop_after`` or the end).
``dump``: rank 0 then writes every parameter's full fp32 weight and Adam moments, put
together from the ZeRO partitions (a collective), to that file.
"""

import json
import sys

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from pipeline.config import load_config
from pipeline.train.trainer import Trainer


def full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    opt = engine.optimizer
    if getattr(opt, "_hp_optimizer_states_linked", False):
        # DeepSpeed (0.19) links the Adam moments of every parameter group after the
        # first group's first step, when the later groups have none yet: link again.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        fp32 = safe_get_full_fp32_param(p)
        if fp32 is None:  # ZeRO-0 fp32: the torch optimizer holds the module's parameters
            state = getattr(opt, "optimizer", opt).state[p]
            row = {"fp32": p.detach(), "exp_avg": state["exp_avg"],
                   "exp_avg_sq": state["exp_avg_sq"]}  # fmt: skip
        else:
            row = {"fp32": fp32}
            for key in ("exp_avg", "exp_avg_sq"):
                row[key] = safe_get_full_optimizer_state(p, key)
        out[name] = {k: v.detach().to("cpu", torch.float32).clone() for k, v in row.items()}
    return out


if __name__ == "__main__":
    (plan,) = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    for run in json.loads(open(plan, encoding="utf-8").read()):
        trainer = Trainer(load_config(run["config"], run["overrides"]))
        if run.get("resume_only"):
            trainer.resume_if_asked()
            trainer.stream.close()
        else:
            trainer.run(stop_after=run.get("stop_after"))
        if run.get("dump"):
            state = full_state(trainer.engine)
            if trainer.rank == 0:
                torch.save(state, run["dump"])
