"""`plm train` with train.out_dir on an S3 server (moto's server mode): real DeepSpeed (CPU,
gloo), real MLflow. The store-level details are in tests/unit/test_out_store.py; a resume
from the store on empty disks, bit for bit, each rank fetching its own files, and one on
another world size (the universal conversion) are in the cluster tests
(tests/cluster/test_train_cluster.py, tests/cluster/test_elastic.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, one_plm_line, plm
from s3_outage import _start_moto, outage_s3_fixture  # noqa: F401  (outage_s3)

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def _wait_for(pred, timeout=300.0, what=""):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _complete_on_store(fs, uri: str, tag: str) -> bool:
    """COMPLETE and every file a 1-rank ZeRO-0 checkpoint holds, on the store."""
    import pyarrow.fs as pafs

    base = f"{uri[len('s3://') :]}/checkpoints/{tag}"
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))}
    need = {"COMPLETE", "mp_rank_00_model_states.pt", "trainer_rank0.pt", "config.yaml",
            "ds_config.json"}  # fmt: skip
    return need <= names


def test_store_stopped_mid_upload_latest_never_names_an_incomplete_checkpoint(
    outage_s3, tiny_data, tmp_path
):
    """The S3 server stops while a checkpoint uploads and answers again 8 s later:
    training goes on, the uploads are retried, the run finishes with every checkpoint
    complete. Then it stops again mid-upload and the trainer is killed meanwhile: `latest`
    on the store names a complete checkpoint, never the one being uploaded."""
    import pyarrow.fs as pafs

    uri = "s3://plm-own/run"
    fs = pafs.FileSystem.from_uri(uri)[0]
    stage = tmp_path / "stage"
    args = [sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
            f"train.out_dir={uri}", f"train.local_dir={stage}", "train.save_every=5",
            "train.eval_every=0", "train.keep_last=2", "mlflow.register=false"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([*args, "train.max_steps=60"], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    _wait_for(lambda: (stage / "checkpoints" / "step00000010").is_dir(), what="a second save")
    outage_s3.stop()
    time.sleep(8)
    outage_s3.start()
    assert proc.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-4000:]
    text = (tmp_path / "first.log").read_text()
    assert "retrying for up to" in text, text[-3000:]
    with fs.open_input_stream("plm-own/run/checkpoints/latest") as f:
        assert f.read() == b"step00000060"
    assert _complete_on_store(fs, uri, "step00000060")
    assert _complete_on_store(fs, uri, "step00000055")  # keep_last=2 on the store
    assert not _complete_on_store(fs, uri, "step00000050")

    log = open(tmp_path / "second.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([*args, "train.max_steps=400"], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    _wait_for(lambda: (stage / "checkpoints" / "step00000070").is_dir(), what="a new save")
    outage_s3.stop()
    time.sleep(2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    outage_s3.start()
    with fs.open_input_stream("plm-own/run/checkpoints/latest") as f:
        latest = f.read().decode()
    assert "step00000060" <= latest <= "step00000070"
    assert _complete_on_store(fs, uri, latest)
    if latest != "step00000070":  # it was not finished before the server stopped
        assert (
            not fs.get_file_info("plm-own/run/checkpoints/step00000070/COMPLETE").type
            == pafs.FileType.File
        )
    out = plm(*args[3:], f"train.max_steps={int(latest[4:]) + 5}", cwd=tmp_path)
    assert f"resumed from {uri}/checkpoints/{latest}" in out.stdout


def test_missing_bucket_and_bad_credentials_are_one_plm_line(s3, tiny_data, tmp_path):
    """Before training starts: one `plm:` line naming the URI and what is missing, exit 2;
    the secret never printed."""
    common = [f"data.path={tiny_data}", "train.max_steps=2", "mlflow.register=false"]
    proc = plm("train", BERT, *common, "train.out_dir=s3://no-such-bucket/run",
               cwd=tmp_path, check=False)  # fmt: skip
    line = one_plm_line(proc)
    assert "train.out_dir=s3://no-such-bucket/run" in line and "does not exist" in line, line
    assert "step" not in proc.stdout

    moto, port = _start_moto(tmp_path, INITIAL_NO_AUTH_ACTION_COUNT="1")  # then keys checked
    try:
        import boto3

        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="plm-auth")
        secret = "not-the-right-secret-3f9a"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "AKIAWRONGKEY",
               "AWS_SECRET_ACCESS_KEY": secret}  # fmt: skip
        proc = plm("train", BERT, *common, "train.out_dir=s3://plm-auth/run", cwd=tmp_path,
                   env=env, check=False)  # fmt: skip
        line = one_plm_line(proc)
        assert "train.out_dir=s3://plm-auth/run" in line and "access denied" in line, line
        assert secret not in proc.stdout + proc.stderr
    finally:
        os.kill(moto.pid, signal.SIGTERM)
        moto.wait(timeout=30)
