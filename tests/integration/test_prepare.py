"""`plm data prepare` end to end on tiny corpora, with a real (local) Ray and a real tokenizer."""

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import main
from pipeline.data.shards import DataDir, ShardError, block_sample
from pipeline.errors import ConfigError
from pipeline.prepare import job
from pipeline.prepare import prepare as prep
from pipeline.prepare.config import PrepareConfig, load_prepare_config
from pipeline.prepare.inspect import inspect_data
from pipeline.prepare.prepare import PrepareError, foreign_files, run_prepare
from pipeline.prepare.readers import InputError
from pipeline.prepare.tokenizer import TokenizerSpec, load_tokenizer, train_tokenizer

pytestmark = pytest.mark.slow

WORDS = (
    "the model reads text and learns which word comes next while the data stage "
    "writes shards that every objective can use again and again without a new pass"
).split()


def paragraph(i: int, n_sent: int = 3) -> str:
    """A distinct, deterministic document of a few sentences."""
    rng = np.random.default_rng(i)
    sents = []
    for _ in range(n_sent):
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), 8)]
        sents.append(" ".join(words).capitalize() + f" number {i}.")
    return " ".join(sents)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(paragraph(i) for i in range(200)), encoding="utf-8")
    spec = TokenizerSpec(kind="wordpiece", vocab_size=300, sample_docs=1000)
    return train_tokenizer([str(corpus)], spec, root / "wordpiece")


