"""CheckpointManager with a real (single-process, gloo) DeepSpeed engine and a tiny model."""

import random

import pytest
import torch

from pipeline.config import TrainSection
from pipeline.train import engine as ds_engine
from pipeline.train.checkpoint import COMPLETE, LATEST, CheckpointError, CheckpointManager
from pipeline.train.schedule import scheduler_factory

pytestmark = pytest.mark.slow


def tiny_engine(seed=0, stage=2):
    ds_engine.init_distributed()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1)
    )
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": stage},
    }
    sched = scheduler_factory(TrainSection(max_steps=10, warmup_steps=2))
    return ds_engine.initialize(model, ds, sched), ds


def step(engine, n=1):
    for _ in range(n):
        x = torch.randn(4, 8)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()


def weights(engine):
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_save_load_latest_and_incomplete_ignored(tmp_path):
    engine, ds = tiny_engine()
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    assert mgr.latest() is None
    step(engine, 3)
    random.seed(99)
    tag = mgr.save(engine, 3, {"loader": {"cursor": 12}}, {"name": "x"}, ds)
    assert mgr.latest() == tag == "step00000003"
    assert (tmp_path / "checkpoints" / tag / COMPLETE).is_file()
    saved_w, saved_lr = weights(engine), engine.get_lr()[0]
    random.seed(99)
    expect_next = random.random()
    # A save that died half-way: files but no completion marker. It never becomes latest.
    half = tmp_path / "checkpoints" / "step00000004"
    half.mkdir()
    (half / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    assert (
        mgr.latest() == tag
        and tag in mgr.complete_tags()
        and "step00000004" not in mgr.complete_tags()
    )

    step(engine, 2)  # move away from the saved state
    assert any(not torch.equal(saved_w[k], v) for k, v in weights(engine).items())
    random.random()
    state = mgr.load(engine, mgr.latest())
    assert state["loader"] == {"cursor": 12} and state["step"] == 3
    assert all(torch.equal(saved_w[k], v) for k, v in weights(engine).items())
    assert engine.get_lr()[0] == pytest.approx(saved_lr)
    assert random.random() == expect_next  # RNG states restored


def test_keep_last_and_loud_failures(tmp_path):
    engine, ds = tiny_engine(seed=1)
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step00000000").mkdir()  # an old interrupted save
    for s in (1, 2, 3):
        step(engine)
        mgr.save(engine, s, {"loader": {}}, {}, ds)
    assert mgr.complete_tags() == ["step00000002", "step00000003"]
    assert not (tmp_path / "checkpoints" / "step00000000").exists()
    with pytest.raises(CheckpointError, match="incomplete"):
        mgr.load(engine, "step00000009")
    (tmp_path / "checkpoints" / LATEST).write_text("step00000009")
    with pytest.raises(CheckpointError, match="step00000009"):
        mgr.latest()
    other = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=2)
    with pytest.raises(CheckpointError, match="written by 1 ranks.*universal checkpoint"):
        other.load(engine, "step00000003")  # ZeRO-2 shards of 1 rank: converted first
    # DeepSpeed files gone but marker present: DeepSpeed would start from scratch; we raise.
    for f in (tmp_path / "checkpoints" / "step00000003").glob("*model_states.pt"):
        f.unlink()
    with pytest.raises(CheckpointError, match="could not load"):
        mgr.load(engine, "step00000003")


class _RunsCode:
    """Unpickling this calls a function: what a tampered trainer state could do."""

    def __reduce__(self):
        return (print, ("code ran while loading a checkpoint",))


