"""Shared fixtures: a tiny prepared data dir, built once per session with the real
tokenizer trainer and the real `plm data prepare` (a local Ray job)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SUBJECTS = [
    "the cat",
    "a dog",
    "the parser",
    "our model",
    "the compiler",
    "a student",
    "the river",
]
_VERBS = ["reads", "writes", "sees", "builds", "follows", "checks", "likes"]
_OBJECTS = ["the book", "a tree", "the token", "a list", "the file", "some data", "the sky"]
_ENDS = ["today", "again", "slowly", "at night", "with care", "every day", "for fun"]


def synthetic_corpus(n_docs: int = 240, seed: int = 7) -> str:
    """Documents of 4-12 template sentences, blank-line separated: learnable structure."""
    rng = random.Random(seed)
    docs = []
    for d in range(n_docs):
        topic = rng.choice(_SUBJECTS)
        sents = []
        for _ in range(rng.randint(4, 12)):
            subj = topic if rng.random() < 0.5 else rng.choice(_SUBJECTS)
            sents.append(
                f"{subj.capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                f"{rng.choice(_ENDS)} (doc {d})."
            )
        docs.append(" ".join(sents))
    return "\n\n".join(docs) + "\n"


def build_data_dir(root: Path, shard_docs: int = 40) -> Path:
    """Tokenizer (wordpiece, tiny vocab) + shards, through the real components."""
    from pipeline.data.prepare import PrepareConfig, run_prepare
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    corpus = root / "corpus.txt"
    corpus.write_text(synthetic_corpus(), encoding="utf-8")
    tok = root / "tok"
    train_tokenizer([str(corpus)], TokenizerSpec(kind="wordpiece", vocab_size=300), tok)
    cfg = PrepareConfig(
        inputs=[str(corpus)],
        tokenizer=str(tok),
        output=str(root / "data"),
        valid_fraction=0.1,
        shard_docs=shard_docs,
        max_doc_tokens=128,
        num_cpus=1,
    )
    return Path(run_prepare(cfg))


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment: ``mlflow.set_tracking_uri`` (called by
    in-process tests of generate/neighbors/fine-tuning) also sets MLFLOW_TRACKING_URI,
    which the ``plm`` subprocesses of later tests would otherwise inherit."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared data dir (read-only for tests: copy it before corrupting anything)."""
    return build_data_dir(tmp_path_factory.mktemp("tiny_data"))


def plm(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 600, check=True):
    """Run the `plm` CLI in a fresh process (what users and launchers run)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"plm {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return proc
