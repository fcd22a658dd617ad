"""Training steps/s with data.path on S3 (moto's server on loopback) vs the local data dir.

    python bench/bench_remote_data.py [--docs 20000 --block-tokens 65536 --steps 20
                                       --rounds 3 --cold-steps 30]

One data dir (the benches' corpus through ``plm data tokenizer`` / ``plm data prepare``,
blocks of ``--block-tokens`` tokens, under --work-dir, default /tmp/bench-remote-data),
copied to a bucket of a ``moto_server`` started here on
127.0.0.1 (pyarrow.fs.copy_files). For each model (bert-tiny as configs/test/bert-tiny.yaml,
and a 4-layer hidden-256 BERT), two Trainers in this process (``benchlib.Ours``, the
loader in-process, ``data.workers: 0``), one on the local dir and one on
``s3://bench/data`` with an empty ``data.cache_dir``:

* cold: the S3 side's first ``--cold-steps`` steps (its cache empty): the bytes it
  fetched for blocks over the bytes of the blocks it read (goal <= 1.1; the manifest,
  indexes, tokenizer and token counts are counted apart), and its steps/s;
* steady: then ``--rounds`` rounds of ``--steps`` steps on each side, alternating which
  goes first; a step = the next batch from the stream + ``train_step``. Prints each
  side's median steps/s and the median per-round ratio S3 / local (goal >= 0.9).

Wall seconds: the S3 side's waits on the network count (that is the point).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

MODELS = {
    "bert-tiny": {"arch": "bert", "preset": "bert-tiny", "dropout": 0.0,
                  "attention_dropout": 0.0},
    "bert-4x256": {"arch": "bert", "preset": "bert-tiny", "num_layers": 4, "hidden_size": 256,
                   "num_heads": 4, "intermediate_size": 1024, "dropout": 0.0,
                   "attention_dropout": 0.0},
}  # fmt: skip
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip


def start_moto(log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "wb") as out:
        proc = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moto_server did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.1)


def upload(data: Path, endpoint: str) -> str:
    import boto3
    import pyarrow.fs as pafs

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    pafs.copy_files(str(data), "s3://bench/data", source_filesystem=pafs.LocalFileSystem())
    return "s3://bench/data"


def steps(side, it, n: int) -> float:
    """Wall seconds of n steps (batch + train_step), the loss read after."""
    t0 = time.perf_counter()
    for _ in range(n):
        side.step(next(it))
    side.read_loss()
    return time.perf_counter() - t0


def bench_model(name: str, model: dict, data: Path, uri: str, args, tmp: Path) -> dict:
    objective, train = {"kind": "mlm+nsp"}, {"micro_batch_size": args.batch_size, "lr": 1e-3}
    sides, its = {}, {}
    for where, path in (("local", data), ("s3", uri)):
        cfg = benchlib.experiment_config(name, model, objective, path, args.seq_len, train,
                                         tmp / f"{name}-{where}" / "run")  # fmt: skip
        if where == "s3":
            cache = tmp / f"{name}-cache"
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={
                "path": uri, "cache_dir": str(cache)})})  # fmt: skip
        sides[where] = benchlib.Ours(cfg)
        its[where] = iter(sides[where].trainer.stream)
    s3 = sides["s3"].trainer.data
    cold_s = steps(sides["s3"], its["s3"], args.cold_steps)
    steps(sides["local"], its["local"], args.cold_steps)
    cold = s3.stats()
    per_round, rates = [], {"local": [], "s3": []}
    for r in range(args.rounds):
        order = ("local", "s3") if r % 2 == 0 else ("s3", "local")
        took = {w: steps(sides[w], its[w], args.steps) for w in order}
        for w in order:
            rates[w].append(args.steps / took[w])
        per_round.append(took["local"] / took["s3"])
    total = s3.stats()
    epoch = loader_epoch(sides["s3"].trainer, uri, tmp / f"{name}-epoch-cache", args)
    assert sides["s3"].losses == sides["local"].losses, "the two sides trained differently"
    for side in sides.values():
        side.close()
    out = {
        "model": name,
        "local_steps_s": statistics.median(rates["local"]),
        "s3_steps_s": statistics.median(rates["s3"]),
        "steady_ratio": statistics.median(per_round),
        "ratio_range": [min(per_round), max(per_round)],
        "cold_steps_s": args.cold_steps / cold_s,
        "cold_fetched_over_read": cold["fetched_bytes"] / max(cold["read_bytes"], 1),
        "epoch_fetched_over_read": epoch["fetched_bytes"] / max(epoch["read_bytes"], 1),
        "cold": cold,
        "total": total,
        "epoch": epoch,
    }
    print(f"{name:11s} local {out['local_steps_s']:6.2f} steps/s  s3 {out['s3_steps_s']:6.2f} "
          f"steps/s  steady s3/local {out['steady_ratio']:.3f} "
          f"[{min(per_round):.3f}, {max(per_round):.3f}]  | cold {out['cold_steps_s']:.2f} "
          f"steps/s, fetched/read {out['cold_fetched_over_read']:.3f} "
          f"({cold['fetched_bytes']:,} / {cold['read_bytes']:,} bytes, {cold['blocks_read']} "
          f"blocks; metadata {cold['meta_bytes']:,} bytes); after: {total['blocks_fetched']} "
          f"blocks fetched, {total['cache_hits']} cache hits, {total['prefetched']} prefetched; "
          f"a whole epoch of the loader from a cold cache: fetched/read "
          f"{out['epoch_fetched_over_read']:.3f} ({epoch['blocks_fetched']} blocks fetched, "
          f"{epoch['blocks_read']} read)")  # fmt: skip
    return out


def prepare(work: Path, args) -> Path:
    """The benches' corpus and tokenizer (benchlib), shards of ``--block-tokens`` blocks:
    many blocks, so prefetch and the cache have work (reused when the knobs match)."""
    knobs = {"docs": args.docs, "words": args.words, "vocab": args.vocab_size,
             "seed": args.seed, "block_tokens": args.block_tokens,
             "version": benchlib.DATA_VERSION}  # fmt: skip
    stamp, data = work / "remote_data.json", work / "data"
    if stamp.is_file() and json.loads(stamp.read_text()) == knobs:
        return data
    work.mkdir(parents=True, exist_ok=True)
    corpus, tok = work / "corpus.txt", work / "tokenizer"
    benchlib.write_corpus(corpus, args.docs, args.max_sentences, args.words, args.seed)
    benchlib.plm_cli("data", "tokenizer", "--input", str(corpus), "--kind", "wordpiece",
                     "--lowercase", "--vocab-size", str(args.vocab_size), "--output", str(tok))  # fmt: skip
    benchlib.plm_cli("data", "prepare", "--input", str(corpus), "--tokenizer", str(tok),
                     "--output", str(data), "--valid-fraction", "0.01", "--block-tokens",
                     str(args.block_tokens), "--num-cpus", str(args.prepare_cpus), "--force")  # fmt: skip
    stamp.write_text(json.dumps(knobs))
    return data


def loader_epoch(trainer, uri: str, cache: Path, args) -> dict:
    """One whole epoch of the train stream alone from a cold cache: the S3 side's counters
    (the prefetch of the next group is read before the epoch ends)."""
    from pipeline.data.remote import CacheConfig
    from pipeline.data.shards import DataDir
    from pipeline.loader.stream import PretrainStream

    data = DataDir(uri, CacheConfig(str(cache), trainer.cfg.data.cache_bytes, 4))
    stream = PretrainStream(data, "train", trainer.objective, args.batch_size, seed=1)
    it = iter(stream)
    for _ in range(stream.batches_per_epoch):
        next(it)
    return data.stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, docs=20000, words=3000, vocab_size=2000)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--cold-steps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20, help="steps per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--block-tokens", type=int, default=1 << 16, help="tokens per block")
    args = ap.parse_args()
    if not args.data_dir:
        work = Path(args.work_dir or "/tmp/bench-remote-data")
        args.data_dir = str(prepare(work, args))
    with benchlib.session(args, "wordpiece") as s:
        proc, endpoint = start_moto(s.tmp / "moto.log")
        os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
        try:
            uri = upload(s.data, endpoint)
            manifest = json.loads((s.data / "manifest.json").read_text())
            blocks = sum(e["n_blocks"] for e in manifest["splits"]["train"]["shards"])
            print(f"s3: {uri} on moto at {endpoint}; {blocks} train blocks")
            results = [bench_model(m, MODELS[m], s.data, uri, args, s.tmp)
                       for m in args.models.split(",")]  # fmt: skip
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        s.finish({"results": results, "train_blocks": blocks})


if __name__ == "__main__":
    main()
