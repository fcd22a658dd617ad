"""A URI where a local path is taken is refused, naming the flag or key: one `plm:` line,
exit 2, and no folder ``s3:`` in the working directory (what a URI read as a local path
creates). Every path flag of `plm` and every path key of the configs is walked; a new one
that is not classified here fails the walk until it is."""

from __future__ import annotations

import argparse
import re
import typing

import pytest
from conftest import REPO
from pydantic import BaseModel

from pipeline import cli
from pipeline.config import ExperimentConfig, validate_dict
from pipeline.errors import ConfigError
from pipeline.finetune.config import FinetuneConfig, validate_finetune
from pipeline.prepare.config import PrepareConfig
from pipeline.storage import local_path, redact_uri, store_path

URI = "s3://b/x"
BERT = str(REPO / "configs/test/bert-tiny.yaml")
TOPIC = str(REPO / "configs/finetune/bert-topic.yaml")

# Every path argument of `plm`: (command words, dest) -> a command line giving it URI.
LOCAL_FLAGS = {
    ("data", "prepare", "config"): ["data", "prepare", "--config", URI],
    ("data", "prepare", "entities"): ["data", "prepare", "--input", "c.txt", "--tokenizer", "t",
                                      "--output", "o", "--entities", URI],
    ("train", "config"): ["train", URI],
    ("export", "bundle"): ["export", "--to", "hf", URI, "out"],
    ("export", "out"): ["export", "--to", "hf", "bundle", URI],
    ("generate", "model"): ["generate", URI, "--prompt", "hi"],
    ("finetune", "config"): ["finetune", URI],
    ("eval", "suite"): ["eval", URI, "--models", "random"],
    ("predict", "model"): ["predict", URI, "--input", "in.jsonl"],
    ("predict", "input"): ["predict", "model", "--input", URI],
    ("predict", "output"): ["predict", "model", "--input", "in.jsonl", "--output", URI],
    ("neighbors", "model"): ["neighbors", URI, "word"],
    ("demo", "workdir"): ["demo", "--workdir", URI],
    **{("rig", c, "root"): ["rig", c, "--root", URI, *(["node1"] if c in ("exec", "kill") else [])]
       for c in ("up", "exec", "env", "mem", "kill", "down")},
    ("rig", "cp", "root"): ["rig", "cp", "--root", URI, "f", "node1:/tmp/f"],
    ("tracking", "user", "job", "password_file"): ["tracking", "user", "job", "--user", "u",
                                                   "--experiment", "e", "--password-file", URI],
    ("tracking", "user", "viewer", "password_file"): ["tracking", "user", "viewer", "--user",
                                                      "u", "--password-file", URI],
}  # fmt: skip
# Those that take a URI too (the store's tests: test_tokenizer_store.py).
STORE_FLAGS = {
    ("data", "tokenizer", "input"), ("data", "tokenizer", "output"), ("data", "prepare", "input"),
    ("data", "prepare", "tokenizer"), ("data", "prepare", "output"), ("data", "inspect", "dir"),
    ("eval", "models"), ("eval", "watch"),  # a run on a store (test_eval_stage.py)
}  # fmt: skip
# Arguments whose name says "path" without being one (or values, not paths).
_PATHISH = re.compile(r"input|output|dir|path|file|config|model|bundle|root|workdir|tokenizer|"
                      r"entities|out\b|teacher|source")  # fmt: skip
NOT_PATHS = {("generate", "tracking_uri"), ("predict", "tracking_uri"), ("data", "prepare",
             "ray_address"), ("rig", "up", "no_ssh"),
             ("tracking", "user", "job", "model")}  # a registered model's name  # fmt: skip


