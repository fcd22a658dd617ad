"""ZeRO-Infinity on the CPU accelerator: one host, under a memory cap, trains a model whose
training state does not fit the cap, by swapping it to the local disk (issue 38, point 5).

    python bench/bench_nvme_offload.py --work-dir /var/tmp/bench-nvme-data   # needs root

Data (through benchlib): a generated corpus, a WordPiece tokenizer of --vocab-size (300,
as tests/cluster/test_big_model.py: bert-base's encoder, 86M parameters) and shards.

Each run is ``plm train`` with one rank (ZeRO-3, the model bert-base, fp32, --steps
steps) in a cgroup v1 memory group made here (/sys/fs/cgroup/memory/plm-bench-nvme-*:
``memory.limit_in_bytes`` = --cap, no swap on this machine), removed afterwards:

- ``zero3``: configs/deepspeed/zero3.json: the state in memory;
- ``zero3-offload``: configs/deepspeed/zero3-offload.json: the state offloaded to memory
  (ZeRO-Offload), which does not make it smaller;
- ``zero3-nvme``: configs/deepspeed/zero3-nvme.json, PLM_NVME_PATH a folder under
  --work-dir (this machine's disk), ``offload_param.buffer_size`` set to the model's
  largest parameter (2.36M elements: the feed-forward weights; the JSON's default holds
  bert-base's 30522-word embeddings).

Then the same nvme run without the cap and zero3 without the cap, for their peaks and
losses. Per run: the exit code, the kernel's OOM kills in the group
(``memory.oom_control``'s ``oom_kill``), the group's peak (``memory.max_usage_in_bytes``,
page cache included), the rank's own peak resident memory (the run's last line), the
swap files' size, the step losses, wall seconds. --json writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from benchlib import add_common_args, load1, prepare_data  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/memory")
BIG = REPO / "configs/test/bert-base-fp32.yaml"
RANK_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "MALLOC_MMAP_THRESHOLD_": "65536",  # docs/training.md: glibc keeps freed heap otherwise
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", text.strip().upper())
    if not m:
        raise SystemExit(f"--cap {text!r}: a size like 1.4G or 1500M")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


class MemoryGroup:
    """A cgroup v1 memory group of ``limit`` bytes, for one command at a time."""

    def __init__(self, name: str, limit: int | None):
        self.path = CGROUP / name
        self.path.mkdir()
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.limit = int((self.path / "memory.limit_in_bytes").read_text())

    def oom_kills(self) -> int:
        text = (self.path / "memory.oom_control").read_text()
        m = re.search(r"^oom_kill (\d+)", text, re.M)
        return int(m.group(1)) if m else 0

    def peak(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def run(self, argv: list[str], env: dict, cwd: Path, timeout: float) -> tuple[int, str]:
        procs = str(self.path / "cgroup.procs")

        def enter() -> None:  # in the child, before exec: it and all it starts are inside
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=enter)  # fmt: skip
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        return p.returncode, out

    def remove(self) -> None:
        for _ in range(50):  # the last process may take a moment to leave
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def one_run(args, work: Path, name: str, ds_json: Path, cap: int | None) -> dict:
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    nvme = work / "nvme" / name
    shutil.rmtree(nvme, ignore_errors=True)
    env = {**os.environ, **RANK_ENV, "PLM_NVME_PATH": str(nvme)}
    argv = [sys.executable, "-m", "pipeline.cli", "train", str(BIG), "name=bench-nvme",
            f"data.path={args.data}", f"data.seq_len={args.seq}", f"train.max_steps={args.steps}",
            "train.resume=never", f"deepspeed={ds_json}", f"train.out_dir={run_dir}",
            f"mlflow.tracking_uri=sqlite:///{work}/mlflow.db"]  # fmt: skip
    group = MemoryGroup(f"plm-bench-nvme-{os.getpid()}-{name}", cap)
    try:
        t0, load0 = time.perf_counter(), load1()
        rc, out = group.run(argv, env, REPO, args.timeout)
        seconds = time.perf_counter() - t0
        kills, peak, limit = group.oom_kills(), group.peak(), group.limit
    finally:
        group.remove()
    swap = sum(p.stat().st_size for p in nvme.rglob("*") if p.is_file()) if nvme.is_dir() else 0
    rss = re.findall(r"peak resident memory per rank: ([\d.]+) GiB", out)
    losses = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for row in map(json.loads, metrics.read_text().splitlines()):
            if "step_loss" in row:
                losses[row["step"]] = row["step_loss"]
    shutil.rmtree(nvme, ignore_errors=True)
    res = {"name": name, "deepspeed": str(ds_json), "cap": cap, "limit": limit, "rc": rc,
           "oom_kills": kills, "group_peak": peak, "rank_peak_gib": float(rss[-1]) if rss else None,
           "swap_bytes": swap, "losses": losses, "seconds": seconds, "load_before": load0,
           "load_after": load1(), "tail": out[-3000:]}  # fmt: skip
    state = "trained" if rc == 0 else ("killed for memory" if kills else f"failed rc {rc}")
    print(f"  {name:<22} cap {'-' if cap is None else f'{cap / 2**30:.2f} GiB':>9}: {state}, "
          f"group peak {peak / 2**30:.2f} GiB, rank peak "
          f"{res['rank_peak_gib'] if rss else '-'} GiB, {seconds:.0f} s, losses "
          f"{[round(x, 4) for x in losses.values()]}", flush=True)  # fmt: skip
    if rc != 0 and not kills:
        print(out[-3000:], flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_common_args(ap, docs=2_000, words=2_000, vocab_size=300)
    ap.add_argument("--cap", default="1.4G", help="the memory group's limit")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--buffer-size", type=int, default=2_400_000,
                    help="offload_param.buffer_size (elements): the largest parameter")  # fmt: skip
    ap.add_argument("--runs", default="zero3,zero3-offload,zero3-nvme,zero3-nvme-uncapped,zero3-uncapped")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()
    if not (CGROUP / "memory.limit_in_bytes").is_file() or not os.access(CGROUP, os.W_OK):
        raise SystemExit(f"needs the cgroup v1 memory controller writable at {CGROUP} (root)")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-nvme-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    args.data = args.data_dir or str(prepare_data(work, "wordpiece", args))
    nvme_json = json.loads((REPO / "configs/deepspeed/zero3-nvme.json").read_text())
    nvme_json["zero_optimization"]["offload_param"]["buffer_size"] = args.buffer_size
    (work / "zero3-nvme.json").write_text(json.dumps(nvme_json, indent=1))
    configs = {"zero3": REPO / "configs/deepspeed/zero3.json",
               "zero3-offload": REPO / "configs/deepspeed/zero3-offload.json",
               "zero3-nvme": work / "zero3-nvme.json"}  # fmt: skip
    cap = parse_size(args.cap)
    print(f"bert-base at vocabulary {args.vocab_size}, 1 rank, ZeRO-3, fp32, seq {args.seq}, "
          f"micro-batch 1, {args.steps} steps; cap {args.cap}; load {load1():.2f}", flush=True)  # fmt: skip
    results = []
    for name in args.runs.split(","):
        base = name.removesuffix("-uncapped")
        results.append(one_run(args, work, name, configs[base],
                               None if name.endswith("-uncapped") else cap))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
