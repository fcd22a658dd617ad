"""The tokenizer on an object store, and a store's faults told before any work, against a
real S3 server (moto's server mode, tests/s3_server.py): `plm data tokenizer --output
s3://...` writes the bucket (no ``s3:`` folder in the cwd), `plm data prepare --tokenizer
s3://...` reads it from there into the data dir; a missing bucket, refused credentials or
no connection is one `plm:` line naming the URI, exit 2, before the sampling or Ray; no
credential is in anything a run writes."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, free_port, plm, synthetic_corpus

from pipeline import cli
from pipeline.prepare.tokenizer import META_FILE, TOKENIZER_FILE, load_tokenizer

BERT = str(REPO / "configs/test/bert-tiny.yaml")
TOK = ["--kind", "wordpiece", "--vocab-size", "300"]


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(synthetic_corpus(), encoding="utf-8")
    return path


def run(argv, cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """`plm ARGV` in this process, in ``cwd``: (exit code, stdout, stderr)."""
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_tokenizer_goes_to_the_bucket_and_reads_back(s3, corpus, tmp_path, monkeypatch,
                                                         capsys):  # fmt: skip
    uri = s3.prefix("tok")
    work = tmp_path / "cwd"
    code, out, err = run(["data", "tokenizer", "--input", corpus, *TOK, "--output", uri],
                         work, monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    assert f"tokenizer written to {uri}" in out
    assert not list(work.iterdir())  # no s3: folder: the files are in the bucket
    run(["data", "tokenizer", "--input", corpus, *TOK, "--output", tmp_path / "local"],
        work, monkeypatch, capsys)  # fmt: skip
    for name in (TOKENIZER_FILE, META_FILE):  # the same bytes as a local training
        assert s3.get(f"{uri}/{name}") == (tmp_path / "local" / name).read_bytes()
    tok, meta = load_tokenizer(uri)
    assert meta["vocab_size"] == tok.get_vocab_size() == load_tokenizer(tmp_path / "local")[1][
        "vocab_size"]  # fmt: skip
    s3.put(f"{uri}/{TOKENIZER_FILE}", b"{}")  # a swapped file is caught on the store too
    with pytest.raises(Exception, match="does not match the sha256"):
        load_tokenizer(uri)


@pytest.mark.slow  # a Ray job (prepare); its own local Ray: the workers get the AWS_* variables
def test_prepare_reads_the_tokenizer_from_the_bucket(s3, corpus, tmp_path, monkeypatch, capsys):
    tok = s3.prefix("tok")
    work = tmp_path / "cwd"
    assert run(["data", "tokenizer", "--input", corpus, *TOK, "--output", tok],
               work, monkeypatch, capsys)[0] == 0  # fmt: skip
    data = s3.prefix("data")
    code, _, err = run(["data", "prepare", "--input", corpus, "--tokenizer", tok, "--output", data,
                        "--shard-docs", "40", "--max-doc-tokens", "128", "--num-cpus", "1"],
                       work, monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    assert not list(work.iterdir())
    manifest = json.loads(s3.get(f"{data}/manifest.json"))
    for name in (TOKENIZER_FILE, META_FILE):  # the data dir's copy: training finds it there
        assert s3.get(f"{data}/tokenizer/{name}") == s3.get(f"{tok}/{name}")
    assert manifest["tokenizer"]["fingerprint"] == json.loads(s3.get(f"{tok}/{META_FILE}"))[
        "sha256"]  # fmt: skip
    from pipeline.data.remote import CacheConfig
    from pipeline.data.shards import DataDir

    d = DataDir(data, CacheConfig(str(tmp_path / "cache")))
    assert d.tokenizer_path.read_bytes() == s3.get(f"{tok}/{TOKENIZER_FILE}")


# --- a store's faults, before any work -------------------------------------------------------


def _commands(corpus: Path, bad: str, good_tok: str, tmp_path: Path) -> dict[str, list]:
    """Each command that takes a URI, with ``bad`` (a URI on the faulty store) there."""
    return {
        "--output": ["data", "tokenizer", "--input", corpus, *TOK, "--output", bad],
        "--input": ["data", "tokenizer", "--input", f"{bad}/c.txt", *TOK, "--output",
                    tmp_path / "tok"],
        "--tokenizer": ["data", "prepare", "--input", corpus, "--tokenizer", bad, "--output",
                        tmp_path / "data"],
        "prepare --output": ["data", "prepare", "--input", corpus, "--tokenizer", good_tok,
                             "--output", bad],
        "data.path": ["train", BERT, f"data.path={bad}", f"data.cache_dir={tmp_path / 'c'}",
                      "--dry-run"],
    }  # fmt: skip


def _refused_before_work(argv, tmp_path, monkeypatch, capsys, bad: str, why: str) -> None:
    work = tmp_path / "cwd"
    code, out, err = run(argv, work, monkeypatch, capsys)
    line = one_line(code, err)
    assert bad in line and why in line, line
    assert "tokenizer: sampling" not in err and "Ray" not in out + err  # no work started
    assert not list(work.iterdir()) and not (tmp_path / "data").exists()
    assert not (tmp_path / "tok").exists()


def test_a_missing_bucket_is_one_line_before_any_work(s3, corpus, tmp_path, monkeypatch, capsys):
    good = tmp_path / "good_tok"
    assert run(["data", "tokenizer", "--input", corpus, *TOK, "--output", good],
               tmp_path / "w0", monkeypatch, capsys)[0] == 0  # fmt: skip
    bad = "s3://no-such-bucket-plm/x"
    for argv in _commands(corpus, bad, str(good), tmp_path).values():
        _refused_before_work(argv, tmp_path, monkeypatch, capsys, bad,
                             "bucket no-such-bucket-plm not found")  # fmt: skip


def _auth(s3, count: str) -> None:
    """moto's server checks credentials after ``count`` more requests (inf: never)."""
    req = urllib.request.Request(f"{s3.endpoint}/moto-api/reset-auth", data=count.encode(),
                                 method="POST", headers={"Content-Type": "text/plain"})  # fmt: skip
    urllib.request.urlopen(req, timeout=10).close()


