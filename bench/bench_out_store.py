"""train.out_dir on S3 against a local folder, side by side in one run (issue 39).

    python bench/bench_out_store.py                        # bert-base, 4 layers, 3 saves each
    python bench/bench_out_store.py --layers 12 --saves 2  # the whole bert-base

Data (as bench_checkpoint.py, through benchlib): a generated corpus, a WordPiece tokenizer
and shards, cached under --work-dir. The S3 server is moto's server mode on loopback,
started here; the resume's fetch reaches it through a relay that counts the bytes on the
wire (HTTP included), training reaches it directly.

Per out_dir (``local``: a folder on this disk; ``s3``: ``s3://bench/run`` with
``train.local_dir`` a folder on this disk), a process builds the real ``Trainer`` (1 rank,
bert with --layers layers, objective mlm, ZeRO-2 so the optimizer partition is a file of
its own as on many ranks, async saves) and runs ``Trainer.train_step`` as ``Trainer.run``
does, the pending checkpoint finished at the step boundary where the per-step all-reduce
says its files are written (and, for s3, uploaded). After --warmup steps, --saves times:
--steps-between plain steps, one ``Trainer.save()``, then steps until the checkpoint is
complete (at most --steps-between; then ``finish()`` waits). As in ``Trainer.run``, a
completion left to the store's upload thread is waited for by the next ``save()``.

- blocked: what a save costs training, wall seconds: the ``save()`` call, plus for each
  step until the checkpoint is complete its time above the median plain step (the next
  update waits for the writes of held tensors; the upload thread and the S3 server take
  CPU), plus any wait in ``finish()``.
- resume (s3 only): a new staging folder, empty; ``CheckpointManager.fetch_for_load`` of
  the latest checkpoint for rank 0: the bytes the relay carried (requests and answers,
  listing and lookups included) against the bytes of the files rank 0 loads.

- held: the part of ``blocked`` spent on the training thread waiting for the save itself,
  CPU contention aside: ``save()``, the optimizer updates held for the writes
  (``SnapshotWriter.blocked_s``), the checkpoint's completion at a step boundary
  (``finish(agreed=True)``: COMPLETE, ``latest``, pruning, on the store for s3) and any
  wait in ``finish()``.

--rounds N runs local then s3 N times, each a fresh process (so both see the machine's
load in turn); the S3 server's CPU seconds during each s3 run are recorded (on a 2-core
machine the server, which a real deployment runs elsewhere, competes with training;
--server-nice 19 lets it yield the CPU to training; --server-cpu 1 gives it a CPU of its
own and training the others, as if it ran elsewhere).
Per run also the training process's own CPU seconds (the same steps and saves in both
modes: for s3 the difference is what the upload client costs a node). Prints one table
and the ratios (goal: blocked s3 / local <= 1.1; wire / rank's files <= 1.05); --json
writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from benchlib import add_common_args, load1, prepare_data  # noqa: E402


def server_setup(args) -> None:
    """In the S3 server's process, before it starts: its nice value and CPU."""
    os.nice(args.server_nice)
    if args.server_cpu is not None:
        os.sched_setaffinity(0, {args.server_cpu})


def training_setup(args) -> None:
    """In a training process, before it starts: every CPU but the server's."""
    if args.server_cpu is not None:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {args.server_cpu})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingRelay:
    """127.0.0.1:port -> the S3 server; counts the bytes each way."""

    def __init__(self, target: int):
        self.port, self.target, self.sent, self.received = _free_port(), target, 0, 0
        self.lock = threading.Lock()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s) -> None:
        while True:
            client, _ = s.accept()
            up = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, up, "sent"), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, "received"), daemon=True).start()

    def _pump(self, a, b, counter: str) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
                with self.lock:
                    setattr(self, counter, getattr(self, counter) + len(data))
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def experiment(args, out_dir: str, local_dir: str | None):
    from pipeline.config import validate_dict

    raw = {
        "name": "bench-out-store",
        "model": {"arch": "bert", "preset": "bert-base", "num_layers": args.layers},
        "objective": {"kind": "mlm"},
        "data": {"path": args.data_dir, "seq_len": args.seq, "workers": 0},
        "train": {
            "micro_batch_size": args.micro_batch, "grad_accum": 1, "max_steps": 1_000_000,
            "warmup_steps": 0, "schedule": "constant", "eval_every": 0, "save_every": 0,
            "log_every": 1_000_000, "resume": "never", "keep_last": 2, "bundle_every": 0,
            "out_dir": out_dir, "local_dir": local_dir, "async_save": True,
        },
        "deepspeed": "configs/deepspeed/zero2.json",
        "mlflow": {"tracking_uri": f"sqlite:///{args.tmp}/mlflow-{args.mode}.db",
                   "register": False},
    }  # fmt: skip
    return validate_dict(raw, "bench-out-store")


