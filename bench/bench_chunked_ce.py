"""Cross-entropy over a large vocabulary: F.cross_entropy(logits.float()) vs chunked.

    python bench/bench_chunked_ce.py                    # 2048 x 50304 bf16, 5 timed steps
    python bench/bench_chunked_ce.py --rows 8192 --variants plain,chunked,chunked-64

One step = the loss of bf16 logits [rows, vocab] (a leaf that requires grad, ~15% of
rows ignored) + backward, on the CPU with one torch thread. Each variant runs in a fresh
process: it builds the logits (in chunks, so no fp32 copy of them ever exists there),
notes its peak resident set (``ru_maxrss``), runs one step and notes the peak again; the
difference is the step's peak extra memory (the bf16 gradient autograd leaves in
``.grad`` included). Then ``--steps`` more steps are timed in CPU seconds of the process
(``time.process_time``; less disturbed than wall time on a shared machine), median
reported. Variants:

* ``plain``: ``F.cross_entropy(logits.float(), labels, ignore_index=-100)`` (what clm and
  bilm did before);
* ``chunked``: ``chunked_cross_entropy(logits, labels)``, the default chunk size on the
  CPU (2^21 elements: 41 rows of 50304);
* ``chunked-R``: the same, R rows per chunk (``chunked-667``: the default on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = "plain,chunked,chunked-667"


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(variant: str, rows: int, vocab: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from pipeline.objectives.chunked_ce import chunked_cross_entropy

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16)
    for start in range(0, rows, 64):  # fp32 temporaries of 64 rows only
        block = logits[start : start + 64]
        block.copy_(torch.randn(block.shape, generator=g) * 2)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < 0.15] = -100
    logits.requires_grad_()

    if variant == "plain":

        def loss_fn():
            return F.cross_entropy(logits.float(), labels, ignore_index=-100)
    else:
        chunk_rows = None if variant == "chunked" else int(variant.split("-")[1])

        def loss_fn():
            return chunked_cross_entropy(logits, labels, -100, chunk_rows)

    def step() -> float:
        logits.grad = None
        loss = loss_fn()
        loss.backward()
        return loss.item()

    before = max_rss_bytes()
    loss = step()
    peak = max_rss_bytes()
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {
        "variant": variant,
        "loss": loss,
        "peak_extra_bytes": peak - before,
        "cpu_s": statistics.median(cpu),
        "wall_s": statistics.median(wall),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_variant(variant: str, rows: int, vocab: int, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, __file__, "--child", variant, "--rows", str(rows)]
    cmd += ["--vocab", str(vocab), "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default=VARIANTS, help=f"comma-separated (default {VARIANTS})")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.vocab, args.steps)))
        return

    mib = 2**20
    logits_mib = args.rows * args.vocab * 2 / mib
    print(
        f"bf16 logits {args.rows} x {args.vocab} ({logits_mib:.0f} MiB; an fp32 copy "
        f"{2 * logits_mib:.0f} MiB), {cpu_name()}, "
        f"torch 1 thread, {args.steps} timed steps per variant"
    )
    variants = args.variants.split(",")
    results = [run_variant(v, args.rows, args.vocab, args.steps) for v in variants]
    print(f"{'variant':<12} {'peak extra MiB':>15} {'CPU s/step':>11} {'wall s/step':>12}  loss")
    for r in results:
        print(
            f"{r['variant']:<12} {r['peak_extra_bytes'] / mib:>15.0f} {r['cpu_s']:>11.3f} "
            f"{r['wall_s']:>12.3f}  {r['loss']:.6f}"
        )
    base = results[0]
    for r in results[1:]:
        print(
            f"{r['variant']} / {base['variant']}: peak extra memory "
            f"{r['peak_extra_bytes'] / base['peak_extra_bytes']:.2f}x, "
            f"CPU time {r['cpu_s'] / base['cpu_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
