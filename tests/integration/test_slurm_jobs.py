"""Jobs on a Slurm cluster (``train --launcher slurm``, ``submit --backend slurm``), on
network-namespace hosts.

A test cluster (:class:`~elasticps.testing.slurm.SlurmCluster`): munged and
slurmctld on this machine, a slurmd on each of three namespace hosts. The audit
model (one counter per record) must come out exact after a node's death
(every process of it SIGKILLed and its link set down): once inside an
allocation made with ``salloc``, once as a batch job made with ``submit
--backend slurm`` (then read with ``status``, ``logs`` and ``list``); and
``stop`` ends a second submitted job.

Skipped where network namespaces cannot be made or Slurm is not installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.testing import kill_leftovers, wait_for, wait_for_shard_checkpoint
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.testing.slurm import SlurmCluster, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]

WHY_NOT = unavailable()
if WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=WHY_NOT))

RECORDS = 4000
EPOCHS = 30
JOB_TIMEOUT_S = 140.0
_STARTED = re.compile(r"started (ps|trainer) on (h\d+) \(srun pid (\d+)\)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with SlurmCluster(3) as made:
        yield made


@pytest.fixture()
def nodes(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield cluster
    for name in cluster.hosts.hosts:  # every node up again for the next test
        cluster.revive_node(name)
    cluster.wait_idle(list(cluster.hosts.hosts), timeout_s=60.0)


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit")
    write_dataset(out, RECORDS)
    return out


def placements(out: Path) -> list[tuple[str, str]]:
    """``(role kind, node)`` of every role the launcher started on a node, in order."""
    path = out / "logs" / "launcher.log"
    log = path.read_text() if path.exists() else ""
    return [(m.group(1), m.group(2)) for m in _STARTED.finditer(log)]


def kill_first_ps_node(cluster: SlurmCluster, out: Path, spare: str = "") -> str:
    """Kill the node of the first PS (not ``spare``), once a shard is checkpointed."""
    wait_for_shard_checkpoint(out)
    victim = next(h for kind, h in placements(out) if kind == "ps" and h != spare)
    cluster.kill_node(victim)
    return victim


def assert_exact(out: Path, stdout: str) -> None:
    line = json.loads(stdout.strip().splitlines()[-1])
    assert line["exactly_once"] is True, line
    assert line["samples_trained"] == RECORDS * EPOCHS, line
    audit = check_run(out)
    assert audit.exactly_once, audit.as_dict()
    assert audit.exact == RECORDS


def test_a_dead_node_in_an_allocation_costs_no_update(
    nodes: SlurmCluster, audit_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    train = [sys.executable, "-m", "elasticps", "train", "--launcher", "slurm",
             *train_args(audit_dir, out, "sync", EPOCHS), "--no-progress"]  # fmt: skip
    argv = ["timeout", str(int(JOB_TIMEOUT_S)), "salloc", "-N3", "--no-kill", "--quiet", *train]
    proc = subprocess.Popen(
        argv, env=nodes.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        victim = kill_first_ps_node(nodes, out)
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(out / "pids.json")
    assert proc.returncode == 0, stderr[-4000:]
    assert_exact(out, stdout)
    later = placements(out)[5:]  # after the first two PS and three trainers
    assert ("ps", victim) not in later and any(kind == "ps" for kind, _ in later), later
    assert "stopped answering" in stderr or "does not answer" in stderr, stderr[-3000:]


def elasticps(env: dict[str, str], *args: str, timeout_s: float = 60.0) -> tuple[int, str, str]:
    """Run ``elasticps ARGS``; return its status, stdout and stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "elasticps", *args],
        env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def job_status(env: dict[str, str], job: str) -> dict[str, object]:
    rc, out, err = elasticps(env, "status", job, "--backend", "slurm", "--json")
    assert rc == 0, err[-2000:]
    status: dict[str, object] = json.loads(out)
    return status


