"""The ZeRO-3 universal conversion spread over the ranks of the new world
(pipeline/train/universal.py), against DeepSpeed's own ``ds_to_universal`` in one process:
a checkpoint written by 2 ranks, converted by 3 (every rank with a share of the old ranks'
files and of the parameters), gives the same files holding the same tensors; a file that
fails on one rank stops every rank with the same error."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port

from pipeline.train.out_store import OutStore
from pipeline.train.universal import deal_by_size

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# One rank's part: 2 ranks train a small ZeRO-3 model 2 steps and save; or N ranks convert.
RANK = """
import sys, torch
from pipeline.train import engine as ds_engine
from pipeline.train.checkpoint import CheckpointError, CheckpointManager
from pipeline.train.schedule import scheduler_factory
from pipeline.config import TrainSection
ds_engine.init_distributed()
import torch.distributed as dist
rank, world = dist.get_rank(), dist.get_world_size()
from pipeline.train.out_store import OutStore
root, what, staging = sys.argv[1], sys.argv[2], sys.argv[3]  # staging: this rank's own disk
out = OutStore.open(root, staging.format(rank=rank), rank, 0) if staging else root
mgr = CheckpointManager(out, keep_last=2, rank=rank, world_size=world, asynchronous=False)
if what == "save":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 24),
                                torch.nn.LayerNorm(24), torch.nn.Linear(24, 7))
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "train_batch_size": 4 * world, "steps_per_print": 10**9,
          "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True,
                                                   "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3}}
    engine = ds_engine.initialize(model, ds, scheduler_factory(TrainSection(max_steps=10)))
    torch.manual_seed(rank)
    for _ in range(2):
        loss = engine(torch.randint(0, 50, (4, 5))).pow(2).mean()
        engine.backward(loss)
        engine.step()
    mgr.save(engine, 2, {"loader": {}}, {}, ds, {"zero_stage": 3})
    mgr.finish()
else:
    try:
        print("SECONDS", mgr.to_universal("step00000002"), flush=True)
    except CheckpointError as err:
        print("ERROR", err, flush=True)
"""


def ranks(world: int, root: Path | str, what: str, staging: str = "") -> list[str]:
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(root), what, staging], env=env,
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    return [out for out, _ in outs]


def tensors(path: Path):
    got = torch.load(path, weights_only=False)
    return got if isinstance(got, dict) else {"tensor": got}


def test_deal_by_size_balances_and_agrees():
    sizes = {"emb": 1000, "a": 300, "b": 300, "c": 200, "d": 100, "e": 100}
    dealt = deal_by_size(sizes, 3)
    assert sorted(n for share in dealt for n in share) == sorted(sizes)
    assert dealt[0] == ["emb"] and sorted(sum(sizes[n] for n in s) for s in dealt[1:]) == [500, 500]
    assert deal_by_size(sizes, 1) == [sorted(sizes, key=lambda n: (-sizes[n], n))]


def test_three_ranks_convert_two_ranks_zero3_as_deepspeed_does(s3, tmp_path):
    """Nothing shared: each rank a node of its own (its own staging folder), the files
    travelling through the store. (A local out_dir, a folder every rank sees, runs the same
    steps in place: tests/integration/test_elastic_resume.py converts ZeRO-3 so.)"""
    root = f"s3://plm-test/universal-{tmp_path.name}"
    ranks(2, root, "save", str(tmp_path / "old{rank}"))
    view = OutStore.open(root, str(tmp_path / "view"), 0, 0)  # what the store holds
    rel = "checkpoints/step00000002"
    view.fetch(p for p, _ in view.list_files(rel))
    tag = view.local / rel
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == [
        f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in (0, 1)
    ]
    # DeepSpeed's conversion, one process, on a copy: the reference.
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    ref_in = tmp_path / "ref" / "step00000002"
    shutil.copytree(tag, ref_in)
    ds_to_universal(argparse.Namespace(
        input_folder=str(ref_in), output_folder=str(tmp_path / "ref" / "universal"),
        num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
        inject_missing_state=True))  # fmt: skip

    staging = str(tmp_path / "new{rank}")
    outs = ranks(3, root, "convert", staging)
    assert all(out.startswith("SECONDS") for out in outs), outs
    view.fetch(p for p, _ in view.list_files(f"{rel}/universal"))
    ours, ref = tag / "universal", tmp_path / "ref" / "universal"
    files = sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*") if p.is_file())
    want = sorted(p.relative_to(ref).as_posix() for p in ref.rglob("*") if p.is_file())
    assert files == sorted([*want, "COMPLETE"])
    assert any(f.endswith("/exp_avg_sq.pt") for f in files)
    for rel_file in want:
        a, b = tensors(ours / rel_file), tensors(ref / rel_file)
        if rel_file.endswith(("_states.pt", "optimizer_state.pt")):  # copied / DeepSpeed's own
            assert (ours / rel_file).read_bytes() == (ref / rel_file).read_bytes(), rel_file
            continue
        assert a.keys() == b.keys(), rel_file
        for k in a:
            assert torch.equal(a[k], b[k]), (rel_file, k)
    assert not view.list_files(f"{rel}/universal-parts")  # the fragments are gone
    # Each new rank fetched only what its share needed: new rank 2 read no old partition
    # (old ranks 0 and 1 went to new ranks 0 and 1) and kept no fragments.
    node2 = tmp_path / "new2" / rel
    assert not list(node2.glob("*optim_states.pt")), sorted(node2.iterdir())
    assert not (node2 / "universal-parts").exists()
    assert (tmp_path / "new1" / rel / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    # Done once: a second call converts nothing.
    assert all(float(out.split()[1]) == 0.0 for out in ranks(3, root, "convert", staging))

    # A partition that fails to load on the rank reading it (old rank 1: new rank 1) stops
    # every rank with that error, and leaves no COMPLETE.
    bad = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    view.delete_tree(f"{rel}/universal")
    view.write_bytes(f"{rel}/{bad}", b"not a checkpoint")
    outs = ranks(3, root, "convert", str(tmp_path / "again{rank}"))
    assert all(out.startswith("ERROR") and bad in out for out in outs), outs
    assert "extraction failed on rank 1" in outs[0] and "extraction failed on rank 1" in outs[2]
    assert not view.exists(f"{rel}/universal/COMPLETE")
