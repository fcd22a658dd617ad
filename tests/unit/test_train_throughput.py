"""Honest throughput: FLOPs of what the model computes on the real tokens (attention at
each sequence's real length, the decoder on the positions it scores)."""

import os

import pytest
import torch
from conftest import tiny_model

from pipeline.train.batch_stats import flops_model
from pipeline.train.batch_stats import work_stats as _work_stats
from pipeline.train.parallelize import local_world_size, set_cpu_threads


def test_work_stats_count_real_sequences_and_decoded_positions():
    mask = torch.tensor([[1] * 6 + [0] * 2, [1] * 3 + [0] * 5])
    labels = torch.full((2, 8), -100)
    labels[0, 1], labels[1, 2] = 7, 9
    squares, decoded = _work_stats(
        {"input_ids": mask, "attention_mask": mask, "mlm_labels": labels}
    )
    assert (squares, decoded) == (6**2 + 3**2, 2)
    # documents packed in rows: one sequence per run of a document id, row by row
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    squares, decoded = _work_stats({"input_ids": docs, "document_ids": docs})
    assert (squares, decoded) == (9 + 4 + 9 + 64, 16)


@pytest.mark.parametrize("arch", ["bert", "albert", "electra", "roberta", "gpt2"])
def test_flops_model_equals_the_models_formula(arch):
    model = tiny_model(arch)
    flops = flops_model(model, 64)
    for attended, decoded in [(64, 1.0), (23.5, 0.15), (3, 0.0)]:
        assert flops(attended, decoded) == pytest.approx(model.flops_per_token(attended, decoded))
    if arch != "gpt2":  # encoders: the labelled share of the decoder is what runs
        assert flops(64, 0.15) < flops(64, 1.0)
    assert flops(20, 1.0) < flops(64, 1.0)  # attention at the real length


def test_cpu_threads_shared_by_the_ranks_of_a_machine(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "64")  # the deepspeed launcher's: 64 ranks here
        assert local_world_size() == 64
        assert set_cpu_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
        assert set_cpu_threads() is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_SIZE", "1")  # one rank: half the CPUs, not one per CPU
        cpus = len(os.sched_getaffinity(0))
        torch.set_num_threads(cpus)
        assert set_cpu_threads() == max(1, cpus // 2) == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_compile_without_a_cpu_compiler_is_a_config_error(monkeypatch):
    """train.compile on the CPU needs a C++ compiler: one ConfigError naming the key and the
    way out, before any model is built (the dry run calls the same check)."""
    import torch._inductor.config as inductor

    from pipeline.config import TrainSection
    from pipeline.errors import ConfigError
    from pipeline.train.parallelize import apply, check_compile

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/g++",))
    with pytest.raises(ConfigError, match=r"train\.compile=true.*train\.compile=false"):
        check_compile(TrainSection(compile=True))
    model = tiny_model("bert")
    with pytest.raises(ConfigError):
        apply(model, TrainSection(compile=True))
    assert all(layer._compiled_call_impl is None for layer in model.repeated_layers())
    check_compile(TrainSection(compile=False))  # nothing asked, nothing checked
