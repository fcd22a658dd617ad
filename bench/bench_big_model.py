"""A model no single host can hold: ZeRO-3 over capped rig hosts, side by side with the
same run on one capped host.

    python bench/bench_big_model.py --model bert-large --cap 4.5G      # as root
    python bench/bench_big_model.py --model gpt2-medium --cap 4.5G --subnet 198.18.0.128/25

Brings up a rehearsal cluster (pipeline/rig.py) whose hosts each get a memory cgroup of
``--cap``; trains the preset (fp32, seq 128, micro batch 1, global batch 2, dropout 0)
on a data dir made here with an 8k WordPiece tokenizer of the bundled corpus:

1. one host, one rank, ZeRO-3 and ZeRO-0: expected to be killed for memory (the kernel's
   OOM killer inside the host's cgroup; read back from the cgroup's counters);
2. two hosts, one rank each, ZeRO-3 (one `plm train` per host with the torchrun-style
   environment, as a Kubernetes pod runs it: nothing else on the host): trains ``--steps`` steps, an asynchronous checkpoint at step 2, the final
   checkpoint and the streamed, sharded bundle; then the same with
   ``train.activation_checkpointing=true``;
3. the same two hosts resume from that run's step-2 checkpoint and train one more step;
4. the reference: one uncapped process in the root namespace, ZeRO-3, grad_accum 2 (the
   same global batch): its losses against 2.'s.

``--lost-host``: instead, 3 capped hosts under ``launch/elastic_train.py --nnodes 2:3``
(one rank each, global batch 6, a checkpoint every 2 steps on the shared dir); once the
step-2 checkpoint is written and step 3 logged, node2 is lost (``Rig.kill``: every
process of the host SIGKILLed); node0 and node1 meet again, convert the 3-rank ZeRO-3
checkpoint for 2 ranks (universal checkpoint) and finish. Reports each host's cgroup
peak and the ranks' resident peaks, OOM kills, the time from the loss to the end of the
next step (the change's first row of metrics.jsonl) and the trainer's
``elastic/seconds_lost`` / ``elastic/startup_s``. The checkpoints go to the rig's shared
dir, not its S3 server: that server runs on node0, inside node0's cap, and keeps every
object in memory, so a checkpoint of a model no host can hold cannot go there.

For each: exit status, OOM kills, each host's peak (the cgroup's max usage) beside
DeepSpeed's estimate (``estimate_zero3_model_states_mem_needs``), the arithmetic (20 bytes
a parameter for fp32 ZeRO-3: the parameter partition, its fp32 master, its gradient,
Adam's two moments, over the ranks) and the step time. Prints a JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def experiment(model: str, data: Path) -> list[str]:
    """``plm train``'s config and overrides: the preset ``model`` at seq 128, 3 steps."""
    gpt2 = model.startswith("gpt2")
    return [str(REPO / "configs/test/bert-base-fp32.yaml"), f"name=big-{model}",
            f"model.arch={'gpt2' if gpt2 else 'bert'}", f"model.preset={model}",
            f"objective.kind={'clm' if gpt2 else 'mlm'}", f"data.path={data}",
            "data.seq_len=128", "train.max_steps=3", "train.schedule=linear",
            "train.save_every=2", "train.keep_last=2", "train.bundle_shard_mb=512",
            "deepspeed=configs/deepspeed/zero3.json"]  # fmt: skip


