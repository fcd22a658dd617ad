"""The `plm` command line: parse, validate, call.

A note for developers: no pipeline logic lives here; each command parses its arguments
and calls the stage that does the work. What users read is ``DESCRIPTION``/``EPILOG``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import NoReturn


def _data_tokenizer(args: argparse.Namespace) -> int:
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    spec = TokenizerSpec(
        kind=args.kind,
        vocab_size=args.vocab_size,
        lowercase=args.lowercase,
        sample_docs=args.sample_docs,
        seed=args.seed,
        text_field=args.text_field,
    )
    if args.dry_run:
        from pipeline.prepare.plan import print_tokenizer_plan

        return print_tokenizer_plan(args.input, spec, args.output)
    out = train_tokenizer(args.input, spec, args.output)
    print(f"tokenizer written to {out}")
    return 0


# --- path arguments -------------------------------------------------------------------------
# Every path argument is added through ``_local`` (a local path: a URI is refused, naming
# the flag, before any work) or ``_store`` (a local path or a store URI, which carries no
# credentials or query); ``check_paths`` checks what the chosen command was given.


def _path_arg(parser, flags, kind: str, alternative: str, kwargs) -> argparse.Action:
    action = parser.add_argument(*flags, **kwargs)
    shown = flags[0] if action.option_strings else (action.metavar or action.dest.upper())
    paths = dict(parser.get_default("paths_") or {})
    paths[action.dest] = (shown, kind, alternative)
    parser.set_defaults(paths_=paths)
    return action


def _local(parser, *flags, alternative: str = "", **kwargs) -> argparse.Action:
    return _path_arg(parser, flags, "local", alternative, kwargs)


def _store(parser, *flags, **kwargs) -> argparse.Action:
    return _path_arg(parser, flags, "store", "", kwargs)


def check_paths(args: argparse.Namespace) -> None:
    """A ConfigError (exit 2, one line) for a URI given where a local path is taken, or a
    store URI with credentials in it; before the command does anything."""
    from pipeline.storage import local_path, store_path

    for dest, (shown, kind, alternative) in (getattr(args, "paths_", None) or {}).items():
        values = getattr(args, dest, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str):
                if kind == "local":
                    local_path(value, shown, alternative)
                else:
                    store_path(value, shown)


# --- `plm data prepare [CONFIG] key=value ...` ----------------------------------------------
# The grammar of `plm train` and `plm finetune`, CONFIG optional. Each key of PrepareConfig
# that takes one value has a flag too, made from the field (``_add_key_flags``), so a new
# key gets its flag without an edit here; the exceptions are declared in
# ``_add_prepare_parser``. CONFIG, then the flags, then key=value: a later one wins.

# A dotted key followed by "=": never a path (a path has "/", a URI "://").
OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


class _DataConfig(argparse.Action):
    """The data config, given once: as `--config FILE`, or as the first of the words
    `[CONFIG] key=value ...` when it is no key=value (the others are the overrides)."""

    def __call__(self, parser, namespace, values, option_string=None):
        config = values
        if option_string is None:  # the positional words
            words = list(values)
            config = words.pop(0) if words and not OVERRIDE.match(words[0]) else None
            setattr(namespace, self.dest, words)
        if config is None:
            return
        if namespace.config is not None:
            parser.error("the data config is given twice: give CONFIG or --config FILE")
        namespace.config = config
        if option_string is None:  # check_paths names it as the user gave it
            namespace.paths_ = {**namespace.paths_, "config": ("CONFIG", "local", "")}


def _add_key_flags(parser: argparse.ArgumentParser, model, declared: set[str]) -> None:
    """A flag for each key of ``model`` outside ``declared`` that takes one value:
    `--shard-docs N` sets shard_docs (``flag_name``), a bool key's flag sets it true, a
    path key's is checked as the key is (_local / _store); a key holding a list takes the
    text as its validator does (`--languages en,zh`). A section's keys are key=value only."""
    from pipeline.config import path_kind, value_type
    from pipeline.prepare.config import SHARD_SIZE_KEYS, flag_name

    one_size = parser.add_mutually_exclusive_group()  # one of them, as the config takes
    keys = []
    for key, field in model.model_fields.items():
        kind, typ = path_kind(field), value_type(field)
        if key in declared or typ not in (None, bool, int, float, str):  # a section's class
            continue
        text = field.description  # argparse reads "%" in a help as a format
        kwargs: dict = {"dest": key, "help": text.replace("%", "%%") if text else None}
        if typ is bool:
            kwargs.update(action="store_const", const=True)
        elif typ in (int, float):
            kwargs["type"] = typ
        target = one_size if key in SHARD_SIZE_KEYS else parser
        if kind is None:
            target.add_argument(flag_name(key), **kwargs)
        else:
            _path_arg(target, (flag_name(key),), kind, "", kwargs)
        keys.append(key)
    parser.set_defaults(key_flags_=tuple(keys))


