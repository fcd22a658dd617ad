"""`plm data prepare --near-dedup on` end to end with a real local Ray: the same bytes on 1
and 2 CPUs, near-duplicates counted under their own reason with the kept document's
place beside each example, and `off` the output of before."""

import json
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.data.shards import load_manifest
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planted_corpus  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}  # fmt: skip


def test_near_dedup_gives_the_same_bytes_on_1_and_2_cpus(tmp_path, monkeypatch):
    docs, pairs = planted_corpus.generate(600_000, seed=3)
    planted_corpus.write(tmp_path / "in", docs, pairs, n_files=2)
    (tmp_path / "in/pairs.jsonl").rename(tmp_path / "pairs.jsonl")
    tok = train_tokenizer([str(tmp_path / "in")], TokenizerSpec(kind="wordpiece", vocab_size=400),
                          tmp_path / "tok")  # fmt: skip
    common = ["data", "prepare", "--input", str(tmp_path / "in"), "--tokenizer", str(tok),
              "--shard-docs", "50", "--split-bytes", "60000"]  # fmt: skip
    runs = {}
    from pipeline.prepare import near_dedup

    for name, extra in {"one": ["--near-dedup", "on", "--num-cpus", "1"],
                        "two": ["--near-dedup", "on", "--num-cpus", "2"],
                        "off": ["--near-dedup", "off", "--num-cpus", "2"],
                        "default": ["--num-cpus", "2"]}.items():  # fmt: skip
        with monkeypatch.context() as patch:
            if name == "two":  # and the clusters over several partitions (the driver's)
                patch.setattr(near_dedup, "ARCS_PER_PARTITION", 8)
            assert main([*common, "--output", str(tmp_path / name), *extra]) == 0
        runs[name] = load_manifest(tmp_path / name)
    one, two, off, default = (runs[k] for k in ("one", "two", "off", "default"))
    assert one["stats"]["units"] >= 8
    assert one["stats"]["near_dedup_cluster_partitions"] == 1
    assert two["stats"]["near_dedup_cluster_partitions"] == one["stats"]["units"]
    assert two["stats"]["near_dedup_cluster_rounds"] >= 2
    assert files(tmp_path / "one") == files(tmp_path / "two")
    for key in ("splits", "totals", "rejected", "reject_examples", "sources", "data_config"):
        assert one[key] == two[key], key
    # Off is the default, and the output (and config hash) of a prepare without near-dedup.
    assert files(tmp_path / "off") == files(tmp_path / "default")
    assert off["data_config_hash"] == default["data_config_hash"]
    assert "near_dedup" not in off["data_config"] and "near_duplicate" not in off["rejected"]
    assert one["data_config"]["near_dedup"] == {"enabled": True, "ngram": 5, "bands": 14, "rows": 8}
    # The planted copies: the exact ones are duplicates; >= 95% of those at J >= 0.8
    # (about a fifth of the pairs) are removed, and few more than the copies above J 0.5.
    exact = sum(p.kind == "exact" for p in pairs)
    high = sum(p.jaccard >= 0.8 and p.kind != "exact" for p in pairs)
    above = sum(0.5 < p.jaccard < 1 for p in pairs)
    assert one["rejected"]["duplicate"] == off["rejected"]["duplicate"] == exact
    assert 0.95 * high <= one["rejected"]["near_duplicate"] <= above + 2
    removed = one["rejected"]["near_duplicate"]
    assert one["totals"]["documents_kept"] == off["totals"]["documents_kept"] - removed
    examples = one["reject_examples"]["near_duplicate"]
    assert len(examples) == 5
    for example in examples:
        kept = example["kept"]
        assert set(kept) >= {"source", "ordinal"}
        assert (kept["source"], kept.get("from_byte", 0), kept["ordinal"]) < (
            example["source"], example.get("from_byte", 0), example["ordinal"]
        )  # fmt: skip
    stats = one["stats"]
    assert 0 < stats["worker_cpu_seconds_near_dedup"] < stats["worker_cpu_seconds"]
    json.dumps(one)  # the manifest stays plain JSON