def make_data(work: Path) -> Path:
    data = work / "data"
    if (data / "manifest.json").is_file():
        return data
    plm = [sys.executable, "-m", "pipeline.cli"]
    subprocess.run([*plm, "data", "tokenizer", "--input", "builtin:python-docs", "--kind",
                    "wordpiece", "--vocab-size", "8000", "--output", str(work / "tok")],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run([*plm, "data", "prepare", "--input", "builtin:python-docs", "--tokenizer",
                    str(work / "tok"), "--output", str(data)], check=True, capture_output=True)  # fmt: skip
    return data


def model_size(model: str) -> tuple[int, int]:
    """(parameters, the largest layer's) of the preset at an 8k vocabulary (meta device)."""
    import torch

    from pipeline.models.registry import build_model, resolve_model_config

    arch = "gpt2" if model.startswith("gpt2") else "bert"
    section = {"arch": arch, "preset": model}
    if arch == "bert":
        section["pair_head"] = False  # objective mlm: no pooler / NSP head
    cfg = resolve_model_config(section, 8000)
    with torch.device("meta"):
        m = build_model(arch, cfg)
    total = sum(p.numel() for p in m.parameters())
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    return total, largest


def step_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows of steps (none if the run wrote no file)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "step_loss" in r]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["step_loss"] for r in step_rows(run_dir)}


def step_seconds(run_dir: Path) -> dict[int, float]:
    """Each step's wall seconds after the first, from metrics.jsonl's row times (one row a
    step, `train.log_every` 1): the step, its loss's all-reduce and any save it made."""
    timed = [(r["step"], r["time"]) for r in step_rows(run_dir) if "time" in r]
    return {b[0]: b[1] - a[1] for a, b in zip(timed, timed[1:], strict=False)}


