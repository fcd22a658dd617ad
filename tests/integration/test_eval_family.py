"""`plm eval`'s bundles from ZeRO-2 checkpoints (the family runs: 2 ranks, ZeRO-2, gloo):
the final checkpoint's bundle, made on the evaluation side from the fp32 partitions, is
tensor-for-tensor the bundle training wrote at the same step."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("name", ["gpt", "electra"])
def test_a_zero2_checkpoint_makes_the_bundle_training_wrote(family_runs, name, tmp_path):
    import torch

    from pipeline.eval.checkpoint_bundle import bundle_from_checkpoint, checkpoint_meta
    from pipeline.models.bundle import read_tensors

    run = family_runs[name]
    final = run / "bundles" / "final"
    tag = max(p for p in (run / "checkpoints").iterdir() if (p / "COMPLETE").is_file())
    assert checkpoint_meta(tag)["zero_stage"] == 2
    made = bundle_from_checkpoint(tag, tmp_path / "b", final)
    ours, theirs = dict(read_tensors(made)), dict(read_tensors(final))
    assert list(ours) == list(theirs)
    for k, t in theirs.items():
        assert torch.equal(ours[k], t), k
