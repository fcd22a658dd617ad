"""A non-finite loss skips the update (real DeepSpeed engine, tiny model, single process)."""

import pytest
import torch

from pipeline.config import validate_dict
from pipeline.loader.stream import MixSource
from pipeline.train import engine as ds_engine
from pipeline.train.checkpoint import CheckpointManager
from pipeline.train.model_inputs import forward_keys
from pipeline.train.schedule import scheduler_factory
from pipeline.train.stop import GracefulStop
from pipeline.train.stragglers import StragglerWatch
from pipeline.train.trainer import Trainer

pytestmark = pytest.mark.slow


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, position_ids=None,
                document_ids=None):  # fmt: skip
        return {"logits": self.out(self.emb(input_ids))}


class PoisonableObjective:
    """Cross-entropy; a batch flagged 'poison' gives a NaN loss, as a diverged step would."""

    def loss(self, outputs, batch):
        loss = torch.nn.functional.cross_entropy(
            outputs["logits"].flatten(0, 1), batch["labels"].flatten()
        )
        if bool(batch["poison"].any()):
            loss = loss * float("nan")
        return loss, {"lm_loss": loss.detach()}


def batches(poison_at):
    g = torch.Generator().manual_seed(0)
    i = 0
    while True:
        ids = torch.randint(0, 16, (4, 6), generator=g)
        yield {"input_ids": ids, "labels": ids, "poison": torch.tensor([i in poison_at])}
        i += 1


def make_trainer(grad_accum: int, stage: int = 2):
    cfg = validate_dict({"name": "t", "model": {"arch": "x"}, "data": {"path": "x"},
                         "train": {"micro_batch_size": 4, "grad_accum": grad_accum, "lr": 1e-2,
                                   "warmup_steps": 0, "max_steps": 10},
                         "deepspeed": f"configs/deepspeed/zero{stage}.json"})  # fmt: skip
    ds_engine.init_distributed()
    torch.manual_seed(0)
    trainer = Trainer.__new__(Trainer)  # only what train_step needs, no data dir
    trainer.cfg, trainer.dev, trainer.world, trainer.rank = cfg, torch.device("cpu"), 1, 0
    trainer.step = 0
    trainer.reset_metrics()
    trainer.stopper, trainer.stop_agreed = GracefulStop(10.0), False  # no signal
    trainer.ckpt = CheckpointManager("unused", 1, 0, 1, asynchronous=True)  # nothing pending
    trainer.stragglers = StragglerWatch(0, 0, 1)  # one rank: not watched
    trainer.sources = [MixSource("unused")]  # one source: no per-source token counts
    trainer.objective = PoisonableObjective()
    model = TinyLM()
    trainer.input_keys, trainer.uses_memory = forward_keys(model), False
    trainer.engine = ds_engine.initialize(
        model, ds_engine.build_ds_config(cfg, 1), scheduler_factory(cfg.train)
    )
    return trainer


def weights(engine):
    if engine.zero_optimization_partition_weights():
        from pipeline.train.full_weights import consolidated_state_dict

        return list(consolidated_state_dict(engine).values())
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_nonfinite_step_is_skipped_and_training_goes_on(grad_accum):
    trainer = make_trainer(grad_accum)
    poison = {2 * grad_accum + grad_accum - 1}  # last micro-batch of the 3rd step
    it = batches(poison)
    out = trainer.train_step(it)
    assert out is not None and torch.isfinite(out.values[0])
    out = trainer.train_step(it)
    assert out is not None
    before, lr_before = weights(trainer.engine), trainer.engine.get_lr()[0]
    assert trainer.train_step(it) is None  # poisoned: skipped
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer.engine), strict=True))
    assert trainer.engine.get_lr()[0] == lr_before  # the schedule did not advance either
    out = trainer.train_step(it)  # the next step trains normally, with finite weights
    assert out is not None and torch.isfinite(out.values[0])
    after = weights(trainer.engine)
    assert all(torch.isfinite(w).all() for w in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("grad_accum,bad", [(1, 0), (2, 1), (3, 0)])
def test_skipped_window_leaves_no_partial_gradients(grad_accum, bad, stage):
    """Skipping window 3 must equal never having seen it (no stale accumulated grads),
    whether its bad micro-batch is the last (no backward) or an earlier one (its
    non-finite gradients were accumulated before the step's one check)."""
    a = make_trainer(grad_accum, stage)
    it = batches({2 * grad_accum + bad})  # micro-batch `bad` of the 3rd window
    for _ in range(4):
        a.train_step(it)
    b = make_trainer(grad_accum, stage)
    it = batches(set())
    b.train_step(it)
    b.train_step(it)
    for _ in range(grad_accum):  # the same data, without the poisoned window
        next(it)
    b.train_step(it)
    for wa, wb in zip(weights(a.engine), weights(b.engine), strict=True):
        assert torch.allclose(wa, wb, atol=1e-6), (wa - wb).abs().max()