def run_on_hosts(rig, hosts: list[str], argv_of, env: dict, log_dir: Path, name: str):
    """Start ``argv_of(rank)`` on each host (peaks reset first), wait; per host: exit
    status, OOM kills during the run, peak bytes, the log."""
    before = {h: rig.memory(h)["oom_kills"] or 0 for h in hosts}
    for h in hosts:
        rig.reset_peak(h)
    procs, logs = [], []
    t0 = time.monotonic()
    for r, h in enumerate(hosts):
        log = log_dir / f"{name}-{h}.log"
        logs.append(log)
        procs.append(rig.popen(h, argv_of(r), env=env, cwd=str(rig.shared),
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115  # fmt: skip
    codes = []
    for p in procs:
        codes.append(p.wait())
        if codes[-1] != 0:  # one rank gone: the others cannot finish
            for q in procs:
                if q.poll() is None:
                    rig.kill(hosts[procs.index(q)])
    wall = time.monotonic() - t0
    out = []
    for h, code, log in zip(hosts, codes, logs, strict=True):
        m = rig.memory(h)
        text = log.read_text(errors="replace")
        peaks = [x.split("per rank: ")[1] for x in text.splitlines() if "per rank: " in x]
        steps = [x.split("] ", 1)[1][:60] for x in text.splitlines() if "] step " in x]
        saves = [float(x.split("the save took ")[1].split()[0]) for x in text.splitlines()
                 if "the save took " in x]  # fmt: skip
        held = [x.split("] ", 1)[1] for x in text.splitlines() if "checkpoints held training" in x]
        out.append({"host": h, "exit": code, "oom_kills": (m["oom_kills"] or 0) - before[h],
                    "peak": m["peak"], "rank_peaks": peaks[-1] if peaks else None,
                    "last_step_line": steps[-1] if steps else None, "log": str(log),
                    "save_calls_s": saves, "saves_held": held[-1] if held else None})  # fmt: skip
    return out, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="bert-large", choices=["bert-large", "gpt2-medium", "bert-base"]
    )
    ap.add_argument("--lost-host", action="store_true", help="3 hosts elastic, node2 killed")
    ap.add_argument("--cap", default="4.5G")
    ap.add_argument("--subnet", default="198.18.0.0/24")
    ap.add_argument("--work", default="/var/tmp/plm-bench-big")
    ap.add_argument("--skip-one-host", action="store_true")
    args = ap.parse_args()

    from pipeline import rig as rigmod

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = make_data(work)
    total, largest = model_size(args.model)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    name = "big"
    rigmod.down(name)  # a leftover of an interrupted bench
    if args.lost_host:
        results = lost_host(args, rigmod, work, data, total)
        print(json.dumps(results))
        report_lost_host(results)
        return 0
    rig = rigmod.up(2, name=name, subnet=args.subnet, mem_per_host=args.cap, shared=True)
    results: dict = {"model": args.model, "params": total, "largest_layer": largest,
                     "cap": rigmod.parse_size(args.cap)}  # fmt: skip
    try:
        shared = rig.shared
        logs = shared / "logs"
        logs.mkdir()
        plm_train = [sys.executable, "-m", "pipeline.cli", "train", *experiment(args.model, data)]

        def per_node(run_dir: Path, extra: list[str]):
            """One `plm train` per host, the torchrun-style environment saying who it is
            (what a Kubernetes pod runs): the host holds that one process, no launcher."""
            return lambda r: [
                "env", f"RANK={r}", "LOCAL_RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=node0",
                "MASTER_PORT=29533", *plm_train, f"train.out_dir={run_dir}",
                f"mlflow.tracking_uri=sqlite:///{run_dir}.db", *extra,
            ]  # fmt: skip

        env = {**os.environ, **RANK_ENV}
        if not args.skip_one_host:
            for stage, ds in (("zero3", "configs/deepspeed/zero3.json"), ("zero0", "auto")):
                run_dir = shared / f"one-{stage}"
                argv = [*plm_train, f"train.out_dir={run_dir}", f"deepspeed={ds}",
                        "train.grad_accum=2", f"mlflow.tracking_uri=sqlite:///{run_dir}.db"]  # fmt: skip
                hosts, wall = run_on_hosts(rig, ["node0"], lambda r, a=argv: a, env, logs,
                                           f"one-{stage}")  # fmt: skip
                results[f"one_host_{stage}"] = {"hosts": hosts, "wall_s": wall}
        # the same with activation checkpointing: its final checkpoint only (disk space)
        ac = ["train.activation_checkpointing=true", "train.save_every=0"]
        for key, run, extra in (("two_hosts", "two", []), ("two_hosts_ac", "two-ac", ac)):
            hosts, wall = run_on_hosts(rig, ["node0", "node1"], per_node(shared / run, extra),
                                       env, logs, run)  # fmt: skip
            results[key] = {"hosts": hosts, "wall_s": wall, "losses": losses(shared / run),
                            "step_s": step_seconds(shared / run)}  # fmt: skip
        run_dir = shared / "two"
        bundle = run_dir / "bundles" / "final"
        results["bundle_files"] = sorted(p.name for p in bundle.glob("*.safetensors"))
        resumed = shared / "resumed"
        if (run_dir / "checkpoints" / "step00000002").is_dir():
            shutil.copytree(run_dir, resumed)
            shutil.copyfile(f"{run_dir}.db", f"{resumed}.db")  # the same MLflow run goes on
            shutil.rmtree(resumed / "checkpoints" / "step00000003", ignore_errors=True)
            (resumed / "checkpoints" / "latest").write_text("step00000002")
            hosts, wall = run_on_hosts(rig, ["node0", "node1"], per_node(resumed, []), env,
                                       logs, "resumed")  # fmt: skip
            results["resumed"] = {"hosts": hosts, "wall_s": wall, "losses": losses(resumed)}
    finally:
        kept = work / f"logs-{args.model}"
        shutil.rmtree(kept, ignore_errors=True)
        if (rig.shared / "logs").is_dir():
            shutil.copytree(rig.shared / "logs", kept)
        rigmod.down(name)

    ref_dir = work / "reference"
    shutil.rmtree(ref_dir, ignore_errors=True)
    t0 = time.monotonic()
    ref = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", *experiment(args.model, data),
                          f"train.out_dir={ref_dir}", "train.grad_accum=2", "train.save_every=0",
                          f"mlflow.tracking_uri=sqlite:///{ref_dir}.db"],
                         env={**os.environ, **RANK_ENV},
                         capture_output=True, text=True)  # fmt: skip
    results["reference"] = {"exit": ref.returncode, "wall_s": time.monotonic() - t0,
                            "losses": losses(ref_dir)}  # fmt: skip

    cpu_est, dev_est, _ = estimate_zero3_model_states_mem_needs(
        total, largest, num_gpus_per_node=1, num_nodes=2, cpu_offload=False
    )
    results["estimate_bytes"] = {"deepspeed": cpu_est + dev_est, "arithmetic": 20 * total // 2}
    print(json.dumps(results))
    report(results)
    return 0


def lost_host(args, rigmod, work: Path, data: Path, total: int) -> dict:
    """3 capped hosts, elastic; node2 lost after the step-2 checkpoint (see the doc)."""
    rig = rigmod.up(3, name="big", subnet=args.subnet, mem_per_host=args.cap, shared=True,
                    s3=False, ssh=False)  # fmt: skip
    results: dict = {"model": args.model, "params": total, "cap": rigmod.parse_size(args.cap)}
    agents = {}
    try:
        shared = rig.shared
        run_dir = shared / "lost"
        logs = shared / "logs"
        logs.mkdir()
        cmd = [sys.executable, str(REPO / "launch" / "elastic_train.py"), "--nnodes", "2:3",
               "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29400", "--last-call", "10",
               "--skip-dry-run", *experiment(args.model, data), f"train.out_dir={run_dir}",
               "train.max_steps=5", "train.save_every=2", "train.global_batch=6", "train.keep_last=5",
               "train.collective_timeout_s=60", f"mlflow.tracking_uri=sqlite:///{run_dir}.db"]  # fmt: skip
        env = {**os.environ, **RANK_ENV}
        for h in rig.hosts:
            rig.reset_peak(h.name)
        t0 = time.time()
        for h in rig.hosts:
            out = open(logs / f"lost-{h.name}.log", "wb")  # noqa: SIM115
            agents[h.name] = rig.popen(h.name, cmd, env=env, cwd=str(shared), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

        def rows() -> list[dict]:
            path = run_dir / "metrics.jsonl"
            if not path.is_file():
                return []
            return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

        def ooms() -> dict[str, int]:
            return {h.name: rig.memory(h.name)["oom_kills"] or 0 for h in rig.hosts}

        start_ooms = ooms()

        def wait(what: str, check, timeout: float = 3600, running: bool = True):
            """Until ``check()``; an OOM kill on a host that must go on ends the bench (the
            agents would restart the ranks into the same kill, max_restarts times)."""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                got = check()
                if got:
                    return got
                if running and any(agents[h].poll() is not None for h in ("node0", "node1")):
                    break
                now = ooms()
                if any(now[h] > start_ooms[h] for h in ("node0", "node1")):
                    raise RuntimeError(f"waiting for {what}: killed for memory under the "
                                       f"{args.cap} cap ({now}; logs in {logs})")  # fmt: skip
                time.sleep(0.5)
            raise RuntimeError(f"waiting for {what}: not seen (logs in {logs})")

        latest = run_dir / "checkpoints" / "latest"
        wait("the step-2 checkpoint and step 3",
             lambda: latest.is_file() and any(r.get("step", 0) >= 3 and "step_loss" in r
                                              for r in rows()))  # fmt: skip
        peaks_before = {h.name: rig.memory(h.name)["peak"] for h in rig.hosts}
        t_loss = time.time()
        rig.kill("node2")
        change = wait("the first step on 2 ranks",
                      lambda: next((r for r in rows() if r.get("elastic/changes")), None))  # fmt: skip
        results["loss_to_next_step_s"] = change["time"] - t_loss
        results["change"] = {k: v for k, v in change.items() if k.startswith("elastic/")}
        results["change"]["step"] = change["step"]
        wait("the end", lambda: all(agents[h].poll() is not None for h in ("node0", "node1")),
             running=False)  # fmt: skip
        codes = {h: agents[h].wait() for h in ("node0", "node1")}
        results["wall_s"] = time.time() - t0
        results["codes"] = codes
        results["hosts"] = {}
        for h in rig.hosts:
            m = rig.memory(h.name)
            text = (logs / f"lost-{h.name}.log").read_text(errors="replace")
            peaks = [x.split("per rank: ")[1] for x in text.splitlines() if "per rank: " in x]
            results["hosts"][h.name] = {"peak": m["peak"], "peak_before_loss":
                                        peaks_before[h.name], "oom_kills": m["oom_kills"],
                                        "rank_peaks": peaks[-1] if peaks else None}  # fmt: skip
        results["steps"] = sorted({r["step"] for r in rows() if "step_loss" in r})
        said = (logs / "lost-node0.log").read_text(errors="replace").splitlines()
        results["conversion"] = next((x for x in said if "to a universal checkpoint" in x), None)
        with sqlite3.connect(f"{run_dir}.db") as db:  # one MLflow run through the loss
            results["mlflow_runs"] = [r[0] for r in db.execute("select status from runs")]
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                proc.kill()
        kept = work / f"logs-lost-{args.model}"
        shutil.rmtree(kept, ignore_errors=True)
        if (rig.shared / "logs").is_dir():
            shutil.copytree(rig.shared / "logs", kept)
        rigmod.down("big")
    return results


def report_lost_host(r: dict) -> None:
    gib = 2**30
    print(f"\n{r['model']}: {r['params'] / 1e6:.1f}M parameters, 3 hosts of "
          f"{r['cap'] / gib:.2f} GiB, node2 lost after step 3")  # fmt: skip
    print(f"  exit codes {r['codes']}, steps {r['steps']}, wall {r['wall_s']:.0f} s")
    print(f"  host loss -> end of the next step: {r['loss_to_next_step_s']:.1f} s; "
          f"trainer: {r['change']}")  # fmt: skip
    print(f"  {r.get('conversion')}\n  MLflow runs (status): {r.get('mlflow_runs')}")
    for h, m in r["hosts"].items():
        print(f"  {h}: cgroup peak {m['peak'] / gib:.2f} GiB (before the loss "
              f"{m['peak_before_loss'] / gib:.2f}), OOM kills {m['oom_kills']}, "
              f"ranks' resident peaks {m['rank_peaks']}")  # fmt: skip


def report(r: dict) -> None:
    gib = 2**30
    print(
        f"\n{r['model']}: {r['params'] / 1e6:.1f}M parameters, cap {r['cap'] / gib:.2f} GiB a host"
    )
    print(f"estimate per rank (2 ranks): DeepSpeed {r['estimate_bytes']['deepspeed'] / gib:.2f} "
          f"GiB, 20 B x params / 2 = {r['estimate_bytes']['arithmetic'] / gib:.2f} GiB")  # fmt: skip
    for key in ("one_host_zero3", "one_host_zero0", "two_hosts", "two_hosts_ac", "resumed"):
        if key not in r:
            continue
        for h in r[key]["hosts"]:
            print(f"  {key:15s} {h['host']}: exit {h['exit']}, OOM kills {h['oom_kills']}, "
                  f"cgroup peak {h['peak'] / gib:.2f} GiB (with page cache), "
                  f"ranks' resident peaks {h.get('rank_peaks', '-')}  ({r[key]['wall_s']:.0f} s)")  # fmt: skip
            if h.get("save_calls_s"):
                print(f"  {'':15s} save calls {h['save_calls_s']} s; {h['saves_held']}")
        if r[key].get("step_s"):
            steps = ", ".join(f"step {k}: {v:.1f} s" for k, v in r[key]["step_s"].items())
            print(f"  {'':15s} step wall times {steps}")
    ref = r["reference"]["losses"]
    for key in ("two_hosts", "two_hosts_ac"):
        two = r.get(key, {}).get("losses", {})
        for step in sorted(ref):
            if str(step) in two or step in two:
                got = two.get(step, two.get(str(step)))
                print(f"  step {step}: {key} {got:.6f}, 1 host uncapped {ref[step]:.6f}, "
                      f"rel {abs(got - ref[step]) / abs(ref[step]):.2e}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
