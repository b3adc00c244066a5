"""One failure schedule through each way of running a job: the same decisions, the same end.

The schedule: every trainer ends with an internal error (status 1 from the
model's ``forward``; an exception there would be a user error), so the
supervision policy replaces the first ones and fails the job once
:data:`~elasticps.launcher.supervisor.MAX_TRAINER_FAILURES` failed in a row
with no task progress in between. Each entry of :data:`PATHS` runs a job
that way and returns what it saw; another backend is one more entry.

A trainer of :class:`elasticps.Local` is a thread of the caller, so its
"status 1" is ``SystemExit(1)`` raised in ``forward``: the thread ends as a
trainer process ends on ``sys.exit(1)``, with the status the policy reads.
A worker of :func:`elasticps.dist_train` runs the user's whole script, so
the policy (``replace_trainers=False``) fails the job at the first failure:
the same policy, one decision. Both record the failed job in an output
directory, so that ``status`` and ``list`` read it as for the others.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_k8s import FakeKubeServer

from elasticps.cli import main
from elasticps.config import KubernetesConfig, ManagerConfig
from elasticps.coord.etcd_server import EtcdServer
from elasticps.coord.store import JobStore
from elasticps.launcher.kubernetes import in_cluster_manager, job_selector
from elasticps.launcher.supervisor import MAX_TRAINER_FAILURES
from elasticps.testing import kill_leftovers, run_elasticps, wait_for
from elasticps.testing.hosts import NamespaceHosts
from elasticps.testing.hosts import unavailable as hosts_unavailable
from elasticps.testing.slurm import SlurmCluster
from elasticps.testing.slurm import unavailable as slurm_unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB_TIMEOUT_S = 200.0
COMMAND_TIMEOUT_S = 90.0

# The MNIST MLP, whose trainers (never the launcher) end with status 1 in forward.
FAILING_MODEL = (
    (EXAMPLES / "mnist_mlp.py").read_text()
    + """

_Working = Model


class Model(_Working):  # type: ignore[no-redef]
    def forward(self, inputs: Tensor) -> Tensor:
        import os
        import threading

        if os.environ.get("ELASTICPS_ROLE") == "trainer":
            os._exit(1)  # an internal error: an exception here is the user's (status 2)
        if threading.current_thread().name.startswith("trainer-"):
            raise SystemExit(1)  # a trainer thread of Local(): the same end
        return super().forward(inputs)
