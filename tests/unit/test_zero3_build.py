"""ZeRO-3 builds the model partitioned (deepspeed.zero.Init) with exactly the weights of a
whole build, for every architecture (real DeepSpeed, one gloo rank)."""

import pytest
import torch

from pipeline.models.blocks import numel
from pipeline.models.registry import ARCHITECTURES, build_model, resolve_model_config
from pipeline.train import engine as ds_engine

pytestmark = pytest.mark.slow

PRESETS = {arch: f"{arch}-tiny" for arch in ARCHITECTURES}
ZERO3 = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_partitioned_build_has_the_weights_of_a_whole_one(arch):
    import deepspeed

    ds_engine.init_distributed()
    cfg = resolve_model_config({"arch": arch, "preset": PRESETS[arch]}, 1000)
    torch.manual_seed(0)
    whole = build_model(arch, cfg)
    torch.manual_seed(0)
    with ds_engine.partitioned_build(ZERO3):
        part = build_model(arch, cfg)
    params = dict(part.named_parameters())
    assert all(hasattr(p, "ds_id") for p in params.values())  # partitioned as created
    assert sum(numel(p) for p in params.values()) == sum(p.numel() for p in whole.parameters())
    for name, p in params.items():
        with deepspeed.zero.GatheredParameters([p]):
            torch.testing.assert_close(p.data, whole.state_dict()[name], rtol=0, atol=0, msg=name)


def test_below_zero3_nothing_is_partitioned():
    with ds_engine.partitioned_build({"zero_optimization": {"stage": 2}}):
        model = build_model(
            "bert", resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, 100)
        )
    assert not any(hasattr(p, "ds_id") for p in model.parameters())
