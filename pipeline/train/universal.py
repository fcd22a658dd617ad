"""A ZeRO-3 checkpoint converted to a universal one by every rank of the new world.

An elastic resume on another number of ranks loads a universal checkpoint: per parameter,
its fp32 weights and Adam moments whole (DeepSpeed's layout, ``<tag>/universal/zero/<name>/
{fp32,exp_avg,exp_avg_sq}.pt``). DeepSpeed's ``ds_to_universal`` makes it in one process that
reads every old rank's files; under ZeRO-3, where no host may hold the whole model, and with
nothing shared but a bucket, the work is spread here over the ranks of the new world, with
DeepSpeed's own per-file and per-parameter steps:

1. **extract**: old rank ``d``'s optimizer partition is read by new rank ``d % world`` (one
   file in memory at a time: 12 bytes x parameters / old world), which writes each
   parameter's fragment of it (``extract_zero_shards_stage3``) under ``<tag>/universal-parts/``
   and uploads them;
2. **merge**: the parameters are dealt to the ranks by size (largest first, to the rank with
   the fewest elements so far); a rank fetches its parameters' fragments and joins them
   (``merge_zero3_slices``: one parameter in memory at a time) into ``<tag>/universal/zero/``;
   rank 0 also writes the optimizer's common state, and each rank copies the model-states
   files of the old ranks it read.

Each rank's uploads are confirmed before the next step starts; the caller writes the
universal folder's ``COMPLETE`` last. With a local out_dir (a folder every host sees) the
same steps read and write in place and nothing travels. A rank's failure is every rank's:
each step ends with all of them learning whether one failed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.train.out_store import OutStore

UNIVERSAL = "universal"
PARTS = "universal-parts"  # the fragments between the two steps; deleted at the end
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # per parameter: what extract writes, merge joins
# A parameter's name as torch makes it: module names joined by dots. DeepSpeed's conversion
# makes a folder of each (os.path.join(out, name)): '/' or '..' would write elsewhere.
_PARAM_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


def fragment(parts: str, name: str, state: str, d: int) -> str:
    """Where DeepSpeed's extract step writes old rank ``d``'s fragment of a parameter's state
    (``dump_param_fragment``: tensor-parallel index 0, the old rank in two digits)."""
    return f"{parts}/{name}/0/{state}.{d:02d}"


def check_param_names(groups, where: object) -> None:
    """Every name of ``groups`` (DeepSpeed's ``param_shapes`` or ``param_slice_mappings``:
    one mapping per parameter group, or one mapping) a dotted module path, before the
    conversion makes a folder of it; ValueError naming the file and the name otherwise."""
    for group in [groups] if isinstance(groups, dict) else list(groups or []):
        for name in group:
            if not (isinstance(name, str) and _PARAM_NAME.fullmatch(name)):
                raise ValueError(
                    f"{where}: parameter name {name!r} is not a dotted module path, and the "
                    "conversion would make a folder of it outside the checkpoint; refused, "
                    "nothing written: resume only from checkpoints written by `plm train`"
                )


def check_checkpoint_names(folder: Path) -> None:
    """The parameter names of a ZeRO 1-2 checkpoint folder that DeepSpeed's
    ``ds_to_universal`` makes folders of: its model states' ``param_shapes`` and its
    optimizer partitions' ``param_slice_mappings`` (memory-mapped: nothing else is read).
    Loaded as the caller set it up (``weights_only_loads``)."""
    for path in sorted(folder.glob("*model_states.pt")):
        states = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        check_param_names(states.get("param_shapes"), path)
    for path in sorted(folder.glob("*optim_states.pt")):
        states = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        optim = states.get("optimizer_state_dict") or {}
        check_param_names(optim.get("param_slice_mappings"), path)


class ConversionFailed(RuntimeError):
    """One rank's step failed; raised on every rank with that rank's words."""


def deal_by_size(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The names dealt to ``world`` ranks, largest first, each to the rank holding the fewest
    elements so far (ties: the lower rank): the same answer on every rank."""
    load, dealt = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        dealt[r].append(name)
    return dealt


