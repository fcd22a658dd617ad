"""Test driver, started by the `deepspeed` launcher on every rank: several `plm train`
runs one after another in the same processes, so the tests pay for one launcher and
process-group start-up instead of one per architecture.

    deepspeed --num_gpus 2 tests/integration/train_many.py PLAN.json

PLAN.json: a list of {"config": PATH, "overrides": ["key=value", ...]}.
"""

import json
import sys

from pipeline.config import load_config
from pipeline.train.trainer import train

if __name__ == "__main__":
    # the launcher adds --local_rank=N to a script's arguments (LOCAL_RANK is in the env too)
    (plan,) = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    for run in json.loads(open(plan, encoding="utf-8").read()):
        train(load_config(run["config"], run["overrides"]))