def _commands(parser: argparse.ArgumentParser, words=()):
    """(command words, subparser) of every leaf command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*words, name))


def test_every_path_flag_is_classified_and_registered():
    registered, pathish = set(), set()
    for words, sub in _commands(cli.build_parser()):
        paths = sub.get_default("paths_") or {}
        for dest, (_, kind, _) in paths.items():
            registered.add((*words, dest))
            assert ((*words, dest) in STORE_FLAGS) == (kind == "store"), (words, dest)
        for action in sub._actions:
            if action.dest != "help" and _PATHISH.search(action.dest):
                pathish.add((*words, action.dest))
    assert registered == set(LOCAL_FLAGS) | STORE_FLAGS
    unregistered = {p for p in pathish - registered if p not in NOT_PATHS and p[:2] + p[-1:]
                    not in NOT_PATHS}  # fmt: skip
    assert not unregistered, f"path-like arguments not added through _local/_store: {unregistered}"


def refused(argv, tmp_path, monkeypatch, capsys) -> str:
    """Run `plm ARGV` in this process in an empty cwd: exit 2, one plm: line (returned),
    nothing written."""
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not list(work.iterdir()), list(work.iterdir())  # no s3: folder, nothing at all
    return lines[0]


@pytest.mark.parametrize("key", sorted(LOCAL_FLAGS), ids="-".join)
def test_a_local_path_flag_refuses_a_uri(key, tmp_path, monkeypatch, capsys):
    argv = LOCAL_FLAGS[key]
    line = refused(argv, tmp_path, monkeypatch, capsys)
    before = argv[argv.index(URI) - 1]
    flag = before if before.startswith("--") else key[-1].upper()  # a positional: its name
    assert line.startswith(f"plm: {flag}={URI}: {flag} takes a local path, not a URI"), line
    if key[-1] == "model":
        assert "models:/NAME@ALIAS or runs:/RUN_ID/model" in line


# --- config keys ---------------------------------------------------------------------------


def _leaf_keys(model: type[BaseModel], prefix: str = ""):
    """Dotted keys of every str-valued leaf of a config model (lists of models: ``.path``)."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        args = [field.annotation, *typing.get_args(field.annotation)]
        args += [a for t in args for a in typing.get_args(t)]
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested and nested[0] is not model:
            yield from _leaf_keys(nested[0], key + ".")
        elif str in args or any(typing.get_origin(a) is typing.Annotated for a in args):
            yield key


PATH_KEY = re.compile(r"(^|\.)(path|.*dir|teacher|source|train|valid|test|deepspeed|inputs|"
                      r"tokenizer|output|entities|.*file)$")  # fmt: skip
# Every path key of the three configs: "local" (a URI refused), "store" (a URI taken).
CONFIG_KEYS = {
    "experiment": {"data.path": "store", "data.sources.path": "store", "data.cache_dir": "local",
                   "objective.distill.teacher": "local", "deepspeed": "local",
                   # train.out_dir (a URI taken, OutStore) and its local staging dir
                   "train.out_dir": "store", "train.local_dir": "local"},
    "finetune": {"model.source": "local", "data.train": "local", "data.valid": "local",
                 "data.test": "local", "train.out_dir": "local", "deepspeed": "local"},
    "prepare": {"inputs": "store", "tokenizer": "store", "output": "store", "entities": "local"},
}  # fmt: skip
MODELS = {"experiment": ExperimentConfig, "finetune": FinetuneConfig, "prepare": PrepareConfig}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_every_path_key_is_classified(which):
    found = {k for k in _leaf_keys(MODELS[which]) if PATH_KEY.search(k)}
    assert found == set(CONFIG_KEYS[which])


def _raw(which: str) -> dict:
    if which == "experiment":
        return {"name": "x", "model": {"arch": "bert"}, "data": {"path": "d"}}
    if which == "finetune":
        return {"name": "x", "model": {"source": "m"}, "task": {"type": "classification"},
                "data": {"train": "t.jsonl"}}  # fmt: skip
    return {"inputs": ["c.txt"], "tokenizer": "t", "output": "o"}


def _set(raw: dict, key: str, value: str) -> dict:
    node = raw
    parts = key.split(".")
    if parts[:2] == ["data", "sources"]:
        raw["data"] = {"path": None, "sources": [{"path": value}]}
        return raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = [value] if parts[-1] == "inputs" else value
    return raw