def test_trainer_state_loads_with_weights_only(tmp_path, capsys):
    import numpy as np

    engine, ds = tiny_engine(seed=2)
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    step(engine)
    np.random.seed(5)
    trainer_state = {"loader": {"epoch": np.int64(2), "samples": 8}, "memory": [torch.ones(2, 3)]}
    tag = mgr.save(engine, 1, trainer_state, {}, ds)
    path = tmp_path / "checkpoints" / tag / "trainer_rank0.pt"
    raw = torch.load(path, weights_only=True)  # no pickled classes or numpy arrays in it
    assert raw["loader"] == {"epoch": 2, "samples": 8} and raw["step"] == 1
    expect = np.random.random()
    np.random.random()
    state = mgr.load(engine, tag)
    assert np.random.random() == expect  # numpy's RNG state restored from plain types
    assert torch.equal(state["memory"][0], torch.ones(2, 3))
    # A trainer state that would run code when unpickled is refused, and nothing runs.
    torch.save({**raw, "evil": _RunsCode()}, path)
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        mgr.load(engine, tag)
    assert "code ran" not in capsys.readouterr().out
    # A state written before this format (numpy's RNG tuple with an ndarray) still loads.
    legacy = {**raw, "rng": {**raw["rng"], "numpy": np.random.get_state()}}
    torch.save(legacy, path)
    expect = np.random.random()
    np.random.random()
    mgr.load(engine, tag)
    assert np.random.random() == expect