PREPARE_HELP = """\
CONFIG, a YAML data config (configs/data/), is optional; `--config FILE` is the same. Each
key=value sets one of its keys by its dotted path, the value read as YAML
(near_dedup.enabled=true, clean.min_chars=20, inputs=[a.txt,b.txt]). Every key that takes
one value has a flag too (--shard-docs N is shard_docs=N). Flags override the file and
key=value overrides both; shard_docs or shard_bytes set here replaces the file's other."""


class _Parser(argparse.ArgumentParser):
    """A parser that may add its arguments when it first parses (``later``): `plm data
    prepare`'s come from PrepareConfig, an import every other command would pay for."""

    later = None

    def parse_known_args(self, args=None, namespace=None):
        if self.later is not None:
            add, self.later = self.later, None
            add(self)
        return super().parse_known_args(args, namespace)


def _add_prepare_parser(data, lazy: bool) -> None:
    """`plm data prepare`; ``lazy``: its arguments are added when it parses."""
    prep = data.add_parser(
        "prepare", help="Ray job: corpus -> WebDataset shards + manifest",
        description=PREPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    prep.set_defaults(func=_data_prepare)
    if lazy:
        prep.later = _add_prepare_arguments
    else:
        _add_prepare_arguments(prep)


def _add_prepare_arguments(prep: argparse.ArgumentParser) -> None:
    """`plm data prepare`'s arguments (pipeline/prepare/config.py PrepareConfig: its keys)."""
    from pipeline.prepare.config import FLAG_NAMES, PrepareConfig

    prep.add_argument(
        "overrides", nargs="*", action=_DataConfig, metavar="CONFIG key=value",
        help="the data config, then dotted overrides of its keys",
    )  # fmt: skip
    _local(prep, "--config", action=_DataConfig, help="the data config (as CONFIG)")
    # Named exceptions: inputs takes one or more values; near_dedup.enabled is on|off.
    inputs = PrepareConfig.model_fields["inputs"].description
    _store(prep, FLAG_NAMES["inputs"], dest="input", nargs="+", help=inputs)
    _add_key_flags(prep, PrepareConfig, declared={"inputs"})
    prep.add_argument(
        FLAG_NAMES["near_dedup.enabled"], dest="near_dedup", choices=("on", "off"),
        help="MinHash LSH near-duplicate removal (near_dedup.enabled; default off)",
    )  # fmt: skip
    prep.add_argument(
        "--dry-run", action="store_true", help="validate inputs and config, print the plan, no Ray"
    )


def _names_a_key(word: str, model) -> bool:
    return bool(OVERRIDE.match(word)) and word.split("=")[0].split(".")[0] in model.model_fields


def prepare_config_from_args(args: argparse.Namespace):
    """The PrepareConfig of `plm data prepare`'s command line (a ConfigError naming the key)."""
    from pipeline.prepare.config import PrepareConfig, load_prepare_config

    flags = {k: getattr(args, k) for k in args.key_flags_ if getattr(args, k) is not None}
    overrides = list(args.overrides)
    if args.input is not None:  # `--input A B key=value`: argparse gives the item to --input
        items = [word for word in args.input if _names_a_key(word, PrepareConfig)]
        inputs = [word for word in args.input if word not in items]
        if inputs:
            flags["inputs"] = inputs
        overrides = items + overrides
    if args.near_dedup is not None:  # the section's other keys: the file's
        flags["near_dedup"] = {"enabled": args.near_dedup == "on"}
    return load_prepare_config(args.config, flags, overrides)


def _data_prepare(args: argparse.Namespace) -> int:
    cfg = prepare_config_from_args(args)
    if args.dry_run:
        from pipeline.prepare.plan import print_prepare_plan

        return print_prepare_plan(cfg)
    from pipeline.prepare.prepare import run_prepare

    run_prepare(cfg)
    return 0


def _data_inspect(args: argparse.Namespace) -> int:
    from pipeline.prepare.inspect import inspect_data

    return inspect_data(args.dir, verify=args.verify)


# `plm train` finished training but MLflow did not answer within mlflow.final_wait_s: the
# run stays RUNNING there with rows unsent; re-running the same command syncs them.
EXIT_TRACKING_UNSYNCED = 3


def _train(args: argparse.Namespace) -> int:
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)  # fails here, naming the key
    from pipeline.train.checkpoint import CheckpointError

    if args.dry_run:
        from pipeline.train.plan import print_plan

        try:
            return print_plan(cfg)
        except CheckpointError as err:  # the run's `latest` cannot be resumed: as below
            if _prints(err):  # a CheckpointNameError is a ConfigError too: rank 0's line
                print(f"plm: {err}", file=sys.stderr)
            return 2
    from pipeline.train.faults import EXIT_PEER_LOST, PeerLost
    from pipeline.train.stop import TrainingStopped
    from pipeline.train.trainer import TrainingDiverged, train

    try:
        result = train(cfg)
    except TrainingStopped as err:  # SIGTERM / SIGINT: checkpointed, MLflow run KILLED
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"plm: {err}", file=sys.stderr)
        return err.exit_code
    except TrainingDiverged as err:  # the message says what was saved and what to change
        print(f"plm: {err}", file=sys.stderr)
        return 1
    except CheckpointError as err:  # names the checkpoint and what is wrong with it
        print(f"plm: {err}", file=sys.stderr)
        return 2
    except PeerLost as err:  # a lost peer or rendezvous: this rank, its host, what to do
        print(f"plm: {err}", file=sys.stderr)
        return EXIT_PEER_LOST
    from pipeline.train.engine import leave_process_group

    leave_process_group()  # every rank leaves together
    if result.tracking_left_behind:  # trained, but MLflow lacks part of it (rank 0)
        print(f"plm: {result.tracking_left_behind}", file=sys.stderr)
        return EXIT_TRACKING_UNSYNCED
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def _export(args: argparse.Namespace) -> int:
    from pipeline.export.hf import ExportError, export_to_hf
    from pipeline.models.bundle import run_or_bundle

    try:
        bundle = run_or_bundle(args.bundle)  # a run's folder: its bundles/final
        shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
        out = export_to_hf(bundle, args.out, max_shard_bytes=shard)
    except (ExportError, FileNotFoundError) as err:  # names the bundle (and key) and why
        print(f"plm: export: {err}", file=sys.stderr)
        return 2
    source = "" if bundle == Path(args.bundle) else f" (from {bundle})"
    print(f"transformers folder written to {out}{source}")
    return 0