@pytest.fixture
def corpus(tmp_path):
    """Two sources: a txt (blank-line separated) and a jsonl."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(paragraph(i) for i in range(40)) + "\n", "utf-8")
    lines = [json.dumps({"text": paragraph(100 + i, n_sent=12)}) for i in range(20)]
    (src / "b.jsonl").write_text("\n".join(lines) + "\n", "utf-8")
    return src


def config(inputs, tokenizer_dir, output, **kw) -> PrepareConfig:
    kw.setdefault("shard_docs", 7)
    kw.setdefault("valid_fraction", 0.2)
    kw.setdefault("max_doc_tokens", 64)
    return PrepareConfig(
        inputs=[str(i) for i in inputs], tokenizer=str(tokenizer_dir), output=str(output), **kw
    )


def shard_bytes(root) -> dict[str, bytes]:
    """Every file but the manifest (whose ``stats`` are the run's timings)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


KEY = re.compile(r"u\d{6}[tv]\d{3}-\d{5}-\d+")  # unit, split, part - block - document
NUMBER = re.compile(r"number (\d+)")


def numbers(data: DataDir, split: str) -> list[int]:
    """The paragraph number of every document (piece) of a split, in shard order."""
    tok, _ = load_tokenizer(data.root / "tokenizer")
    return [int(NUMBER.search(tok.decode(d.tokens.tolist())).group(1))
            for d in data.iter_split(split)]  # fmt: skip


def test_prepare_writes_a_valid_data_dir(ray_local, corpus, tokenizer_dir, tmp_path, capsys):
    out = run_prepare(config([corpus], tokenizer_dir, tmp_path / "data"))
    data = DataDir(out)
    assert data.verify() == []
    m = data.manifest
    assert m["format_version"] == 3 and m["token_dtype"] == "uint16"
    assert m["tokenizer"]["fingerprint"] == load_tokenizer(tokenizer_dir)[1]["sha256"]
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (
        tokenizer_dir / "tokenizer.json"
    ).read_bytes()
    assert [s["uri"].rsplit("/", 1)[1] for s in m["sources"]] == ["a.txt", "b.jsonl"]
    for s in m["sources"]:  # read whole: one digest, the file's sha256, hashed by a task
        stored = Path(s["uri"]).read_bytes()
        assert s["size"] == len(stored) and s["mtime_ns"] == Path(s["uri"]).stat().st_mtime_ns
        assert s["digests"] == [
            {"bytes": [0, len(stored)], "sha256": hashlib.sha256(stored).hexdigest()}
        ]
    assert m["totals"]["documents_read"] == 60 and m["totals"]["documents_kept"] == 60
    # Long jsonl documents (12 sentences) were split into pieces of <= 64 tokens.
    docs = [d for split in ("train", "valid") for d in data.iter_split(split)]
    assert len(docs) == m["totals"]["n_docs"] > 60
    assert max(d.n_tokens for d in docs) <= 64
    assert sum(d.n_tokens for d in docs) == m["totals"]["n_tokens"]
    assert all(KEY.fullmatch(d.key) for d in docs)
    for split in ("train", "valid"):
        order = numbers(data, split)  # a.txt holds paragraphs 0-39, b.jsonl 100-119
        assert order == sorted(order)  # source order
        assert m["splits"][split]["n_docs"] == len(order) > 0
        assert all(info["n_docs"] <= 7 for info in m["splits"][split]["shards"])
    doc = docs[0]
    assert doc.tokens.dtype == np.uint16 and doc.sents[-1] == doc.n_tokens and doc.words[0] == 0
    assert doc.meta["language"] == "other" and doc.meta["source"].endswith("a.txt")
    capsys.readouterr()
    assert inspect_data(out, verify=True) == 0
    shown = capsys.readouterr().out
    assert "train" in shown and "valid" in shown and "verify       ok" in shown
    assert f"sha256 {m['sources'][0]['digests'][0]['sha256'][:16]}" in shown


def test_rerun_is_up_to_date_and_force_rebuilds_identical_bytes(
    ray_local, corpus, tokenizer_dir, tmp_path, capsys
):
    first = run_prepare(config([corpus], tokenizer_dir, tmp_path / "one"))
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    capsys.readouterr()
    run_prepare(config([corpus], tokenizer_dir, tmp_path / "one"))
    assert "up to date" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == before
    # Another dir, other execution settings (tiny encode batches): the same bytes.
    second = run_prepare(config([corpus], tokenizer_dir, tmp_path / "two", batch_docs=3))
    assert shard_bytes(first) == shard_bytes(second)
    # An input written again (a new modification time) is another input: not up to date.
    source = Path(DataDir(first).manifest["sources"][0]["uri"])
    later = source.stat().st_mtime_ns + 1_000_000_000
    os.utime(source, ns=(later, later))
    with pytest.raises(PrepareError, match="other inputs"):
        run_prepare(config([corpus], tokenizer_dir, tmp_path / "one"))


def test_the_up_to_date_check_lists_the_inputs_and_never_reads_them(tmp_path):
    """The driver's fingerprint costs a listing, not a pass over a TB of input: bytes
    rewritten under the same size and modification time give the same fingerprint (the
    documented blind spot, `--force` rebuilds); a new modification time another one."""
    from pipeline.prepare.readers import resolve_inputs

    path = tmp_path / "a.txt"
    path.write_text("one document\n\nanother one\n")
    stat = path.stat()

    def fp() -> str:
        return prep.fingerprint("cfg", prep._source_entries(resolve_inputs([str(path)])), "tok")

    before = fp()
    path.write_bytes(b"X" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fp() == before
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert fp() != before
    # A filesystem that reports no modification time: the content identifies the source.
    [source] = resolve_inputs([str(path)])
    [entry] = prep._source_entries([dataclasses.replace(source, mtime_ns=None)])
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_changed_config_over_existing_dir_needs_force(ray_local, corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "data"
    run_prepare(config([corpus], tokenizer_dir, out))
    with pytest.raises(PrepareError, match="--force"):
        run_prepare(config([corpus], tokenizer_dir, out, valid_fraction=0.5))
    run_prepare(config([corpus], tokenizer_dir, out, valid_fraction=0.5, force=True))
    assert DataDir(out).manifest["data_config"]["valid_fraction"] == 0.5
    assert DataDir(out).verify() == []


def test_killed_run_is_completed_by_the_next_run(ray_local, corpus, tokenizer_dir, tmp_path):
    reference = run_prepare(config([corpus], tokenizer_dir, tmp_path / "ref"))
    out = run_prepare(config([corpus], tokenizer_dir, tmp_path / "data"))
    # What a kill leaves: no manifest, a truncated shard, temp files, a stale extra shard.
    (out / "manifest.json").unlink()
    shard = out / "train/shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:1000])
    (out / "train/shard-000002.tar.tmp").write_bytes(b"partial")
    (out / "train/shard-000099.tar").write_bytes(b"stale")
    with pytest.raises(ShardError):
        DataDir(out)  # without a manifest nothing reads it as finished
    run_prepare(config([corpus], tokenizer_dir, out))  # no --force needed
    assert DataDir(out).verify() == []
    assert shard_bytes(out) == shard_bytes(reference)


def test_dedup_keeps_the_first_occurrence_in_source_order(ray_local, tokenizer_dir, tmp_path):
    dup = paragraph(7)
    a = tmp_path / "in/a.txt"
    a.parent.mkdir()
    a.write_text("\n\n".join([dup, paragraph(1), dup, paragraph(2)]), "utf-8")
    b = tmp_path / "in/b.txt"
    b.write_text("\n\n".join([paragraph(3), dup]), "utf-8")
    out = run_prepare(config([a, b], tokenizer_dir, tmp_path / "data", valid_fraction=0.0))
    data = DataDir(out)
    assert data.manifest["rejected"] == {"duplicate": 2}
    examples = data.manifest["reject_examples"]["duplicate"]
    assert [(e["source"].rsplit("/", 1)[1], e["ordinal"]) for e in examples] == [
        ("a.txt", 2),
        ("b.txt", 1),
    ]
    assert numbers(data, "train") == [7, 1, 2, 3]


def test_rejects_are_counted_by_reason(ray_local, tokenizer_dir, tmp_path):
    good = [paragraph(i) for i in range(4)]
    raw = (
        good[0].encode()
        + b"\n\nbad \xff\xfe bytes in this document here\n\n"
        + b"short\n\n"
        + good[1].encode()
        + b"\n\n"
        + good[0].encode()
    )
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_bytes(raw)
    jsonl = [
        json.dumps({"text": good[2]}),
        json.dumps({"text": ""}),
        json.dumps({"other": "x"}),
        "{not json",
        json.dumps({"text": good[3]}),
    ]
    (tmp_path / "in/b.jsonl").write_text("\n".join(jsonl) + "\n", "utf-8")
    out = run_prepare(config([tmp_path / "in"], tokenizer_dir, tmp_path / "data"))
    m = DataDir(out).manifest
    assert m["rejected"] == {
        "bad_json": 1,
        "duplicate": 1,
        "invalid_utf8": 1,
        "no_text": 1,
        "too_short": 2,  # "short" and the empty string
    }
    assert m["totals"]["documents_read"] == 10 and m["totals"]["documents_kept"] == 4
    assert m["reject_examples"]["invalid_utf8"][0]["line"] == 3


def test_foreign_files_are_refused_before_ray(corpus, tokenizer_dir, tmp_path, monkeypatch):
    out = tmp_path / "data"
    (out / "train").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "train/readme.md").write_text("mine")
    assert foreign_files(*prep.output_fs(str(out))) == ["notes.txt", "train/readme.md"]
    monkeypatch.setattr(job, "init_ray", _ray_must_not_start)
    with pytest.raises(PrepareError, match=r"notes\.txt, train/readme\.md"):
        run_prepare(config([corpus], tokenizer_dir, out))


def _ray_must_not_start(*args):
    raise AssertionError("Ray was started before validation finished")


def test_force_leaves_foreign_files_in_place(ray_local, corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    run_prepare(config([corpus], tokenizer_dir, out, force=True))
    assert (out / "notes.txt").read_text() == "mine" and DataDir(out).verify() == []


def test_missing_input_is_named_before_ray_starts(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(job, "init_ray", _ray_must_not_start)
    missing = tmp_path / "nope" / "corpus.txt"
    with pytest.raises(InputError, match=re.escape(str(missing))):
        run_prepare(config([missing], tokenizer_dir, tmp_path / "data"))
    good = tmp_path / "good.txt"
    good.write_text(paragraph(1), "utf-8")
    with pytest.raises(InputError, match="tokenizer folder"):
        run_prepare(config([good], tmp_path / "no-tok", tmp_path / "d"))
    # through the CLI: exit code 2 and the path on stderr
    assert main(["data", "prepare", "--input", str(missing), "--tokenizer", str(tokenizer_dir),
                 "--output", str(tmp_path / "data")]) == 2  # fmt: skip


def test_a_tokenizer_file_is_taken_as_its_folder(tokenizer_dir, corpus, tmp_path, monkeypatch,
                                                 capsys):  # fmt: skip
    """`--tokenizer tok/tokenizer.json` (or tokenizer_meta.json) means the folder `tok`; it
    was "tokenizer folder tok/tokenizer.json does not exist". Any other file: one `plm:`
    line saying to pass the folder, before Ray."""
    monkeypatch.setattr(job, "init_ray", _ray_must_not_start)
    for name in ("tokenizer.json", "tokenizer_meta.json"):
        assert config([corpus], tokenizer_dir / name, tmp_path / "d").tokenizer == str(
            tokenizer_dir
        )
    args = ["data", "prepare", "--input", str(corpus), "--output", str(tmp_path / "data")]
    assert main([*args, "--tokenizer", str(tokenizer_dir / "tokenizer.json"), "--dry-run"]) == 0
    assert f"tokenizer       {tokenizer_dir}: wordpiece" in capsys.readouterr().out
    other = corpus / "a.txt"
    for extra in (["--dry-run"], []):
        assert main([*args, "--tokenizer", str(other), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"plm: tokenizer folder {other} is a file"), err
        assert "pass the folder that holds tokenizer.json and tokenizer_meta.json" in err[0]
    assert not (tmp_path / "data").exists()


def test_parquet_without_the_text_column_names_the_columns(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(job, "init_ray", _ray_must_not_start)
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a b c"], "id": [1]}), path)
    with pytest.raises(InputError, match=r"no column 'text'.*\['body', 'id'\]"):
        run_prepare(config([path], tokenizer_dir, tmp_path / "data"))


def test_parquet_with_text_field(ray_local, tokenizer_dir, tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": [paragraph(i) for i in range(10)]}), path)
    out = run_prepare(config([path], tokenizer_dir, tmp_path / "data", text_field="body"))
    assert DataDir(out).manifest["totals"]["documents_kept"] == 10


def test_valid_split_is_stable_when_shard_size_changes(ray_local, corpus, tokenizer_dir, tmp_path):
    small = DataDir(run_prepare(config([corpus], tokenizer_dir, tmp_path / "s", shard_docs=3)))
    large = DataDir(
        run_prepare(
            config([corpus], tokenizer_dir, tmp_path / "l", shard_docs=None, shard_bytes=1 << 20)
        )
    )
    assert len(small.shards("train")) > len(large.shards("train")) == 1
    for split in ("train", "valid"):
        assert numbers(small, split) == numbers(large, split)
    assert small.manifest["data_config_hash"] != large.manifest["data_config_hash"]


def test_large_vocabulary_gives_uint32_tokens(ray_local, tokenizer_dir, tmp_path):
    # The tiny tokenizer plus 70,000 added words: ids above 65535 occur in the text.
    tok, meta = load_tokenizer(tokenizer_dir)
    tok.add_tokens([f"zzword{i}" for i in range(70_000)])
    big = tmp_path / "big-tok"
    big.mkdir()
    data = tok.to_str().encode()
    (big / "tokenizer.json").write_bytes(data)
    import hashlib

    meta = {
        **meta,
        "vocab_size": tok.get_vocab_size(True),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (big / "tokenizer_meta.json").write_text(json.dumps(meta))
    (tmp_path / "c.txt").write_text(paragraph(1) + " zzword69999 end.\n\n" + paragraph(2), "utf-8")
    out = run_prepare(config([tmp_path / "c.txt"], big, tmp_path / "data", valid_fraction=0.0))
    data_dir = DataDir(out)
    assert data_dir.manifest["token_dtype"] == "uint32"
    doc = next(data_dir.iter_split("train"))
    assert (
        doc.tokens.dtype == np.uint32
        and int(doc.tokens.max()) == tok.token_to_id("zzword69999") > 65535
    )


def test_cli_with_yaml_config_and_flag_overrides(ray_local, corpus, tokenizer_dir, tmp_path):
    cfg = tmp_path / "data.yaml"
    cfg.write_text(
        f"inputs: [{corpus}]\ntokenizer: {tokenizer_dir}\noutput: {tmp_path / 'yaml-out'}\n"
        "shard_bytes: 100000\nvalid_fraction: 0.1\nclean: {min_chars: 20}\n"
    )
    assert main(["data", "prepare", "--config", str(cfg), "--shard-docs", "5"]) == 0
    m = DataDir(tmp_path / "yaml-out").manifest
    assert m["data_config"]["shard_docs"] == 5 and m["data_config"]["shard_bytes"] is None
    assert (
        m["data_config"]["valid_fraction"] == 0.1 and m["data_config"]["clean"]["min_chars"] == 20
    )


def test_config_errors_name_the_key(tmp_path):
    cfg = tmp_path / "data.yaml"
    cfg.write_text("inputs: [x]\ntokenizer: t\noutput: o\nshard_dcos: 5\n")
    with pytest.raises(ConfigError, match="shard_dcos"):
        load_prepare_config(cfg, {})
    with pytest.raises(ConfigError, match="--output"):
        load_prepare_config(None, {"inputs": ["x"], "tokenizer": "t"})
    with pytest.raises(ConfigError, match="clean.min_chars"):
        load_prepare_config(None, {"inputs": ["x"], "tokenizer": "t", "output": "o",
                                        "clean": {"min_chars": -1}})  # fmt: skip


def test_block_samples_are_the_bytes_webdataset_writes(tmp_path):
    import webdataset as wds

    members = {"tokens.npy": b"\x93NUMPY" + bytes(range(200)), "meta.json": b'{"a": "\xe7"}',
               "docs.npy": b"x" * 513, "words.npy": b""}  # fmt: skip
    reference = tmp_path / "reference.tar"
    with open(reference, "wb") as f:
        tar = wds.TarWriter(f, user="", group="", mode=0o644, mtime=0)
        for key in ("u000000t000-00000", "u000000t000-00001"):
            tar.write({"__key__": key, **members})
        tar.close()
    ours = b"".join(block_sample(k, members)[0] for k in ("u000000t000-00000", "u000000t000-00001"))
    assert reference.read_bytes()[: len(ours)] == ours


def test_entity_list_writes_spans(ray_local, corpus, tokenizer_dir, tmp_path):
    entities = tmp_path / "entities.txt"
    entities.write_text("# entities of the toy corpus\nnumber 7\nshards\n\n", encoding="utf-8")
    out = run_prepare(config([corpus], tokenizer_dir, tmp_path / "data", entities=str(entities)))
    data = DataDir(out)
    tok, _ = load_tokenizer(out / "tokenizer")
    mentions = 0
    for split in ("train", "valid"):
        for doc in data.iter_split(split):
            assert doc.spans is not None and doc.spans.shape[1] == 2
            for a, b in doc.spans:
                assert tok.decode(doc.tokens[a:b].tolist()) in {"number 7", "shards"}
                mentions += 1
    assert mentions > 5
    settings = json.loads((out / "manifest.json").read_text())["data_config"]
    assert len(settings["entities_sha256"]) == 64
    # ERNIE's entity stage on these very spans: every mention masked whole or not at all.
    from pipeline.config import ObjectiveSection
    from pipeline.objectives import Piece, Unit, build_objective

    meta = json.loads((out / "tokenizer/tokenizer_meta.json").read_text())
    cfg = ObjectiveSection(kind="ernie", ernie={"nsp": False, "stages": [
        {"masking": "entity", "until": 1.0}]})  # fmt: skip
    ernie = build_objective(cfg, meta["roles"], meta["vocab_size"], 128)
    ernie.total_batches = 1
    whole = 0
    for d, doc in enumerate(data.iter_split("train")):
        for seed in range(20):
            unit = Unit(key=(d, 0), pieces=(Piece(d, 0, doc.n_tokens),))
            ex = ernie.make_example(unit, [doc], np.random.default_rng([seed, d]), position=0)
            selected = ex["mlm_labels"][1 : 1 + doc.n_tokens] >= 0  # [CLS] doc [SEP]
            for a, b in doc.spans.tolist():
                assert selected[a:b].all() or not selected[a:b].any()
                whole += int(selected[a:b].all())
    assert whole > 20
    # Without the list: no spans.npy at all.
    plain = run_prepare(config([corpus], tokenizer_dir, tmp_path / "plain"))
    assert all(d.spans is None for d in DataDir(plain).iter_split("train"))


def test_bad_entity_list_fails_before_ray_naming_the_line(corpus, tokenizer_dir, tmp_path):
    bad = tmp_path / "entities.txt"
    bad.write_bytes(b"Paris\nBerlin\n\xff\xfe broken\n")
    with pytest.raises(InputError, match=r"entities.txt line 3 is not valid UTF-8"):
        run_prepare(config([corpus], tokenizer_dir, tmp_path / "data", entities=str(bad)))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n", encoding="utf-8")
    with pytest.raises(InputError, match="holds no entity"):
        run_prepare(config([corpus], tokenizer_dir, tmp_path / "data", entities=str(empty)))
    assert not (tmp_path / "data").exists()


def tokens_of(data: DataDir) -> dict[str, list[list[int]]]:
    return {s: [d.tokens.tolist() for d in data.iter_split(s)] for s in ("train", "valid")}


def test_one_large_file_is_read_by_several_tasks(ray_local, tokenizer_dir, tmp_path):
    from pipeline.prepare.job import plan_units
    from pipeline.prepare.readers import resolve_inputs

    big = tmp_path / "big.txt"
    big.write_text("\n\n\n".join(paragraph(i) for i in range(120)) + "\n", "utf-8")
    units = plan_units(resolve_inputs([str(big)]), 2000)
    assert len(units) >= 5 and all(len(u) == 1 and u[0].source == 0 for u in units)
    whole = DataDir(run_prepare(config([big], tokenizer_dir, tmp_path / "whole")))
    cut = DataDir(run_prepare(config([big], tokenizer_dir, tmp_path / "cut", split_bytes=2000)))
    assert cut.manifest["stats"]["units"] == len(units)
    assert whole.manifest["stats"]["units"] == 1
    assert numbers(cut, "train") == numbers(whole, "train") == sorted(numbers(whole, "train"))
    assert tokens_of(cut) == tokens_of(whole)
    assert cut.manifest["totals"]["documents_read"] == 120
    # Each task hashed its own range; the ranges tile the file.
    stored = big.read_bytes()
    digests = cut.manifest["sources"][0]["digests"]
    assert len(digests) == len(units) and digests[-1]["bytes"][1] == len(stored)
    for d, nxt in zip(digests, digests[1:] + [None], strict=True):
        start, end = d["bytes"]
        assert d["sha256"] == hashlib.sha256(stored[start:end]).hexdigest()
        assert nxt is None or nxt["bytes"][0] == end


def test_dedup_is_the_same_across_units_and_partitions(
    ray_local, tokenizer_dir, tmp_path, monkeypatch
):
    """Duplicates in other units (and other files), found the same with 1 or 3 reducers:
    the first occurrence in source order wins."""
    from pipeline.prepare import dedup

    dup_a, dup_b = paragraph(7), paragraph(8)
    a = tmp_path / "in/a.txt"
    a.parent.mkdir()
    docs = [paragraph(i) for i in range(30)]
    docs[20], docs[25] = dup_a, dup_b  # 7 and 8 again, far later in the same file
    a.write_text("\n\n".join(docs) + "\n", "utf-8")
    (tmp_path / "in/b.txt").write_text(f"{dup_b}\n\n{paragraph(40)}\n\n{dup_a}\n", "utf-8")
    outs = []
    for n in (1, 3):
        monkeypatch.setattr(dedup, "n_partitions", lambda _bytes, n=n: n)
        cfg = config([tmp_path / "in"], tokenizer_dir, tmp_path / f"p{n}", split_bytes=1500)
        outs.append(DataDir(run_prepare(cfg)))
    one, three = outs
    assert one.manifest["stats"]["dedup_partitions"] == 1
    assert three.manifest["stats"]["dedup_partitions"] == 3
    assert one.manifest["stats"]["units"] >= 4
    assert one.manifest["rejected"] == three.manifest["rejected"] == {"duplicate": 4}
    assert shard_bytes(one.root / "train") == shard_bytes(three.root / "train")
    kept = sorted(numbers(one, "train") + numbers(one, "valid"))
    assert kept == [i for i in range(30) if i not in (20, 25)] + [40]


def test_duplicates_found_after_the_write_are_dropped_from_its_parts(
    ray_local, tokenizer_dir, tmp_path
):
    """The write tasks write every document; the duplicates found afterwards are dropped
    from the parts that hold them (tests/unit/test_prepare_dedup.py: the same bytes as a
    write that never saw them). End to end: the kept documents are the corpus without
    its repeats, in order, pieces of long documents included; a document that gives no
    token is ``no_tokens`` and its repeat a ``duplicate``; the data dir verifies."""
    no_tokens = "\ufffd" * 20  # BertNormalizer drops U+FFFD: no token at all
    originals = [paragraph(i, n_sent=12 if i % 5 == 0 else 3) for i in range(60)]
    originals[13] = no_tokens
    repeats = {3: 0, 9: 2, 21: 5, 30: 13, 38: 20, 44: 5, 52: 41, 58: 10, 59: 57}
    with_repeats = []
    for i, doc in enumerate(originals):
        with_repeats.append(doc)
        if i in repeats:
            with_repeats.append(originals[repeats[i]])
    kw = {"split_bytes": 2500, "block_tokens": 50, "shard_docs": 6}
    (tmp_path / "a").mkdir()
    (tmp_path / "a/c.txt").write_text("\n\n".join(with_repeats) + "\n", "utf-8")
    (tmp_path / "b").mkdir()
    (tmp_path / "b/c.txt").write_text("\n\n".join(originals) + "\n", "utf-8")
    dups = DataDir(
        run_prepare(config([tmp_path / "a/c.txt"], tokenizer_dir, tmp_path / "dups", **kw))
    )
    never = DataDir(
        run_prepare(config([tmp_path / "b/c.txt"], tokenizer_dir, tmp_path / "never", **kw))
    )
    m, ref = dups.manifest, never.manifest
    assert m["stats"]["units"] >= 5 and m["stats"]["units_rewritten_for_duplicates"] >= 4
    assert ref["stats"]["units_rewritten_for_duplicates"] == 0
    assert m["rejected"] == {"duplicate": len(repeats), "no_tokens": 1}
    assert ref["rejected"] == {"no_tokens": 1}
    for split in ("train", "valid"):
        assert numbers(dups, split) == numbers(never, split) != []
    for key in ("n_docs", "n_tokens", "documents_kept", "languages"):
        assert m["totals"][key] == ref["totals"][key], key
    assert m["totals"]["documents_read"] == ref["totals"]["documents_read"] + len(repeats)
    assert dups.verify() == [] and inspect_data(dups.root, verify=True) == 0
    left = [p.name for split in ("train", "valid") for p in (dups.root / split).iterdir()]
    assert all(name.startswith("shard-") for name in left)  # the replaced parts are gone
    # Each example names a repeat: its slice's document at that ordinal came before.
    data = (tmp_path / "a/c.txt").read_bytes()
    examples = m["reject_examples"]["duplicate"]
    assert len(examples) == 5

    def place(e):  # (the document an example names, its index in the corpus)
        before = data[: e.get("from_byte", 0)].decode().count("\n\n")
        docs = data[e.get("from_byte", 0) :].decode().split("\n\n")
        return docs[e["ordinal"]].strip(), before + e["ordinal"]

    for e in examples:
        doc, at = place(e)
        assert with_repeats.index(doc) < at
    [example] = m["reject_examples"]["no_tokens"]  # the first one, not its repeat
    assert place(example) == (no_tokens, with_repeats.index(no_tokens))


def test_an_unusable_output_uri_is_refused_before_ray(corpus, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(job, "init_ray", _ray_must_not_start)
    # a StoreError (the store's check, before any work), a ConfigError as PrepareError is
    with pytest.raises(ConfigError, match=r"--output=nosuch://bucket/data: not a usable"):
        run_prepare(config([corpus], tokenizer_dir, "nosuch://bucket/data"))


def test_a_truncated_gzip_is_a_counted_reject_and_the_other_inputs_are_kept(
    ray_local, tokenizer_dir, tmp_path, capsys
):
    """A .jsonl.gz cut in the middle: its documents before the break are kept, the break
    is one ``truncated`` reject naming the file (and a warning line), the other input is
    read whole."""
    import gzip

    lines = [json.dumps({"text": paragraph(i)}) + "\n" for i in range(400)]
    packed = gzip.compress("".join(lines).encode())
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(packed[: len(packed) // 2])
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(paragraph(i) for i in range(1000, 1040)) + "\n")
    data = DataDir(run_prepare(config([bad, other], tokenizer_dir, tmp_path / "data")))
    m = data.manifest
    assert m["rejected"] == {"truncated": 1}
    [example] = m["reject_examples"]["truncated"]
    assert example["source"] == str(bad) and "breaks off" in example["detail"]
    read = {s["uri"].rsplit("/", 1)[1]: s for s in m["sources"]}
    assert read["other.txt"]["n_docs_kept"] == 40
    kept_cut = read["cut.jsonl.gz"]["n_docs_kept"]
    assert 100 < kept_cut < 400 and read["cut.jsonl.gz"]["n_docs_read"] == kept_cut + 1
    kept = set(numbers(data, "train") + numbers(data, "valid"))
    assert kept == set(range(kept_cut)) | set(range(1000, 1040))  # the first ones, uncut
    err = capsys.readouterr().err
    assert "warning: 1 compressed input(s) break off" in err and "cut.jsonl.gz" in err


@pytest.mark.parametrize("kind", ["empty", "content_field", "garbage", "latin1"])
def test_unusable_input_exits_2_with_one_line_and_no_data_dir(
    ray_local, tokenizer_dir, tmp_path, capsys, kind
):
    """An input that gives no document (an empty file, a jsonl whose text is under another
    field: all rejected no_text, or garbage) was a 0-document data dir and exit 0: now one
    `plm:` line (for the field: the fields seen and --text-field), exit 2, no manifest."""
    if kind == "empty":
        path = tmp_path / "c.txt"
        path.write_bytes(b"")
    elif kind == "content_field":
        path = tmp_path / "c.jsonl"
        lines = [json.dumps({"id": i, "content": paragraph(i)}) for i in range(5)]
        path.write_text("\n".join(lines) + "\n", "utf-8")
    elif kind == "latin1":
        path = tmp_path / "c.txt"
        path.write_bytes("".join(f"Caf\u00e9 n\u00b0{i} \u00e0 la cr\u00e8me.\n\n"
                                 for i in range(20)).encode("latin-1"))  # fmt: skip
    else:
        path = tmp_path / "c.jsonl"
        path.write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "data"
    code = main(["data", "prepare", "--input", str(path), "--tokenizer", str(tokenizer_dir),
                 "--output", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("plm:")]
    assert code == 2 and len(lines) == 1, err
    assert str(path) in lines[0] and "no data dir was written" in lines[0]
    assert not (out / "manifest.json").exists()
    if kind == "empty":
        assert "holds no document" in lines[0]
    if kind == "content_field":
        assert "no_text 5" in lines[0] and "no string field 'text'" in lines[0]
        assert "fields seen: content, id" in lines[0] and "--text-field" in lines[0]
        # the hint works: the same output, the field named
        assert main(["data", "prepare", "--input", str(path), "--tokenizer", str(tokenizer_dir),
                     "--output", str(out), "--text-field", "content"]) == 0  # fmt: skip
        assert DataDir(out).manifest["totals"]["documents_kept"] == 5
    if kind == "garbage":
        assert "none of the" in lines[0] and "rejected:" in lines[0]
    if kind == "latin1":  # what to do about it, in the same line
        assert "invalid_utf8" in lines[0] and "iconv -f latin1 -t utf-8" in lines[0]
