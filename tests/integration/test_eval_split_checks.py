"""The valid split meets the eval batch before anything starts, and a failed evaluation
keeps the training done (a checkpoint due at that step is written before evaluating).

docs/cluster.md step 4 on a small corpus: 10 steps trained, then the first evaluation
found the valid split too small for the batch, before the step-10 save: nothing kept."""

from __future__ import annotations

import shutil
import tarfile

import pytest
from conftest import REPO, one_plm_line, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs" / "test" / "bert-tiny.yaml")


def test_a_valid_split_too_small_for_the_eval_batch_is_refused_before_any_step(tiny_data, tmp_path):
    """micro_batch_size 128: the train split has enough examples, the valid split (64) not."""
    run = tmp_path / "run"
    args = ["train", BERT, f"data.path={tiny_data}", f"train.out_dir={run}",
            "train.micro_batch_size=128", "train.max_steps=10", "train.eval_every=10",
            "train.log_every=1"]  # fmt: skip
    line = one_plm_line(plm(*args, "--dry-run", cwd=tmp_path, check=False))
    assert "split 'valid'" in line and str(tiny_data) in line
    assert "mlm+nsp examples" in line and "eval batch" in line and "= 128" in line
    assert "train.micro_batch_size" in line and "train.eval_every=0" in line
    real = plm(*args, cwd=tmp_path, check=False)
    assert one_plm_line(real) == line
    assert "step 1:" not in real.stdout and not (run / "checkpoints").exists()
    # without evaluation the same run is valid
    ok = plm(*args, "train.eval_every=0", "--dry-run", cwd=tmp_path)
    assert "config valid" in ok.stdout


def _corrupt_first_valid_block(data):
    """One byte of the first valid block's data flipped: sizes and the index still match
    the manifest (the start checks pass), the block's crc32 does not (its first read
    fails)."""
    shard = data / "valid" / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.size > 8)
    raw = bytearray(shard.read_bytes())
    raw[member.offset_data + 4] ^= 0xFF
    shard.write_bytes(bytes(raw))


def test_a_failed_evaluation_keeps_the_checkpoint_of_its_step(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    _corrupt_first_valid_block(data)
    run = tmp_path / "run"
    proc = plm("train", BERT, f"data.path={data}", f"train.out_dir={run}",
               "train.max_steps=10", "train.eval_every=5", "train.save_every=5",
               cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "corrupt" in proc.stderr
    # the 5 steps trained before the evaluation are kept, and a rerun resumes them
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000005"
