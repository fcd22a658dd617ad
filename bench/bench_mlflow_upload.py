"""What the MLflow upload and download of a large bundle cost in memory: the trainer's
own calls (``Tracker.log_artifacts`` of the bundle as ``model``, then ``Tracker.register``:
the pyfunc LoggedModel and its registered version) and the fine-tune's download of
``models:/NAME@ALIAS`` (``fetch_bundle``), each in a fresh process, against

- ``sqlite``: a local sqlite store, artifacts in a local folder;
- ``server``: an ``mlflow server`` on loopback, artifacts proxied (HTTP) to a local folder;
- ``server-s3``: the same server with its artifacts on an S3 server (moto, loopback), as
  the rehearsal cluster runs it (docs/cluster.md).

    python bench/bench_mlflow_upload.py --bundle RUN_DIR/bundles/final
    python bench/bench_mlflow_upload.py --preset bert-large       # builds one (8k vocab)

Each phase is first run on a bert-tiny bundle (MLflow's code loaded, its first-use
allocations made); then the kernel's peak is reset (``/proc/PID/clear_refs`` 5) and the
phase's growth is ``VmHWM - VmRSS at the start``, for the client and for every process of
the server (the most any one of them grew). moto keeps each object in memory, so its
growth is the data and is not reported. Prints a JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "launch")]  # s3_server, all_in_one


def status_bytes(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int | str) -> int:
    """VmHWM := VmRSS for ``pid``; its VmRSS now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_bytes(pid, "VmRSS")


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (an mlflow server's uvicorn workers)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for child in Path(f"/proc/{p}/task").glob("*/children"):
            todo += [int(c) for c in child.read_text().split()]
    return found


# --- the client: one phase in a fresh process -------------------------------------------


def client(phase: str, uri: str, bundle: Path, small: Path, work: Path) -> dict:
    """``upload``: a run that logs ``small`` then ``bundle`` as the trainer does (artifact
    folder ``model``, registered pyfunc model); ``download``: ``fetch_bundle`` of the
    registered models, small first. The growth of this process's peak during the
    ``bundle`` part, and the server's when ``server_pid`` is in the environment."""
    import gc

    from pipeline.models.bundle import fetch_bundle
    from pipeline.train.tracking import Tracker

    server = os.environ.get("BENCH_SERVER_PID")

    def measured(fn) -> dict:
        gc.collect()
        pids = tree(int(server)) if server else []
        starts = {p: reset_peak(p) for p in pids}
        start = reset_peak("self")
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        growth = {p: status_bytes(p, "VmHWM") - s for p, s in starts.items()}
        return {"client_growth": status_bytes("self", "VmHWM") - start,
                "server_growth": max(growth.values()) if growth else None,
                "server_processes": len(pids), "wall_s": wall}  # fmt: skip

    out: dict = {}
    if phase == "upload":
        for name, folder in (("small", small), ("big", bundle)):
            tracker = Tracker(work / f"run-{name}", enabled=True)
            tracker.start(tracking_uri=uri, experiment="bench-upload", run_name=name, params={},
                          tags={}, resume=False)  # fmt: skip

            def upload(tracker=tracker, name=name, folder=folder):
                tracker.log_artifacts(folder, "model")
                tracker.register("model", f"bench-{name}", "current", {}, bundle_dir=folder)

            result = measured(upload)
            tracker.end()
            if tracker.warnings:
                raise SystemExit(f"the upload warned: {tracker.warnings}")
        out["upload"] = result
    else:
        for name in ("small", "big"):
            dst = work / f"download-{name}"
            shutil.rmtree(dst, ignore_errors=True)
            result = measured(lambda dst=dst, name=name: fetch_bundle(
                f"models:/bench-{name}@current", uri, dst))  # fmt: skip
        out["download"] = result
    return out


# --- the stores --------------------------------------------------------------------------


def run_target(target: str, bundle: Path, small: Path, work: Path) -> dict:
    """Both phases against ``target``'s store: its servers started here (the all-in-one's
    ``mlflow server``; moto for ``server-s3``) and stopped after."""
    from all_in_one import MlflowServer
    from s3_server import _free_port, start_moto

    work = work / target
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    moto, server = None, None
    try:
        if target == "sqlite":
            uri = f"sqlite:///{work / 'mlflow.db'}"
        else:
            server = MlflowServer(work, work)  # artifacts proxied to work/mlartifacts
            if target == "server-s3":
                port = _free_port()
                moto = start_moto(port, work / "moto.log")
                s3 = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                      "AWS_DEFAULT_REGION": "us-east-1",
                      "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}  # fmt: skip
                os.environ.update(s3)  # the server's (MlflowServer passes os.environ on)
                env.update(s3)
                import boto3

                boto3.client("s3", endpoint_url=s3["MLFLOW_S3_ENDPOINT_URL"]).create_bucket(
                    Bucket="artifacts"
                )
                server.artifacts = "s3://artifacts/mlflow"
            server.start()
            uri = server.url
            env["BENCH_SERVER_PID"] = str(server.proc.pid)
        result: dict = {"target": target}
        for phase in ("upload", "download"):
            proc = subprocess.run(
                [sys.executable, __file__, "--client", phase, "--uri", uri, "--bundle",
                 str(bundle), "--small", str(small), "--work", str(work)],
                env=env, cwd=work, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{target} {phase}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
            result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        return result
    finally:
        if server is not None:
            server.stop()
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=60)


# --- the bundles -------------------------------------------------------------------------


def make_bundle(preset: str, work: Path) -> tuple[Path, Path]:
    """A ``preset`` BERT bundle (random weights, 8k WordPiece vocabulary of the bundled
    corpus) and a bert-tiny one on the same tokenizer; built once in ``work``."""
    tok = work / "tok"
    if not (tok / "tokenizer_meta.json").is_file():
        subprocess.run([sys.executable, "-m", "pipeline.cli", "data", "tokenizer", "--input",
                        "builtin:python-docs", "--kind", "wordpiece", "--vocab-size", "8000",
                        "--output", str(tok)], check=True, capture_output=True)  # fmt: skip
    made = []
    for name in (preset, "bert-tiny"):
        out = work / f"bundle-{name}"
        if not (out / "config.yaml").is_file():
            code = (
                "import json, sys, torch; from pipeline.models import build_model, "
                "resolve_model_config; from pipeline.models.bundle import save_bundle; "
                "v = json.load(open(sys.argv[2] + '/tokenizer_meta.json'))['vocab_size']; "
                "c = resolve_model_config({'arch': 'bert', 'preset': sys.argv[1]}, v); "
                "torch.manual_seed(0); m = build_model('bert', c); "
                "save_bundle(sys.argv[3], 'bert', c, m.state_dict(), sys.argv[2])"
            )
            subprocess.run([sys.executable, "-c", code, name, str(tok), str(out)], check=True)
        made.append(out)
    return made[0], made[1]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="a bundle folder (default: built, --preset)")
    ap.add_argument("--preset", default="bert-large")
    ap.add_argument("--targets", default="sqlite,server,server-s3")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/plm-bench-mlflow"))
    ap.add_argument("--client", choices=["upload", "download"], help=argparse.SUPPRESS)
    ap.add_argument("--uri", help=argparse.SUPPRESS)
    ap.add_argument("--small", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(client(args.client, args.uri, args.bundle, args.small, args.work)))
        return 0

    args.work.mkdir(parents=True, exist_ok=True)
    big, small = make_bundle(args.preset, args.work)
    if args.bundle is not None:
        big = args.bundle
    size = folder_bytes(big)
    results = [run_target(t, big, small, args.work) for t in args.targets.split(",")]
    print(json.dumps({"bundle": str(big), "bundle_bytes": size, "results": results}))
    print(f"\nbundle {big}: {mib(size)}")
    print(
        "| store | upload: client peak growth | server | wall | download: client | server | wall |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        u, d = r["upload"], r["download"]
        print(f"| {r['target']} | {mib(u['client_growth'])} | {mib(u['server_growth'])} | "
              f"{u['wall_s']:.1f} s | {mib(d['client_growth'])} | {mib(d['server_growth'])} | "
              f"{d['wall_s']:.1f} s |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
