"""A training step reads nothing from the device but its one agreed flag: the layouts
(packed index, sequence boundaries, labelled positions) come from the loader's CPU batch.

On a GPU every value read to the host (``.item()``, ``bool()``, ``.tolist()``, the size
of ``nonzero`` or of a boolean gather) waits for the device: the CPU stops queueing
kernels. These tests count such reads during real ``Trainer.train_step`` calls (real
DeepSpeed engine, tiny models, the real objectives) on the CPU, with the reads the
trainer makes on the loader's CPU batch (token counts, the layouts) left out: there they
cost no sync. What is left must be the one read each optimizer step makes by design (the
2-number all-reduce that lets every rank skip a non-finite step or stop on a signal),
and the window's read at ``log_every``.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.config import ObjectiveSection, validate_dict
from pipeline.loader.stream import MixSource
from pipeline.objectives import build_objective
from pipeline.train import engine as ds_engine
from pipeline.train import trainer as trainer_module
from pipeline.train.checkpoint import CheckpointManager
from pipeline.train.model_inputs import forward_keys
from pipeline.train.schedule import scheduler_factory
from pipeline.train.stop import GracefulStop
from pipeline.train.stragglers import StragglerWatch
from pipeline.train.trainer import Trainer

pytestmark = pytest.mark.slow

# aten ops whose result needs a value (or a size) only the data holds
READ_OPS = (
    "_local_scalar_dense",  # .item(), bool(), int(), float()
    "nonzero",
    "masked_select",
    "unique",
    "repeat_interleave.Tensor",
)
ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 3}
PIPELINE = str(Path(trainer_module.__file__).parents[1])


class HostReads(TorchDispatchMode):
    """Records each host read while active and not paused: the aten ops of READ_OPS,
    indexing with a boolean mask (its output size), and ``Tensor.tolist`` / ``.numpy``
    (which bypass the dispatcher; patched by ``watching``). Each read is recorded as
    (what, the innermost function of ``pipeline/`` that made it)."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.paused = 0

    def record(self, what: str) -> None:
        if self.paused:
            return
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(PIPELINE)]
        self.reads.append((what, frames[-1].name if frames else "?"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(op in name for op in READ_OPS):
            self.record(name)
        elif name.startswith("aten.index.") or name.startswith("aten.index_put"):
            indices = args[1] if len(args) > 1 else []
            if any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.record(f"{name} (boolean mask)")
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def paused_call(self, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            with self.pause():
                return fn(*args, **kwargs)

        return call


@contextlib.contextmanager
def watching(monkeypatch) -> Iterator[HostReads]:
    mode = HostReads()
    for method in ("tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            mode.record(f"Tensor.{_method}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with mode:
        yield mode


def make_trainer(arch: str, kind: str, objective_extra: dict | None = None) -> Trainer:
    """A Trainer around a real DeepSpeed engine (ZeRO-0, fp32, one rank) and the real
    objective, without a data dir: only what ``train_step`` needs."""
    cfg = validate_dict({
        "name": "t", "model": {"arch": arch, "preset": f"{arch}-tiny"}, "data": {"path": "x"},
        "objective": {"kind": kind, **(objective_extra or {})},
        "train": {"micro_batch_size": 4, "grad_accum": 2, "lr": 1e-3, "warmup_steps": 0,
                  "max_steps": 10, "log_every": 3},
        "deepspeed": "configs/deepspeed/zero0.json",
    })  # fmt: skip
    ds_engine.init_distributed()
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dev, trainer.world, trainer.rank = cfg, torch.device("cpu"), 1, 0
    trainer.step, trainer.tokens_seen, trainer.tokens_by_source = 0, 0, [0]
    trainer.reset_metrics()
    trainer.stopper, trainer.stop_agreed = GracefulStop(10.0), False
    # no checkpoint pending: the step's all-reduce still carries its "writing" flag
    trainer.ckpt = CheckpointManager("unused", 1, 0, 1, asynchronous=True)  # writes nothing
    trainer.stragglers = StragglerWatch(0, 0, 1)  # one rank: not watched
    trainer.sources = [MixSource("unused")]
    # dropout on, as in training; RoBERTa pads with the tokenizer's id (0 here)
    model = tiny_model(arch, **({"pad_token_id": 0} if arch == "roberta" else {}))
    model.set_unpad(True)
    trainer.objective = build_objective(cfg.objective, ROLES, 100, 24, set(range(5)))
    trainer.objective.attach(model)
    trainer.input_keys, trainer.uses_memory = forward_keys(model), False
    trainer.engine = ds_engine.initialize(
        model, ds_engine.build_ds_config(cfg, 1), scheduler_factory(cfg.train)
    )
    return trainer


def mlm_batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Padded MLM batches, rows of 24, 17, 5 and 11 real tokens (the unpadded path)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(24)[None] < torch.tensor([[24], [17], [5], [11]])).long()
    while True:
        ids = torch.where(mask.bool(), torch.randint(5, 100, (4, 24), generator=g), 0)
        labels = torch.where((torch.rand(4, 24, generator=g) < 0.2) & mask.bool(), ids, -100)
        yield {"input_ids": ids, "attention_mask": mask, "mlm_labels": labels,
               "token_type_ids": torch.zeros_like(ids)}  # fmt: skip


def sop_batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """The MLM batches with sentence-order labels (ALBERT's mlm+sop)."""
    for batch in mlm_batches(seed):
        yield {**batch, "sop_labels": torch.tensor([0, 1, 1, 0])}


def clm_batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Packed CLM blocks with documents (block_cross_document_attention)."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * 24, [0] * 20 + [1] * 4, [0] * 24])
    while True:
        tokens = torch.randint(5, 100, (4, 25), generator=g)
        yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "document_ids": docs,
               "position_ids": torch.arange(24)[None].repeat(4, 1)}  # fmt: skip


def train_and_count(trainer: Trainer, batches, monkeypatch, steps: int) -> list[list]:
    """The host reads of each of ``steps`` train_step calls (after one warm-up step),
    the loader-CPU-batch work of the trainer left out."""
    trainer.train_step(batches)  # first step: DeepSpeed's lazy setup, metric names
    per_step = []
    with watching(monkeypatch) as mode:
        for fn in ("_tokens_by_source", "_work_stats"):
            monkeypatch.setattr(trainer_module, fn, mode.paused_call(getattr(trainer_module, fn)))
        model = trainer.engine.module
        monkeypatch.setattr(model, "attention_layout", mode.paused_call(model.attention_layout))
        for _ in range(steps):
            mode.reads.clear()
            record = trainer.train_step(batches)
            per_step.append(list(mode.reads))
            assert record is not None
            trainer.window.append(record)  # what Trainer.run does with it
        mode.reads.clear()
        trainer._read_window()  # what log_every reads
        per_step.append(list(mode.reads))
    return per_step


FLAG_READ = [("Tensor.tolist", "train_step")]  # the step's agreed non-finite / stop flags


@pytest.mark.parametrize(
    "arch,kind,extra,batches",
    [
        ("bert", "mlm", None, mlm_batches),
        ("roberta", "mlm", None, mlm_batches),
        ("albert", "mlm+sop", None, sop_batches),
        ("electra", "rtd", None, mlm_batches),
        ("gpt2", "clm", {"clm": {"block_cross_document_attention": True}}, clm_batches),
    ],
)
def test_a_training_step_reads_only_its_flag_from_the_device(
    arch, kind, extra, batches, monkeypatch
):
    trainer = make_trainer(arch, kind, extra)
    *steps, window = train_and_count(trainer, batches(), monkeypatch, steps=2)
    for reads in steps:  # grad_accum 2: two forwards, two backwards, one update each
        assert reads == FLAG_READ
    # log_every: the window's grad norms and table, one read each for all its steps
    assert window == [("Tensor.tolist", "_read_window")] * 2


def test_the_counter_sees_the_reads_of_a_forward_without_a_layout(monkeypatch):
    """What the test above would catch: the same BERT forward and MLM loss, its layout
    built from the device tensors (no ``layout``), reads the rows' lengths, the packed
    positions and the labelled positions' count."""
    model = tiny_model("bert")
    model.set_unpad(True)
    batch = next(mlm_batches())
    objective = build_objective(ObjectiveSection(kind="mlm"), ROLES, 100, 24, set(range(5)))
    with watching(monkeypatch) as mode:
        objective.loss(model(**batch), batch)
    where = {w for _, w in mode.reads}
    assert {"encoder_attention", "true_positions", "labelled_rows"} <= where, mode.reads
    mode.reads.clear()
    with watching(monkeypatch) as mode:
        with mode.pause():
            layout = model.attention_layout(batch)
        objective.loss(model(**batch, layout=layout), batch)
    assert mode.reads == []


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(
    "arch,batches", [("bert", mlm_batches), ("electra", mlm_batches), ("gpt2", clm_batches)]
)
def test_no_sync_in_a_gpu_forward_and_backward(arch, batches):
    """On a GPU, torch's own sync debug mode: forward, loss and backward with the layout
    built on the CPU batch (varlen kernels) raise on any synchronising call."""
    model = tiny_model(arch).cuda()
    model.set_unpad(True)
    kind = {"bert": "mlm", "electra": "rtd", "gpt2": "clm"}[arch]
    extra = {"clm": {"block_cross_document_attention": True}} if arch == "gpt2" else {}
    objective = build_objective(ObjectiveSection(kind=kind, **extra), ROLES, 100, 24, set())
    batch = next(batches())
    layout = model.attention_layout(batch).to("cuda")
    batch = {k: v.cuda() for k, v in batch.items()}
    inputs = {k: v for k, v in batch.items() if k in forward_keys(model)}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = objective.loss(model(**inputs, layout=layout), batch)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss.detach().cpu())
