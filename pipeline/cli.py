"""`plm`: parse, validate, call. No pipeline logic lives here."""

from __future__ import annotations

import argparse
import sys


def _data_tokenizer(args: argparse.Namespace) -> int:
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    spec = TokenizerSpec(
        kind=args.kind,
        vocab_size=args.vocab_size,
        lowercase=args.lowercase,
        sample_docs=args.sample_docs,
        seed=args.seed,
        text_field=args.text_field,
    )
    out = train_tokenizer(args.input, spec, args.output)
    print(f"tokenizer written to {out}")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from pipeline.data.prepare import prepare_from_cli

    return prepare_from_cli(args)


def _data_inspect(args: argparse.Namespace) -> int:
    from pipeline.data.inspect import inspect_data

    return inspect_data(args.dir, verify=args.verify)


def _train(args: argparse.Namespace) -> int:
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)  # fails here, naming the key
    if args.dry_run:
        from pipeline.train.plan import print_plan

        return print_plan(cfg)
    from pipeline.train.trainer import TrainingDiverged, train

    try:
        train(cfg)
    except TrainingDiverged as err:  # the message says what was saved and what to change
        print(f"plm: {err}", file=sys.stderr)
        return 1
    return 0


def _export(args: argparse.Namespace) -> int:
    from pipeline.export.hf import export_to_hf

    out = export_to_hf(args.bundle, args.out)
    print(f"transformers folder written to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo

    return run_demo(args.workdir, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plm", description=__doc__)
    # The deepspeed launcher puts --local_rank=N before the subcommand (LOCAL_RANK has it too).
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="tokenizer training, sharding, inspection").add_subparsers(
        dest="data_command", required=True
    )

    tok = data.add_parser("tokenizer", help="train a HF tokenizer on a corpus")
    tok.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, folders, globs, pyarrow URIs or builtin:NAME",
    )
    tok.add_argument("--kind", choices=["wordpiece", "bpe", "unigram"], required=True)
    tok.add_argument("--vocab-size", type=int, required=True)
    tok.add_argument("--output", required=True)
    tok.add_argument("--lowercase", action="store_true")
    tok.add_argument(
        "--sample-docs", type=int, default=200_000, help="documents in the seeded training sample"
    )
    tok.add_argument("--seed", type=int, default=1234)
    tok.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    tok.set_defaults(func=_data_tokenizer)

    prep = data.add_parser("prepare", help="Ray job: corpus -> WebDataset shards + manifest")
    prep.add_argument("--config", help="YAML data config (configs/data/); flags override it")
    prep.add_argument("--input", nargs="+")
    prep.add_argument("--tokenizer", help="folder with tokenizer.json + tokenizer_meta.json")
    prep.add_argument("--output")
    prep.add_argument("--valid-fraction", type=float)
    size = prep.add_mutually_exclusive_group()
    size.add_argument("--shard-docs", type=int)
    size.add_argument("--shard-bytes", type=int)
    prep.add_argument("--max-doc-tokens", type=int)
    prep.add_argument("--text-field")
    prep.add_argument("--entities", help="entity list (one per line) -> spans.npy (ERNIE)")
    prep.add_argument("--ray-address", help="a running cluster (else RAY_ADDRESS, else local)")
    prep.add_argument("--num-cpus", type=int, help="CPUs of the local Ray instance")
    prep.add_argument("--force", action="store_true", help="rebuild even if up to date")
    prep.set_defaults(func=_data_prepare)

    insp = data.add_parser("inspect", help="totals, splits, rejects; --verify re-hashes")
    insp.add_argument("dir")
    insp.add_argument("--verify", action="store_true")
    insp.set_defaults(func=_data_inspect)

    train = sub.add_parser("train", help="pretrain (what `deepspeed` and Kubernetes run)")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and print the plan without starting DeepSpeed",
    )
    # The deepspeed launcher appends --local_rank=N; the env var LOCAL_RANK carries it too.
    train.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    train.set_defaults(func=_train)

    export = sub.add_parser("export", help="convert a model bundle")
    export.add_argument("--to", choices=["hf"], required=True)
    export.add_argument("bundle")
    export.add_argument("out")
    export.set_defaults(func=_export)

    demo = sub.add_parser("demo", help="the whole pipeline on the bundled default corpus")
    demo.add_argument("--workdir", default="demo")
    demo.add_argument("--steps", type=int, default=300)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError
    from pipeline.data.shards import ShardError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ShardError) as err:  # bad input: a clear message, no traceback
        print(f"plm: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
