"""launch/ray_submit.py against a real `ray start --head` cluster with token authentication."""

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, load_launch_script, plm

from pipeline.data.shards import DataDir
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SUBMIT = REPO / "launch" / "ray_submit.py"


# Its port picking, and its stop of one head's processes by their temp dir (not `ray stop`:
# that stops every Ray process on the machine, other users' included).
aio = load_launch_script("all_in_one")


@pytest.fixture(scope="module")
def head():
    """A one-node cluster with token auth, its own ports and temp dir; torn down after."""
    # short: unix socket paths; named "ray" so that RAY_TMPDIR=<its parent> finds it
    temp_dir = str(Path(tempfile.mkdtemp(prefix="plmray-", dir="/tmp")) / "ray")
    Path(temp_dir).mkdir()
    token = Path(temp_dir) / "token"
    token.write_text(secrets.token_hex(32))
    gcs, dash, client, nm, om, agent, agent_grpc, rt, metrics, wmin = aio.free_ports(10)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # one machine: loopback addresses only
    }
    env.pop("RAY_ADDRESS", None)
    cmd = [
        "ray", "start", "--head", "--num-cpus", "2", "--temp-dir", temp_dir,
        "--port", str(gcs), "--dashboard-port", str(dash), "--include-dashboard", "true",
        "--dashboard-host", "127.0.0.1", "--ray-client-server-port", str(client),
        "--node-manager-port", str(nm), "--object-manager-port", str(om),
        "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
        "--runtime-env-agent-port", str(rt), "--metrics-export-port", str(metrics),
        "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats",
    ]  # fmt: skip
    try:
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=180)
        yield {"address": f"http://127.0.0.1:{dash}", "token": token, "temp_dir": temp_dir}
    except subprocess.CalledProcessError as err:
        pytest.fail(f"ray start failed:\n{err.stdout}\n{err.stderr}")
    finally:
        client_server = f"--address=127.0.0.1:{gcs} "  # its command line lacks temp_dir
        killed = aio.stop_ray_head(temp_dir, client_server)
        assert not killed, f"these Ray processes needed SIGKILL: {killed}"
        assert not aio.processes_with(temp_dir) and not aio.processes_with(client_server)


def submit(args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(SUBMIT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        cwd=REPO,
    )


def test_prepare_runs_as_a_ray_job_with_token_auth(head, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Document {i} tells a short story about item {i * 7}." for i in range(60))
    )
    tok = train_tokenizer(
        [str(corpus)], TokenizerSpec(kind="wordpiece", vocab_size=200), tmp_path / "tok"
    )
    out = tmp_path / "data"
    prepare_args = ["--", "--input", str(corpus), "--tokenizer", str(tok), "--output", str(out),
                    "--shard-docs", "20", "--valid-fraction", "0.1"]  # fmt: skip
    # No token: the cluster refuses, and the script says how to give one.
    refused = submit(["--address", head["address"], *prepare_args], {"HOME": str(tmp_path)})
    assert refused.returncode == 2, refused.stderr
    assert "token" in refused.stderr and not out.exists()
    # With the token (found through RAY_AUTH_TOKEN_PATH): submitted, followed, succeeded.
    done = submit(
        [
            "--address",
            head["address"],
            "--job-id",
            f"plm-test-{secrets.token_hex(3)}",
            *prepare_args,
        ],
        {"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(head["token"])},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "auth: token from RAY_AUTH_TOKEN_PATH" in done.stderr
    assert "SUCCEEDED" in done.stderr
    # Ray's lines about packaging the working_dir only with -v.
    assert " INFO " not in done.stderr and " WARNING " not in done.stderr, done.stderr
    data = DataDir(out)
    assert data.verify() == []
    assert data.manifest["totals"]["documents_kept"] == 60

    # `plm data prepare` without an address while that cluster runs and is the latest one
    # `ray start` made (in the Ray temp dir the prepare sees, where a bare ray.init() looks
    # for one to join): a local Ray of its own with the CPUs asked for, the cluster's shards.
    assert (Path(head["temp_dir"]) / "ray_current_cluster").is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(Path(head["temp_dir"]).parent)
    local = tmp_path / "local"
    plm("data", "prepare", *prepare_args[1:5], "--output", str(local), "--shard-docs", "20",
        "--valid-fraction", "0.1", "--num-cpus", "1", cwd=tmp_path, env=env)  # fmt: skip
    shards = sorted(p.relative_to(out) for p in out.rglob("*.tar"))
    assert shards and shards == sorted(p.relative_to(local) for p in local.rglob("*.tar"))
    assert all((out / s).read_bytes() == (local / s).read_bytes() for s in shards)


def test_a_failing_job_exits_non_zero(head, tmp_path):
    failed = submit(
        [
            "--address",
            head["address"],
            "--",
            "--input",
            str(tmp_path / "missing.txt"),
            "--tokenizer",
            str(tmp_path),
            "--output",
            str(tmp_path / "out"),
        ],  # fmt: skip
        {"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(head["token"])},
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "FAILED" in failed.stderr
    assert "missing.txt" in failed.stdout  # the job's own error, streamed back
