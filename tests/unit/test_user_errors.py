"""Failures a user causes or can fix: one `plm:` line on stderr, exit 2, no traceback."""

from __future__ import annotations

import random

import pytest
from conftest import one_plm_line, plm


def test_unigram_vocab_smaller_than_the_alphabet_names_the_size_that_works(tmp_path):
    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 300)]  # 300 distinct characters
    docs = ["".join(rng.choice(chars) for _ in range(40)) for _ in range(80)]
    corpus = tmp_path / "zh.txt"
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    args = ["data", "tokenizer", "--input", str(corpus), "--kind", "unigram"]
    proc = plm(*args, "--vocab-size", "100", "--output", str(tmp_path / "t"), cwd=tmp_path,
               check=False)  # fmt: skip
    line = one_plm_line(proc)
    assert "--vocab-size 100 is too small" in line and "distinct characters" in line
    enough = line.rsplit("--vocab-size ", 1)[1].split()[0]
    assert int(enough) > 300
    plm(*args, "--vocab-size", enough, "--output", str(tmp_path / "t"), cwd=tmp_path)  # works


@pytest.mark.slow  # imports transformers' model code
def test_an_export_transformers_cannot_represent_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    from test_export_hf_gpt import gpt_bundle

    _, bundle = gpt_bundle(tmp_path, intermediate_size=200)
    proc = plm("export", "--to", "hf", str(bundle), str(tmp_path / "hf"), cwd=tmp_path,
               check=False)  # fmt: skip
    line = one_plm_line(proc)
    assert str(bundle) in line and "intermediate_size=200" in line
    assert not (tmp_path / "hf").exists()
    proc = plm("export", "--to", "hf", str(tmp_path / "nope"), str(tmp_path / "hf"),
               cwd=tmp_path, check=False)  # fmt: skip
    assert "is not a model bundle" in one_plm_line(proc)


@pytest.mark.slow  # over 5 s: out of the fast tier
def test_export_into_a_pipe_prints_no_progress_bar(tmp_path):
    """transformers' "Writing model shards" bar is for terminals: piped, `plm export` says
    only where the folder went (with -v the libraries' output is left as it is)."""
    pytest.importorskip("transformers")
    from test_export_hf_gpt import gpt_bundle

    _, bundle = gpt_bundle(tmp_path)
    proc = plm("export", "--to", "hf", str(bundle), str(tmp_path / "hf"), cwd=tmp_path)
    assert "Writing model shards" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stdout.strip() == f"transformers folder written to {tmp_path / 'hf'}"


@pytest.mark.parametrize(
    "rank,local_rank,typo_prints,missing_file_prints",
    [("0", "0", True, True), ("1", "1", False, False), ("2", "0", False, True)],
)
def test_a_config_error_prints_once_under_a_launcher(
    tmp_path, monkeypatch, capsys, rank, local_rank, typo_prints, missing_file_prints
):
    """Every rank of a launcher meets a config's error: only rank 0 prints it (one line,
    not one per rank); one that depends on the machine (a file missing there) is printed
    by each machine's local rank 0. Every rank exits 2."""
    from conftest import REPO

    from pipeline.cli import main

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "4")
    bert = str(REPO / "configs/test/bert-tiny.yaml")
    for argv, prints in (
        (["train", bert, "train.max_stepz=3"], typo_prints),
        (["train", str(tmp_path / "nope.yaml")], missing_file_prints),
    ):
        assert main(argv) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("plm:")]
        assert len(lines) == (1 if prints else 0), (argv, lines)
