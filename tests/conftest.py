"""Shared fixtures: a tiny prepared data dir, built once per session with the real
tokenizer trainer and the real `plm data prepare` (a local Ray job)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# heartbeat: a line while a test runs for minutes (`pytest -q` is never silent that long);
# s3_server: a real S3 endpoint on loopback (moto) for data dirs on an object store.
pytest_plugins = ["heartbeat", "s3_server"]

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


# An English document that passes every quality filter ({i}: make each one unique).
GOOD_DOC = (
    "The river runs through the old town and past the market square number {i}.\n"
    "Every morning the fishermen bring their catch to the stalls by the water.\n"
    "Visitors come to see the bridge, which was built with stone from the hills.\n"
    "In the evening the lights of the cafes shine on the water and people walk home.\n"
    "Nobody in the town remembers a year when the river froze over completely."
)


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


def build_data_dir(root: Path, shard_docs: int = 40, kind: str = "wordpiece") -> Path:
    """Tokenizer (tiny vocab) + shards, through the real components."""
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.prepare import run_prepare
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    corpus = root / "corpus.txt"
    corpus.write_text(synthetic_corpus(), encoding="utf-8")
    tok = root / "tok"
    vocab = 300 if kind == "wordpiece" else 400  # byte-level BPE starts from 256 bytes
    train_tokenizer([str(corpus)], TokenizerSpec(kind=kind, vocab_size=vocab), tok)
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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's `--dist loadgroup` (CI runs `-n 2`): a group runs whole on
    one worker, in collection order. The rehearsal cluster's tests share one rig (and their
    namespaces must not overlap), the per-architecture tests share the family runs, and any
    other module keeps its module fixtures: each is built once, as without xdist."""
    for item in items:
        if item.get_closest_marker("cluster"):
            group = "rig"
        elif "family_runs" in item.fixturenames:
            group = "family"
        else:
            group = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for a whole module (start-up costs seconds); run_prepare reuses it.
    Started as plm starts its own: on 127.0.0.1 only."""
    import ray

    from pipeline.prepare.job import init_ray

    init_ray(None, 2)
    yield
    ray.shutdown()


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


@pytest.fixture(scope="session")
def tiny_bpe_data(tmp_path_factory) -> Path:
    """The same corpus with a byte-level BPE tokenizer (RoBERTa, GPT-2); read-only too."""
    return build_data_dir(tmp_path_factory.mktemp("bpe_data"), kind="bpe")


def load_launch_script(name: str):
    """A script of launch/ (not a package) as a module, for its functions."""
    spec = importlib.util.spec_from_file_location(name, REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


# --- 2 ranks through the real `deepspeed` launcher on the CPU ------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_argv(target: list[str], port: int, master_addr: str | None = None,
                   hostfile: Path | None = None) -> list[str]:  # fmt: skip
    """The `deepspeed` command for 2 ranks on this machine. Without a hostfile DeepSpeed's
    runner always gives the ranks MASTER_ADDR=127.0.0.1; ``master_addr`` needs a HOSTFILE
    (written here: ``localhost slots=2``) and ``--no_ssh``, which launches locally too."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if master_addr is None:
        cmd += ["--num_gpus", "2"]
    else:
        if hostfile is None:
            raise AssertionError("master_addr needs a hostfile path")
        hostfile.write_text("localhost slots=2\n")
        cmd += ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0",
                "--master_addr", master_addr]  # fmt: skip
    return [*cmd, "--master_port", str(port), *target]