def _no_credentials_flag(args: argparse.Namespace) -> None:
    """--tracking-uri with a user part: refused (argv is in every process list)."""
    from pipeline.errors import ConfigError
    from pipeline.storage import redact_uri, uri_secret_part

    value = getattr(args, "tracking_uri", None)
    if value and (uri_secret_part(value) or "").startswith("user part"):
        raise ConfigError(
            f"--tracking-uri {redact_uri(value)}: may not carry a user part (user:pass@): "
            "the command line is in every process list; give MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD_FILE (a file holding the password) in the environment "
            "(docs/tracking.md)"
        )


def _generate(args: argparse.Namespace) -> int:
    from pipeline.generate import generate_from_cli

    _no_credentials_flag(args)
    return generate_from_cli(args)


def _finetune(args: argparse.Namespace) -> int:
    from pipeline.finetune.config import load_finetune_config
    from pipeline.finetune.loop import finetune

    finetune(load_finetune_config(args.config, args.overrides))  # bad input: exit 2
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pipeline.eval.suite import EvalError

    _no_credentials_flag(args)
    if args.report:
        from pipeline.eval.evaluate import report_run

        print(report_run(args.report, args.tracking_uri))
        return 0
    if not args.suite or not (args.models or args.watch):
        raise EvalError(
            "plm eval SUITE --models SOURCE [SOURCE ...], plm eval SUITE --watch RUN_DIR "
            "[--models random], or plm eval --report RUN"
        )
    from pipeline.eval.evaluate import evaluate, watch
    from pipeline.eval.suite import load_suite

    # `--models A B key=value`: argparse gives the override to --models; a source is never
    # a dotted key followed by "=" (a path has "/", a URI "://").
    overrides = list(args.overrides) + [m for m in args.models if OVERRIDE.match(m)]
    args.models = [m for m in args.models if not OVERRIDE.match(m)]
    if args.tracking_uri:
        overrides.append(f"mlflow.tracking_uri={args.tracking_uri}")
    suite = load_suite(args.suite, overrides)  # bad input: exit 2, before Ray
    if args.watch:
        result = watch(suite, args.watch, args.models, args.address, not args.no_ray,
                       args.poll_s)  # fmt: skip
    else:
        result = evaluate(suite, args.models, args.address, use_ray=not args.no_ray)
    failed = sum(r.scores is None for r in result.results)
    return 1 if failed == len(result.results) else 0


