"""Bundles hold the fp32 master weights, also in bf16 runs (real DeepSpeed, one process)."""

import pytest
import torch

from pipeline.config import TrainSection
from pipeline.train import engine as ds_engine
from pipeline.train.full_weights import consolidated_state_dict
from pipeline.train.schedule import scheduler_factory

pytestmark = pytest.mark.slow


class Tied(torch.nn.Module):
    """An embedding tied to the output projection, a LayerNorm and a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 32, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        return self.out(h * self.scale.to(h.dtype))


def trained(stage: int, precision: str):
    ds_engine.init_distributed()
    torch.manual_seed(0)
    model = Tied()
    ds = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "train_batch_size": 4, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16"},
    }  # fmt: skip
    engine = ds_engine.initialize(
        model, ds, scheduler_factory(TrainSection(max_steps=10, warmup_steps=0))
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 6), generator=g)
        logits = engine(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()
    return engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_bundle_holds_fp32_master_weights(stage):
    engine = trained(stage, "bf16")
    sd = consolidated_state_dict(engine)
    assert set(sd) == {"emb.weight", "ln.weight", "ln.bias", "out.weight", "scale"}
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert torch.equal(sd["emb.weight"], sd["out.weight"])  # tied: one master, two names
    # Not bf16-rounded: three Adam steps of 1e-3 leave bits below bf16's 8-bit mantissa.
    w = sd["emb.weight"]
    assert not torch.equal(w.to(torch.bfloat16).float(), w)
    # ... and it is the master of the 16-bit weights the model runs with.
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        lp = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    for k in ("emb.weight", "ln.weight", "ln.bias"):
        assert lp[k].dtype == torch.bfloat16
        assert torch.equal(sd[k].to(torch.bfloat16), lp[k]), k


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_bundle_equals_the_model_weights(stage):
    import deepspeed

    engine = trained(stage, "fp32")
    sd = consolidated_state_dict(engine)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        lp = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    assert sd.keys() == lp.keys()
    for k in sd:
        assert torch.equal(sd[k], lp[k]), k