def deepspeed_env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def deepspeed_launch(target: list[str], cwd: Path, timeout: int = 900):
    """``deepspeed --num_gpus 2 TARGET`` on the CPU accelerator (gloo); asserts exit 0.
    TARGET: ``["--module", "pipeline.cli", "train", ...]`` or a script and its arguments."""
    port = free_port()
    cmd = deepspeed_argv(target, port)
    proc = subprocess.run(cmd, cwd=cwd, env=deepspeed_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    # DeepSpeed's CPU all-reduce files: the ranks unlink them (engine.init_distributed).
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    return proc


def metrics_rows(run_dir: Path) -> list[dict]:
    """The rows the trainer wrote to RUN_DIR/metrics.jsonl (rank 0)."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> list[float]:
    return [r["step_loss"] for r in metrics_rows(run_dir) if "step_loss" in r]


def falls(values: list[float], by: float = 0.1) -> bool:
    """Finite, and the sum of the last three is clearly below that of the first three."""
    return all(v == v for v in values) and sum(values[-3:]) < sum(values[:3]) - by


# Every tiny architecture of the family, trained one after another in the same two ranks
# (tests/integration/train_many.py): one launcher start-up instead of eleven. Each entry:
# config, steps, and the overrides its tests need (eval/save intervals, lr).
FAMILY = {
    "roberta": ("roberta-tiny", 10, ["train.eval_every=0", "train.save_every=0"]),
    "bert-wwm": ("bert-wwm-tiny", 10, ["train.eval_every=0", "train.save_every=0"]),
    "albert": ("albert-tiny", 10, ["train.eval_every=0", "train.save_every=0"]),
    "electra": ("electra-tiny", 10, ["train.eval_every=0", "train.save_every=10"]),
    "distilbert": ("distilbert-tiny", 10, ["train.eval_every=0", "train.save_every=10"]),
    "ernie": ("ernie-tiny", 10, ["train.eval_every=0", "train.save_every=10"]),
    "gpt": (
        "gpt-tiny",
        12,
        ["train.eval_every=6", "train.save_every=6", "train.lr=2.0e-3", "mlflow.register=true"],
    ),  # fmt: skip
    "transformer-xl": (
        "transformer-xl-tiny",
        12,
        ["train.eval_every=6", "train.save_every=6", "train.lr=2.0e-3"],
    ),
    "xlnet": ("xlnet-tiny", 10, ["train.eval_every=5", "train.save_every=5", "train.lr=2.0e-3"]),
    "elmo": ("elmo-tiny", 10, ["train.eval_every=5", "train.save_every=0"]),
    "word2vec": ("word2vec-tiny", 10, ["train.eval_every=5", "train.save_every=0"]),
}


@pytest.fixture(scope="session")
def family_runs(tiny_data, tiny_bpe_data, tmp_path_factory) -> dict[str, Path]:
    """{name: run dir} of every FAMILY run, trained for real under the `deepspeed` launcher
    (2 ranks, ZeRO-2, CPU). RoBERTa reads a byte-level BPE data dir (its tokenizer kind);
    DistilBERT's teacher is a fresh bert-tiny bundle on the data's tokenizer. The MLflow
    store is ROOT/mlflow.db (the launch's working directory)."""
    import torch

    from pipeline.models import build_model, resolve_model_config
    from pipeline.models.bundle import save_bundle

    root = tmp_path_factory.mktemp("family")
    meta = json.loads((tiny_data / "tokenizer" / "tokenizer_meta.json").read_text())
    teacher_cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, meta["vocab_size"])
    torch.manual_seed(0)
    teacher = build_model("bert", teacher_cfg)
    teacher_dir = save_bundle(root / "teacher", "bert", teacher_cfg, teacher.state_dict(),
                              tiny_data / "tokenizer")  # fmt: skip
    plan = []
    for name, (config, steps, overrides) in FAMILY.items():
        data = tiny_bpe_data if name == "roberta" else tiny_data
        extra = [f"objective.distill.teacher={teacher_dir}"] if name == "distilbert" else []
        plan.append({
            "config": str(REPO / "configs/test" / f"{config}.yaml"),
            "overrides": [f"data.path={data}", f"train.out_dir={root / name}",
                          "deepspeed=configs/deepspeed/zero2.json", f"train.max_steps={steps}",
                          "train.log_every=1", "mlflow.register=false", *overrides, *extra],
        })  # fmt: skip
    (root / "plan.json").write_text(json.dumps(plan, indent=1))
    driver = REPO / "tests" / "integration" / "train_many.py"
    proc = deepspeed_launch([str(driver), str(root / "plan.json")], cwd=root, timeout=1800)
    assert proc.stdout.count("world size 2, ZeRO 2") == len(FAMILY), proc.stdout[-4000:]
    return {name: root / name for name in FAMILY}


# --- tiny models for in-process tests ---------------------------------------------------


def tiny_model(arch: str, vocab_size: int = 100, **overrides):
    """A model of the ``<arch>-tiny`` preset, seeded (vocab 100 is padded to 128)."""
    import torch

    from pipeline.models import build_model, resolve_model_config

    section = {"arch": arch, "preset": f"{arch}-tiny", **overrides}
    cfg = resolve_model_config(section, vocab_size)
    torch.manual_seed(0)
    return build_model(arch, cfg)


def random_ids(B: int = 2, T: int = 16, seed: int = 1, vocab_size: int = 100):
    import torch

    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def one_plm_line(proc, code: int = 2) -> str:
    """The one `plm:` line a refused command printed (exit ``code``, no traceback)."""
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    return lines[0]


# --- the rehearsal cluster (tests/cluster) -------------------------------------------------

RIG_SUBNETS = ("198.18.0.128/26", "198.18.0.192/26", "198.18.0.64/26", "198.18.0.0/26")


@pytest.fixture(scope="session")
def rig():
    """The rehearsal cluster (pipeline/rig.py) of the `cluster` tests: 3 hosts, one for the
    session, on a part of 198.18.0.0/24 no other rig here uses; skipped, saying why, where
    this machine cannot make one (no root, iproute2, sshd or pdsh)."""
    from pipeline import rig as rigmod

    why = rigmod.check_prerequisites(ssh=True)
    if why:
        pytest.skip(why)
    if shutil.which("pdsh") is None:
        pytest.skip("the hostfile launch needs pdsh (Debian: pdsh)")
    _down_stale_test_rigs(rigmod)
    name = f"t{os.getpid()}"
    made = None
    for subnet in RIG_SUBNETS:
        try:
            made = rigmod.up(3, name=name, subnet=subnet)  # nothing shared but the bucket
            break
        except rigmod.RigError as err:
            if "overlaps" not in str(err):
                raise
    assert made is not None, "every test subnet is in use: `plm rig down` the other rigs"
    try:
        yield made
    finally:
        rigmod.down(name)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"plm-{name}-" not in left


def _down_stale_test_rigs(rigmod) -> None:
    """Rigs of test sessions that were killed before their teardown (named t<pid>, d<pid>,
    m<pid>, z<pid>, u<pid>, e<pid> after the pytest process that made them): taken down, so none piles up."""
    import re

    for state in sorted(rigmod.DEFAULT_ROOT.glob("*/rig.json")):
        m = re.fullmatch(r"[tdmzue](\d+)", state.parent.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            rigmod.down(state.parent.name)


def rank_env(rank: int, world: int, port: str) -> dict[str, str]:
    """The environment of one CPU rank of a test's own `plm train` on this machine, as
    torchrun gives it (rank 0 serves the store on ``port``)."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # fmt: skip


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a rank's data-loader workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found