def test_a_submitted_job_survives_a_dead_node_and_the_job_commands_read_it(
    nodes: SlurmCluster, audit_dir: Path, tmp_path: Path
) -> None:
    env = nodes.env()
    env["ELASTICPS_STATE_DIR"] = str(tmp_path / "state")
    out = tmp_path / "run"
    job = "audit-slurm"
    try:
        rc, stdout, err = elasticps(
            env, "submit", "--backend", "slurm", "--nodes", "3", "--job", job,
            *train_args(audit_dir, out, "sync", EPOCHS),
        )  # fmt: skip
        assert rc == 0, err[-3000:]
        assert json.loads(stdout)["job"] == job
        # The launcher runs on the allocation's first node; another one dies.
        victim = kill_first_ps_node(nodes, out, spare="h0")
        wait_for(
            lambda: (
                job_status(env, job)["state"] not in ("pending", "starting", "running", "stopping")
            ),
            "the submitted job's end",
            timeout_s=JOB_TIMEOUT_S,
            interval_s=0.5,
        )
        status = job_status(env, job)
        assert status["state"] == "finished", status
        batch = Path(str(status["log"])).read_text()  # train's stdout and stderr
        assert_exact(out, next(x for x in reversed(batch.splitlines()) if x.startswith("{")))
        later = placements(out)[5:]
        assert ("ps", victim) not in later and any(kind == "ps" for kind, _ in later), later
        rc, logs, err = elasticps(env, "logs", job, "--backend", "slurm", "--role", "launcher")
        assert rc == 0 and "[sbatch] {" in logs and "[launcher]" in logs, (logs[-2000:], err)
        rc, listing, err = elasticps(env, "list", "--backend", "slurm", "--json")
        assert rc == 0, err
        rows = [json.loads(line) for line in listing.splitlines()]
        assert [(r["job"], r["state"]) for r in rows] == [(job, "finished")], rows
    finally:
        kill_leftovers(out / "pids.json")
        _cancel_all(env)


def test_stop_ends_a_submitted_job_cleanly(
    nodes: SlurmCluster, audit_dir: Path, tmp_path: Path
) -> None:
    env = nodes.env()
    env["ELASTICPS_STATE_DIR"] = str(tmp_path / "state")
    out = tmp_path / "run"
    job = "audit-stop"
    try:
        rc, _, err = elasticps(
            env, "submit", "--backend", "slurm", "--nodes", "2", "--job", job,
            *train_args(audit_dir, out, "async", 100_000),
        )  # fmt: skip
        assert rc == 0, err[-3000:]
        wait_for_shard_checkpoint(out)
        rc, stopped, err = elasticps(env, "stop", job, "--backend", "slurm", timeout_s=120)
        assert rc == 0, err[-3000:]
        assert json.loads(stopped)["state"] == "stopped", stopped
        assert job_status(env, job)["state"] == "stopped"
    finally:
        kill_leftovers(out / "pids.json")
        _cancel_all(env)


def _cancel_all(env: dict[str, str]) -> None:
    """Cancel every Slurm job left (a failed test's), so the next test has the nodes."""
    subprocess.run(["scancel", "--user", str(os.getuid())], env=env, timeout=30, check=False)


_API_SCRIPT = """
import json, sys
import elasticps
from elasticps import updater

data, out, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = data + "/audit_model.py"
seen = []
params = elasticps.train(
    model, None, elasticps.Parquet.from_model_file(data, model, records_per_task=200),
    updater=updater.SGD(lr=1.0), num_passes=epochs, event_handler=seen.append,
    cluster=elasticps.Slurm(output=out, trainers=3, ps=2, sync_reduction="sum",
                            big_array_bound=500, lease_ttl_s=2, checkpoint_every_s=1),
)
counter = params["counter"]
print(json.dumps({"events": [type(e).__name__ for e in seen],
                  "counter": [float(counter.min()), float(counter.max())]}))
"""


def test_the_python_api_runs_a_job_in_an_allocation(
    nodes: SlurmCluster, audit_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    script = tmp_path / "api_job.py"
    script.write_text(_API_SCRIPT)
    epochs = 3
    argv = ["timeout", str(int(JOB_TIMEOUT_S)), "salloc", "-N3", "--no-kill", "--quiet",
            sys.executable, str(script), str(audit_dir), str(out), str(epochs)]  # fmt: skip
    try:
        done = subprocess.run(argv, env=nodes.env(), capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S + 10, check=False)  # fmt: skip
    finally:
        kill_leftovers(out / "pids.json")
        _cancel_all(nodes.env())
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["events"][0] == "BeginTraining" and result["events"][-1] == "EndTraining"
    # Every record applied once per pass, in the set train() returned.
    assert result["counter"] == [float(epochs), float(epochs)], result
    assert check_run(out).exactly_once
    assert {node for _, node in placements(out)} <= set(nodes.hosts.hosts)
    assert len({node for kind, node in placements(out) if kind == "ps"}) == 2