def rank_main(args) -> None:
    from pipeline.train.trainer import Trainer

    if args.mode == "s3":
        cfg = experiment(args, args.store_uri, f"{args.tmp}/stage-s3-{args.round}")
    else:
        cfg = experiment(args, f"{args.tmp}/local-run-{args.round}", None)
    trainer = Trainer(cfg)
    it = iter(trainer.stream)
    plain: list[float] = []
    saves: list[dict] = []

    completing: list[float] = []  # finish(agreed=True) inside a step: COMPLETE, latest, prune

    def step() -> float:
        t0 = time.perf_counter()
        record = trainer.train_step(it)
        trainer.step += 1
        if record is not None:
            trainer.window.append(record)
        if trainer.writes_done:  # as Checkpointer.step_done
            trainer.writes_done = False
            t1 = time.perf_counter()
            trainer.ckpt.finish(agreed=True)
            completing.append(time.perf_counter() - t1)
        return time.perf_counter() - t0

    def waited() -> float:  # optimizer updates held for the checkpoint's writes, in all
        writer = trainer.ckpt.writer
        return writer.blocked_s if writer is not None else 0.0

    for _ in range(args.warmup):
        step()
    for _ in range(args.saves):
        plain += [step() for _ in range(args.steps_between)]
        completing.clear()
        w0, t0 = waited(), time.perf_counter()
        tag = trainer.save()
        save_s = time.perf_counter() - t0
        after = []
        while trainer.ckpt.pending is not None and len(after) < args.steps_between:
            after.append(step())
        t0 = time.perf_counter()
        if trainer.ckpt.pending is not None:  # not complete after --steps-between steps
            trainer.ckpt.finish()
        finish_s = time.perf_counter() - t0
        saves.append({"tag": tag, "save_s": save_s, "steps_after_s": after,
                      "finish_wait_s": finish_s, "write_wait_s": waited() - w0,
                      "complete_s": sum(completing)})  # fmt: skip
    trainer.ckpt.finish()  # the last completion on the store, if one was left to it
    median = statistics.median(plain)
    for s in saves:
        s["blocked_s"] = (
            s["save_s"] + sum(max(0.0, x - median) for x in s["steps_after_s"]) + s["finish_wait_s"]
        )
        s["held_s"] = s["save_s"] + s["write_wait_s"] + s["complete_s"] + s["finish_wait_s"]
    out = {"mode": args.mode, "params": trainer.n_params, "median_step_s": median,
           "saves": saves, "bytes": sum(p.stat().st_size for p in
                                        (trainer.ckpt.root / saves[-1]["tag"]).iterdir()),
           "store": trainer.out.stats(), "process_cpu_s": time.process_time()}  # fmt: skip
    trainer.stream.close()
    Path(args.result).write_text(json.dumps(out, indent=1))


