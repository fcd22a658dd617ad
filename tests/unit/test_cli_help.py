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


# --- plm tracking user: an MLflow server's users (pipeline/tracking_admin.py) ---------------


def test_plm_tracking_user_help_names_both_roles_and_the_password_file(capsys):
    for argv in (["tracking", "user", "--help"], ["tracking", "user", "job", "--help"],
                 ["tracking", "user", "viewer", "--help"]):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 0, argv
        out = capsys.readouterr().out
        assert "--password-file" in out, out
        assert "--password " not in out and "--password\n" not in out  # no such option shown
    with pytest.raises(SystemExit):
        main(["tracking", "user", "--help"])
    out = capsys.readouterr().out
    assert "job" in out and "viewer" in out and "never" in out and "docs/tracking.md" in out


@pytest.mark.parametrize("given", [["--password", "hunter2hunter2"], ["--password=hunter2hunter2"],
                                   ["--password"]])  # fmt: skip
def test_plm_tracking_user_takes_no_password_on_the_command_line(given, tmp_path, capsys):
    """Not as --password, nor as an abbreviation of --password-file (argparse's default
    would read `--password X` as `--password-file X`), and the value is not echoed."""
    pw = tmp_path / "pw"
    argv = ["tracking", "user", "job", "--user", "u", "--experiment", "e", *given]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--password-file", str(pw)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--password-file FILE" in err and "hunter2" not in err, err
    assert not pw.exists()


def test_plm_tracking_user_makes_the_user_from_the_password_file(tmp_path, monkeypatch, capsys):
    from pipeline import tracking_admin

    made = []
    monkeypatch.setattr(tracking_admin, "make_viewer",
                        lambda uri, user, pw: made.append((uri, user, pw))
                        or {"user": user, "created": True, "permission": "READ"})  # fmt: skip
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    pw = tmp_path / "viewer.pw"
    assert main(["tracking", "user", "viewer", "--user", "v", "--password-file", str(pw),
                 "--generate"]) == 0  # fmt: skip
    assert made == [("http://127.0.0.1:9", "v", pw.read_text().strip())]
    assert pw.stat().st_mode & 0o777 == 0o600
    assert "user 'v' (created): READ on every" in capsys.readouterr().out
    # the admin's password in --tracking-uri: refused, one plm: line, the password masked
    code = main(["tracking", "user", "viewer", "--user", "v", "--password-file", str(pw),
                 "--tracking-uri", "http://admin:hunter2hunter2@127.0.0.1:9"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("plm: --tracking-uri=http://***@127.0.0.1:9: a URI")
    assert "hunter2" not in err and err.count("\n") == 1 and len(made) == 1


@pytest.mark.parametrize("argv", [
    ["predict", "m", "--input", "rows.jsonl"],
    ["generate", "m", "--prompt", "x"],
    ["eval", "--report", "r"],
])  # fmt: skip
def test_a_tracking_uri_flag_with_a_password_is_refused_without_showing_it(argv, capsys):
    code = main([*argv, "--tracking-uri", "http://job:s3cret-pw@node0:5000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("plm:") == 1, err
    assert "s3cret-pw" not in err and "MLFLOW_TRACKING_PASSWORD_FILE" in err, err
