import json

import pytest
import torch

from pipeline.config import validate_dict
from pipeline.errors import ConfigError
from pipeline.train.engine import build_ds_config, param_groups

BASE = {"name": "t", "model": {"arch": "bert"}, "data": {"path": "x"}}


def cfg_with(**sections):
    raw = {**BASE, **sections}
    return validate_dict(raw)


@pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero3"])
def test_ds_config_filled_from_experiment(stage):
    cfg = cfg_with(
        train={
            "micro_batch_size": 4,
            "grad_accum": 3,
            "lr": 2e-4,
            "weight_decay": 0.05,
            "betas": [0.9, 0.95],
            "grad_clip": 0.5,
            "precision": "bf16",
        },
        deepspeed=f"configs/deepspeed/{stage}.json",
    )
    ds = build_ds_config(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5  # explicit: its default changed in 0.19.3
    assert ds["fp16"]["enabled"] is False
    if stage == "zero0":  # the whole model on every rank: fp32 weights under autocast
        assert ds["bf16"] == {"enabled": False}
        assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    else:  # DeepSpeed's ZeRO optimizers keep the fp32 masters of bf16 weights
        assert ds["bf16"] == {"enabled": True} and "torch_autocast" not in ds
    opt = ds["optimizer"]
    assert opt["type"] == "AdamW" and opt["params"]["lr"] == 2e-4
    assert opt["params"]["betas"] == [0.9, 0.95] and opt["params"]["weight_decay"] == 0.05
    assert opt["params"]["torch_adam"] is True
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"):
        assert key in ds
    assert not any(k.startswith("_") for k in ds)
    assert ds["zero_optimization"]["stage"] == int(stage[-1])


def test_offload_uses_deepspeed_cpu_adam():
    ds = build_ds_config(cfg_with(deepspeed="configs/deepspeed/zero3-offload.json"), 1)
    assert "torch_adam" not in ds["optimizer"]["params"]
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_conflicting_or_misspelled_deepspeed_keys_are_named(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 99, "zero_optimization": {"stage": 1}})
    )
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        build_ds_config(cfg_with(deepspeed=str(bad)), 1)
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comms": True}}))
    with pytest.raises(ConfigError, match="overlap_comms"):
        build_ds_config(cfg_with(deepspeed=str(bad)), 1)
    bad.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match="optimizer"):
        build_ds_config(cfg_with(deepspeed=str(bad)), 1)
    with pytest.raises(ConfigError, match="does not exist"):
        build_ds_config(cfg_with(deepspeed=str(tmp_path / "nope.json")), 1)


def test_no_weight_decay_on_bias_and_layernorm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert len(no_decay["params"]) == 4  # 2 biases + LayerNorm weight and bias


def test_precision_the_accelerator_lacks_is_a_config_error():
    from deepspeed.accelerator import get_accelerator

    from pipeline.train.engine import initialize

    if get_accelerator().is_fp16_supported():
        pytest.skip("this accelerator supports fp16")
    ds = build_ds_config(cfg_with(train={"precision": "fp16"}), 1)
    with pytest.raises(ConfigError, match=r"train.precision=fp16: .* does not support fp16"):
        initialize(torch.nn.Linear(2, 2), ds, None)


def test_an_unknown_top_level_deepspeed_key_is_refused_with_the_nearest(tmp_path):
    """`zero_optimisation` would be ignored by DeepSpeed (a run at ZeRO 0): refused."""
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"_comment": "fine", "zero_optimisation": {"stage": 2}}))
    with pytest.raises(ConfigError, match=r"unknown top-level key 'zero_optimisation'.*"
                       r"did you mean 'zero_optimization'"):  # fmt: skip
        build_ds_config(cfg_with(deepspeed=str(bad)), 1)
    inline = {"zero_optimization": {"stage": 1}, "flops_profiler": {"enabled": False}}
    assert build_ds_config(cfg_with(deepspeed=inline), 1)["zero_optimization"]["stage"] == 1


def test_known_keys_cover_every_key_deepspeeds_parser_reads():
    """Parse our full config with DeepSpeed's own DeepSpeedConfig through a dict that
    records each key asked for: none of them may be one we would refuse."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from pipeline.train.engine import DEEPSPEED_KEYS

    asked: set[str] = set()

    class Recording(dict):
        def get(self, key, *default):
            asked.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

    ds = build_ds_config(cfg_with(deepspeed="configs/deepspeed/zero2.json"), 1)
    DeepSpeedConfig(Recording(ds))
    assert len(asked) > 40
    assert asked <= DEEPSPEED_KEYS, sorted(asked - DEEPSPEED_KEYS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,precision,clip",
    [(0, "fp32", 0.05), (0, "fp32", 0.0), (0, "bf16", 0.05), (1, "fp32", 0.05),
     (2, "fp32", 0.05), (3, "fp32", 0.05)],
)  # fmt: skip
def test_grad_norm_is_recorded_and_clipping_happens_once(stage, precision, clip, monkeypatch):
    """engine.get_global_grad_norm() is the step's real gradient norm in every stage and
    precision (ZeRO-0 fp32, the one-rank default, read None: logged as 0), and the
    gradients the optimizer applies were clipped once, to ``clip``."""
    import deepspeed.runtime.utils as ds_utils

    from pipeline.train import engine as ds_engine
    from pipeline.train.schedule import scheduler_factory

    clips = []
    real_clip = ds_utils.clip_grad_norm_

    def counting_clip(*args, **kwargs):
        clips.append(1)
        return real_clip(*args, **kwargs)

    monkeypatch.setattr(ds_utils, "clip_grad_norm_", counting_clip)
    monkeypatch.setattr("deepspeed.runtime.engine.clip_grad_norm_", counting_clip)
    real_torch_clip = torch.nn.utils.clip_grad_norm_

    def counting_torch_clip(*args, **kwargs):
        clips.append(1)
        return real_torch_clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", counting_torch_clip)

    def tiny():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))

    def loss_of(model):
        return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())

    reference = tiny()
    loss_of(reference).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    cfg = cfg_with(
        train={"micro_batch_size": 4, "grad_accum": 1, "lr": 1e-2, "warmup_steps": 0,
               "max_steps": 10, "precision": precision, "grad_clip": clip},
        deepspeed=f"configs/deepspeed/zero{stage}.json",
    )  # fmt: skip
    ds_engine.init_distributed()
    engine = ds_engine.initialize(tiny(), build_ds_config(cfg, 1), scheduler_factory(cfg.train))
    applied = []
    if stage == 0:  # torch's optimizer (bf16: under autocast): see the gradients it applies
        step = engine.optimizer.step

        def recording_step(*args, **kwargs):
            grads = [p.grad.norm() for p in engine.module.parameters()]
            applied.append(float(torch.linalg.vector_norm(torch.stack(grads))))
            return step(*args, **kwargs)

        engine.optimizer.step = recording_step
    engine.backward(loss_of(engine))
    engine.step()
    got = engine.get_global_grad_norm()
    assert got is not None
    tol = 2e-2 if precision == "bf16" else 1e-5
    assert float(got) == pytest.approx(float(norm), rel=tol)
    assert float(norm) > 0.5  # well above clip: clipping matters
    if applied:
        assert applied == [pytest.approx(clip if clip else float(norm), rel=1e-4)]
        assert len(clips) == (1 if clip else 0)
