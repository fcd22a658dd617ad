"""`plm demo`: the whole pipeline on the bundled corpus, on a laptop CPU, in minutes.

builtin:python-docs (the docstrings CPython ships, no download) -> WordPiece tokenizer
-> WebDataset shards (a local Ray job) -> a tiny BERT (MLM) under DeepSpeed ZeRO-2
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


# Fine-tuning seeds: one accuracy from 40 labelled paragraphs is noisy (up to 0.07 apart between
# seeds), so the demo reports the mean and each seed, for both initialisations.
FINETUNE_SEEDS = (0, 1, 2)


def run_demo(
    workdir: str | Path = "demo",
    steps: int = 6000,
    finetune_epochs: int = 20,
    objective: str = "mlm",
    seed: int = 1234,
) -> int:
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(workdir)
    data = _shards(workdir, tokenizer)
    run_dir = workdir / "runs" / NAME
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh training run each time (new MLflow run and version)
    # MLM only (RoBERTa's finding holds here too: with NSP the same 6000 steps reached MLM
    # accuracy 0.24 instead of 0.29, and the topic task gained +0.05 instead of +0.19) and
    # 6000 steps of 32 x 64 tokens: a tiny BERT needs that long to learn which words go
    # together, which is what the topic task draws on (README, section 6, has the runs).
    cfg = load_config(
        CONFIGS_DIR / "test" / "bert-tiny.yaml",
        [
            f"name={NAME}",
            f"data.path={data}",
            "data.seq_len=64",
            f"objective.kind={objective}",
            f"train.max_steps={steps}",
            f"train.seed={seed}",
            "train.micro_batch_size=32",
            "train.lr=3.0e-3",
            f"train.warmup_steps={max(1, steps // 10)}",
            "train.log_every=20",
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
    summary: dict = {"pretraining": {"steps": result.steps, "mlm_loss": [start, end]}}
    if finetune_epochs > 0 and result.bundle_dir is not None:
        scores = _finetune(workdir, result, cfg, finetune_epochs)
        summary["topic_test_accuracy"] = scores
        mean = {init: sum(accs) / len(accs) for init, accs in scores.items()}
        print(
            f"[demo] fine-tuned topic accuracy (test, mean of seeds {list(FINETUNE_SEEDS)}): "
            f"pretrained {mean['pretrained']:.3f} vs random init {mean['random']:.3f}"
        )
        for init, accs in scores.items():
            print(f"[demo]   {init:<10} {'  '.join(f'{a:.3f}' for a in accs)}")
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[demo] summary:       {workdir / 'summary.json'}")
    return 0 if end < start else 1


def _finetune(workdir: Path, result, cfg, epochs: int) -> dict[str, list[float]]:
    """Fine-tune the demo BERT on the python-docs topic task (pipeline/finetune/demo_task.py),
    and the same architecture from random initialisation, with the same recipe, once per
    seed in FINETUNE_SEEDS. The first pretrained run is registered as NAME-topic."""
    from pipeline.finetune.config import validate_finetune
    from pipeline.finetune.demo_task import build_topic_task, topic_finetune_config
    from pipeline.finetune.loop import finetune

    paths = build_topic_task(workdir / "task")
    # The registered model when there is one (the path a user takes), else the bundle.
    source = (
        f"models:/{NAME}@{cfg.mlflow.alias}" if result.model_version else str(result.bundle_dir)
    )
    scores: dict[str, list[float]] = {"pretrained": [], "random": []}
    for seed in FINETUNE_SEEDS:
        for init in scores:
            register = init == "pretrained" and seed == FINETUNE_SEEDS[0]
            name = f"{NAME}-topic" if register else f"{NAME}-topic-{init}-seed{seed}"
            print(f"[demo] fine-tuning {source} ({init} weights, seed {seed}) -> {name}")
            raw = topic_finetune_config(
                source,
                init,
                paths,
                workdir / "runs" / name,
                name,
                tracking_uri=cfg.mlflow.tracking_uri,
                register=register,
                epochs=epochs,
                seed=seed,
            )
            res = finetune(validate_finetune(raw, "demo fine-tuning"))
            scores[init].append(res.test["accuracy"])
            if res.model_version:
                print(f"[demo] registered:    models:/{name}@current (version {res.model_version})")
                print(
                    f"[demo] predict with:  plm predict models:/{name}@current --input {paths['test']}"
                )
    return scores
