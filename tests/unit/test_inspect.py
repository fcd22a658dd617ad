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


def test_inspect_of_an_unfinished_dir_fails_clearly(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path)]) == 1
    assert "plm data prepare" in capsys.readouterr().err
