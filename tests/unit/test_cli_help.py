"""`plm --help` says what plm is for, to its users (it opened with a developers' note,
"parse, validate, call. No pipeline logic lives here."), and its example commands parse."""

from __future__ import annotations

import shlex

import pytest

from pipeline.cli import build_parser, main


def test_plm_help_says_what_plm_is_for_and_its_examples_parse(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    about = out.split("\n\n")[1]  # the paragraph after the usage lines
    assert about.startswith("Pretrain language models"), out
    for word in ("tokenizer", "shards", "DeepSpeed", "MLflow", "fine-tune", "transformers"):
        assert word in about, (word, about)
    assert "No pipeline logic" not in out and "parse, validate, call" not in out
    assert "plm demo" in out and "plm COMMAND --help" in out

    examples = [cmd.strip() for line in out.splitlines() if line.startswith("  plm ")
                for cmd in line.split("|")]  # fmt: skip
    assert len(examples) == 6, examples
    parser = build_parser()
    for cmd in examples:
        argv = shlex.split(cmd)
        assert argv[0] == "plm"
        args = parser.parse_args(argv[1:])  # each one as the command line takes it
        assert callable(args.func), cmd
