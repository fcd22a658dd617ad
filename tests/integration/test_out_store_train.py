"""`plm train` with train.out_dir on an S3 server (moto's server mode): real DeepSpeed (CPU,
gloo), real MLflow. The store-level details are in tests/unit/test_out_store.py; a resume
from the store on empty disks, bit for bit, each rank fetching its own files, and one on
another world size (the universal conversion) are in the cluster tests
(tests/cluster/test_train_cluster.py, tests/cluster/test_elastic.py), and so is the store
out of reach mid-upload (a host's link cut)."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import REPO, one_plm_line, plm
from s3_outage import _start_moto

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


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
