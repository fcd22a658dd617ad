import math

import pytest
import torch

from pipeline.config import TrainSection
from pipeline.train.metrics import throughput
from pipeline.train.plan import model_state_bytes
from pipeline.train.schedule import lr_multiplier, scheduler_factory


def test_warmup_then_linear_decay_to_min():
    def f(s):
        return lr_multiplier(s, warmup_steps=10, max_steps=110, schedule="linear", min_lr_ratio=0.1)  # noqa: E731

    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)  # clamps past the end
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_cosine_and_constant():
    c = lambda s: lr_multiplier(s, warmup_steps=0, max_steps=100, schedule="cosine")  # noqa: E731
    assert c(0) == pytest.approx(1.0)
    assert c(50) == pytest.approx(0.5)
    assert c(100) == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(70, warmup_steps=5, max_steps=100, schedule="constant") == 1.0
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_multiplier(70, warmup_steps=5, max_steps=100, schedule="poly")


def test_lambda_lr_state_round_trip():
    cfg = TrainSection(max_steps=20, warmup_steps=4, lr=1.0, schedule="cosine")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = scheduler_factory(cfg)(opt)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = scheduler_factory(cfg)(opt2)
    sched2.load_state_dict(state)  # the optimizer's own state carries the current lr
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_zero_memory_model_partitions():
    n, w = 1_000_000, 4
    p0, g0, o0 = model_state_bytes(n, 0, w, "fp32", False)
    assert (p0, g0, o0) == (4e6, 4e6, 8e6)
    p3, g3, o3 = model_state_bytes(n, 3, w, "fp32", False)
    assert (p3, g3, o3) == (1e6, 1e6, 3e6)  # the ZeRO optimizer's own fp32 master too
    p1, g1, o1 = model_state_bytes(n, 1, w, "bf16", False)
    assert (p1, g1, o1) == (2e6, 2e6, 3e6)
    assert model_state_bytes(n, 3, w, "bf16", True) == (0.0, 0.5e6, 0.0)


def test_throughput_reports_mfu_only_with_a_peak():
    m = throughput(
        tokens=1000, samples=10, seconds=2.0, flops_per_token=6e6, world_size=2, peak_flops=None
    )
    assert m["tokens_per_s"] == 500 and m["samples_per_s"] == 5
    assert math.isclose(m["flops_per_s_per_device"], 1000 * 6e6 / 2 / 2)
    assert "mfu" not in m
    m = throughput(
        tokens=1000, samples=10, seconds=2.0, flops_per_token=6e6, world_size=2, peak_flops=1.5e9
    )
    assert m["mfu"] == pytest.approx(1.0)