def _predict(args: argparse.Namespace) -> int:
    from pipeline.finetune.predict import predict

    _no_credentials_flag(args)
    out = predict(args.model, args.input, args.output, args.batch_size, args.tracking_uri)
    print(f"predictions written to {out}")
    return 0


def _neighbors(args: argparse.Namespace) -> int:
    from pipeline.neighbors import neighbors_from_cli

    return neighbors_from_cli(args)


def _setup(args: argparse.Namespace) -> int:
    from pipeline.train.ds_ops import setup

    return setup(verbose=args.verbose > 0, nvme=args.nvme)


def _demo(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo

    steps = {} if args.steps is None else {"steps": args.steps}  # else the demo's recipe
    return run_demo(args.workdir, seed=args.seed, **steps)


BUNDLE_OR_MLFLOW = "a bundle folder, models:/NAME@ALIAS or runs:/RUN_ID/model"
FINETUNED_OR_MLFLOW = "a fine-tuned folder, models:/NAME@ALIAS or runs:/RUN_ID/model"


def _add_eval_parser(sub) -> None:
    """`plm eval`'s arguments (pipeline/eval/evaluate.py)."""
    ev = sub.add_parser(
        "eval", help="score checkpoints on a suite of tasks (Ray), rank them in MLflow"
    )
    _local(ev, "suite", nargs="?", help="YAML evaluation suite (configs/eval/)")
    ev.add_argument("overrides", nargs="*", metavar="key=value")
    _store(
        ev,
        "--models",
        nargs="+", default=[], metavar="SOURCE",
        help="a run's train.out_dir (all its checkpoints; s3:// too), a checkpoint or bundle "
        "folder, models:/NAME@ALIAS, runs:/ID/model, or random (the untrained baseline)",
    )  # fmt: skip
    ev.add_argument(
        "--address", default=None, help="Ray cluster (else RAY_ADDRESS, else a local Ray)"
    )
    ev.add_argument("--no-ray", action="store_true", help="run every cell in this process")
    _store(
        ev,
        "--watch",
        metavar="RUN_DIR",
        help="score each checkpoint of a training run as it is written (--models: the baselines)",
    )
    ev.add_argument(
        "--poll-s", type=float, default=30.0, help="--watch: seconds between looks at the run"
    )
    ev.add_argument(
        "--report",
        metavar="RUN",
        help="print the table of an evaluation run (or a pretraining run's newest)",
    )
    ev.add_argument("--tracking-uri", default=None, help="MLflow store (else MLFLOW_TRACKING_URI)")
    ev.set_defaults(func=_eval)


TRACKING_USER_HELP = """\
an MLflow server's users (its basic-auth app), made by its admin, who signs in from the
environment: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD_FILE (or
MLFLOW_TRACKING_PASSWORD). The new user's password comes from --password-file only, never
from the command line (every process list shows it); --generate writes a new one there.

  plm tracking user job --user bert-job --experiment bert-tiny \\
      --password-file ~/.mlflow/bert-job --generate
  plm tracking user viewer --user viewer --password-file ~/.mlflow/viewer --generate

docs/tracking.md ("Who may write") says what each role may do."""


def _add_tracking_parser(sub) -> None:
    """`plm tracking user job|viewer` (pipeline/tracking_admin.py)."""
    from pipeline.tracking_admin import add_role_parsers

    tracking = sub.add_parser("tracking", help="the MLflow server's users (its admin)")
    user = tracking.add_subparsers(dest="tracking_command", required=True).add_parser(
        "user", help="make a job's user or a viewer", description=TRACKING_USER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_role_parsers(user.add_subparsers(dest="role", required=True), path_arg=_local)
    user.set_defaults(func=_tracking_user)


def _tracking_user(args: argparse.Namespace) -> int:
    from pipeline.tracking_admin import run

    return run(args)  # an AdminError is a ConfigError: one plm: line, exit 2


DESCRIPTION = """\
Pretrain language models of the ELMo -> GPT -> BERT family on your own text: train a
tokenizer, turn a corpus into shards (a Ray job), pretrain under DeepSpeed (from one CPU
to a cluster) with every run tracked and its model registered in MLflow; then fine-tune,
evaluate, generate, or export the model to transformers."""
EPILOG = """\
the stages, in order:
  plm data tokenizer --input CORPUS --kind wordpiece --vocab-size 8000 --output TOK
  plm data prepare --input CORPUS --tokenizer TOK --output DATA
  plm train configs/test/bert-tiny.yaml data.path=DATA train.out_dir=RUN
  plm export --to hf RUN OUT  |  plm finetune CONFIG  |  plm eval SUITE --models RUN

`plm demo` runs the whole pipeline on a bundled corpus. `plm COMMAND --help` gives a
command's options; the repository's README.md and docs/ say the rest."""


def build_parser(lazy: bool = False) -> argparse.ArgumentParser:
    """`plm`'s parser; ``lazy``: a command's arguments that cost an import to make are made
    when it parses (`plm data prepare`'s), so the other commands start without it."""
    parser = argparse.ArgumentParser(
        prog="plm",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the libraries' INFO lines and warnings too (quiet by default)",
    )
    # The deepspeed launcher puts --local_rank=N before the subcommand (LOCAL_RANK has it too).
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_data_parsers(sub, lazy)
    _add_train_parser(sub)
    _add_export_parser(sub)
    _add_generate_parser(sub)
    _add_finetune_parser(sub)
    _add_eval_parser(sub)
    _add_predict_parser(sub)
    _add_neighbors_parser(sub)
    _add_setup_parser(sub)
    _add_rig_parser(sub)
    _add_tracking_parser(sub)
    _add_demo_parser(sub)
    _verbose_everywhere(parser)
    return parser


def _add_data_parsers(sub, lazy: bool) -> None:
    """`plm data tokenizer|prepare|inspect`."""
    data = sub.add_parser("data", help="tokenizer training, sharding, inspection").add_subparsers(
        dest="data_command", required=True, parser_class=_Parser
    )

    tok = data.add_parser("tokenizer", help="train a HF tokenizer on a corpus")
    _store(
        tok,
        "--input",
        nargs="+",
        required=True,
        help="files, folders, globs, pyarrow URIs or builtin:NAME",
    )
    tok.add_argument("--kind", choices=["wordpiece", "bpe", "unigram"], required=True)
    tok.add_argument("--vocab-size", type=int, required=True)
    _store(tok, "--output", required=True, help="a folder, or a URI (s3://bucket/prefix)")
    tok.add_argument("--lowercase", action="store_true")
    tok.add_argument(
        "--sample-docs", type=int, default=200_000, help="documents in the seeded training sample"
    )
    tok.add_argument("--seed", type=int, default=1234)
    tok.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    tok.add_argument(
        "--dry-run", action="store_true", help="validate inputs, print the plan, train nothing"
    )
    tok.set_defaults(func=_data_tokenizer)

    _add_prepare_parser(data, lazy)

    insp = data.add_parser("inspect", help="totals, splits, rejects; --verify re-hashes")
    _store(insp, "dir")
    insp.add_argument("--verify", action="store_true")
    insp.set_defaults(func=_data_inspect)


def _add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="pretrain (what `deepspeed` and Kubernetes run)")
    _local(train, "config")
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


def _add_export_parser(sub) -> None:
    export = sub.add_parser(
        "export", help="write a model bundle (or a run's final one) as a transformers folder"
    )
    export.add_argument("--to", choices=["hf"], required=True)
    _local(export, "bundle", help="a model bundle folder, or a training run's folder (RUN_DIR: "
           "its bundles/final)")  # fmt: skip
    _local(export, "out", help="the transformers folder to write")
    export.add_argument(
        "--max-shard-mb",
        type=_positive_float,
        help="weights per file of the export (default: the bundle's train.bundle_shard_mb)",
    )
    export.set_defaults(func=_export)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="continue a prompt with gpt / gpt2 / transformer-xl")
    _local(gen, "model", alternative=f"give {BUNDLE_OR_MLFLOW}", help=BUNDLE_OR_MLFLOW)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus; 1.0: no cut")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tracking-uri", help="MLflow (else MLFLOW_TRACKING_URI, else ./mlflow.db)")
    gen.add_argument("--no-cache", action="store_true", help="recompute the past every step")
    gen.set_defaults(func=_generate)


