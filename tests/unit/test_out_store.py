"""train.out_dir on an object store (pipeline/train/out_store.py): a real DeepSpeed engine
(one process, gloo) checkpointing through ``CheckpointManager`` to a real S3 server (moto's
server mode, tests/s3_server.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from s3_outage import outage_s3_fixture  # noqa: F401  (the outage_s3 fixture)
from test_train_checkpoint import step, tiny_engine, weights

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.train.checkpoint import COMPLETE, CheckpointManager
from pipeline.train.out_store import LocalOut, OutStore, RemoteOut, owner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BERT = os.path.join(REPO, "configs/test/bert-tiny.yaml")


def test_out_dir_takes_a_uri_and_refuses_what_is_not_one(s3, tmp_path):
    """A URI is one (no folder named ``s3:``), a typo of one is refused naming the key, a
    URI carrying credentials is refused without showing them; a folder stays a folder."""
    cfg = load_config(BERT, ["train.out_dir=s3://plm-test/runs/el"])
    assert cfg.train.out_dir == "s3://plm-test/runs/el"
    assert isinstance(OutStore.open(cfg.train.out_dir, str(tmp_path / "stage")), RemoteOut)
    assert isinstance(OutStore.open(str(tmp_path / "run")), LocalOut)
    for bad, said in [
        ("s3:/plm/runs/el", "neither a folder nor a URI"),
        ("ftp://host/runs", "not a filesystem plm writes to"),
        ("s3://", "names no bucket"),
        ("s3://AKIAXX:hunter2@plm/runs", "s3://***@plm/runs"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(BERT, [f"train.out_dir={bad}"])
        text = str(err.value)
        assert "train.out_dir" in text and said in text, text
        assert "hunter2" not in text
    with pytest.raises(ConfigError, match="train.local_dir"):
        load_config(BERT, ["train.out_dir=s3://plm/x", "train.local_dir=s3://plm/y"])


def test_owner_of_checkpoint_files():
    assert owner("zero_pp_rank_1_mp_rank_00_optim_states.pt") == 1
    assert owner("bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt") == 12
    assert owner("zero_pp_rank_0_mp_rank_00_model_states.pt") == 0
    assert owner("trainer_rank3.pt") == 3
    for shared in ("mp_rank_00_model_states.pt", "config.yaml", "COMPLETE", "zero_to_fp32.py"):
        assert owner(shared) is None


def _store_files(s3, uri: str) -> dict[str, bytes]:
    """Every object under ``uri`` (relative path -> bytes), read straight from the server."""
    import pyarrow.fs as pafs

    fs = s3.fs()
    base = uri[len("s3://") :]
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return {
        i.path[len(base) + 1 :]: s3.get(f"s3://{i.path}")
        for i in infos
        if i.type == pafs.FileType.File
    }


@pytest.mark.slow
def test_checkpoints_on_s3_published_last_pruned_and_fetched_per_rank(s3, tmp_path):
    """Async saves to s3://: `latest` and COMPLETE appear on the store only when the
    checkpoint is finished, after its files; keep_last prunes on the store; a resume from
    an empty staging folder fetches this rank's files only (not another rank's ZeRO
    partition or trainer state, not the recovery scripts) and loads bit for bit."""
    uri = s3.prefix("run")
    engine, ds = tiny_engine(seed=5)
    store = OutStore.open(uri, str(tmp_path / "stage-a"), rank=0, local_rank=0)
    mgr = CheckpointManager(store, keep_last=2, rank=0, world_size=1, asynchronous=True)
    step(engine, 2)
    tag = mgr.save(engine, 2, {"loader": {"cursor": 8}}, {"name": "x"}, ds)
    assert mgr.pending is not None
    store.wait()  # every file of it is on the store, but it is not finished yet
    files = _store_files(s3, uri)
    assert f"checkpoints/{tag}/trainer_rank0.pt" in files
    assert "checkpoints/latest" not in files and f"checkpoints/{tag}/{COMPLETE}" not in files
    assert mgr.latest() is None
    assert mgr.finish() == tag and mgr.latest() == tag
    files = _store_files(s3, uri)
    assert files["checkpoints/latest"] == tag.encode()
    staged = mgr.root / tag
    for name in os.listdir(staged):  # the store holds what this node wrote, byte for byte
        assert files[f"checkpoints/{tag}/{name}"] == (staged / name).read_bytes(), name
    for s in (3, 4):
        step(engine)
        mgr.save(engine, s, {"loader": {"cursor": 4 * s}}, {"name": "x"}, ds)
        mgr.finish()
    saved_w = weights(engine)
    tags = sorted({p.split("/")[1] for p in _store_files(s3, uri) if p.count("/") == 2})
    assert tags == ["step00000003", "step00000004"]  # keep_last=2, on the store
    staged = sorted(n for n in os.listdir(mgr.root) if not n.endswith(".py"))  # DeepSpeed's
    assert staged == ["latest", "step00000004"]  # recovery scripts aside: one staged
    # Another rank's files beside this one's on the store: never fetched by rank 0.
    last = f"{uri}/checkpoints/step00000004"
    s3.put(f"{last}/zero_pp_rank_1_mp_rank_00_optim_states.pt", b"rank 1's partition")
    s3.put(f"{last}/trainer_rank1.pt", b"rank 1's state")
    mine = {
        p: len(b)
        for p, b in _store_files(s3, uri).items()
        if p.startswith("checkpoints/step00000004/")
        and owner(p.rsplit("/", 1)[1]) in (None, 0)
        and not p.endswith(".py")
    }
    assert any("zero_pp_rank_0" in p for p in mine)

    fresh, _ = tiny_engine(seed=9)
    store_b = OutStore.open(uri, str(tmp_path / "stage-b"), rank=0, local_rank=0)
    mgr_b = CheckpointManager(store_b, keep_last=2, rank=0, world_size=1)
    assert mgr_b.latest() == "step00000004"
    state = mgr_b.load(fresh, "step00000004")
    assert state["loader"] == {"cursor": 16} and state["step"] == 4
    for k, v in weights(fresh).items():
        assert torch.equal(v, saved_w[k]), k
    names, nbytes = mgr_b.fetched
    assert sorted(f"checkpoints/step00000004/{n}" for n in names) == sorted(mine)
    assert nbytes == sum(mine.values()) == store_b.stats()["fetched_bytes"]
    for p in mine:  # fetched bit for bit
        assert (store_b.local / p).read_bytes() == (store.local / p).read_bytes(), p


@pytest.mark.slow
def test_a_stopped_store_delays_the_checkpoint_never_training(outage_s3, tmp_path):
    """The server stops just before a save: the save returns, training steps go on, the
    checkpoint stays pending, its uploads are retried, and `latest` on the store stays on
    the previous one; once the server answers again the checkpoint completes."""
    uri = "s3://plm-own/run"
    engine, ds = tiny_engine(seed=6)
    store = OutStore.open(uri, str(tmp_path / "stage"), rank=0, local_rank=0)
    mgr = CheckpointManager(store, keep_last=2, rank=0, world_size=1, asynchronous=True)
    step(engine)
    first = mgr.save(engine, 1, {"loader": {}}, {"name": "x"}, ds)
    mgr.finish()
    outage_s3.stop()
    try:
        step(engine)
        tag = mgr.save(engine, 2, {"loader": {}}, {"name": "x"}, ds)
        for _ in range(5):  # training goes on while the store does not answer
            step(engine)
        deadline = time.monotonic() + 120
        while store.stats()["retries"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.stats()["retries"] >= 2  # the uploads failed and were tried again
        assert mgr.writes_busy()
    finally:
        outage_s3.start()
    assert OutStore.open(uri, str(tmp_path / "other")).read_bytes("checkpoints/latest") == (
        first.encode()
    )
    while mgr.writes_busy():
        time.sleep(0.1)
    assert mgr.finish() == tag and mgr.latest() == tag


@pytest.mark.slow
def test_a_step_boundary_completion_leaves_the_store_requests_to_the_upload_thread(
    outage_s3, tmp_path
):
    """``finish(agreed=True)`` (the trainer's step boundary, every rank's files uploaded)
    sends COMPLETE, ``latest`` and pruning through the upload thread: with the server
    stopped right then, it returns at once and the completion waits (before: the step
    retried on the training thread, then failed); the next collective ``finish`` waits
    for the completion, so ``latest`` names the checkpoint."""
    uri = "s3://plm-own/run"
    engine, ds = tiny_engine(seed=7)
    store = OutStore.open(uri, str(tmp_path / "stage"), rank=0, local_rank=0, retry_s=30)
    mgr = CheckpointManager(store, keep_last=1, rank=0, world_size=1, asynchronous=True)
    step(engine)
    first = mgr.save(engine, 1, {"loader": {}}, {"name": "x"}, ds)
    mgr.finish()
    step(engine)
    tag = mgr.save(engine, 2, {"loader": {}}, {"name": "x"}, ds)
    while mgr.writes_busy():  # what the trainer's all-reduce agrees on
        time.sleep(0.05)
    outage_s3.stop()
    try:
        assert mgr.finish(agreed=True) == tag
        assert mgr.pending is None and mgr.deferred
        assert store.busy()  # the completion is queued: the store does not answer
    finally:
        outage_s3.start()
    assert mgr.finish() is None and not mgr.deferred  # waits for the completion
    assert mgr.latest() == tag and mgr.complete_tags() == [tag]  # keep_last=1 pruned
    assert first not in [name for name, _ in store.list_dir("checkpoints")]