def together(step: str, call, *args) -> None:
    """``call(*args)`` on this rank; then every rank learns whether any failed, and raises."""
    error = None
    try:
        call(*args)
    except Exception as err:  # told to every rank below, then raised as theirs
        error = (type(err).__name__, str(err), err)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error and error[:2])
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if error is not None:
        raise error[2]  # this rank's own, as it was raised
    rank, (kind, text) = failed[0]
    raise ConversionFailed(
        f"the universal conversion's {step} failed on rank {rank}: {kind}: {text}"
    )


def convert_zero3(store: OutStore, rel: str, rank: int, world: int, old_world: int) -> None:
    """Collective: ZeRO-3 checkpoint folder ``rel`` (relative to the store's root), saved
    by ``old_world`` ranks (its COMPLETE says), into ``rel/universal`` (without its
    COMPLETE: the caller's). A rank file past ``old_world`` is a lost host's late upload
    of an older save of this step, not part of it. DeepSpeed's torch.load calls run as the
    caller set them up (``weights_only_loads``)."""
    from deepspeed.checkpoint.ds_to_universal import (
        extract_zero_shards_stage3,
        merge_zero3_slices,
    )

    local = store.local
    out, parts = f"{rel}/{UNIVERSAL}", f"{rel}/{PARTS}"
    # What the old world left: its optimizer partitions, one per old rank.
    old = {}
    for name, is_dir in store.list_dir(rel):
        m = OPTIM_FILE.match(name)
        if m and not is_dir:
            if int(m[2]) != 0:
                raise ValueError(f"{store.where(rel)}: {name} is of a tensor-parallel run")
            if int(m[1]) < old_world:
                old[int(m[1])] = name
    if sorted(old) != list(range(old_world)):
        raise ValueError(
            f"{store.where(rel)}: ZeRO-3 partitions of ranks {sorted(old)}, saved by {old_world}"
        )
    mine = [d for d in range(old_world) if d % world == rank]

    # A leftover of a conversion killed before its COMPLETE: gone before anyone writes.
    store.clear(out)
    store.clear(parts)
    store.wait()
    dist.barrier()

    shapes: list[dict[str, torch.Size]] = []  # per parameter group: name -> shape

    def extract() -> None:
        store.fetch([f"{rel}/{MODEL_FILE.format(0)}"])
        model0 = local / rel / MODEL_FILE.format(0)
        shapes.extend(torch.load(model0, map_location="cpu", weights_only=True)["param_shapes"])
        check_param_names(shapes, model0)  # before any folder is made of them
        params = [n for group in shapes for n in group]
        for d in mine:
            files = [f"{rel}/{old[d]}", f"{rel}/{MODEL_FILE.format(d)}"]
            store.fetch(files)
            grid = [[str(local / rel / old[e]) if e == d else None for e in range(old_world)]]
            extract_zero_shards_stage3(grid, [shapes], old_world, str(local / parts), (0, d))
            model = local / out / MODEL_FILE.format(d)
            model.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local / files[1], model)
            written = [fragment(parts, n, state, d) for n in params for state in STATES]
            store.upload_files([f"{out}/{model.name}", *written])
        if rank == 0:
            from deepspeed.checkpoint.ds_to_universal import _save_optimizer_state_stage3

            args = type("Args", (), {"output_folder": str(local / out)})
            _save_optimizer_state_stage3(args, [str(local / rel / old[0])])
            store.upload_files([f"{out}/zero/optimizer_state.pt"])
        store.wait()

    together("extraction", extract)

    sizes = {n: max(1, int(torch.Size(s).numel())) for group in shapes for n, s in group.items()}
    names = deal_by_size(sizes, world)[rank]

    def merge() -> None:
        for name in names:
            store.fetch(fragment(parts, name, st, d) for st in STATES for d in range(old_world))
            merge_zero3_slices(old_world, str(local / out / "zero"), str(local / parts), name)
            store.upload_files(f"{out}/zero/{name}/{state}.pt" for state in STATES)
        store.wait()

    together("merge", merge)
    if rank == 0:
        store.delete_tree(parts)  # on the store (or the shared folder) and this node's copy
    shutil.rmtree(local / parts, ignore_errors=True)  # every other node's
