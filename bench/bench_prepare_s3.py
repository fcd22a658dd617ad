"""`plm data prepare` with its input and output on S3 against local paths, in CPU seconds,
side by side in one run.

    python bench/bench_prepare_s3.py [--mb 50] [--num-cpus 2] [--rounds 3]

The S3 server is moto's server mode on loopback (the rig's server, without the rig): the
job reaches it through pyarrow's S3 filesystem and the standard AWS_* variables, as it
would reach S3 or MinIO. Measured: the CPU seconds of the whole `plm data prepare` process
tree (driver, Ray's processes, workers; ``bench_prepare.tree_cpu``), not the server's: on
a cluster the object store's CPU is not the job's. The two runs take turns round by round
(``--force``: every round rebuilds); the medians and their ratio are printed, goal <= 1.1.
Both runs must put the same documents and tokens in every shard (checked; the bytes
differ only in the source names the blocks record: a path, a URI).
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prepare import make_corpus, make_tokenizer, tree_cpu  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3(log: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    port = free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    server = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # fmt: skip
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return server, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-s3-"))
    server, s3env = start_s3(work / "s3.log")
    try:
        import pyarrow.fs as pafs

        corpus = work / "corpus.jsonl"
        n_docs = make_corpus(corpus, args.mb)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **s3env}
        s3 = pafs.S3FileSystem(endpoint_override=s3env["AWS_ENDPOINT_URL"], access_key="bench",
                               secret_key="bench", region="us-east-1", scheme="http",
                               allow_bucket_creation=True)  # fmt: skip
        s3.create_dir("bench")
        pafs.copy_files(str(corpus), "bench/corpus/corpus.jsonl", destination_filesystem=s3)
        tok = make_tokenizer(corpus, work, env)
        print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB, {n_docs:,} documents; "
              f"S3: moto_server on {s3env['AWS_ENDPOINT_URL']}")  # fmt: skip
        runs = {
            "local": (str(corpus), str(work / "data")),
            "s3": ("s3://bench/corpus/corpus.jsonl", "s3://bench/data"),
        }
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for kind, (inp, out) in runs.items():
                cmd = ["plm", "data", "prepare", "--input", inp, "--tokenizer", str(tok),
                       "--output", out, "--num-cpus", str(args.num_cpus), "--force"]  # fmt: skip
                w, c, _ = tree_cpu(cmd, env)
                cpu[kind].append(c)
                wall[kind].append(w)
                print(f"round {r + 1} {kind:5s}: {c:7.1f} CPU s, {w:6.1f} s wall", flush=True)
        local_m = json.loads((work / "data" / "manifest.json").read_text())
        with s3.open_input_file("bench/data/manifest.json") as f:
            s3_m = json.loads(f.read())
        # Not the same bytes: each block names its source (a path here, a URI there).
        same = all(
            [(e["n_docs"], e["n_tokens"]) for e in local_m["splits"][s]["shards"]]
            == [(e["n_docs"], e["n_tokens"]) for e in s3_m["splits"][s]["shards"]]
            for s in local_m["splits"]
        )
        med = {k: statistics.median(v) for k, v in cpu.items()}
        ratio = med["s3"] / med["local"]
        print(f"median CPU s: local {med['local']:.1f}, s3 {med['s3']:.1f}")
        print(f"prepare CPU, s3:// in and out / local paths   {ratio:5.2f}  (goal <= 1.1)")
        print(f"the same documents and tokens in every shard: {same}")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"cpu": cpu, "wall": wall, "median": med, "ratio": ratio, "same": same,
                 "mb": args.mb, "num_cpus": args.num_cpus}, indent=1))  # fmt: skip
        return 0 if same else 1
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