def _validate(which: str, raw: dict):
    if which == "experiment":
        return validate_dict(raw, "c.yaml")
    if which == "finetune":
        return validate_finetune(raw, "c.yaml")
    from pipeline.prepare.config import load_prepare_config

    return load_prepare_config(None, raw)


@pytest.mark.parametrize(
    "which,key", [(w, k) for w in sorted(CONFIG_KEYS) for k in sorted(CONFIG_KEYS[w])]
)
def test_a_local_path_key_refuses_a_uri_and_a_store_key_takes_one(which, key):
    kind = CONFIG_KEYS[which][key]
    raw = _set(_raw(which), key, URI)
    if kind == "store":
        _validate(which, raw)
        secret = "s3://AKIA:hunter2@b/x"
        with pytest.raises(ConfigError) as err:
            _validate(which, _set(_raw(which), key, secret))
        assert "hunter2" not in str(err.value) and "user part" in str(err.value)
        return
    with pytest.raises(ConfigError) as err:
        _validate(which, raw)
    text = str(err.value)
    shown = key.replace("sources.path", "sources.0.path")
    shown = "inputs.0" if key == "inputs" else shown
    assert "\n" not in text and text.startswith(f"{shown}={URI}: {shown} takes a local path")


def test_plm_train_and_finetune_refuse_a_uri_key_before_any_work(tmp_path, monkeypatch, capsys):
    for argv in (["train", BERT, "deepspeed=s3://b/x", "--dry-run"],
                 ["train", BERT, "data.cache_dir=s3://b/x", "--dry-run"],
                 ["finetune", TOPIC, "train.out_dir=s3://b/x"],
                 ["finetune", TOPIC, "data.train=s3://b/x"]):  # fmt: skip
        line = refused(argv, tmp_path, monkeypatch, capsys)
        key = argv[2].split("=")[0]
        assert line.startswith(f"plm: {key}=s3://b/x: {key} takes a local path"), line


# --- the functions ---------------------------------------------------------------------------


def test_local_path_and_store_path():
    assert local_path("runs/x", "--out") == "runs/x"
    assert local_path("models:/m@current", "MODEL") == "models:/m@current"  # not a file URI
    with pytest.raises(ConfigError, match=r"^--out=file:///tmp/x: --out takes a local path"):
        local_path("file:///tmp/x", "--out")
    assert store_path("s3://b/x", "--output") == "s3://b/x"
    for uri, shown in (("s3://AK:hunter2@b/x", "s3://***@b/x"),
                       ("s3://b/x?secret_key=hunter2&region=eu", "s3://b/x?secret_key=***&region=***"),
                       ("gs://b/x?access_token=hunter2", "gs://b/x?access_token=***")):  # fmt: skip
        assert redact_uri(uri) == shown
        with pytest.raises(ConfigError) as err:
            store_path(uri, "--output")
        assert "hunter2" not in str(err.value) and str(err.value).startswith(f"--output={shown}")
        with pytest.raises(ConfigError) as err:
            local_path(uri, "--entities")
        assert "hunter2" not in str(err.value)


def test_a_store_flag_refuses_credentials_in_its_uri(tmp_path, monkeypatch, capsys):
    line = refused(["data", "tokenizer", "--input", "c.txt", "--kind", "bpe", "--vocab-size",
                    "300", "--output", "s3://KEY:TOPSECRET@b/tok"], tmp_path, monkeypatch, capsys)  # fmt: skip
    assert "TOPSECRET" not in line and "AWS_SECRET_ACCESS_KEY" in line


@pytest.mark.parametrize("flag", ["--models", "--watch"])
def test_plm_eval_refuses_a_store_uri_with_credentials_in_it(flag, tmp_path, monkeypatch, capsys):
    line = refused(["eval", "suite.yaml", flag, "s3://AKIA:hunter2@b/run"], tmp_path,
                   monkeypatch, capsys)  # fmt: skip
    assert line.startswith(f"plm: {flag}=s3://***@b/run") and "hunter2" not in line, line