"""
)


@dataclass(frozen=True)
class Seen:
    """What one path saw of the job.

    Attributes:
        exit_code: the job's exit status (the command's, or the error's).
        error: the job's one-line error.
        decisions: ``(role, happened, decided)`` of each trainer decision, the
            decision's text cut at its first ``:``.
        state: the job's state as ``elasticps status`` reads it.
        listed: the job's state in ``elasticps list``.
    """

    exit_code: int
    error: str
    decisions: tuple[tuple[str, str, str], ...]
    state: str
    listed: str


def _cli(tmp_path: Path, data: Path, model: Path) -> Seen:
    output = tmp_path / "out"
    done = run_elasticps(_train_args(data, model, output), timeout_s=JOB_TIMEOUT_S, cwd=tmp_path)
    return _seen(done.returncode, done.stderr, output)


def _seen(returncode: int, stderr: str, output: Path) -> Seen:
    """What a ``train`` command that ended with ``returncode`` and ``stderr`` left in
    ``output`` (its directory, alone in its parent), as ``status`` and ``list`` read it."""
    record = json.loads((output / "run.json").read_text())
    errors = [line for line in stderr.splitlines() if line.startswith("elasticps: ")]
    return Seen(
        returncode, errors[-1] if errors else stderr[-2000:], _decisions(record), *_states(output)
    )


def _states(output: Path) -> tuple[str, str]:
    """The state of the run in ``output`` (alone in its parent) in ``status``, and in ``list``."""
    status = run_elasticps(
        ["status", "--output", output, "--json"], timeout_s=COMMAND_TIMEOUT_S, cwd=output.parent
    )
    assert status.returncode == 0, status.stderr
    listing = run_elasticps(["list", output.parent, "--json"], timeout_s=COMMAND_TIMEOUT_S)
    assert listing.returncode == 0, listing.stderr
    rows = [json.loads(line) for line in listing.stdout.splitlines() if line.strip()]
    return json.loads(status.stdout)["state"], (
        rows[0]["state"] if len(rows) == 1 else f"rows: {rows}"
    )


def _decisions(record: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """``Seen.decisions`` from a ``run.json`` (or a Kubernetes job's ``status``)."""
    return tuple(
        (d["role"], d["happened"], d["decided"].split(":")[0])
        for d in record["decisions"]
        if d["role"] == "trainer"
    )


def _train_args(data: Path, model: Path, output: Path) -> list[str | Path]:
    """The failing job's ``train`` flags: the MNIST MLP, 1 trainer, 1 PS, 1 epoch."""
    return ["train", "--model", model, "--data", data, "--output", output, "--no-progress",
            "--trainers", "1", "--ps", "1", "--epochs", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def ssh_hosts() -> Iterator[NamespaceHosts]:
    """One namespace host with sshd (skips where none can be made)."""
    why = hosts_unavailable()
    if why is not None:
        pytest.skip(why)
    with NamespaceHosts(1) as made:
        yield made


def _ssh_hosts(tmp_path: Path, data: Path, model: Path, hosts: NamespaceHosts) -> Seen:
    """``train --hosts FILE`` over ssh to a namespace host."""
    output = tmp_path / "out"
    host_file = tmp_path / "hosts.txt"
    host_file.write_text("".join(f"{name} slots=3\n" for name in hosts.hosts))
    try:
        done = run_elasticps(
            [*_train_args(data, model, output),
             "--hosts", host_file, "--ssh-config", hosts.ssh_config],
            timeout_s=JOB_TIMEOUT_S,
            cwd=tmp_path,
        )  # fmt: skip
    finally:
        kill_leftovers(output / "pids.json")
    return _seen(done.returncode, done.stderr, output)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A one-node test Slurm cluster (skips where none can be made)."""
    why = slurm_unavailable()
    if why is not None:
        pytest.skip(why)
    with SlurmCluster(1) as made:
        yield made


def _slurm(tmp_path: Path, data: Path, model: Path, cluster: SlurmCluster) -> Seen:
    """``train --launcher slurm`` inside an allocation made with ``salloc``."""
    output = tmp_path / "out"
    train = [sys.executable, "-m", "elasticps", *map(str, _train_args(data, model, output)),
             "--launcher", "slurm"]  # fmt: skip
    try:
        done = subprocess.run(
            ["timeout", str(int(JOB_TIMEOUT_S)), "salloc", "-N1", "--quiet", *train],
            env=cluster.env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S + 10,
            cwd=tmp_path, check=False,
        )  # fmt: skip
    finally:
        kill_leftovers(output / "pids.json")
    return _seen(done.returncode, done.stderr, output)


def _slurm_submit(tmp_path: Path, data: Path, model: Path, cluster: SlurmCluster) -> Seen:
    """``submit --backend slurm``; then ``status`` and ``list --backend slurm``."""
    env = cluster.env()
    env["ELASTICPS_STATE_DIR"] = str(tmp_path / "state")
    output = tmp_path / "out"
    job = "failing-slurm"
    backend = ["--backend", "slurm"]

    def status() -> dict[str, Any]:
        done = run_elasticps(["status", job, *backend, "--json"], timeout_s=COMMAND_TIMEOUT_S,
                             env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return dict(json.loads(done.stdout))

    args = _train_args(data, model, output)[1:]  # the flags, without "train"
    try:
        done = run_elasticps(
            ["submit", *backend, "--nodes", "1", "--job", job,
             *[a for a in args if a != "--no-progress"]],
            timeout_s=COMMAND_TIMEOUT_S, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        wait_for(
            lambda: status()["state"] not in ("pending", "starting", "running", "stopping"),
            "the submitted job's end",
            timeout_s=JOB_TIMEOUT_S,
            interval_s=0.5,
        )
        state = status()["state"]
        listing = run_elasticps(["list", *backend, "--json"], timeout_s=COMMAND_TIMEOUT_S,
                                env=env)  # fmt: skip
        assert listing.returncode == 0, listing.stderr
        rows = [json.loads(line) for line in listing.stdout.splitlines() if line.strip()]
    finally:
        kill_leftovers(output / "pids.json")
        subprocess.run(["scancel", "--user", str(os.getuid())], env=env, timeout=30, check=False)
    record = json.loads((output / "run.json").read_text())
    return Seen(
        record["exit_code"],
        f"elasticps: {record['error']}",
        _decisions(record),
        state,
        rows[0]["state"] if len(rows) == 1 else f"rows: {rows}",
    )


def _local_api(tmp_path: Path, data: Path, model: Path) -> Seen:
    """:func:`elasticps.train` with ``cluster=Local(output=...)``: trainer threads, server
    processes; the error carries the decisions, and ``run.json`` records the same."""
    import elasticps
    from elasticps.errors import JobFailedError
    from elasticps.model_file import load_model_file

    spec = load_model_file(model)
    reader = elasticps.Parquet.from_model_file(data / "train.parquet", model, batch_size=64)
    output = tmp_path / "out"
    with pytest.raises(JobFailedError) as raised:
        elasticps.train(spec.build(), spec.loss, reader,
                        cluster=elasticps.Local(trainers=1, ps=1, output=output))  # fmt: skip
    decisions = _decisions({"decisions": raised.value.decisions})
    record = json.loads((output / "run.json").read_text())
    assert (record["launcher"], record["exit_code"]) == ("python-api", 1), record
    assert _decisions(record) == decisions
    return Seen(1, f"elasticps: {raised.value}", decisions, *_states(output))


DIST_SCRIPT = """
import os
import sys

from elasticps.dist import dist_train


def work():
    os._exit(1)  # an internal error of the worker (the user's script)


if __name__ == "__main__":
    try:
        dist_train(work, workers=1, ps=1, timeout_s=120, output="out")
    except Exception as exc:
        import json
        print(json.dumps({"error": str(exc), "decisions": getattr(exc, "decisions", [])}))
        sys.exit(1)
"""


def _dist_train(tmp_path: Path, data: Path, model: Path) -> Seen:
    """:func:`elasticps.dist_train` from a script: its worker exits 1 at once."""
    del data, model  # the worker is the user's script itself
    script = tmp_path / "dist_job.py"
    script.write_text(DIST_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, cwd=tmp_path, check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    raised = json.loads(lines[-1])
    output = tmp_path / "out"
    record = json.loads((output / "run.json").read_text())
    assert (record["launcher"], record["exit_code"]) == ("dist_train", 1), record
    assert _decisions(record) == _decisions(raised)
    return Seen(done.returncode, f"elasticps: {raised['error']}", _decisions(record),
                *_states(output))  # fmt: skip


@dataclass(frozen=True)
class FakeCluster:
    """The fake Kubernetes API server, and the etcd (and key prefix) of the job's master."""

    kube: FakeKubeServer
    etcd: EtcdServer
    etcd_job: str


@pytest.fixture()
def fake_cluster(
    etcd_server: EtcdServer, job_name: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeCluster]:
    """The fake API server (schedules pods at once, runs no containers), whose address
    the in-cluster credentials give."""
    from kubernetes import client
    from kubernetes import config as kube_config

    with FakeKubeServer() as kube:
        monkeypatch.setattr(
            kube_config,
            "load_incluster_config",
            lambda: client.Configuration.set_default(client.Configuration(host=kube.url)),
        )
        try:
            yield FakeCluster(kube, etcd_server, job_name)
        finally:
            client.Configuration.set_default(None)


def _kubernetes(tmp_path: Path, data: Path, model: Path, fake: FakeCluster) -> Seen:
    """``submit --backend kubernetes`` to the fake API server, with the master's in-cluster
    worker manager; the test plays the kubelet: each trainer pod's container exits 1."""
    kube = fake.kube
    ns, job, image = "ml", "failing", "registry.example/elasticps:1"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
    }))  # fmt: skip
    cluster = ["--backend", "kubernetes", "--namespace", ns, "--kubeconfig", str(kubeconfig)]

    def command(*args: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(list(args)) == 0, args
        return out.getvalue()

    command("submit", *cluster, "--image", image, "--job", job, "--model", str(model),
            "--data", str(data / "train.parquet"), "--trainers", "1", "--ps", "1",
            "--epochs", "1")  # fmt: skip
    hook = in_cluster_manager(
        job,
        ManagerConfig(min_trainers=1, max_trainers=1, backoff_base_s=0.1, backoff_cap_s=0.2,
                      tick_s=0.05),
        ps=1,
        config=KubernetesConfig(namespace=ns, image=image),
        state_poll_s=0.1,
    )  # fmt: skip
    trainers = f"{job_selector(job)},elasticps/role=trainer"
    records = f"{job_selector(job)},elasticps/role=state"

    def trainers_exit_1() -> bool:
        for pod in kube.objects("pods", ns, trainers):
            if pod["status"]["phase"] == "Running":
                kube.finish(ns, pod["metadata"]["name"], exit_code=1, reason="Error")
        return bool(kube.objects("configmaps", ns, records))

    with JobStore(fake.etcd.endpoint, fake.etcd_job) as store:
        stop = hook(store)
        try:
            wait_for(trainers_exit_1, "the job's failure recorded", timeout_s=JOB_TIMEOUT_S)
        finally:
            stop()
    status = json.loads(command("status", job, *cluster, "--json"))
    rows = [json.loads(line) for line in command("list", *cluster, "--json").splitlines()]
    return Seen(
        status["exit_code"],
        f"elasticps: {status['failure']}",
        _decisions(status),
        status["state"],
        rows[0]["state"] if len(rows) == 1 else f"rows: {rows}",
    )


@dataclass(frozen=True)
class JobPath:
    """One way of running a job.

    Attributes:
        name: the test id.
        run: runs the failing job in a fresh directory with the MNIST data
            and the model file, then the values of the fixtures ``needs``;
            returns what it saw.
        records_decisions: whether ``Seen.decisions`` is filled.
        needs: names of the fixtures (the test hosts, a cluster) ``run`` takes.
        replaces_trainers: whether the path's policy replaces a failed trainer
            (all but ``dist_train``, whose workers each run the whole script).
    """

    name: str
    run: Callable[..., Seen]
    records_decisions: bool = True
    needs: tuple[str, ...] = ()
    replaces_trainers: bool = True


PATHS = [
    JobPath("cli", _cli),
    JobPath("ssh-hosts", _ssh_hosts, needs=("ssh_hosts",)),
    JobPath("slurm", _slurm, needs=("slurm_cluster",)),
    JobPath("slurm-submit", _slurm_submit, needs=("slurm_cluster",)),
    JobPath("kubernetes", _kubernetes, needs=("fake_cluster",)),
    JobPath("local-api", _local_api),
    JobPath("dist_train", _dist_train, replaces_trainers=False),
]
"""The ways of running a job."""


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_trainers_that_keep_failing_fail_the_job(
    path: JobPath, mnist_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model = tmp_path / "failing_mlp.py"
    model.write_text(FAILING_MODEL)
    seen = path.run(tmp_path, mnist_dir, model, *map(request.getfixturevalue, path.needs))
    assert seen.exit_code == 1, seen.error
    assert (seen.state, seen.listed) == ("failed", "failed"), seen
    if not path.replaces_trainers:
        assert seen.decisions == (("trainer", "exit 1", "fail (exit 1)"),), seen.decisions
        assert "status 1" in seen.error, seen.error
        return
    assert "trainers keep failing" in seen.error, seen.error
    if path.records_decisions:
        limit = MAX_TRAINER_FAILURES
        assert seen.decisions[:limit] == (
            *[("trainer", "exit 1", "replace")] * (limit - 1),
            ("trainer", "exit 1", "fail (exit 1)"),
        ), seen.decisions
        assert all(d[2] == "ignore" for d in seen.decisions[limit:]), seen.decisions
