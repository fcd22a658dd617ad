"""A training run whose `mlflow server` goes away and comes back: the metrics logged
meanwhile are sent from metrics.jsonl, the run is ended and the model registered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, load_launch_script, metrics_rows
from s3_outage import Outage

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")
STEPS = 200


def last_step(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in metrics_rows(run_dir)), default=0) if path.is_file() else 0


def wait_until(what, proc, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None or what(), proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def sign_in(monkeypatch, aio, server) -> None:
    """As the server's admin (it runs MLflow's basic-auth app), here and in plm's children."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", aio.ADMIN_USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD",
                       aio.read_secret(server.password_file(aio.ADMIN_USER)))  # fmt: skip


def crash(server) -> None:
    """The outage: the server's process group killed at once, as a crash or an evicted pod
    ends it. A SIGTERM'd server shuts down gracefully and keeps answering its open
    connection meanwhile: the tiny run (about 50 steps/s) once finished all its steps in
    that time, and then waited for a server that the test only restarts mid-run."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=60)


def test_a_run_that_lost_its_server_is_complete_once_the_server_is_back(tiny_data, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    from mlflow import MlflowClient

    aio = load_launch_script("all_in_one")
    (tmp_path / "logs").mkdir()
    server = aio.MlflowServer(tmp_path, tmp_path / "logs")
    server.start()
    sign_in(monkeypatch, aio, server)
    port = int(server.url.rsplit(":", 1)[1])
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
         f"train.out_dir={run_dir}", f"train.max_steps={STEPS}", "train.log_every=1",
         "train.eval_every=0", "train.save_every=0", f"mlflow.tracking_uri={server.url}",
         "mlflow.retry_every_s=1", "mlflow.final_wait_s=300"],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: last_step(run_dir) >= 5, proc)
        crash(server)  # the outage
        down_at = last_step(run_dir)
        assert down_at < STEPS - 20, "the run outran the outage"
        # Training goes on without it; the rows pile up in metrics.jsonl.
        wait_until(lambda: last_step(run_dir) >= down_at + 20 or proc.poll() is not None, proc)
        server.start(port=port)  # back, same address and store
        output = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 0, output[-4000:]
    assert "MLflow answers again" in output, output[-4000:]

    # The restarted server's store has it all: status, every step, the registered model.
    server.start(port=port)
    try:
        client = MlflowClient(server.url)
        run_id = (run_dir / "mlflow_run_id").read_text().strip()
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
        by_step = {m.step: m.value for m in history}
        assert by_step == {r["step"]: r["loss"] for r in metrics_rows(run_dir)
                           if "step_loss" in r}  # fmt: skip
        version = client.get_model_version_by_alias("bert-tiny", "current")
        assert version.run_id == run_id
    finally:
        server.stop()


def test_the_tracker_picks_up_again_in_the_middle_of_a_run(tmp_path, monkeypatch):
    """The Tracker itself, against a real server stopped and started again between two
    logged steps: the steps logged meanwhile arrive, then logging goes on live."""
    from mlflow import MlflowClient

    from pipeline.train.tracking import Tracker

    aio = load_launch_script("all_in_one")
    (tmp_path / "logs").mkdir()
    server = aio.MlflowServer(tmp_path, tmp_path / "logs")
    server.start()
    sign_in(monkeypatch, aio, server)
    port = int(server.url.rsplit(":", 1)[1])
    tracker = Tracker(tmp_path / "run", enabled=True, retry_every_s=0.5, final_wait_s=0)
    try:
        tracker.start(tracking_uri=server.url, experiment="outage", run_name="r", params={},
                      tags={}, resume=False)  # fmt: skip
        for step in range(1, 4):
            tracker.log_metrics({"loss": 1.0 / step}, step)
        server.stop()
        for step in range(4, 8):  # down: into metrics.jsonl only
            tracker.log_metrics({"loss": 1.0 / step}, step)
        assert not tracker.mlflow_ok
        server.start(port=port)
        time.sleep(0.6)  # past retry_every_s: the next call asks again
        for step in range(8, 11):
            tracker.log_metrics({"loss": 1.0 / step}, step)
        assert tracker.mlflow_ok and tracker.backfilled >= 4
        # The process lost here (its run left open), the next job resumes the run from the
        # same folder: it sends nothing twice (a count left at the outage's end sent steps
        # 9 and 10 again, twice in the history).
        assert (tmp_path / "run" / "mlflow_synced").read_text() == "10"
        # Even rows the server stored but the tracker never heard it (a call that timed
        # out) are one point each when sent again: say steps 9 and 10 were.
        (tmp_path / "run" / "mlflow_synced").write_text("8")
        import mlflow

        mlflow.end_run()
        tracker = Tracker(tmp_path / "run", enabled=True, retry_every_s=0.5, final_wait_s=0)
        tracker.start(tracking_uri=server.url, experiment="outage", run_name="r", params={},
                      tags={}, resume=True)  # fmt: skip
        tracker.log_metrics({"loss": 1.0 / 11}, 11)
        tracker.end("FINISHED")
        client = MlflowClient(server.url)
        history = client.get_metric_history(tracker.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, 12))
        assert client.get_run(tracker.run_id).info.status == "FINISHED"
        assert (tmp_path / "run" / "mlflow_synced").read_text() == "11"
    finally:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run()
        server.stop()


def test_a_finished_run_that_mlflow_lacks_exits_3_with_one_line(tiny_data, tmp_path):
    """Training finished but MLflow never answered (nothing listens at the URI): `plm
    train` does not exit 0 in silence; one `plm:` line says what MLflow lacks and that the
    same command syncs it, and the status is 3."""
    from conftest import free_port, one_plm_line, plm

    run_dir = tmp_path / "run"
    proc = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
               "train.max_steps=4", "train.eval_every=0", "train.save_every=0",
               f"mlflow.tracking_uri=http://127.0.0.1:{free_port()}", "mlflow.final_wait_s=0",
               cwd=tmp_path, check=False)  # fmt: skip
    line = one_plm_line(proc, code=3)
    assert "did not answer within mlflow.final_wait_s=0 s" in line, line
    assert "Re-run the same command" in line and "metric rows" in line, line
    assert (run_dir / "checkpoints" / "latest").is_file()  # the training itself is done


class SlowArtifactStore(Outage):
    """The server as a client sees it through a TCP relay that holds back the answer to
    each artifact upload (``PUT /api/2.0/mlflow-artifacts/``) for ``delay_s``, as a server
    proxying artifacts answers only once it has stored the file on its object store."""

    def __init__(self, target_port: int, delay_s: float):
        self.delay_s = delay_s
        super().__init__(target_port)

    def _relay(self, client, upstream) -> None:
        import threading

        upload = threading.Event()  # an upload's request went up: hold its answer

        def request(data: bytes) -> None:
            if b"PUT /api/2.0/mlflow-artifacts/" in data:
                upload.set()

        def answer(_data: bytes) -> None:
            if upload.is_set():
                time.sleep(self.delay_s)
                upload.clear()

        for a, b, hook in ((client, upstream, request), (upstream, client, answer)):
            threading.Thread(target=self._pump, args=(a, b, hook), daemon=True).start()


def test_an_upload_may_wait_longer_for_the_server_than_the_other_calls(tmp_path, monkeypatch):
    """A server that takes 7 s to answer an upload: the bundle's files still arrive
    (mlflow.upload_timeout_s, 600 by default), while every other call keeps its 5 s
    (an unreachable server costs seconds); the same upload with upload_timeout_s at 2 is
    a warning, the tracker's answer to a failed MLflow call. Before, every upload had 5 s,
    and a 1.17 GiB bundle through the rig's MLflow server to its S3 server failed."""
    from mlflow import MlflowClient

    from pipeline.train import tracking

    aio = load_launch_script("all_in_one")
    (tmp_path / "logs").mkdir()
    server = aio.MlflowServer(tmp_path, tmp_path / "logs")
    server.start()
    sign_in(monkeypatch, aio, server)
    relay = SlowArtifactStore(int(server.url.rsplit(":", 1)[1]), delay_s=7.0)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "model.safetensors").write_bytes(os.urandom(1 << 16))
    os.environ.pop(tracking.TIMEOUT_VAR, None)  # (the autouse fixture restores it)
    try:
        for name, timeout_s in (("patient", 600.0), ("hasty", 2.0)):
            tracker = tracking.Tracker(tmp_path / name, enabled=True, final_wait_s=0,
                                       upload_timeout_s=timeout_s)  # fmt: skip
            tracker.start(tracking_uri=relay.endpoint, experiment="slow", run_name=name,
                          params={}, tags={}, resume=False)  # fmt: skip
            assert os.environ[tracking.TIMEOUT_VAR] == tracking.SHORT_TIMEOUT_S
            tracker.log_artifacts(bundle, "model")
            assert os.environ[tracking.TIMEOUT_VAR] == tracking.SHORT_TIMEOUT_S
            if name == "patient":
                assert tracker.warnings == []
                listed = MlflowClient(server.url).list_artifacts(tracker.run_id, "model")
                assert [f.path for f in listed] == ["model/model.safetensors"]
            else:  # (the server may have stored the file: the client stopped waiting)
                assert len(tracker.warnings) == 1 and "log_artifacts model" in tracker.warnings[0]
            tracker.end("FINISHED")

        # the user's own MLFLOW_HTTP_REQUEST_TIMEOUT is theirs, uploads included
        os.environ[tracking.TIMEOUT_VAR] = "3"
        tracking._short_http_timeouts()
        with tracking.upload_timeout(600):
            assert os.environ[tracking.TIMEOUT_VAR] == "3"
    finally:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run()
        relay.stop()
        server.stop()