def _add_finetune_parser(sub) -> None:
    ft = sub.add_parser("finetune", help="fine-tune a pretrained model on a labelled task")
    _local(ft, "config", help="YAML fine-tuning config (configs/finetune/)")
    ft.add_argument("overrides", nargs="*", metavar="key=value")
    ft.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ft.set_defaults(func=_finetune)


def _add_predict_parser(sub) -> None:
    pred = sub.add_parser("predict", help="batch inference with a fine-tuned model")
    _local(pred, "model", alternative=f"give {FINETUNED_OR_MLFLOW}", help=FINETUNED_OR_MLFLOW)
    _local(pred, "--input", required=True, help="csv / jsonl / parquet with the task's columns")
    _local(pred, "--output", help="OUT.jsonl or OUT.csv (default: INPUT.predictions.jsonl)")
    pred.add_argument("--batch-size", type=int, default=64)
    pred.add_argument(
        "--tracking-uri", default=None, help="MLflow store (else MLFLOW_TRACKING_URI)"
    )
    pred.set_defaults(func=_predict)


def _add_neighbors_parser(sub) -> None:
    nb = sub.add_parser("neighbors", help="nearest words by cosine (word2vec, ELMo layer 0)")
    _local(nb, "model", alternative=f"give {BUNDLE_OR_MLFLOW}", help=BUNDLE_OR_MLFLOW)
    nb.add_argument("word")
    nb.add_argument("--k", type=int, default=10)
    nb.set_defaults(func=_neighbors)


