"""A silent, stuck or slow host under launch/elastic_train.py, at the default settings
(issue 53): 3 hosts x 1 rank, bert-tiny, `train.out_dir` on the bucket through a relay on
the laptop, nothing set but the run's length (and the straggler window, 20 steps instead
of 100, to fit it). One run meets, in turn:

1. node2's link cut (`ip link set down`: nothing dies): the survivors' heartbeat watch
   finds it (`train.heartbeat_timeout_s`, 10 s), each says so in one `plm:` line naming
   node2 and its address, the run goes on on 2 hosts; the link back up, node2 comes back;
2. an upload held: the relay keeps every byte of the next checkpoint's upload for 25 s
   (longer than the heartbeat timeout): no restart, nobody named;
3. node2's CPU starved (a CPU cgroup: a fifth of one CPU): no restart; node2 named as a
   straggler, once per window at most, in MLflow's straggler/* metrics too;
4. node2's rank stuck (its data-loader workers frozen, as over a stalled filesystem; the
   rank and its heartbeat go on): after the progress bound (60 s) it writes its threads'
   stacks and says it is stuck, the others name it, the round starts again on 3 hosts;
5. node2 frozen (SIGSTOP of every process of it, as a frozen VM): named, the run goes on
   on 2 hosts.

The steps after each loss of node2 equal a 2-rank run from the checkpoint the survivors
resumed (torchrun on the laptop) within 1e-4; the steps redone after the stuck round (the
same 3 ranks) are the lost ones, within 1e-5. The figures (detection, rendezvous, start-up)
are bench/bench_elastic_cluster.py's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs
import pytest
from cluster_util import REPO, HeldRelay, cpu_share, pids_of, s3_fs, small_rig
from conftest import build_data_dir, child_pids

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
COLLECTIVE_TIMEOUT_S = 300  # the default: what a silent host cost before the heartbeat
BERT = str(REPO / "configs/test/bert-tiny.yaml")
DRIVER = str(REPO / "tests" / "integration" / "elastic_driver.py")
BUCKET, RUN = rigmod.S3_BUCKET, "silent/run"
HOLD_S = 25  # the held upload: longer than the heartbeat timeout (10 s)
TRAIN = [
    "train.max_steps=100000", "train.save_every=5", "train.eval_every=0",
    "train.log_every=1", "train.global_batch=48", "train.keep_last=100",
    "train.bundle_every=0", "train.straggler_every=20", "mlflow.register=false",
    "data.workers=2",  # the default (the test config has none): a stalled loader to freeze
]  # fmt: skip


def parse(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def training_pids(rig, host: str) -> list[int]:
    return pids_of(rig, host, b"torch.distributed.run", b"pipeline.cli", b"elastic_train.py")


def rank_pid(rig, host: str) -> int:
    """The host's rank: the agent's child (its data-loader workers are the rank's)."""
    agents = set(pids_of(rig, host, b"torch.distributed.run"))
    (rank,) = [p for p in pids_of(rig, host, b"pipeline.cli") if p not in agents
               and int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) in agents]  # fmt: skip
    return rank