def test_refused_credentials_are_one_line_before_any_work(s3, corpus, tmp_path, monkeypatch,
                                                          capsys):  # fmt: skip
    good = tmp_path / "good_tok"
    assert run(["data", "tokenizer", "--input", corpus, *TOK, "--output", good],
               tmp_path / "w0", monkeypatch, capsys)[0] == 0  # fmt: skip
    bad = s3.prefix("denied")
    _auth(s3, "0")  # from now on: these credentials are unknown to the server
    try:
        for argv in _commands(corpus, bad, str(good), tmp_path).values():
            _refused_before_work(argv, tmp_path, monkeypatch, capsys, bad, "access denied")
    finally:
        _auth(s3, "inf")


@pytest.mark.slow  # the S3 client retries a refused connection for seconds, per command
def test_no_connection_is_one_line_before_any_work(s3, corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    bad = "s3://plm-test/x"
    for what in ("--output", "--tokenizer"):
        argv = _commands(corpus, bad, str(tmp_path), tmp_path)[what]
        _refused_before_work(argv, tmp_path, monkeypatch, capsys, bad, "cannot connect")


# --- no credential in anything a run writes --------------------------------------------------

SECRET = "plm-secret-7f3a9c"  # AWS_SECRET_ACCESS_KEY (moto takes any)
TOKEN = "plm-session-token-51be2d"  # AWS_SESSION_TOKEN


@pytest.mark.slow  # tokenizer + Ray prepare + 2 training steps, as subprocesses
def test_no_credential_is_in_anything_a_run_writes(s3, corpus, tmp_path):
    env = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN,
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # fmt: skip
    tok, data = s3.prefix("tok"), s3.prefix("data")
    procs = [
        plm("data", "tokenizer", "--input", str(corpus), *TOK, "--output", tok, cwd=tmp_path,
            env=env),
        plm("data", "prepare", "--input", str(corpus), "--tokenizer", tok, "--output", data,
            "--shard-docs", "40", "--max-doc-tokens", "128", "--num-cpus", "1", cwd=tmp_path,
            env=env),
        plm("train", BERT, f"data.path={data}", f"train.out_dir={tmp_path / 'run'}",
            "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
            "mlflow.register=false", cwd=tmp_path, env=env),
        plm("data", "prepare", "--input", str(corpus), "--tokenizer", "s3://AK:" + SECRET +
            "@plm-test/t", "--output", data, cwd=tmp_path, env=env, check=False),
    ]  # fmt: skip
    assert procs[-1].returncode == 2
    written = [p.stdout.encode() + p.stderr.encode() for p in procs]
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert any(f.name == "mlflow.db" for f in files) and (tmp_path / "run").is_dir()
    written += [f.read_bytes() for f in files if f != corpus]
    fs = s3.fs()
    import pyarrow.fs as pafs

    for prefix in (tok, data):  # everything the run put in the bucket (manifest, tokenizer)
        for info in fs.get_file_info(pafs.FileSelector(prefix[len("s3://") :], recursive=True)):
            if info.type == pafs.FileType.File:
                with fs.open_input_file(info.path) as f:
                    written.append(f.read())
    assert len(written) > 10
    for blob in written:
        for secret in (SECRET, TOKEN):
            assert secret.encode() not in blob
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != SECRET  # the test's own env untouched