def _add_setup_parser(sub) -> None:
    setup = sub.add_parser(
        "setup",
        help="build DeepSpeed's CPU ops into this venv now (install / image build time), "
        "so no run compiles",
    )
    setup.add_argument(
        "--nvme",
        action="store_true",
        help="also DeepSpeed's async I/O op, for offload to a local disk "
        "(configs/deepspeed/zero3-nvme.json; needs libaio-dev)",
    )
    setup.set_defaults(func=_setup)


RIG_COMMANDS = (
    ("up", "create the hosts, their links, sshd and the S3 server"),
    ("exec", "run a command on one host: plm rig exec node1 -- CMD"),
    ("env", "the laptop's shell lines for the rig's S3 server"),
    ("cp", "copy a file onto hosts (FILE node1:PATH ...) or back (node1:PATH FILE)"),
    ("mem", "each host's memory cgroup: limit, usage, peak, failcnt, OOM kills"),
    ("kill", "stop a host's processes by PID (not its sshd): a lost host"),
    ("down", "stop what the rig started (by PID) and remove its namespaces"),
)


def _add_rig_parser(sub) -> None:
    """`plm rig ...` (pipeline/rig.py): every command names the rig and its root."""
    rig = sub.add_parser(
        "rig", help="a rehearsal cluster on this machine: hosts as network namespaces"
    ).add_subparsers(dest="rig_command", required=True)
    for name, text in RIG_COMMANDS:
        cmd = rig.add_parser(name, help=text)
        cmd.add_argument("--name", default="rig", help="the rig's name (several may be up)")
        _local(cmd, "--root", default="/var/tmp/plm-rig", help="where rigs keep their dirs")
        cmd.set_defaults(func=_rig)
        if name == "up":
            _add_rig_up_arguments(cmd)
        if name == "exec":
            cmd.add_argument(
                "--peak", action="store_true", help="print the host's peak memory after CMD"
            )
            cmd.add_argument("host")
            cmd.add_argument("cmd", nargs=argparse.REMAINDER)
        if name == "cp":
            cmd.add_argument("src", help="a local FILE, or HOST:PATH to copy back")
            cmd.add_argument("dst", nargs="+", help="HOST:PATH ..., or a local FILE")
        if name == "mem":
            cmd.add_argument("host", nargs="?", default=None, help="one host (default: all)")
        if name == "kill":
            cmd.add_argument("host")
            cmd.add_argument("--signal", default="KILL", help="KILL (a lost host) or TERM")


