"""Untrusted inputs stay inside the folder they belong to (issue 49, point 4): a data dir's
manifest, its shards' tar members, a bundle's index and files, a checkpoint's ``latest``
and the parameter names its conversion makes folders of. Each is refused with one error
naming the file and the bad name, and nothing outside is read or written."""

from __future__ import annotations

import ast
import io
import json
import shutil
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, one_plm_line, plm
from test_bundle import tiny_bert, tokenizer_dir, vocab_of  # noqa: F401 (a fixture)
from test_inspect import make_data_dir

from pipeline.data.shards import (
    CRC,
    DOCS_AT,
    INDEX_COLUMNS,
    LANGS_AT,
    META_AT,
    OFFSET,
    SENTS_AT,
    SIZE,
    SRCS_AT,
    TOKENS_AT,
    WORDS_AT,
    Block,
    DataDir,
    ShardError,
    index_name,
    sha256_file,
    shard_name,
    write_manifest,
)
from pipeline.errors import ConfigError

SHARD = shard_name("train", 0)
KEY = "u000000t000-00000"
_AT = (DOCS_AT, LANGS_AT, META_AT, SENTS_AT, SRCS_AT, TOKENS_AT, WORDS_AT)


# --- data dirs: what the manifest names ---------------------------------------------------


def _rename_shard(root: Path, name) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    entry["name"] = name
    entry["index"] = index_name(name) if isinstance(name, str) and name.endswith(".tar") else name
    write_manifest(root, manifest)


@pytest.mark.parametrize(
    "name",
    ["s3://other-bucket/train/shard-000000.tar", "file:///etc/passwd.tar", "train\\..\\x.tar",
     "train//shard-000000.tar", 7],
)  # fmt: skip
def test_a_manifest_naming_a_shard_elsewhere_is_refused_on_open(tmp_path, name):
    """Another store's URI in a local data dir (or any name that is not plain parts joined
    by '/'): refused when the data dir is opened, naming the manifest and the name."""
    make_data_dir(tmp_path)
    _rename_shard(tmp_path, name)
    with pytest.raises(ShardError, match="not a path inside the data dir") as err:
        DataDir(tmp_path)
    assert "manifest.json" in str(err.value) and repr(name) in str(err.value)


@pytest.mark.parametrize("name", ["s3://other-bucket/train/shard-000000.tar", "train/./x.tar"])
def test_a_data_dir_on_a_store_refuses_names_of_another_place(tmp_path, name):
    """The same check for a data dir read through a store (a file:// URI here)."""
    make_data_dir(tmp_path / "data")
    _rename_shard(tmp_path / "data", name)
    with pytest.raises(ShardError, match="not a path inside the data dir"):
        DataDir(f"file://{tmp_path / 'data'}")


