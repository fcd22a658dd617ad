"""`plm demo`: the whole pipeline on the bundled corpus, on a laptop CPU, in minutes.

builtin:python-docs (the docstrings CPython ships, no download) -> WordPiece tokenizer
-> WebDataset shards (a local Ray job) -> a tiny BERT (MLM + NSP) under DeepSpeed ZeRO-2
-> an MLflow run with the model bundle, registered in the Model Registry
-> fine-tuned on a small labelled task built from the same text (which stdlib package a
   documentation paragraph comes from), next to the same BERT from random initialisation.
Re-running reuses the tokenizer and the shards; the training run starts afresh.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.config import CONFIGS_DIR, load_config

CORPUS = "builtin:python-docs"
NAME = "bert-tiny-demo"
# A small vocabulary: each embedding row gets many updates in a short run, and the tied MLM
# decoder (most of a tiny BERT's compute) stays cheap.
VOCAB_SIZE = 2000


def _tokenizer(workdir: Path) -> Path:
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    out = workdir / "tokenizer"
    meta = out / "tokenizer_meta.json"
    if meta.is_file() and json.loads(meta.read_text())["spec"]["vocab_size"] == VOCAB_SIZE:
        print(f"[demo] tokenizer: reusing {out}")
        return out
    print(f"[demo] tokenizer: training WordPiece (vocab {VOCAB_SIZE}) on {CORPUS}")
    spec = TokenizerSpec(kind="wordpiece", vocab_size=VOCAB_SIZE)
    return Path(train_tokenizer([CORPUS], spec, out))


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


def run_demo(
    workdir: str | Path = "demo",
    steps: int = 1500,
    finetune_epochs: int = 10,
    objective: str = "mlm+nsp",
) -> int:
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
            f"objective.kind={objective}",
            f"train.max_steps={steps}",
            "train.micro_batch_size=16",
            "train.lr=3.0e-3",
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
    if finetune_epochs <= 0 or result.bundle_dir is None:
        return 0 if end < start else 1
    pretrained, scratch = _finetune(workdir, result, cfg, finetune_epochs)
    print(
        f"[demo] fine-tuned topic accuracy (test): pretrained {pretrained:.3f} vs "
        f"random init {scratch:.3f}"
    )
    return 0 if end < start else 1


def _finetune(workdir: Path, result, cfg, epochs: int) -> tuple[float, float]:
    """Fine-tune the demo BERT on the python-docs topic task (pipeline/finetune/demo_task.py),
    and the same architecture from random initialisation, with the same seed and steps."""
    from pipeline.finetune.config import validate_finetune
    from pipeline.finetune.demo_task import build_topic_task, topic_finetune_config
    from pipeline.finetune.loop import finetune

    paths = build_topic_task(workdir / "task")
    # The registered model when there is one (the path a user takes), else the bundle.
    source = (
        f"models:/{NAME}@{cfg.mlflow.alias}" if result.model_version else str(result.bundle_dir)
    )
    scores = {}
    for init in ("pretrained", "random"):
        name = f"{NAME}-topic" if init == "pretrained" else f"{NAME}-topic-random"
        print(f"[demo] fine-tuning {source} ({init} weights) on the topic task -> {name}")
        raw = topic_finetune_config(
            source,
            init,
            paths,
            workdir / "runs" / name,
            name,
            tracking_uri=cfg.mlflow.tracking_uri,
            register=init == "pretrained",
            epochs=epochs,
        )
        ft = validate_finetune(raw, "demo fine-tuning")
        res = finetune(ft)
        scores[init] = res.test["accuracy"]
        if res.model_version:
            print(f"[demo] registered:    models:/{name}@current (version {res.model_version})")
            print(
                f"[demo] predict with:  plm predict models:/{name}@current --input {paths['test']}"
            )
    return scores["pretrained"], scores["random"]