class Scenario:
    """The run's agents, logs and every metrics row ever seen (a resume rewrites
    metrics.jsonl from the checkpoint's copy: the rows of lost steps are kept here)."""

    def __init__(self, rig, base: Path, relay: HeldRelay):
        self.rig, self.base, self.relay = rig, base, relay
        self.data = build_data_dir(base)
        self.db = base / "mlflow.db"
        self.logs: dict[str, Path] = {}
        self.agents: dict[str, subprocess.Popen] = {}
        self.seen: dict[tuple[int, int], list[float]] = {}  # (world, step): step_loss values
        self._rows: list[dict] = []

    def start(self, host: str, k: int) -> None:
        # The relay stands for the S3 endpoint: set on the command line, after the rig's.
        cmd = ["env", f"AWS_ENDPOINT_URL={self.relay.url}", f"AWS_ENDPOINT_URL_S3={self.relay.url}",
               sys.executable, str(REPO / "launch" / "elastic_train.py"), "--nnodes", "2:3",
               "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29400", "--skip-dry-run",
               "--run-id", "plm-silent",  # the hosts' commands differ in train.local_dir
               BERT, f"data.path={self.data}", f"train.out_dir=s3://{BUCKET}/{RUN}",
               f"train.local_dir={self.base / ('stage-' + host)}",
               f"mlflow.tracking_uri=sqlite:///{self.db}", *TRAIN]  # fmt: skip
        self.logs[host] = self.base / f"{host}-{k}.log"
        self.agents[host] = self.rig.popen(host, cmd, env={**os.environ, **ENV},
                                           cwd=str(self.base),
                                           stdout=open(self.logs[host], "wb"),  # noqa: SIM115
                                           stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def rows(self) -> list[dict]:
        """Rank 0's metrics.jsonl (the newest of the hosts' staging folders), every row
        remembered in ``seen``."""
        found = [p for h in ("node0", "node1", "node2")
                 if (p := self.base / f"stage-{h}" / "metrics.jsonl").is_file()]  # fmt: skip
        if found:
            newest = max(found, key=lambda p: p.stat().st_mtime)
            try:
                self._rows = parse(newest.read_text())
            except ValueError:  # caught mid-line
                return self._rows
            for r in self._rows:
                if "step_loss" in r:
                    values = self.seen.setdefault((r["world_size"], r["step"]), [])
                    if r["step_loss"] not in values:
                        values.append(r["step_loss"])
        return self._rows

    def wait(self, pred, what: str, limit: float = 600):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            for h, a in self.agents.items():
                if h != "node2" and a.poll() is not None:
                    raise AssertionError(f"{h}'s agent ended: {self.logs[h].read_text()[-4000:]}")
            time.sleep(0.2)
        tails = "\n".join(f"--- {h}\n{p.read_text()[-3000:]}" for h, p in self.logs.items())
        raise AssertionError(f"no {what} within {limit:.0f} s:\n{tails}")

    def changes(self) -> int:
        return max((r.get("elastic/changes", 0) for r in self.rows()), default=0)

    def change_row(self, n: int) -> dict | None:
        return next((r for r in self.rows() if r.get("elastic/changes") == n), None)

    def steps_at(self, world: int) -> int:
        return sum(1 for r in self.rows() if "step_loss" in r and r.get("world_size") == world)

    def last_step(self) -> int:
        return max((r["step"] for r in self.rows() if "step_loss" in r), default=0)

    def mark(self) -> dict[str, int]:
        return {h: len(p.read_text().splitlines()) for h, p in self.logs.items()}

    def lines(self, since: dict[str, int], hosts=("node0", "node1", "node2")) -> list[str]:
        return [x for h in hosts
                for x in self.logs[h].read_text(errors="replace").splitlines()[since.get(h, 0):]
                if x.startswith("plm:")]  # fmt: skip


def lose_node2(sc: Scenario, event: str) -> dict:
    """Cut node2's link or freeze it; the survivors name it and go on on 2 hosts."""
    node2 = sc.rig.host("node2")
    since, before, at = sc.mark(), sc.changes(), time.monotonic()
    if event == "link cut":
        subprocess.run(["ip", "link", "set", node2.veth, "down"], check=True)
    else:
        for pid in training_pids(sc.rig, "node2"):
            os.kill(pid, signal.SIGSTOP)
    row = sc.wait(lambda: sc.change_row(before + 1), f"the round after the {event}")
    took = time.monotonic() - at
    named = [x for x in sc.lines(since, ("node0", "node1")) if "has been silent" in x]
    print(f"{event}: the next step on 2 hosts {took:.1f} s later; {named[:1]}")
    return {"row": row, "took": took, "named": named, "since": since,
            "resumed": resumed_step(sc, since)}  # fmt: skip


def resumed_step(sc: Scenario, since: dict[str, int]) -> int:
    """The step of the checkpoint the round after ``since`` resumed from (rank 0's line)."""
    for h in ("node0", "node1"):
        for x in sc.logs[h].read_text(errors="replace").splitlines()[since.get(h, 0) :]:
            if m := re.search(r"resumed from \S+/checkpoints/step(\d+) at step", x):
                return int(m[1])
    raise AssertionError(f"no 'resumed from' line on node0 or node1 since {since}")


def scenario(rig, base: Path) -> dict:
    endpoint = urlparse(rig.s3_endpoint)
    relay = HeldRelay(rig.laptop, (endpoint.hostname, endpoint.port))
    sc = Scenario(rig, base, relay)
    out: dict = {"sc": sc, "node2": rig.host("node2")}
    try:
        for h in ("node0", "node1", "node2"):
            sc.start(h, 0)
        sc.wait(lambda: sc.steps_at(3) >= 10, "10 steps on 3 hosts")
        # 1. the link cut, then back up: node2's agent, alive all along, comes back by itself
        out["cut"] = lose_node2(sc, "link cut")
        subprocess.run(["ip", "link", "set", out["node2"].veth, "up"], check=True)
        back = sc.changes() + 1
        out["cut"]["back"] = sc.wait(
            lambda: r if (r := sc.change_row(back)) and r["elastic/world_size"] == 3 else None,
            "node2 back after the link came up")  # fmt: skip
        # The 2-host round's last step: node2 may rejoin after its first one already, and the
        # 3-host round resumes from the last checkpoint, at or before it.
        out["cut"]["last_on_2"] = max(step for world, step in sc.seen if world == 2)
        sc.wait(lambda: sc.steps_at(3) >= 20, "steps on 3 hosts again")
        # 2. the next checkpoint's upload held for longer than the heartbeat timeout
        since, before = sc.mark(), sc.changes()
        relay.hold(HOLD_S)
        sc.wait(lambda: relay.held_since is not None, "an upload through the relay")
        held_from = sc.last_step()
        sc.wait(lambda: time.time() > relay.held_since + HOLD_S, "the hold's end")
        sc.wait(lambda: sc.last_step() >= held_from + 10, "10 steps after the hold")
        out["held"] = {"since": since, "changes": (before, sc.changes()),
                       "bytes": relay.held_bytes, "lines": sc.lines(since)}  # fmt: skip
        # 3. node2's CPU starved for three straggler windows
        since, before, first = sc.mark(), sc.changes(), sc.last_step()
        with cpu_share(training_pids(rig, "node2"), 0.2, rig.name):
            sc.wait(lambda: sc.last_step() >= first + 60, "60 steps with node2 starved")
        out["starved"] = {"changes": (before, sc.changes()), "lines": sc.lines(since),
                          "steps": (first, sc.last_step())}  # fmt: skip
        print("starved:", [x for x in out["starved"]["lines"] if "straggler" in x][:2])
        # 4. node2's rank stuck: its loader workers frozen, the rank itself goes on
        since, before = sc.mark(), sc.changes()
        workers = child_pids(rank_pid(rig, "node2"))
        assert workers, "node2's rank has no data-loader worker"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        at = time.monotonic()
        row = sc.wait(lambda: sc.change_row(before + 1), "the round after the stuck rank")
        out["stuck"] = {"row": row, "took": time.monotonic() - at, "lines": sc.lines(since),
                        "log": sc.logs["node2"].read_text(errors="replace")[-20000:]}  # fmt: skip
        print(f"stuck: the round after {out['stuck']['took']:.1f} s;", out["stuck"]["lines"][:3])
        for pid in workers:  # the agent may have ended them already
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        # The last step before it (rows past it, after the round, are the round's own).
        top = max(int(m[1]) for x in out["stuck"]["lines"]
                  if (m := re.search(r"after step (\d+)", x)))  # fmt: skip
        sc.wait(lambda: sc.last_step() >= top + 3, "3 steps past the stuck round's last")
        # 5. node2 frozen: the run goes on on 2 hosts
        out["frozen"] = lose_node2(sc, "frozen")
        after = range(out["frozen"]["resumed"] + 1, out["frozen"]["resumed"] + 6)
        sc.wait(lambda: sc.rows() and all((2, k) in sc.seen for k in after),
                "5 steps on 2 after the freeze")  # fmt: skip
        sc.rows()
    finally:
        relay.close()
    return out


@pytest.fixture(scope="module")
def silent_run(tmp_path_factory):
    name = f"s{os.getpid() % 100000}"
    rig = small_rig(name, 3, ssh=False, shared=True)
    try:
        base = rig.shared / "silent"
        base.mkdir()
        yield scenario(rig, base)
    finally:
        for h in rig.hosts:
            for pid in training_pids(rig, h.name):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        rigmod.down(name)


def test_a_cut_link_and_a_frozen_host_are_named_and_the_run_goes_on(silent_run):
    node2 = silent_run["node2"]
    for event in ("cut", "frozen"):
        got = silent_run[event]
        row = got["row"]
        assert row["elastic/world_size"] == 2 and row["elastic/old_world_size"] == 3, row
        assert got["took"] < COLLECTIVE_TIMEOUT_S, got["took"]
        assert len(got["named"]) == 2, got  # one per survivor (one rank each)
        assert all(f"on node2 ({node2.address})" in x for x in got["named"]), got["named"]


def test_a_held_upload_and_a_starved_host_cost_no_restart(silent_run):
    held, starved = silent_run["held"], silent_run["starved"]
    assert held["bytes"] > 0  # the hold kept an upload's bytes
    for got in (held, starved):
        assert got["changes"][0] == got["changes"][1], got
        assert not [x for x in got["lines"] if "silent" in x or "stuck" in x], got["lines"]


def test_a_starved_host_is_named_as_a_straggler_once_per_window(silent_run):
    node2 = silent_run["node2"]
    named = [x for x in silent_run["starved"]["lines"] if "is a straggler" in x]
    first, last = silent_run["starved"]["steps"]
    assert named and all(f"on node2 ({node2.address})" in x for x in named), named
    assert len(named) <= (last - first) // 20 + 1, named


def test_a_stuck_rank_writes_its_stacks_is_named_and_the_round_starts_again(silent_run):
    node2, stuck = silent_run["node2"], silent_run["stuck"]
    assert stuck["row"]["elastic/world_size"] == 3, stuck["row"]
    mine = [x for x in stuck["lines"] if "this rank made no progress" in x]
    assert len(mine) == 1 and "on node2:" in mine[0], stuck["lines"]
    assert "dataloader.py" in stuck["log"] and "Thread 0x" in stuck["log"]  # its stacks
    named = [x for x in stuck["lines"] if f"on node2 ({node2.address}) made no progress" in x]
    assert len(named) == 2, stuck["lines"]  # node0's and node1's
    # The steps redone after it (3 ranks again, from the last checkpoint) are the lost ones
    # (the ranks' order may change: the same sums in another order).
    sc = silent_run["sc"]
    for key, values in sc.seen.items():
        if key[0] == 3 and len(values) > 1:
            assert max(values) == pytest.approx(min(values), rel=1e-5), (key, values)


def test_steps_after_each_loss_equal_a_two_rank_run_from_that_checkpoint(silent_run,
                                                                         tmp_path):  # fmt: skip
    sc = silent_run["sc"]
    plan, refs = [], {}
    for event in ("cut", "frozen"):
        start = silent_run[event]["resumed"]
        end = silent_run["cut"]["last_on_2"] if event == "cut" else start + 5
        tag = f"step{start:08d}"
        ref_dir = tmp_path / event
        pafs.copy_files(f"{BUCKET}/{RUN}/checkpoints/{tag}", str(ref_dir / "checkpoints" / tag),
                        source_filesystem=s3_fs(sc.rig))  # fmt: skip
        (ref_dir / "checkpoints" / "latest").write_text(tag)
        overrides = [f"data.path={sc.data}", f"train.out_dir={ref_dir}",
                     f"mlflow.tracking_uri=sqlite:///{tmp_path / (event + '.db')}", *TRAIN]  # fmt: skip
        plan.append({"config": BERT, "overrides": overrides, "stop_after": end})
        refs[event] = (ref_dir, start, end)
        print(f"{event}: resumed from step {start}, compared to step {end}")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, **ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", DRIVER, str(tmp_path / "plan.json")],
                   env=env, check=True, capture_output=True, cwd=tmp_path)  # fmt: skip
    for event, (ref_dir, start, end) in refs.items():
        assert (ref_dir / "metrics.jsonl").is_file(), (event, start, end, silent_run[event])
        ref = {r["step"]: r["step_loss"] for r in parse((ref_dir / "metrics.jsonl").read_text())
               if "step_loss" in r}  # fmt: skip
        assert sorted(ref) == list(range(start + 1, end + 1)), (event, sorted(ref))
        for step, value in ref.items():
            got = sc.seen.get((2, step))
            near = {k: v for k, v in sc.seen.items() if abs(k[1] - step) <= 3}
            assert got and len(got) == 1, (event, step, got, silent_run[event]["row"], near)
            assert got[0] == pytest.approx(value, rel=1e-4), (event, step, got, value)


def test_one_mlflow_run_holds_the_tags_and_metrics(silent_run):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{silent_run['sc'].db}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    silent = {k: v for k, v in found.data.tags.items() if k.startswith("elastic/silent_")}
    assert len(silent) >= 2 and all("node2" in v for v in silent.values()), found.data.tags
    assert "elastic/silent_detect_s" in found.data.metrics
    assert "node2" in found.data.tags.get("straggler/last", ""), found.data.tags
    ranks = client.get_metric_history(found.info.run_id, "straggler/rank")
    assert ranks, "no straggler/rank metric"
