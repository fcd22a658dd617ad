"""`plm demo`: the whole pipeline on the bundled corpus, on a laptop CPU, in minutes.

builtin:python-docs (the docstrings CPython ships, no download) -> WordPiece tokenizer
-> WebDataset shards (a local Ray job) -> a tiny BERT (MLM + NSP) under DeepSpeed ZeRO-2
-> an MLflow run with the model bundle, registered in the Model Registry.
Re-running reuses the tokenizer and the shards; the training run starts afresh.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.config import CONFIGS_DIR, load_config

CORPUS = "builtin:python-docs"
NAME = "bert-tiny-demo"


def _tokenizer(workdir: Path) -> Path:
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    out = workdir / "tokenizer"
    if (out / "tokenizer_meta.json").is_file():
        print(f"[demo] tokenizer: reusing {out}")
        return out
    print(f"[demo] tokenizer: training WordPiece (vocab 6000) on {CORPUS}")
    return Path(train_tokenizer([CORPUS], TokenizerSpec(kind="wordpiece", vocab_size=6000), out))


def _shards(workdir: Path, tokenizer: Path) -> Path:
    from pipeline.data.prepare import PrepareConfig, run_prepare

    print("[demo] shards: `plm data prepare` as a local Ray job (skipped when up to date)")
    cfg = PrepareConfig(
        inputs=[CORPUS],
        tokenizer=str(tokenizer),
        output=str(workdir / "data"),
        valid_fraction=0.05,
        shard_docs=500,
        max_doc_tokens=512,
        num_cpus=2,
    )
    return Path(run_prepare(cfg))


def _mlm_losses(run_dir: Path) -> tuple[float, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r["mlm_loss"] for r in rows if "mlm_loss" in r]
    return values[0], values[-1]


def run_demo(workdir: str | Path = "demo", steps: int = 300) -> int:
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(workdir)
    data = _shards(workdir, tokenizer)
    run_dir = workdir / "runs" / NAME
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh training run each time (new MLflow run and version)
    cfg = load_config(
        CONFIGS_DIR / "test" / "bert-tiny.yaml",
        [
            f"name={NAME}",
            f"data.path={data}",
            "data.seq_len=128",
            f"train.max_steps={steps}",
            "train.micro_batch_size=16",
            "train.lr=2.0e-3",
            f"train.warmup_steps={max(1, steps // 10)}",
            "train.log_every=10",
            f"train.eval_every={max(1, steps // 3)}",
            "train.eval_batches=4",
            f"train.save_every={max(1, steps // 3)}",
            "train.bundle_every=0",
            f"train.out_dir={run_dir}",
            "deepspeed=configs/deepspeed/zero2.json",
        ],
    )
    print(f"[demo] training {NAME}: {steps} steps, DeepSpeed ZeRO-2, world size 1")
    from pipeline.train.tracking import resolve_tracking_uri
    from pipeline.train.trainer import train

    result = train(cfg)
    start, end = _mlm_losses(run_dir)
    uri = resolve_tracking_uri(cfg.mlflow.tracking_uri)
    print()
    print(f"[demo] MLM loss: {start:.3f} at the start -> {end:.3f} at step {result.steps}")
    print(f"[demo] checkpoints:   {run_dir / 'checkpoints'}")
    print(f"[demo] model bundle:  {result.bundle_dir}")
    if result.run_id:
        print(f"[demo] MLflow run:    {result.run_id} (experiment {NAME})")
    if result.model_version:
        print(
            f"[demo] registered:    models:/{NAME}@{cfg.mlflow.alias} (version {result.model_version})"
        )
    print(f"[demo] look at it:    mlflow ui --backend-store-uri {uri}")
    return 0 if end < start else 1
