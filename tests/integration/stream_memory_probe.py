"""One rank of the streaming-memory probe (tests/integration/test_stream_memory.py, and by
hand for the BENCHMARKS numbers): how much a rank's peak resident memory grows while it
exports a bundle to transformers (rank 0, before the process group) and while it loads
the bundle for a ZeRO-3 fine-tune (every rank: built partitioned, filled one gathered
parameter at a time).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python stream_memory_probe.py BUNDLE OUT_DIR SMALL_BUNDLE

Each phase runs first on SMALL_BUNDLE (a model of a few layers: the code it runs is
loaded, its first-use allocations made), then starts by resetting the kernel's peak
(``/proc/self/clear_refs`` 5), so ``VmHWM - VmRSS at the start`` is what BUNDLE's
weights cost. Writes OUT_DIR/rank<r>.json (bytes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _phase_start() -> int:
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def main(bundle: str, out_dir: str, small: str) -> None:
    import deepspeed  # noqa: F401
    import torch
    import transformers  # noqa: F401  (imports are not the phases' memory)

    from pipeline.export.hf import export_to_hf
    from pipeline.finetune.source import ModelSource, load_backbone
    from pipeline.train.engine import init_distributed

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, int] = {}
    if rank == 0:
        export_to_hf(small, Path(out_dir) / "hf-small")
        start = _phase_start()
        export_to_hf(bundle, Path(out_dir) / "hf")
        result["export_growth"] = _status("VmHWM") - start
    init_distributed()
    ds_config = {"train_batch_size": int(os.environ.get("WORLD_SIZE", "1")),
                 "zero_optimization": {"stage": 3}}  # fmt: skip
    load_backbone(ModelSource(Path(small), small), ds_config)
    start = _phase_start()
    model, _ = load_backbone(ModelSource(Path(bundle), bundle), ds_config)
    result["load_growth"] = _status("VmHWM") - start
    result["params"] = sum(1 for _ in model.parameters())
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
