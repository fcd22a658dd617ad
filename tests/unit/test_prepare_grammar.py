"""`plm data prepare [CONFIG] key=value ...`: the grammar of `plm train` and `plm finetune`
(CONFIG optional), each key that takes one value also a flag made from PrepareConfig's
field, one loader and one error text. Parsing and loading only: no Ray, no file read but
the data config."""

from __future__ import annotations

import pytest
from pydantic import Field

from pipeline import cli
from pipeline.config import value_type
from pipeline.prepare import config as prepare_config
from pipeline.prepare.config import PrepareConfig, flag_name

BASE = "inputs: [c.txt]\ntokenizer: tok\noutput: out\n"
# Options of `plm data prepare` that set no key of PrepareConfig.
NOT_KEYS = {"-h", "--help", "--config", "--dry-run", "-v", "--verbose"}


def config_of(*argv: str) -> PrepareConfig:
    args = cli.parse_command_line(cli.build_parser(), ["data", "prepare", *argv])
    return cli.prepare_config_from_args(args)


@pytest.fixture
def data_yaml(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text(BASE + "shard_bytes: 1000\nnear_dedup: {bands: 20}\n")
    return str(path)


def test_config_and_key_values_give_what_the_flags_give(data_yaml):
    by_keys = config_of(data_yaml, "inputs=[a.txt,b.txt]", "shard_docs=5",
                        "near_dedup.enabled=true", "languages=en,zh", "force=true")  # fmt: skip
    by_flags = config_of("--config", data_yaml, "--input", "a.txt", "b.txt", "--shard-docs", "5",
                         "--near-dedup", "on", "--languages", "en,zh", "--force")  # fmt: skip
    assert by_keys == by_flags
    assert by_keys.inputs == ["a.txt", "b.txt"] and by_keys.languages == ["en", "zh"]
    # shard_docs from the command line replaces the file's shard_bytes; a section's key
    # leaves its other keys the file's
    assert by_keys.shard_docs == 5 and by_keys.shard_bytes is None
    assert by_keys.near_dedup.enabled and by_keys.near_dedup.bands == 20
    assert config_of("--config", data_yaml) == config_of(data_yaml)  # --config: CONFIG


@pytest.mark.parametrize(
    "flag,item",
    [(["--shard-docs", "7"], "shard_docs=7"), (["--shard-bytes", "64"], "shard_bytes=64"),
     (["--near-dedup", "on"], "near_dedup.enabled=true"), (["--force"], "force=true"),
     (["--input", "a.txt", "b.txt"], "inputs=[a.txt,b.txt]"), (["--filters", "web"], "filters=web"),
     (["--valid-fraction", "0.1"], "valid_fraction=0.1"), (["--text-field", "body"], "text_field=body"),
     (["--tokenizer", "t/tokenizer.json"], "tokenizer=t/tokenizer.json"),
     (["--num-cpus", "2"], "num_cpus=2"), (["--languages", "all"], "languages=all")],
)  # fmt: skip
def test_an_alias_flag_and_its_key_value_agree(flag, item, data_yaml):
    assert config_of(data_yaml, *flag) == config_of(data_yaml, item) != config_of(data_yaml)


def test_key_value_overrides_a_flag_and_may_follow_the_flags(data_yaml):
    assert config_of(data_yaml, "--shard-docs", "5", "shard_docs=6").shard_docs == 6
    assert config_of("--shard-docs", "5", data_yaml, "shard_docs=6").shard_docs == 6
    # `--input A key=value`: argparse hands the item to --input; it is the key's
    cfg = config_of(data_yaml, "--input", "a.txt", "clean.fold_whitespace=false")
    assert cfg.inputs == ["a.txt"] and cfg.clean.fold_whitespace is False
    cfg = config_of(
        "--input", "a.txt", "--tokenizer", "t", "--output", "o", "clean.fold_whitespace=false"
    )
    assert cfg.clean.fold_whitespace is False  # no CONFIG: the key=value items alone


def one_plm_line(argv, capsys) -> str:
    code = cli.main(["data", "prepare", *argv, "--dry-run"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("plm: "), err
    assert "Traceback" not in err
    return lines[0]


def test_a_bad_key_names_its_dotted_path_in_one_plm_line(data_yaml, tmp_path, capsys):
    line = one_plm_line([data_yaml, "near_dedup.bnads=3"], capsys)
    assert "unknown key `near_dedup.bnads` in `near_dedup.bnads=3` on the command line" in line
    assert "did you mean `near_dedup.bands`?" in line
    line = one_plm_line([data_yaml, "clean.min_chars=-1"], capsys)
    assert "key `clean.min_chars` in `clean.min_chars=-1` on the command line" in line
    line = one_plm_line([data_yaml, "--shard-docs", "0"], capsys)
    assert "key `shard_docs` in `--shard-docs=0` on the command line" in line
    bad = tmp_path / "bad.yaml"  # the file's typo: named as the file's
    bad.write_text(BASE + "clean: {nfkd: true}\n")
    line = one_plm_line([str(bad)], capsys)
    assert line.startswith(f"plm: invalid config {bad}: unknown key `clean.nfkd`"), line
    assert "command line" not in line


def test_a_uri_as_config_is_refused_naming_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = one_plm_line(["s3://b/data.yaml", "shard_docs=5"], capsys)
    assert line.startswith("plm: CONFIG=s3://b/data.yaml: CONFIG takes a local path"), line


def test_the_data_config_is_given_once(data_yaml, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["data", "prepare", data_yaml, "--config", data_yaml])
    assert stop.value.code == 2
    assert "the data config is given twice" in capsys.readouterr().err


def prepare_options(parser) -> dict[str, str]:
    """option string -> dest of `plm data prepare`'s options."""
    data = next(a for a in parser._subparsers._group_actions[0].choices["data"]._actions
                if a.dest == "data_command")  # fmt: skip
    prep = data.choices["prepare"]
    return {flag: a.dest for a in prep._actions for flag in a.option_strings}


def test_every_key_that_takes_one_value_has_its_flag_and_no_other_flag_is_kept():
    options = prepare_options(cli.build_parser())
    sections = {k for k, f in PrepareConfig.model_fields.items()
                if value_type(f) not in (None, bool, int, float, str)}  # fmt: skip
    assert sections == {"clean", "near_dedup"}
    for key in set(PrepareConfig.model_fields) - sections:
        assert flag_name(key) in options, key
    keyed = {flag_name(k) for k in PrepareConfig.model_fields if k not in sections}
    keyed.add(flag_name("near_dedup.enabled"))
    assert set(options) - keyed == NOT_KEYS  # no flag restates a key by hand


def test_a_key_added_to_the_config_gets_its_flag(monkeypatch, data_yaml):
    class Wider(PrepareConfig):
        new_knob: int = Field(3, gt=0, description="a knob")
        new_switch: bool = False

    monkeypatch.setattr(prepare_config, "PrepareConfig", Wider)
    options = prepare_options(cli.build_parser())
    assert options["--new-knob"] == "new_knob" and options["--new-switch"] == "new_switch"
    cfg = config_of(data_yaml, "--new-knob", "5", "--new-switch")
    assert isinstance(cfg, Wider) and cfg.new_knob == 5 and cfg.new_switch
    assert config_of(data_yaml, "new_knob=5") == config_of(data_yaml, "--new-knob", "5")


def test_the_parser_of_main_makes_the_flags_when_it_parses(data_yaml):
    """`plm` itself builds `plm data prepare`'s flags only for that command (the other
    commands start without importing PrepareConfig): the same flags, the same config."""
    argv = ["data", "prepare", data_yaml, "--shard-docs", "5", "near_dedup.enabled=true"]
    lazy = cli.build_parser(lazy=True)
    assert cli.prepare_config_from_args(cli.parse_command_line(lazy, argv)) == config_of(*argv[2:])
    assert prepare_options(lazy) == prepare_options(cli.build_parser())