def _outside_split(tmp_path: Path) -> tuple[Path, Path]:
    """A data dir whose train/ folder is a link to another data dir's (a valid shard)."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    make_data_dir(data)
    make_data_dir(outside)
    shutil.rmtree(data / "train")
    (data / "train").symlink_to(outside / "train")
    return data, outside


def test_a_shard_reached_through_a_link_out_of_the_data_dir_is_not_read(tmp_path):
    data, outside = _outside_split(tmp_path)
    d = DataDir(data)
    for read in (lambda: d.read(SHARD, 0), lambda: d.verify(), lambda: list(d.iter_shard(SHARD))):
        with pytest.raises(ShardError, match="outside the data dir") as err:
            read()
        assert str(data / "train/shard-000000.") in str(err.value)  # the .tar or its index
        assert str(outside) in str(err.value)


@pytest.mark.parametrize("case", ["dotdot", "store_name", "linked_split"])
def test_inspect_verify_refuses_and_reads_nothing_outside(tmp_path, case):
    """`plm data inspect --verify DIR`: exit 2, one `plm:` line naming the manifest or the
    file and the bad name; the valid shard outside is never reported as verified."""
    if case == "linked_split":
        data, _ = _outside_split(tmp_path)
        bad = str(data / "train/shard-000000.")
    else:
        data, outside = tmp_path / "data", tmp_path / "outside"
        make_data_dir(data)
        make_data_dir(outside)
        bad = "../outside/" + SHARD if case == "dotdot" else "s3://other-bucket/" + SHARD
        _rename_shard(data, bad)
    proc = plm("data", "inspect", str(data), "--verify", cwd=tmp_path, check=False, timeout=120)
    line = one_plm_line(proc, code=2)
    assert bad in line, line
    assert "verify       ok" not in proc.stdout


# --- shards: their tar members --------------------------------------------------------------


def _members(raw: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return {m.name: m for m in tar.getmembers()}


def crafted_dir(root: Path, rename=lambda name: name, extra=(), lengths=(5, 6, 7)) -> Path:
    """A data dir of one shard holding one block of documents of ``lengths`` tokens: the members made by
    the project's block encoder, then tarred again with tarfile, each named by
    ``rename``, the (TarInfo, bytes) of ``extra`` added after them; the index row, the
    crc32 and the manifest made to match, so that only the members are wrong."""
    block = Block(np.dtype("<u2"), with_spans=False)
    for n in lengths:
        block.add(np.arange(n) + 10, np.array([n]), np.arange(0, n, 2), None, "x.txt", "other")
    sample, row = block.encode(KEY)
    old = _members(sample)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, m in old.items():
            info = tarfile.TarInfo(rename(name))
            info.size = m.size
            tar.addfile(info, io.BytesIO(sample[m.offset_data : m.offset_data + m.size]))
        for info, payload in extra:
            tar.addfile(info, io.BytesIO(payload) if payload else None)
    raw = out.getvalue()
    new = _members(raw)
    end = max(m.offset_data + -(-m.size // 512) * 512 for m in new.values())
    for col in _AT:  # each member's data moved with its header
        (name, m) = next((n, m) for n, m in old.items()
                         if m.offset_data <= row[col] <= m.offset_data + m.size)  # fmt: skip
        row[col] += new[rename(name)].offset_data - m.offset_data
    row[OFFSET], row[SIZE], row[CRC] = 0, end, zlib.crc32(raw[:end])
    (root / "train").mkdir(parents=True)
    (root / SHARD).write_bytes(raw)
    np.save(root / index_name(SHARD), np.asarray([row], dtype=np.int64).reshape(-1, INDEX_COLUMNS))
    counts = {"n_docs": len(lengths), "n_tokens": sum(lengths)}
    entry = {"name": SHARD, "index": index_name(SHARD), "n_blocks": 1, "bytes": len(raw),
             "sha256": sha256_file(root / SHARD),
             "index_sha256": sha256_file(root / index_name(SHARD)), **counts}  # fmt: skip
    splits = {"train": {"shards": [entry], **counts}}
    write_manifest(root, {"format_version": 3, "tokenizer": {"path": "tokenizer"},
                          "splits": splits, "totals": {}})  # fmt: skip
    return root


def _link(kind: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(f"{KEY}.extra")
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        info.type, info.linkname = tarfile.LNKTYPE, "../outside/x"
    else:
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    return info


def _dotted(prefix: str):
    return lambda name: prefix + name[name.index(".") :]


BAD_MEMBERS = {
    "dotdot": ({"rename": _dotted("../evil")}, "../evil.docs.npy"),
    "absolute": ({"rename": _dotted("/etc/evil")}, "/etc/evil.docs.npy"),
    "inner_dotdot": ({"rename": _dotted("a/../../evil")}, "a/../../evil.docs.npy"),
    "symlink": ({"extra": [(_link("symlink"), b"")]}, f"{KEY}.extra"),
    "hardlink": ({"extra": [(_link("hardlink"), b"")]}, f"{KEY}.extra"),
    "device": ({"extra": [(_link("device"), b"")]}, f"{KEY}.extra"),
}


def test_the_crafted_shard_itself_is_read_and_verified(tmp_path):
    """The crafting is sound: unchanged members read back and verify, so what the tests
    below refuse is the member and nothing else."""
    d = DataDir(crafted_dir(tmp_path))
    assert d.verify() == []
    assert [doc.n_tokens for doc in d.iter_shard(SHARD)] == [5, 6, 7]
    assert d.read(SHARD, 2).key == f"{KEY}-2"


@pytest.mark.parametrize("case", sorted(BAD_MEMBERS))
def test_a_bad_tar_member_is_refused_by_every_reader(tmp_path, case):
    """By random access (the training stream's reads), by webdataset's walk of the tar
    (verify's) and through a store: one ShardError naming the shard and the member."""
    kwargs, member = BAD_MEMBERS[case]
    root = crafted_dir(tmp_path / "data", **kwargs)
    for d in (DataDir(root), DataDir(f"file://{root}")):
        with pytest.raises(ShardError) as err:
            d.read(SHARD, 0)
        assert SHARD in str(err.value) and repr(member) in str(err.value), err.value
        problems = d.verify()
        assert len(problems) == 1 and repr(member) in problems[0], problems
    with pytest.raises(ShardError, match="member"):
        list(DataDir(root).iter_shard(SHARD))


def test_the_training_stream_refuses_a_linked_member(tmp_path):
    from test_stream import objective

    from pipeline.loader.stream import PretrainStream

    kwargs, member = BAD_MEMBERS["symlink"]
    root = crafted_dir(tmp_path / "data", lengths=(60, 70, 80), **kwargs)
    s = PretrainStream(str(root), "train", objective("clm"), micro_batch_size=1, seed=7)
    with pytest.raises(ShardError) as err:
        next(iter(s))
    assert repr(member) in str(err.value) and "symbolic link" in str(err.value)


def test_inspect_verify_names_the_shard_and_its_bad_member(tmp_path):
    kwargs, member = BAD_MEMBERS["dotdot"]
    root = crafted_dir(tmp_path / "data", **kwargs)
    proc = plm("data", "inspect", str(root), "--verify", cwd=tmp_path, check=False, timeout=120)
    line = one_plm_line(proc, code=1)  # a shard that fails verification: exit 1, as a corrupt one
    assert SHARD in line and repr(member) in line, line


# --- bundles: the files their index names ---------------------------------------------------


@pytest.fixture(scope="module")
def sharded_bundle(tmp_path_factory, tokenizer_dir):  # noqa: F811
    """A real tiny BERT bundle in several weights files (so with an index)."""
    from pipeline.models.bundle import save_bundle

    model = tiny_bert(vocab_of(tokenizer_dir))
    out = tmp_path_factory.mktemp("bundle") / "b"
    return save_bundle(out, "bert", model.config, model.state_dict(), tokenizer_dir,
                       max_shard_bytes=1 << 16)  # fmt: skip


def _copy_bundle(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    bundle, outside = tmp_path / "bundle", tmp_path / "outside"
    shutil.copytree(src, bundle)
    outside.mkdir()
    return bundle, outside


@pytest.mark.parametrize("where", ["dotdot", "absolute"])
def test_a_bundle_index_naming_a_file_outside_is_refused(sharded_bundle, tmp_path, where):
    from pipeline.models.bundle import INDEX_FILE, load_bundle, tensor_names

    bundle, outside = _copy_bundle(sharded_bundle, tmp_path)
    index = json.loads((bundle / INDEX_FILE).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copyfile(bundle / first, outside / first)  # a valid file, outside the bundle
    bad = f"../outside/{first}" if where == "dotdot" else str(outside / first)
    index["weight_map"] = {k: bad if v == first else v for k, v in index["weight_map"].items()}
    (bundle / INDEX_FILE).write_text(json.dumps(index))
    for read in (lambda: load_bundle(bundle), lambda: tensor_names(bundle)):
        with pytest.raises(ConfigError, match="outside the bundle") as err:
            read()
        assert INDEX_FILE in str(err.value) and repr(bad) in str(err.value)


def test_a_bundle_weights_file_linked_out_of_the_bundle_is_not_read(sharded_bundle, tmp_path):
    from pipeline.models.bundle import INDEX_FILE, load_bundle

    bundle, outside = _copy_bundle(sharded_bundle, tmp_path)
    first = sorted(set(json.loads((bundle / INDEX_FILE).read_text())["weight_map"].values()))[0]
    shutil.move(bundle / first, outside / first)
    (bundle / first).symlink_to(outside / first)
    with pytest.raises(ConfigError, match="outside the bundle") as err:
        load_bundle(bundle)
    assert str(outside / first) in str(err.value)


def test_export_of_a_bundle_whose_index_leads_outside_is_one_line(sharded_bundle, tmp_path, capsys):
    from pipeline.models.bundle import INDEX_FILE

    bundle, outside = _copy_bundle(sharded_bundle, tmp_path)
    index = json.loads((bundle / INDEX_FILE).read_text())
    for name in set(index["weight_map"].values()):  # valid files, outside the bundle
        shutil.move(bundle / name, outside / name)
    index["weight_map"] = {k: f"../outside/{v}" for k, v in index["weight_map"].items()}
    (bundle / INDEX_FILE).write_text(json.dumps(index))
    from pipeline.cli import main

    assert main(["export", "--to", "hf", str(bundle), str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("plm: ") and "'../outside/model-0000" in line, line
    assert not (tmp_path / "hf").exists()


# --- checkpoints: `latest` and the names the conversion makes folders of ---------------------


@pytest.mark.parametrize("tag", ["../../outside/step00000001", "/tmp/step00000001", "step1/.."])
def test_a_latest_naming_a_folder_outside_the_checkpoints_is_refused(tmp_path, tag):
    from pipeline.train.checkpoint import CheckpointError, CheckpointManager

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    outside = (run / "checkpoints" / tag).resolve() if not tag.startswith("/") else Path(tag)
    if not tag.startswith("/"):  # a complete checkpoint where the tag leads
        outside.mkdir(parents=True, exist_ok=True)
        (outside / "COMPLETE").write_text("{}")
    (run / "checkpoints" / "latest").write_text(tag)
    mgr = CheckpointManager(run, keep_last=2, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="not a checkpoint of this run") as err:
        mgr.latest()
    assert isinstance(err.value, ConfigError)  # `plm train --dry-run` prints it as one line
    assert "latest" in str(err.value) and repr(tag) in str(err.value)


def _crafted_checkpoint(run: Path, stage: int, name: str) -> str:
    """A checkpoint folder whose DeepSpeed files name a parameter ``name`` (what the
    universal conversion makes a folder ``zero/<name>`` of)."""
    tag = "step00000001"
    folder = run / "checkpoints" / tag
    folder.mkdir(parents=True)
    shapes = [{name: torch.Size([4])}]
    if stage == 3:
        torch.save({"param_shapes": shapes}, folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        torch.save(
            {"optimizer_state_dict": {}}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        )
    else:
        torch.save({"param_shapes": shapes, "module": {}}, folder / "mp_rank_00_model_states.pt")
        optim = {"optimizer_state_dict": {"param_slice_mappings": [{name: {}}]}}
        torch.save(optim, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    meta = {"step": 1, "world_size": 1, "zero_stage": stage}
    (folder / "COMPLETE").write_text(json.dumps(meta))
    return tag


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["../../../../escaped", "/tmp/plm-escaped-param"])
def test_a_parameter_name_that_is_a_path_stops_the_universal_conversion(tmp_path, stage, name):
    from pipeline.train import engine as ds_engine
    from pipeline.train.checkpoint import CheckpointError, CheckpointManager

    ds_engine.init_distributed()
    run = tmp_path / "a" / "b" / "run"
    tag = _crafted_checkpoint(run, stage, name)
    mgr = CheckpointManager(run, keep_last=2, rank=0, world_size=1)
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="parameter name") as err:
        mgr.to_universal(tag)
    assert repr(name) in str(err.value)
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert not Path("/tmp/plm-escaped-param").exists()


# --- torch.load ------------------------------------------------------------------------------


def test_every_torch_load_in_the_package_says_weights_only():
    """Not left to torch's default (which an environment variable can turn off): each
    ``torch.load`` call in pipeline/ passes ``weights_only=True``."""
    missing = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if not (isinstance(node, ast.Call) and isinstance(func, ast.Attribute)):
                continue
            if func.attr == "load" and getattr(func.value, "id", None) == "torch":
                given = {k.arg: k.value for k in node.keywords}
                value = given.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing


def test_a_tokenizer_listing_with_a_dotdot_key_writes_nothing_outside_the_cache(s3, tmp_path):
    """An object store may hold a key ``tokenizer/../../x`` (S3 keys are plain strings): its
    copy into the node cache would land outside the cache's tokenizer folder."""
    import boto3
    from test_remote_data import make_blocky_dir

    from pipeline.data.remote import CacheConfig

    uri = s3.upload(make_blocky_dir(tmp_path / "data", n_docs=10, n_shards=1))
    bucket, key = uri[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"{key}/tokenizer/../../../../escaped.json", Body=b"{}")
    cache = tmp_path / "cache"
    d = DataDir(uri, CacheConfig(str(cache), 1 << 30, 2))
    with pytest.raises(ShardError, match="not a plain name") as err:
        _ = d.tokenizer_path  # its download into the cache is what is refused
    assert "../../../../escaped.json" in str(err.value)
    assert not list(tmp_path.rglob("escaped.json"))


def test_a_checkpoint_holding_a_link_out_of_it_is_not_read(tmp_path):
    """Resuming (CheckpointManager.load) and evaluating (checkpoint_bundle) a checkpoint
    whose config.yaml is a link to a file elsewhere: refused before anything is read."""
    from pipeline.eval.checkpoint_bundle import checkpoint_meta
    from pipeline.eval.suite import EvalError
    from pipeline.train.checkpoint import CheckpointError, CheckpointManager

    run = tmp_path / "run"
    tag = _crafted_checkpoint(run, 0, "w")
    folder = run / "checkpoints" / tag
    (tmp_path / "elsewhere.yaml").write_text("name: elsewhere\n")
    (folder / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    with pytest.raises(EvalError, match="outside the checkpoint") as err:
        checkpoint_meta(folder)
    assert str(folder / "config.yaml") in str(err.value)
    mgr = CheckpointManager(run, keep_last=2, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        mgr.load(engine=None, tag=tag)


# --- store keys: a run on a store mirrored or fetched into a local folder ---------------------

ESCAPED = "../../../../escaped"  # from <tag>/<sub>/ up to the test's own tmp_path


def _put_key(s3, uri: str, rel: str, body: bytes = b"{}") -> None:
    """An object at ``uri/rel`` exactly as given (S3 keys are plain strings: '..' stays)."""
    import boto3

    bucket, key = uri[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"{key}/{rel}", Body=body)


def test_a_store_key_leading_out_of_the_staging_folder_is_refused(s3, tmp_path):
    """train.out_dir on a store: a resume lists a checkpoint's universal/ files and fetches
    them into this node's staging folder; a key ``universal/../../../../escaped`` would land
    outside it. Refused by the listing and by the fetch, naming the key; nothing written."""
    from pipeline.train.checkpoint import CheckpointManager
    from pipeline.train.out_store import OutStore

    uri, tag = s3.prefix("run"), "step00000001"
    _put_key(s3, uri, f"checkpoints/{tag}/COMPLETE", json.dumps({"step": 1}).encode())
    bad = f"checkpoints/{tag}/universal/{ESCAPED}"
    _put_key(s3, uri, bad)
    store = OutStore.open(uri, str(tmp_path / "stage"), rank=0, local_rank=0)
    mgr = CheckpointManager(store, keep_last=2, rank=0, world_size=1)
    reads = (lambda: store.list_files(f"checkpoints/{tag}/universal"),
             lambda: store.fetch([f"checkpoints/{tag}/COMPLETE", bad]),
             lambda: mgr.fetch_for_load(tag, universal=True, rank_file=0))  # fmt: skip
    for read in reads:
        with pytest.raises(ConfigError, match="not a plain path inside the run") as err:
            read()
        assert repr(bad) in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.rglob("escaped")) and not list(tmp_path.rglob("COMPLETE"))
    store.close()


def test_a_run_on_a_store_mirrored_for_eval_writes_nothing_outside_the_mirror(s3, tmp_path):
    """`plm eval --models s3://.../run`: a complete checkpoint whose listing holds a key
    ``../../../../escaped`` is refused with one EvalError naming the key, before it is
    written beside (outside) the mirror."""
    from pipeline.eval.store_run import StoreMirror
    from pipeline.eval.suite import EvalError

    uri, tag = s3.prefix("run"), "step00000001"
    _put_key(s3, uri, f"checkpoints/{tag}/config.yaml", b"name: x\n")
    _put_key(s3, uri, f"checkpoints/{tag}/COMPLETE", json.dumps({"step": 1}).encode())
    bad = f"checkpoints/{tag}/{ESCAPED[3:]}"  # from <tag>/ to tmp_path
    _put_key(s3, uri, bad)
    mirror = StoreMirror(uri, tmp_path)
    with pytest.raises(EvalError, match="not a plain path inside the run") as err:
        mirror.sync()
    assert repr(bad) in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.rglob("escaped"))
    assert not (mirror.local / "checkpoints" / tag / "COMPLETE").exists()


# --- bundles: their own files (config.yaml, the tokenizer) as links ---------------------------

BUNDLE_OWN = ("config.yaml", "tokenizer.json", "tokenizer_meta.json")


def _link_out(bundle: Path, outside: Path, name: str) -> Path:
    """The bundle's file ``name`` moved out of it and linked back: valid, read only
    through the link."""
    shutil.move(bundle / name, outside / name)
    (bundle / name).symlink_to(outside / name)
    return outside / name


def _bundle_readers() -> dict:
    """Every reader of a bundle, each given the bundle folder."""
    from pipeline.eval.intrinsic import check_coverage
    from pipeline.eval.sources import read_arch, resolve_candidates
    from pipeline.finetune.source import ModelSource, load_backbone
    from pipeline.generate import generate_text
    from pipeline.models.bundle import load_bundle, read_bundle_config, special_ids
    from pipeline.neighbors import neighbors

    return {
        "load_bundle": load_bundle,
        "read_bundle_config": read_bundle_config,
        "special_ids": special_ids,
        "finetune": lambda b: load_backbone(ModelSource(b, str(b))),
        "neighbors": lambda b: neighbors(b, "the"),
        "generate": lambda b: generate_text(str(b), "the", max_new_tokens=1),
        "eval_arch": read_arch,
        "eval_candidates": lambda b: resolve_candidates([str(b)], b.parent / "work", None),
        "eval_coverage": lambda b: check_coverage("similarity", "t", _no_rows(b), b),
    }


def _no_rows(bundle: Path) -> str:
    rows = bundle.parent / "rows.jsonl"
    rows.write_text("", encoding="utf-8")
    return str(rows)


@pytest.mark.parametrize("name", BUNDLE_OWN)
def test_a_bundle_file_linked_out_of_the_bundle_is_refused_by_every_reader(
    sharded_bundle, tmp_path, name
):
    bundle, outside = _copy_bundle(sharded_bundle, tmp_path)
    target = _link_out(bundle, outside, name)
    for reader, read in _bundle_readers().items():
        with pytest.raises(ConfigError, match="outside the bundle") as err:
            read(bundle)
        text = str(err.value)
        assert str(bundle / name) in text and str(target) in text, (reader, text)


def test_export_of_a_bundle_whose_tokenizer_is_a_link_out_is_one_line(
    sharded_bundle, tmp_path, capsys
):
    from pipeline.cli import main

    for name in BUNDLE_OWN:
        bundle, outside = _copy_bundle(sharded_bundle, tmp_path / name)
        target = _link_out(bundle, outside, name)
        out = tmp_path / name / "hf"
        assert main(["export", "--to", "hf", str(bundle), str(out)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("plm: ") and str(target) in line, line
        assert not out.exists()


def _finetuned(bundle: Path, out: Path) -> Path:
    """A fine-tuned folder (finetune.yaml, head.safetensors, backbone/) around ``bundle``."""
    from safetensors.torch import save_file

    from pipeline.finetune.source import BACKBONE_DIR, FINETUNE_FILE, HEAD_FILE, build_task_model
    from pipeline.models.bundle import load_bundle

    meta = {"task": {"type": "classification"}, "mode": "full", "labels": ["a", "b"]}
    backbone, _ = load_bundle(bundle)
    head = {k: v for k, v in build_task_model(backbone, meta).state_dict().items()
            if not k.startswith("backbone.")}  # fmt: skip
    out.mkdir(parents=True)
    shutil.copytree(bundle, out / BACKBONE_DIR)
    save_file(head, str(out / HEAD_FILE))
    (out / FINETUNE_FILE).write_text(json.dumps({"format_version": 1, **meta}))
    return out


@pytest.mark.parametrize("name", ["finetune.yaml", "head.safetensors", "backbone"])
def test_a_finetuned_folder_whose_part_is_a_link_out_is_not_read(sharded_bundle, tmp_path, name):
    from pipeline.finetune.source import load_finetuned

    folder = _finetuned(sharded_bundle, tmp_path / "ft")
    load_finetuned(folder)  # the crafting is sound: it loads
    outside = tmp_path / "outside"
    outside.mkdir()
    target = _link_out(folder, outside, name)
    with pytest.raises(ConfigError, match="outside") as err:
        load_finetuned(folder)
    assert str(folder / name) in str(err.value) and str(target) in str(err.value)


# --- plm train --dry-run: a checkpoint that cannot be resumed ---------------------------------


def test_dry_run_with_latest_naming_an_incomplete_checkpoint_is_one_line(
    tiny_data, tmp_path, monkeypatch, capsys
):
    """`latest` names a tag whose COMPLETE is missing: the dry run says so in one `plm:` line,
    exit 2 (a checkpoint error, as `plm train` without --dry-run), no traceback."""
    from pipeline.cli import main

    run = tmp_path / "run"
    (run / "checkpoints" / "step00000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step00000002")
    monkeypatch.chdir(tmp_path)
    argv = ["train", str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={tiny_data}",
            f"train.out_dir={run}", "--dry-run"]  # fmt: skip
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("plm: ") and "step00000002" in line and "COMPLETE" in line, line
