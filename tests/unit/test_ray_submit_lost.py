"""launch/ray_submit.py when the cluster goes away while it follows a job: one `plm:` line
and exit 1 (no traceback); a log stream that breaks while the head still answers is not
taken for a lost cluster. Ray's job client is replaced by fakes; no cluster is started."""

from __future__ import annotations

import asyncio

import pytest
import requests
from conftest import load_launch_script
from ray.job_submission import JobStatus

submit = load_launch_script("ray_submit")


class Info:
    def __init__(self, status: JobStatus):
        self.status, self.message = status, ""


class FakeClient:
    """A job client whose log stream breaks at once and whose status answers from
    ``statuses`` (an exception in it is raised)."""

    instances: list[FakeClient] = []

    def __init__(self, address: str, statuses: list):
        self.address, self.statuses, self.asked = address, list(statuses), 0
        FakeClient.instances.append(self)

    def submit_job(self, **kwargs) -> str:
        return kwargs["submission_id"]

    async def tail_job_logs(self, job_id: str):
        yield "prepare: 3/30 units\n"
        await asyncio.sleep(0)
        raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    def get_job_info(self, job_id: str) -> Info:
        self.asked += 1
        answer = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if isinstance(answer, BaseException):
            raise answer
        return Info(answer)


def refused() -> requests.exceptions.ConnectionError:
    return requests.exceptions.ConnectionError(
        "HTTPConnectionPool(host='198.18.0.1', port=8265): Max retries exceeded with url: "
        "/api/jobs/x (Caused by NewConnectionError(...: [Errno 111] Connection refused'))"
    )


@pytest.fixture
def fake_cluster(monkeypatch):
    import ray.job_submission

    made: dict[str, list] = {"statuses": []}
    monkeypatch.setattr(
        ray.job_submission,
        "JobSubmissionClient",
        lambda address: FakeClient(address, made["statuses"]),
    )
    monkeypatch.setattr(submit.time, "sleep", lambda seconds: None)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 64)
    FakeClient.instances.clear()
    return made


ARGV = ["--address", "http://198.18.0.1:8265", "--job-id", "plm-prepare-t", "--",
        "--input", "s3://b/corpus/", "--tokenizer", "/shared/tok", "--output", "s3://b/data"]  # fmt: skip


def test_a_head_that_stops_answering_gives_one_plm_line(fake_cluster, capsys):
    fake_cluster["statuses"] = [refused()]
    assert submit.main(ARGV) == 1
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert "http://198.18.0.1:8265" in line and "plm-prepare-t" in line, line
    assert "connection refused" in line and "ray start --head" in line, line
    assert "rerun this same command" in line and "kept" in line, line
    assert FakeClient.instances[0].asked == submit.STATUS_TRIES  # not on the first failure


def test_a_status_blip_or_a_broken_log_stream_is_not_a_lost_cluster(fake_cluster, capsys):
    fake_cluster["statuses"] = [refused(), JobStatus.RUNNING, refused(), refused(),
                                JobStatus.SUCCEEDED]  # fmt: skip
    assert submit.main(ARGV) == 0
    captured = capsys.readouterr()
    assert "plm:" not in captured.err and "SUCCEEDED" in captured.err, captured.err
    assert "prepare: 3/30 units" in captured.out


def test_the_tokenizer_stage_promises_no_kept_units():
    line = submit.lost_cluster_line("http://h:8265", "j", "tokenizer", "timed out")
    assert line.startswith("plm: ") and "kept" not in line and "trained again" in line