def _add_rig_up_arguments(cmd) -> None:
    cmd.add_argument("--hosts", type=int, default=3)
    cmd.add_argument(
        "--subnet",
        default="198.18.0.0/24",
        help="a part of 198.18.0.0/24 (the only range the rig uses)",
    )
    cmd.add_argument("--no-s3", action="store_true", help="no S3 server on node0")
    cmd.add_argument("--no-ssh", action="store_true", help="no sshd on the hosts")
    cmd.add_argument(
        "--shared",
        action="store_true",
        help="a shared dir on every host, the machine's files writable (default: "
        "nothing shared but the bucket)",
    )
    cmd.add_argument(
        "--mem-per-host",
        metavar="SIZE",
        default=None,
        help="each host's processes in a memory cgroup of SIZE (4.5G, 800M)",
    )


def _add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="the whole pipeline on the bundled default corpus")
    _local(demo, "--workdir", default="demo")
    demo.add_argument(
        "--steps",
        type=int,
        default=None,
        help="pretraining steps (default: the demo's recipe, pipeline/demo.py STEPS)",
    )
    demo.add_argument("--seed", type=int, default=1234, help="pretraining seed")
    demo.set_defaults(func=_demo)


def _rig(args: argparse.Namespace) -> int:
    from pipeline.rig import RigError, main

    try:
        return main(args)
    except RigError as err:
        print(f"plm: rig: {err}", file=sys.stderr)
        return 2


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` after any subcommand too (``plm train -v CONFIG``), adding to ``plm -v``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if not any("-v" in a.option_strings for a in sub._actions):
                    sub.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                                     help=argparse.SUPPRESS)  # fmt: skip
                _verbose_everywhere(sub)


def _prints(err: Exception) -> bool:
    """Whether this process prints ``err``'s `plm:` line, so a launcher's ranks print it
    once: a ConfigError every rank meets alike (the config's) on rank 0 only, a
    machine-wide one (this machine's toolchain or files) on each machine's local rank 0.
    A ShardError is about the shards this rank read: every rank that meets it prints."""
    from pipeline.errors import ConfigError

    if not isinstance(err, ConfigError):
        return True
    which = "LOCAL_RANK" if err.machine_wide else "RANK"
    return os.environ.get(which, "0") == "0"


def quiet_mlflow_telemetry() -> None:
    """MLflow 3's usage telemetry (on by default) is off in everything `plm` starts: this
    process, and what inherits its environment (launcher ranks, Ray workers, an MLflow
    server). A user's own MLFLOW_DISABLE_TELEMETRY (false: on) wins; DO_NOT_TRACK=true
    turns it off in MLflow too."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


# Commands that end their process with ``exit_now`` when run from the command line.
EXITS_NOW = ("train",)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` the way Python's own exit does, minus its teardown.

    In Python's order: the non-daemon threads are joined (thread pools finish their work
    first, by threading's own exit hooks), the ``atexit`` functions run (logging's handlers
    flushed and closed, MLflow's, multiprocessing's children joined, temporary folders
    removed), Python's and C's stdout and stderr are flushed; then ``os._exit``. What is
    skipped writes nothing: freeing every module and the native objects of torch,
    DeepSpeed and gloo (their threads, the process group), a large part of a short
    `plm train`'s time (BENCHMARKS.md, start-up). Before its code is known, `plm train` has
    ended its MLflow run and waited for its checkpoint's writes; a finished run has left
    the process group too (a failed one drops it, as a crash would). A Python without the
    two hooks this needs exits the ordinary way."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exitfuncs is None:
        sys.exit(code)
    shutdown()
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, or closed by the command
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # what C++ code printed through stdio
    except (AttributeError, OSError):
        pass
    os._exit(code)


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None):
    """``parser.parse_args``, but a command's ``key=value`` items may follow its flags too
    (`plm data prepare CONFIG --output DIR key=value`): argparse hands a command's
    positionals only the words before its first flag, and leaves the rest unrecognized."""
    args, extra = parser.parse_known_args(argv)
    overrides = getattr(args, "overrides", None)  # train, finetune, eval, data prepare
    if extra and (overrides is None or not all(OVERRIDE.match(word) for word in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        overrides.extend(extra)
    return args


def main(argv: list[str] | None = None) -> int:
    """`plm`. Without ``argv`` (the `plm` script, `python -m pipeline.cli`, what a launcher
    starts) the command line is this process's, and the commands of ``EXITS_NOW`` end the
    process with their exit code (``exit_now``); with ``argv`` (tests, other code) the
    exit code is returned. Run so, a closed stdout or stderr (`plm train | tee` whose `tee`
    died of the same Ctrl-C) drops what is printed and stops nothing (output.guard_streams)."""
    if argv is None:  # before anything prints (argparse's errors and --help too)
        from pipeline.output import guard_streams

        guard_streams()
    quiet_mlflow_telemetry()  # before anything imports mlflow
    from pipeline.train.ds_ops import configure_allocator

    configure_allocator()  # before the large allocations: freed tensors go back to the system
    from pipeline.data.shards import ShardError
    from pipeline.errors import ConfigError
    from pipeline.output import EXIT_DISK_FULL, DiskFull, disk_full, no_space

    args = parse_command_line(build_parser(lazy=True), argv)
    from pipeline.output import configure

    configure(args.verbose)
    if args.command in ("train", "finetune", "eval", "demo", "setup"):  # before DeepSpeed's
        from pipeline.train.ds_ops import configure_environment

        configure_environment()
    try:
        check_paths(args)  # a URI where a local path is taken: refused before any work
        code = args.func(args)
    except (ConfigError, ShardError) as err:  # bad input: a clear message, no traceback
        if _prints(err):
            print(f"plm: {err}", file=sys.stderr)
        code = 2
    except DiskFull as err:  # names the path, what is needed and free, what to do
        print(f"plm: {err}", file=sys.stderr)
        code = EXIT_DISK_FULL
    except OSError as err:  # a full disk no stage named: still one line, not a traceback
        full = no_space(err)
        if full is None:
            raise
        then = "free space there and run the same command again"
        print(f"plm: {args.command}: {disk_full(full, None, then=then)}", file=sys.stderr)
        code = EXIT_DISK_FULL
    except KeyboardInterrupt:  # Ctrl-C outside training's own stop (which checkpoints first)
        print(
            f"plm: {args.command}: interrupted (Ctrl-C); nothing half-written is ever read as "
            "complete, so the same command starts again cleanly",
            file=sys.stderr,
        )
        code = 130
    if argv is None and args.command in EXITS_NOW:
        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
