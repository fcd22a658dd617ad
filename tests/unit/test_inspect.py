"""`plm data inspect`: summary lines, --verify exit codes, the shard named on corruption."""

import numpy as np

from pipeline.cli import main
from pipeline.data.shards import Document, ShardWriter, brace_pattern, shard_name, write_manifest


def make_data_dir(root, n_docs=6):
    info = {}
    for split, n in (("train", n_docs), ("valid", 2)):
        w = ShardWriter.local(root, shard_name(split, 0), np.uint16)
        for i in range(n):
            w.write(
                Document(
                    key=f"{'cd' * 8}-{i:010d}-0000",
                    tokens=np.arange(4 + i),
                    sents=np.array([4 + i], np.int32),
                    words=np.array([0, 2], np.int32),
                    meta={"source": "x.txt", "language": "other", "n_tokens": 4 + i},
                )
            )
        entry = w.close()
        info[split] = {
            "shards": [entry],
            "n_docs": entry["n_docs"],
            "n_tokens": entry["n_tokens"],
            "pattern": brace_pattern(split, 1),
        }
    write_manifest(
        root,
        {
            "format_version": 3,
            "token_dtype": "uint16",
            "data_config_hash": "ab" * 32,
            "tokenizer": {
                "path": "tokenizer",
                "fingerprint": "ef" * 32,
                "kind": "wordpiece",
                "vocab_size": 300,
            },
            "sources": [{"uri": "/c/x.txt", "size": 123, "sha256": "12" * 32}],
            "splits": info,
            "totals": {"n_docs": n_docs + 2, "n_tokens": 0, "n_shards": 2, "bytes": 0},
            "rejected": {"duplicate": 3, "invalid_utf8": 1},
        },
    )


def test_inspect_prints_totals_splits_rejects_tokenizer(tmp_path, capsys):
    make_data_dir(tmp_path)
    assert main(["data", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "8 docs" in out and "train/shard-000000.tar" in out
    assert "rejected     4 docs" in out and "duplicate" in out and "invalid_utf8" in out
    assert "wordpiece  vocab 300" in out and "/c/x.txt" in out


def test_verify_passes_then_names_the_corrupted_shard(tmp_path, capsys):
    make_data_dir(tmp_path)
    assert main(["data", "inspect", str(tmp_path), "--verify"]) == 0
    assert "verify       ok: 2 shards" in capsys.readouterr().out
    shard = tmp_path / "valid/shard-000000.tar"
    raw = bytearray(shard.read_bytes())
    raw[700] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert main(["data", "inspect", str(tmp_path), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "valid/shard-000000.tar" in err and "train/shard" not in err


def test_inspect_of_an_unfinished_or_missing_dir_is_one_line_and_exit_2(tmp_path, capsys):
    """Bad input, as for every other command: exit 2 (it was 1, the code of a failed
    --verify) and one `plm:` line naming the folder and the command that makes it."""
    for folder in (tmp_path, tmp_path / "MISSING"):
        for verify in ([], ["--verify"]):
            assert main(["data", "inspect", str(folder), *verify]) == 2
            captured = capsys.readouterr()
            err = captured.err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("plm: "), err
            assert str(folder) in err[0] and "plm data prepare" in err[0]
            assert captured.out == ""


def test_the_removed_table_has_stages_counts_shares_examples_and_rules():
    from pipeline.prepare.inspect import removed_table

    manifest = {
        "totals": {"n_docs": 60, "documents_read": 100},
        "rejected": {"duplicate": 5, "c4": 20, "language": 10, "too_short": 4, "novel": 1},
        "reject_examples": {
            "c4": [
                {"source": "/data/web.jsonl", "ordinal": 7, "line": 8,
                 "detail": "curly_brace", "text": "function f() { return 1; } " * 5},
                {"source": "/data/web.jsonl", "ordinal": 9, "line": 10,
                 "detail": "too_few_sentences", "text": "Home. About."},
                {"source": "/data/web.jsonl", "ordinal": 11, "detail": "lorem_ipsum"},
            ],
            "language": [{"source": "/data/web.jsonl", "ordinal": 3, "detail": "de"}],
        },
        "filter_rules": {"c4.curly_brace": 12, "c4.too_few_sentences": 8},
        "lines_removed": {"c4.javascript": 3, "c4.no_terminal_punctuation": 40},
    }  # fmt: skip
    lines = removed_table(manifest)
    text = "\n".join(lines)
    assert lines[0] == "rejected     40 docs of 100 read"
    stages = ("read", "clean", "language", "filters", "dedup", "tokenize", "other")
    reasons = [line.split()[1] for line in lines[2:] if line.split()[0] in stages]
    assert reasons == ["too_short", "language", "c4", "duplicate", "novel"]  # stage order
    c4 = next(line for line in lines if " c4 " in line)
    assert c4.split()[:4] == ["filters", "c4", "20", "20.0%"]
    assert "web.jsonl#7 line 8 [curly_brace] 'function f() { return 1; }" in c4
    assert "web.jsonl#9 line 10 [too_few_sentences] 'Home. About.'" in text
    assert "lorem_ipsum" not in text  # two examples per reason
    assert "web.jsonl#3 [de]" in text and "other       novel" in text
    rule = next(line for line in lines if "c4.curly_brace" in line)
    assert rule.split() == ["c4.curly_brace", "12", "0"]
    assert next(x for x in lines if "no_terminal" in x).split()[1:] == ["0", "40"]


def test_languages_are_listed_with_their_shares(tmp_path, capsys):
    from pipeline.data.shards import DataDir

    make_data_dir(tmp_path)
    data = DataDir(tmp_path)
    data.manifest["totals"]["languages"] = {"en": 6, "zh": 2}
    from pipeline.prepare.inspect import summarize

    assert "languages    en 6 (75.0%)  zh 2 (25.0%)" in summarize(data)