class _CreatesFile:
    """Unpickling this opens (creates) a file: code run by loading a tampered checkpoint."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize(
    "stage,pattern,universal",
    [(0, "mp_rank_00_model_states.pt", False), (2, "*optim_states.pt", False),
     (2, "mp_rank_00_model_states.pt", True), (3, "*optim_states.pt", True)],
)  # fmt: skip
def test_deepspeed_files_that_would_run_code_are_refused(tmp_path, stage, pattern, universal):
    """DeepSpeed unpickles its files with weights_only=False (its load_checkpoint and the
    universal conversion): a checkpoint file altered to carry a pickle that runs code is
    refused with one CheckpointError naming it, and nothing in it runs. The untouched
    checkpoint still loads (and converts) after a normal save."""
    engine, ds = tiny_engine(seed=3, stage=stage)
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    step(engine)
    tag = mgr.save(engine, 1, {"loader": {}}, {}, ds)
    folder = tmp_path / "checkpoints" / tag
    if universal:  # the untouched checkpoint converts: the safe loads read DeepSpeed's files
        mgr.to_universal(tag)
        import shutil

        shutil.rmtree(folder / "universal")
    else:
        mgr.load(engine, tag)
    (path,) = folder.glob(pattern)
    marker = tmp_path / "code-ran"
    state = torch.load(path, weights_only=False)  # the test's own file: trusted here
    state["payload"] = _CreatesFile(marker)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=rf"{path.name} cannot be loaded safely") as err:
        if universal:
            mgr.to_universal(tag)
        else:
            mgr.load(engine, tag)
    assert "_CreatesFile" in str(err.value) or "open" in str(err.value)
    assert not marker.exists()
    assert torch.load is not None and torch.load.__module__ == "torch.serialization"


def test_bundles_pruned_with_their_checkpoints_unless_kept(tmp_path):
    """A bundle beside a checkpoint keep_last deleted goes too; kept ones, final, the ones
    beside kept checkpoints and folders that are not our bundles stay (issue 34)."""
    import yaml

    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    for s in (10, 20):  # the checkpoints keep_last left
        (tmp_path / "checkpoints" / f"step000000{s}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step000000{s}" / COMPLETE).write_text("{}")
    bundles = tmp_path / "bundles"
    meta = {"step00000002": {}, "step00000004": {"kept": True}, "step00000006": {},
            "step00000010": {}, "step00000020": {}, "final": {}}  # fmt: skip
    for name, m in meta.items():
        (bundles / name).mkdir(parents=True)
        (bundles / name / "config.yaml").write_text(yaml.safe_dump({"arch": "bert", "meta": m}))
    (bundles / "step00000008").mkdir()  # no config.yaml: not ours, left alone
    (bundles / "notes").mkdir()
    assert mgr.prune_bundles(bundles) == ["step00000002", "step00000006"]
    left = sorted(p.name for p in bundles.iterdir())
    assert left == ["final", "notes", "step00000004", "step00000008", "step00000010",
                    "step00000020"]  # fmt: skip
    assert mgr.prune_bundles(tmp_path / "none") == []


def test_an_asynchronous_save_is_complete_only_once_written(tmp_path, monkeypatch):
    """train.async_save: save() returns after the snapshot; until the background writes
    are done the checkpoint has no COMPLETE and `latest` names the previous one (what a
    kill -9 then leaves); the next optimizer update waits for the writes (the host tensors
    are held, not copied), so training on does not change what is written; the files hold
    the records a synchronous save of the same state writes, and they load."""
    import threading

    from pipeline.train import checkpoint as ckpt_mod

    engine, ds = tiny_engine(seed=3)
    mgr = CheckpointManager(tmp_path / "async", keep_last=3, rank=0, world_size=1,
                            asynchronous=True)  # fmt: skip
    step(engine, 2)
    first = mgr.save(engine, 2, {"loader": {"cursor": 8}}, {"name": "x"}, ds)
    assert mgr.pending is not None and mgr.latest() is None
    assert mgr.finish() == first and mgr.latest() == first
    step(engine, 1)
    sync = CheckpointManager(tmp_path / "sync", keep_last=3, rank=0, world_size=1)
    sync.save(engine, 3, {"loader": {"cursor": 12}}, {"name": "x"}, ds)
    saved_w = weights(engine)

    release = threading.Event()
    real_save = torch.save

    def slow_save(*args, **kwargs):  # the disk is slow: the background write waits
        if threading.current_thread().name == "checkpoint-writer":
            assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", slow_save)
    tag = mgr.save(engine, 3, {"loader": {"cursor": 12}}, {"name": "x"}, ds)
    folder = tmp_path / "async" / "checkpoints" / tag
    assert mgr.writes_busy() and not (folder / COMPLETE).exists()
    assert mgr.latest() == first  # a kill now resumes from the previous checkpoint
    timer = threading.Timer(0.5, release.set)  # the disk catches up while the step waits
    timer.start()
    step(engine, 2)  # its first update waits for the writes of the held tensors
    timer.join()
    assert mgr.writer.blocked_s > 0
    assert not mgr.writes_busy()
    assert mgr.finish() == tag and mgr.latest() == tag and (folder / COMPLETE).is_file()
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    # The snapshot was taken at save(): the bytes of the synchronous save of step 3.
    sync_folder = tmp_path / "sync" / "checkpoints" / tag
    written = sorted(p.name for p in sync_folder.glob("*.pt") if not p.name.startswith("trainer_"))
    assert written, list(sync_folder.iterdir())
    for name in written:  # the same records (the writer leaves their CRC-32 out)
        assert records(folder / name) == records(sync_folder / name), name
    fresh, _ = tiny_engine(seed=7)
    mgr.load(fresh, tag)
    for k, v in weights(fresh).items():
        assert torch.equal(v, saved_w[k]), k


def test_a_failed_background_write_raises_and_leaves_latest(tmp_path, monkeypatch):
    import threading

    from pipeline.train import checkpoint as ckpt_mod

    engine, ds = tiny_engine(seed=4)
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1, asynchronous=True)
    step(engine, 1)
    first = mgr.save(engine, 1, {"loader": {"cursor": 4}}, {"name": "x"}, ds)
    mgr.finish()

    def full_disk(*args, **kwargs):
        if threading.current_thread().name == "checkpoint-writer":
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    real_save = torch.save

    monkeypatch.setattr(ckpt_mod.torch, "save", full_disk)
    step(engine, 1)
    # The writer thread may fail the first file before DeepSpeed queues the next one of
    # the same checkpoint: the error then surfaces in that save, else at the wait.
    with pytest.raises(OSError, match="No space left"):
        mgr.save(engine, 2, {"loader": {"cursor": 8}}, {"name": "x"}, ds)
        mgr.finish()
    assert mgr.latest() == first


def test_an_asynchronous_save_holds_tensors_and_writes_them_through_a_bounded_buffer(tmp_path):
    """No copy of a rank's state when the save is called: whole host tensors are held
    (same memory), views stand in as untouched placeholders whose source is the view
    itself. The writer's file (skeleton, then each record filled; views and a
    non-contiguous tensor copied through a buffer smaller than one of them) loads to the
    same tensors as torch.save's, and its records equal torch.save's but for the CRC."""
    from pipeline.train.snapshot_writer import SnapshotWriter, hold

    flat = torch.arange(10.0)
    grid = torch.arange(48, dtype=torch.bfloat16).reshape(6, 8)
    state = {
        "whole": flat,
        "view": flat[2:7],  # contiguous, inside a larger storage
        "columns": grid[:, 1:5],  # not contiguous: through the buffer, row by row
        "scalar": torch.tensor(3, dtype=torch.int64)[()],
        "empty": torch.zeros(0),
        "nested": [{"mask": torch.tensor([True, False, True])}, (torch.ones(2, 3),)],
        "n": 3,
    }
    skeleton, sources = hold(state)
    assert skeleton["whole"].data_ptr() == flat.data_ptr()
    assert sources[id(skeleton["view"])].data_ptr() == flat[2:].data_ptr()  # held, not copied
    assert skeleton["view"].untyped_storage().nbytes() == 5 * 4

    class Engine:  # what install() wraps: DeepSpeed's checkpoint engine and update
        checkpoint_engine = None

        def _take_model_step(self):
            return None

    writer = SnapshotWriter.install(Engine(), buffer_bytes=16, safe_globals=[])
    writer.save(state, str(tmp_path / "ours.pt"))
    writer.wait()
    torch.save({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
               tmp_path / "theirs.pt")  # fmt: skip
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    assert ours.keys() == theirs.keys() and ours["n"] == 3
    for a, b in zip(tensors_of(ours), tensors_of(theirs), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert writer.fallbacks == 0
    assert records(tmp_path / "ours.pt") == records(tmp_path / "theirs.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_tensors_go_to_the_file_through_the_pinned_buffer(tmp_path):
    """On a GPU: device tensors (whole, a view, not contiguous) are held, not copied, and
    written through one pinned host buffer smaller than each of them."""
    from pipeline.train.snapshot_writer import SnapshotWriter, hold

    flat = torch.randn(4096, device="cuda")
    state = {"whole": flat, "view": flat[100:3000], "t": flat.view(64, 64).t()}
    skeleton, sources = hold(state)
    assert all(skeleton[k].device.type == "cpu" for k in state)  # placeholders, untouched
    assert sources[id(skeleton["whole"])].data_ptr() == flat.data_ptr()
    writer = SnapshotWriter(None, buffer_bytes=1024, safe_globals=[])
    writer._write(skeleton, sources, str(tmp_path / "d.pt"))
    assert writer.buffer._buffer.is_pinned() and writer.buffer._buffer.numel() == 1024
    back = torch.load(tmp_path / "d.pt", weights_only=True)
    for k, v in state.items():
        assert back[k].device.type == "cpu" and torch.equal(back[k], v.cpu()), k


class Holder:
    """An object with a tensor in it (the writer's walk opens containers, not objects)."""

    def __init__(self, tensor):
        self.tensor = tensor


def test_a_tensor_inside_an_object_is_written_the_plain_way(tmp_path):
    """A state whose tensor hides in an object cannot be paired with its records (one
    record more than the tensors the walk finds): that file is written by a plain
    torch.save, the same tensors; a state without one is written the bounded way."""
    from pipeline.train.snapshot_writer import SnapshotWriter, hold

    writer = SnapshotWriter(None, buffer_bytes=8, safe_globals=[Holder])
    flat = torch.arange(6.0)
    writer._write(*hold({"view": flat[1:4], "n": 1}), str(tmp_path / "a.pt"))
    assert writer.fallbacks == 0
    writer._write(*hold({"view": flat[1:4], "obj": Holder(flat)}), str(tmp_path / "b.pt"))
    assert writer.fallbacks == 1
    with torch.serialization.safe_globals([Holder]):
        back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert torch.equal(back["view"], flat[1:4]) and torch.equal(back["obj"].tensor, flat)


def tensors_of(obj):
    from pipeline.train.snapshot_writer import tensors_in

    return list(tensors_in(obj))


def records(path) -> dict[str, bytes]:
    """A torch.save file's records (but its random serialization id), read raw: the
    asynchronous writer leaves their CRC-32 out, which zipfile's reader would refuse."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: raw_record(path, z.getinfo(n)) for n in z.namelist()
                if not n.endswith("serialization_id")}  # fmt: skip


def raw_record(path, info) -> bytes:
    """A stored (uncompressed) zip member's bytes, read past its local header."""
    import struct

    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        return f.read(info.file_size)