def resume_fetch(args, relay: CountingRelay) -> dict:
    """An empty staging folder, rank 0's files of the latest checkpoint fetched."""
    from pipeline.train.checkpoint import CheckpointManager
    from pipeline.train.out_store import OutStore, owner

    store = OutStore.open(args.store_uri, f"{args.tmp}/stage-resume", rank=0, local_rank=0)
    mgr = CheckpointManager(store, 2, 0, 1)
    tag = mgr.latest()
    listing = store.list_files(f"checkpoints/{tag}")
    need = sum(
        n for p, n in listing
        if owner(p.rsplit("/", 1)[1]) in (None, 0) and not p.endswith(".py")
        and "/universal/" not in p
    )  # fmt: skip
    before = relay.sent + relay.received
    t0 = time.perf_counter()
    names, nbytes = mgr.fetch_for_load(tag, universal=False, rank_file=0)
    seconds = time.perf_counter() - t0
    wire = relay.sent + relay.received - before
    return {"tag": tag, "files": names, "file_bytes": nbytes, "rank_files_bytes": need,
            "checkpoint_bytes": sum(n for _, n in listing), "wire_bytes": wire,
            "seconds": seconds}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_common_args(ap, docs=20_000, words=20_000, vocab_size=30522)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=6)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="local then s3, this many times (each a fresh process)",
    )
    ap.add_argument("--server-nice", type=int, default=0,
                    help="the S3 server's nice value (19: it yields the CPU to training, "
                    "as a server elsewhere would)")  # fmt: skip
    ap.add_argument("--server-cpu", type=int, default=None,
                    help="pin the S3 server to this CPU and both modes' training processes "
                    "to the others (a server elsewhere, as a real store is)")  # fmt: skip
    ap.add_argument("--mode", choices=["local", "s3"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store-uri", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        rank_main(args)
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-out-store-data-"))
    args.data_dir = args.data_dir or str(prepare_data(work, "wordpiece", args))
    tmp = Path(tempfile.mkdtemp(prefix="bench-out-store-", dir="/var/tmp"))
    args.tmp = str(tmp)  # the resume's staging folder (it was None/ in the working dir)
    port = _free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True,
                            preexec_fn=lambda: server_setup(args))  # fmt: skip
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        relay = CountingRelay(port)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}  # fmt: skip
        os.environ.update(env)
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        results: dict = {"local": [], "s3": []}
        for rnd in range(args.rounds):
            for mode in ("local", "s3"):
                result = tmp / f"{mode}-{rnd}.json"
                args.store_uri = f"s3://bench/run{rnd}"
                cmd = [sys.executable, __file__, "--mode", mode, "--result", str(result),
                       "--tmp", str(tmp), "--data-dir", args.data_dir,
                       "--layers", str(args.layers), "--seq", str(args.seq),
                       "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
                       "--saves", str(args.saves), "--steps-between", str(args.steps_between),
                       "--round", str(rnd), "--store-uri", args.store_uri]  # fmt: skip
                load0, moto0 = load1(), _cpu_s(moto.pid)
                print(f"round {rnd}: running {mode} (load {load0:.2f})", flush=True)
                subprocess.run(cmd, check=True, env={**env, "DS_ACCELERATOR": "cpu"},
                               preexec_fn=lambda: training_setup(args))  # fmt: skip
                res = json.loads(result.read_text())
                res.update(load_before=load0, load_after=load1(),
                           server_cpu_s=_cpu_s(moto.pid) - moto0)  # fmt: skip
                results[mode].append(res)
                for folder in (f"local-run-{rnd}", f"stage-s3-{rnd}"):  # GBs each
                    shutil.rmtree(tmp / folder, ignore_errors=True)
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{relay.port}"  # counted
        results["resume"] = resume_fetch(args, relay)
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    saves = {m: [s for res in results[m] for s in res["saves"]] for m in ("local", "s3")}
    med = {(m, k): statistics.median(s[k] for s in saves[m])
           for m in ("local", "s3") for k in ("save_s", "held_s", "blocked_s")}  # fmt: skip
    first = results["local"][0]
    print(f"\nbert, {args.layers} layers, {first['params'] / 1e6:.1f}M params, checkpoint "
          f"{first['bytes'] / 2**20:.0f} MiB (rank 0's files), {args.rounds} round(s) of "
          f"{args.saves} saves per out_dir, load {load1():.2f}")  # fmt: skip
    print(f"{'out_dir':<8} {'median step':>12} {'save()':>8} {'held (median, range)':>24}"
          f" {'blocked (median, range)':>26} {'S3 server CPU':>14} {'training process CPU':>21}")  # fmt: skip
    for m in ("local", "s3"):
        steps = statistics.median(r["median_step_s"] for r in results[m])
        held = [s["held_s"] for s in saves[m]]
        blk = [s["blocked_s"] for s in saves[m]]
        cpu = sum(r["server_cpu_s"] for r in results[m]) if m == "s3" else 0.0
        own = statistics.median(r["process_cpu_s"] for r in results[m])
        print(f"{m:<8} {steps:>11.3f}s {med[m, 'save_s']:>7.3f}s "
              f"{med[m, 'held_s']:>8.3f}s ({min(held):.3f}-{max(held):.3f}) "
              f"{med[m, 'blocked_s']:>9.3f}s ({min(blk):.3f}-{max(blk):.3f}) "
              f"{cpu:>13.1f}s {own:>20.1f}s")  # fmt: skip
    held_ratio = med["s3", "held_s"] / max(med["local", "held_s"], 1e-9)
    ratio = med["s3", "blocked_s"] / max(med["local", "blocked_s"], 1e-9)
    r = results["resume"]
    wire = r["wire_bytes"] / max(r["rank_files_bytes"], 1)
    print(f"held s3 / local: {held_ratio:.2f}x; blocked s3 / local: {ratio:.2f}x (goal <= 1.1x)")
    print(f"resume from s3, empty cache: {r['wire_bytes']:,} bytes on the wire for "
          f"{r['rank_files_bytes']:,} bytes of rank 0's files ({wire:.4f}x, goal <= 1.05x; "
          f"{len(r['files'])} files, {r['seconds']:.2f} s; the checkpoint holds "
          f"{r['checkpoint_bytes']:,})")  # fmt: skip
    results.update(ratio_held=held_ratio, ratio_blocked=ratio, ratio_wire=wire)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
