"""The Kubernetes backend and the worker manager against the fake API server.

The official ``kubernetes`` client talks HTTP to :class:`fake_k8s.FakeKubeServer`
on a loopback port. ``elasticps submit``/``delete`` run in-process through
:func:`elasticps.cli.main` with a kubeconfig pointing at the fake. The test
plays the master pod: it runs the same worker manager the master runs
(:func:`elasticps.launcher.kubernetes.build_manager`), with a fast backoff,
and an injected progress source for stuck detection.

This is not a live cluster: the fake schedules pods at once and runs no
containers (see ``tests/fake_k8s/server.py``).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fake_k8s import FakeKubeServer
from kubernetes import client

from elasticps.cli import main
from elasticps.config import CommonConfig, KubernetesConfig, ManagerConfig, MasterConfig
from elasticps.coord.etcd_server import EtcdServer
from elasticps.coord.store import JobStore
from elasticps.errors import UnschedulableError
from elasticps.launcher.backend import Role, WorkerEvent, WorkerSpec, WorkerState
from elasticps.launcher.kubernetes import (
    ConfigMapDesiredCount,
    KubernetesBackend,
    build_manager,
    job_selector,
    mark_job_failed,
    master_owner,
    set_wanted_trainers,
)
from elasticps.launcher.manager import WorkerManager, policy_event
from elasticps.launcher.pod_events import PodEventListener
from elasticps.launcher.supervisor import FailJob, decision_of
from elasticps.master.main import serve_master
from elasticps.netutil import LOOPBACK
from elasticps.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NS = "ml"
JOB = "kjob"
TRAINERS = "elasticps/role=trainer"
MASTERS = "elasticps/role=master"
# Fast backoff: delays 0.1-0.2, 0.2-0.3, 0.4-0.5, 0.8-0.9, then 1.2 s.
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 1.2
STUCK_AFTER_S = 1.0


@pytest.fixture
def kube() -> Iterator[FakeKubeServer]:
    with FakeKubeServer() as server:
        yield server


@pytest.fixture
def api(kube: FakeKubeServer) -> client.CoreV1Api:
    return client.CoreV1Api(client.ApiClient(client.Configuration(host=kube.url)))


@pytest.fixture
def kubeconfig(kube: FakeKubeServer, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                "users": [{"name": "me", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
                "current-context": "fake",
            }
        )
    )
    return path


def submit(kubeconfig: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    model = tmp_path / "my_model.py"
    model.write_text("import torch\n\nclass Model(torch.nn.Module):\n    pass\n")
    argv = [
        "submit", "--backend", "kubernetes", "--kubeconfig", str(kubeconfig),
        "--image", "registry.example/elasticps:1", "--namespace", NS, "--job", JOB,
        "--model", str(model), "--trainers", "2:4", "--ps", "2", "--mode", "async",
        "--epochs", "5", "--data", "/data/mnist/train.parquet", *extra,
    ]  # fmt: skip
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return dict(json.loads(buffer.getvalue().splitlines()[0]))


class Progress:
    """An injectable progress source: trainers marked healthy progress on every call."""

    def __init__(self) -> None:
        self.stalled: set[str] = set()

    def __call__(self) -> dict[str, float]:
        now = time.monotonic()
        return {f"trainer-{i}": now for i in range(1000) if f"trainer-{i}" not in self.stalled}


@dataclass
class Job:
    """A submitted job and the worker manager its master would run."""

    kube: FakeKubeServer
    api: client.CoreV1Api
    backend: KubernetesBackend
    manager: WorkerManager
    progress: Progress
    master_uid: str

    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        sel = job_selector(JOB) + ("," + selector if selector else "")
        return self.kube.objects("pods", NS, sel)

    def running(self, selector: str = TRAINERS) -> list[str]:
        return running(self.kube, selector)

    def uid(self, pod: str) -> str | None:
        found = self.kube.pod(NS, pod)
        return None if found is None else str(found["metadata"]["uid"])


def running(kube: FakeKubeServer, selector: str) -> list[str]:
    """The job's running pods matching ``selector``, not being deleted, by name."""
    return sorted(
        p["metadata"]["name"]
        for p in kube.objects("pods", NS, f"{job_selector(JOB)},{selector}")
        if p["status"]["phase"] == "Running" and "deletionTimestamp" not in p["metadata"]
    )


def master_pod(kube: FakeKubeServer) -> str:
    """The name of the job's (one) running master pod, made by its Deployment."""
    (name,) = running(kube, MASTERS)
    return name


@pytest.fixture
def job(
    request: pytest.FixtureRequest,
    kube: FakeKubeServer,
    api: client.CoreV1Api,
    kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[Job]:
    """A submitted job (more submit flags: indirect parametrization) and its worker manager."""
    submit(kubeconfig, tmp_path, *getattr(request, "param", ()))
    owner = master_owner(api.api_client, NS, JOB)  # as the master's in-cluster manager does
    assert owner is not None
    backend = KubernetesBackend(
        NS, JOB, "registry.example/elasticps:1", api.api_client, owner, watch_timeout_s=5
    )
    progress = Progress()
    manager = build_manager(
        backend,
        ManagerConfig(
            min_trainers=2,
            max_trainers=4,
            stuck_after_s=STUCK_AFTER_S,
            backoff_base_s=BACKOFF_BASE_S,
            backoff_cap_s=BACKOFF_CAP_S,
            tick_s=0.05,
        ),
        ps=2,
        desired=ConfigMapDesiredCount(api, NS, JOB, poll_s=0.05),
        progress=progress,
    )
    manager.start()
    state = Job(kube, api, backend, manager, progress, owner.uid)
    try:
        wait_for(lambda: len(state.running()) == 4, "4 running trainers", timeout_s=20)
        yield state
    finally:
        manager.stop()
        backend.close()


def test_a_job_submitted_with_trainers_2_to_4_reaches_4_trainer_pods_owned_by_the_master(
    job: Job,
) -> None:
    assert job.running() == [f"{JOB}-trainer-{i}" for i in range(4)]
    wait_for(lambda: job.running("elasticps/role=ps") == [f"{JOB}-ps-0", f"{JOB}-ps-1"], "2 PS")
    for pod in job.pods():
        if pod["metadata"]["labels"]["elasticps/role"] in ("ps", "trainer"):
            refs = pod["metadata"]["ownerReferences"]
            assert [(r["kind"], r["uid"]) for r in refs] == [("Deployment", job.master_uid)]
    # Deleting the master's Deployment deletes its workers (the garbage collector), not etcd.
    job.manager.stop()
    apps = client.AppsV1Api(job.api.api_client)
    apps.delete_namespaced_deployment(f"{JOB}-master", NS)
    assert {p["metadata"]["labels"]["elasticps/role"] for p in job.pods()} == {"etcd"}


def test_unschedulable_trainers_are_retried_with_growing_delays_then_filled(job: Job) -> None:
    job.kube.set_capacity(TRAINERS, 2)
    # Two trainers are preempted; their replacements cannot be scheduled.
    for name in job.running()[:2]:
        job.kube.preempt(NS, name)

    def creates() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {}
        for record in job.manager.records():
            if record.action == "create" and record.reason == "retry":
                times.setdefault(record.name, []).append(record.at_s)
        return times

    wait_for(
        lambda: sum(len(t) >= 4 for t in creates().values()) == 2,
        "4 retries of each unschedulable trainer",
        timeout_s=20,
    )
    assert len(job.running()) == 2
    for times in creates().values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # Exponential, base * 2**(n-1) + U(0, base): two attempts later the
        # delay is at least twice as long. The gaps are wall-clock waits, so
        # only orders are compared (load adds lag, never removes it).
        assert gaps[0] >= BACKOFF_BASE_S, gaps
        assert gaps[2] > gaps[0], gaps
    attempts = [r.attempt for r in job.manager.records() if r.reason == "retry"]
    assert max(attempts) >= 5
    job.kube.set_capacity(TRAINERS, None)
    wait_for(lambda: len(job.running()) == 4, "4 running trainers again", timeout_s=20)


def test_a_quota_error_on_create_backs_off(job: Job) -> None:
    # Once a trainer is preempted, the namespace is full: creates get 403 exceeded quota.
    job.kube.set_pod_quota(len(job.kube.objects("pods", NS)) - 1)
    job.kube.preempt(NS, job.running()[0])

    def refused() -> dict[int, float]:
        """The backoff delay after each refused creation attempt, by attempt number."""
        return {
            r.attempt: r.retry_in_s
            for r in job.manager.records()
            if r.result == "unschedulable" and r.retry_in_s is not None
        }

    wait_for(lambda: 3 in refused(), "a third refused creation attempt", timeout_s=20)
    delays = refused()
    # base * 2**(n-1) + U(0, base): attempt 3 waits at least 4 bases, attempt 1 at most 2.
    assert delays[3] > delays[1], delays
    job.kube.set_pod_quota(None)
    wait_for(lambda: len(job.running()) == 4, "4 running trainers again", timeout_s=20)


def test_pods_deleted_out_of_band_are_replaced(job: Job) -> None:
    victim = job.running()[0]
    job.api.delete_namespaced_pod(victim, NS)  # kubectl delete pod
    wait_for(lambda: len(job.running()) == 4 and victim not in job.running(), "a new trainer")
    wait_for(lambda: len(job.running("elasticps/role=ps")) == 2, "2 PS")
    old_uid = job.kube.pod(NS, f"{JOB}-ps-0")["metadata"]["uid"]  # type: ignore[index]
    job.api.delete_namespaced_pod(f"{JOB}-ps-0", NS)

    def ps0_replaced() -> bool:
        pod = job.kube.pod(NS, f"{JOB}-ps-0")
        return pod is not None and pod["metadata"]["uid"] != old_uid

    wait_for(ps0_replaced, "ps-0 replaced under the same name")
    # A PS that exits leaves its pod (Failed) in the API: it is removed, then replaced.
    old_uid = job.kube.pod(NS, f"{JOB}-ps-1")["metadata"]["uid"]  # type: ignore[index]
    job.kube.finish(NS, f"{JOB}-ps-1", exit_code=137, reason="OOMKilled")

    def ps1_replaced() -> bool:
        pod = job.kube.pod(NS, f"{JOB}-ps-1")
        return (
            pod is not None
            and pod["metadata"]["uid"] != old_uid
            and pod["status"]["phase"] == "Running"
        )

    wait_for(ps1_replaced, "ps-1 replaced after it failed")


def test_a_job_the_policy_fails_reads_failed_in_status_and_list(
    kube: FakeKubeServer,
    api: client.CoreV1Api,
    kubeconfig: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A trainer's user error (exit 2) fails the job: status and list say so, even after the
    master pod is lost and re-created; the master keeps running."""
    submit(kubeconfig, tmp_path)
    master = master_pod(kube)
    backend = KubernetesBackend(NS, JOB, "registry.example/elasticps:1", api.api_client, None)

    decisions: list[dict[str, object]] = []

    def on_decision(event: WorkerEvent, action: object) -> None:
        decision = decision_of(time.time(), policy_event(event, False), action)  # type: ignore[arg-type]
        if decision is not None:
            decisions.append(decision.as_dict())
        if isinstance(action, FailJob):  # as the in-cluster manager's hook does
            mark_job_failed(api, NS, JOB, action.message, exit_code=2, decisions=decisions)

    manager = build_manager(
        backend,
        ManagerConfig(min_trainers=2, max_trainers=2, backoff_base_s=0.1, backoff_cap_s=0.2,
                      tick_s=0.05),
        ps=1,
        desired=ConfigMapDesiredCount(api, NS, JOB, poll_s=0.05),
        progress=None,
        on_decision=on_decision,
    )  # fmt: skip
    manager.start()
    cluster = ["--backend", "kubernetes", "--namespace", NS, "--kubeconfig", str(kubeconfig)]
    try:
        trainers = f"{job_selector(JOB)},{TRAINERS}"
        wait_for(lambda: len(kube.objects("pods", NS, trainers)) == 2, "2 trainer pods")
        assert main(["list", *cluster, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "running"
        victim = kube.objects("pods", NS, trainers)[0]["metadata"]["name"]
        kube.finish(NS, victim, exit_code=2, reason="Error")

        def marked() -> bool:
            return bool(kube.objects("configmaps", NS, f"{job_selector(JOB)},elasticps/role=state"))

        wait_for(marked, "the job's failure recorded")
    finally:
        manager.stop()
        backend.close()
    assert kube.pod(NS, master)["status"]["phase"] == "Running"  # type: ignore[index]

    def check_failed() -> None:
        assert main(["status", JOB, *cluster, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["state"] == "failed" and "user error" in status["failure"], status
        assert main(["status", JOB, *cluster]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith(f"job {JOB} (namespace {NS}): failed ("), first
        assert main(["list", *cluster, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "failed"

    check_failed()
    # The record is not on the master pod: a master re-created elsewhere keeps it.
    kube.lose_node(NS, master)
    wait_for(lambda: running(kube, MASTERS) not in ([], [master]), "a new master pod")
    check_failed()
    # The report names the trainer whose user error failed the job, with its pod's log.
    kube.set_log(NS, victim, "elasticps: error: the model file raised ValueError\n")
    report = tmp_path / "report.html"
    assert main(["report", JOB, *cluster, "--to", str(report)]) == 0
    assert capsys.readouterr().out.strip() == str(report.resolve())
    html = report.read_text()
    worker = victim.removeprefix(f"{JOB}-")
    cause = html.split('id="root-cause"')[1].split("</div>")[0]
    assert worker in cause and "exit 2" in cause, cause
    assert "the model file raised ValueError" in html and 'id="pods"' in html


@pytest.mark.parametrize("job", [("--etcd-replicas", "3")], indirect=True)
def test_each_roles_pod_lost_with_its_node_is_re_created_by_what_the_objects_declare(
    job: Job,
) -> None:
    """A lost node takes one pod of each role: etcd's StatefulSet, the masters' Deployment and
    the worker manager bring each back, and etcd's data stays on its claims."""
    kube = job.kube
    etcd = [f"{JOB}-etcd-{i}" for i in range(3)]
    wait_for(lambda: job.running("elasticps/role=etcd") == etcd, "3 etcd members")
    wait_for(lambda: len(job.running("elasticps/role=ps")) == 2, "2 PS")

    def claims_of(pod: str) -> list[str]:
        volumes = (kube.pod(NS, pod) or {"spec": {}})["spec"].get("volumes") or []
        return [v["persistentVolumeClaim"]["claimName"] for v in volumes if "claimName" in str(v)]

    claims = {c["metadata"]["name"] for c in kube.objects("persistentvolumeclaims", NS)}
    assert claims == {f"data-{name}" for name in etcd}
    assert [claims_of(name) for name in etcd] == [[f"data-{name}"] for name in etcd]

    # etcd: the StatefulSet re-creates a member only once its old pod is gone (at most one
    # pod per name), which a lost node's pod is not until the API removes it by force.
    old_etcd = job.uid(etcd[1])
    kube.lose_node(NS, etcd[1])
    assert job.uid(etcd[1]) == old_etcd and etcd[1] not in job.running("elasticps/role=etcd")
    job.api.delete_namespaced_pod(etcd[1], NS, grace_period_seconds=0)  # PodGC, or --force
    wait_for(lambda: job.uid(etcd[1]) not in (None, old_etcd), "etcd-1 re-created")
    assert claims_of(etcd[1]) == [f"data-{etcd[1]}"]  # the same data

    # The master: its Deployment starts another pod at once; the workers stay (their owner
    # is the Deployment, not the lost pod).
    master = master_pod(kube)
    workers = {name: job.uid(name) for name in job.running()}
    kube.lose_node(NS, master)
    wait_for(lambda: running(kube, MASTERS) not in ([], [master]), "a new master pod")
    assert {name: job.uid(name) for name in workers} == workers

    # A PS: the worker manager re-creates it under its name; the old pod, stuck terminating
    # past its grace period on the lost node, is deleted by force to free the name.
    old_ps = job.uid(f"{JOB}-ps-0")
    kube.lose_node(NS, f"{JOB}-ps-0")
    wait_for(lambda: job.uid(f"{JOB}-ps-0") not in (None, old_ps), "ps-0 re-created")
    wait_for(lambda: f"{JOB}-ps-0" in job.running("elasticps/role=ps"), "ps-0 running")

    # A trainer: replaced by a new one (a new index) on another node.
    victim = job.running()[0]
    kube.lose_node(NS, victim)
    wait_for(lambda: len(job.running()) == 4 and victim not in job.running(), "a new trainer")


def test_a_stuck_trainer_is_replaced(job: Job) -> None:
    stuck = "trainer-1"
    job.progress.stalled.add(stuck)
    wait_for(lambda: f"{JOB}-{stuck}" not in job.running(), "the stuck trainer deleted")
    wait_for(lambda: len(job.running()) == 4, "4 running trainers again")
    reasons = [r.reason for r in job.manager.records() if r.name == stuck]
    assert any(reason.startswith("stuck") for reason in reasons)


def test_scale_down_deletes_the_newest_and_scale_up_is_clamped(
    job: Job, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["scale", JOB, "--trainers", "2", "--backend", "kubernetes",
            "--namespace", NS, "--kubeconfig", str(kubeconfig)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["trainers_wanted"] == 2
    wait_for(lambda: len(job.pods(TRAINERS)) == 2, "2 trainers")
    assert job.running() == [f"{JOB}-trainer-0", f"{JOB}-trainer-1"]
    set_wanted_trainers(job.api, NS, JOB, 3)
    wait_for(lambda: len(job.running()) == 3, "3 trainers")
    set_wanted_trainers(job.api, NS, JOB, 10)  # clamped to MAX
    wait_for(lambda: len(job.running()) == 4, "4 trainers")
    assert job.manager.live_trainers() and len(job.pods(TRAINERS)) == 4


def test_delete_leaves_nothing_with_the_jobs_labels(
    job: Job, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job.manager.stop()  # the master's manager dies with the master pod
    assert main(["delete", JOB, "--namespace", NS, "--kubeconfig", str(kubeconfig)]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    deleted = printed["deleted"]
    assert (deleted["deployments"], deleted["statefulsets"]) == (1, 1), deleted
    assert (deleted["services"], deleted["configmaps"]) == (3, 3), deleted
    selector = f"elasticps/job={JOB}"
    for resource in (
        "pods", "services", "configmaps", "deployments", "statefulsets", "persistentvolumeclaims",
    ):  # fmt: skip
        assert job.kube.objects(resource, NS, selector) == [], resource


def test_submit_with_an_existing_etcd_starts_no_etcd_and_status_lists_the_pods(
    kube: FakeKubeServer,
    kubeconfig: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = submit(kubeconfig, tmp_path, "--etcd", "etcd.infra:2379")
    assert result["etcd"] == "etcd.infra:2379"
    assert not [name for name in result["created"] if "etcd" in name], result
    assert kube.objects("statefulsets", NS) == []
    env = kube.objects("configmaps", NS, "elasticps/role=env")[0]["data"]
    assert env["ELASTICPS_ETCD"] == "etcd.infra:2379"
    assert env["ELASTICPS_MODE"] == "async"
    master_name = master_pod(kube)
    master = kube.pod(NS, master_name)
    assert master is not None
    command = master["spec"]["containers"][0]["command"]
    assert command[:6] == ["elasticps", "master", "--backend", "kubernetes", "--trainers", "2:4"]
    # A second submit of the same job is refused.
    model = tmp_path / "my_model.py"
    argv = ["submit", "--kubeconfig", str(kubeconfig), "--namespace", NS, "--job", JOB,
            "--image", "x", "--model", str(model), "--data", "/d"]  # fmt: skip
    assert main(argv) == 2
    capsys.readouterr()
    cluster = ["--backend", "kubernetes", "--namespace", NS, "--kubeconfig", str(kubeconfig)]
    assert main(["status", JOB, *cluster, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["wanted_trainers"] == 4
    assert [(p["name"], p["state"]) for p in status["pods"]] == [(master_name, "running")]
    kube.set_log(NS, master_name, "hello\nworld\n")
    assert main(["logs", JOB, *cluster]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"[{master_name}] {s}" for s in ("hello", "world")
    ]
    assert main(["logs", JOB, *cluster, "-f"]) == 0  # the fake's log stream ends at once
    assert capsys.readouterr().out.splitlines() == [
        f"[{master_name}] {s}" for s in ("hello", "world")
    ]
    assert main(["list", *cluster, "--json"]) == 0
    (listed,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (listed["job"], listed["state"], listed["pods"]) == (JOB, "running", 1)
    # Without --backend kubernetes, the name is looked up among local runs.
    assert main(["status", JOB]) == 2
    assert "--backend kubernetes" in capsys.readouterr().err


def test_the_in_cluster_hook_runs_the_manager_and_records_the_end_for_status(
    *,
    kube: FakeKubeServer,
    kubeconfig: Path,
    tmp_path: Path,
    etcd_server: EtcdServer,
    job_name: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The master's real ``on_active`` hook, its in-cluster credentials pointed at the fake: its
    pods are owned by the master's Deployment, and the job's end in etcd reaches ``status``."""
    from kubernetes import config as kube_config

    from elasticps.launcher.kubernetes import in_cluster_manager

    submit(kubeconfig, tmp_path)
    monkeypatch.setattr(
        kube_config,
        "load_incluster_config",
        lambda: client.Configuration.set_default(client.Configuration(host=kube.url)),
    )
    hook = in_cluster_manager(
        JOB,
        ManagerConfig(min_trainers=2, max_trainers=2, backoff_base_s=0.1, backoff_cap_s=0.2,
                      tick_s=0.05),
        ps=1,
        config=KubernetesConfig(namespace=NS, image="registry.example/elasticps:1"),
        state_poll_s=0.1,
    )  # fmt: skip
    deployment = kube.objects("deployments", NS)[0]["metadata"]["uid"]
    cluster = ["--backend", "kubernetes", "--namespace", NS, "--kubeconfig", str(kubeconfig)]
    try:
        with JobStore(etcd_server.endpoint, job_name) as store:
            stop = hook(store)
            try:
                wait_for(lambda: len(running(kube, TRAINERS)) == 2, "2 trainers")
                wait_for(lambda: len(running(kube, "elasticps/role=ps")) == 1, "1 PS")
                assert store.ps_desired() == 1
                for pod in kube.objects("pods", NS, f"{job_selector(JOB)},{TRAINERS}"):
                    refs = pod["metadata"]["ownerReferences"]
                    assert [(r["kind"], r["uid"]) for r in refs] == [("Deployment", deployment)]
                assert main(["status", JOB, *cluster, "--json"]) == 0
                assert json.loads(capsys.readouterr().out)["state"] == "running"
                store.set_job_state("finished")  # as the master does after the last pass

                def status() -> str:
                    assert main(["status", JOB, *cluster, "--json"]) == 0
                    return str(json.loads(capsys.readouterr().out)["state"])

                wait_for(lambda: status() == "finished", "status: finished")
                assert main(["list", *cluster, "--json"]) == 0
                assert json.loads(capsys.readouterr().out)["state"] == "finished"
            finally:
                stop()
    finally:
        client.Configuration.set_default(None)


def test_the_listener_relists_after_410_gone_and_reports_deletions_it_missed(
    kube: FakeKubeServer, api: client.CoreV1Api
) -> None:
    backend = KubernetesBackend(NS, JOB, "img", api.api_client, watch_timeout_s=5)
    for i in range(2):
        backend.create(WorkerSpec(Role.TRAINER, i, ("--trainer-id", str(i))))
    events: list[WorkerEvent] = []
    lock = threading.Lock()

    def on_event(event: WorkerEvent) -> None:
        with lock:
            events.append(event)

    def states() -> dict[str, WorkerState]:
        with lock:
            return {e.name: e.state for e in events}

    listener = PodEventListener(api, NS, job_selector(JOB), on_event, watch_timeout_s=5).start()
    try:
        running = {"trainer-0": WorkerState.RUNNING, "trainer-1": WorkerState.RUNNING}
        wait_for(lambda: states() == running, "both running")
        kube.delete_unseen(NS, f"{JOB}-trainer-1")  # the DELETED event is compacted away
        wait_for(lambda: states().get("trainer-1") is WorkerState.DELETED, "the missed deletion")
        assert listener.relists == 2
        kube.compact()
        kube.finish(NS, f"{JOB}-trainer-0", exit_code=1)
        wait_for(lambda: states().get("trainer-0") is WorkerState.FAILED, "trainer-0 failed")
        kube.preempt(NS, f"{JOB}-trainer-0")
        wait_for(lambda: states().get("trainer-0") is WorkerState.DELETED, "trainer-0 deleted")
    finally:
        listener.stop()
    with lock:
        failed = [e for e in events if e.state is WorkerState.FAILED]
    assert [(e.name, e.reason) for e in failed] == [("trainer-0", "exit 1")]


def test_backend_list_create_conflict_and_delete_of_a_missing_pod(
    kube: FakeKubeServer, api: client.CoreV1Api
) -> None:
    backend = KubernetesBackend(NS, JOB, "img", api.api_client)
    spec = WorkerSpec(Role.PS, 0)
    backend.create(spec)
    with pytest.raises(UnschedulableError, match="still exists"):
        backend.create(spec)
    kube.set_capacity("elasticps/role=trainer", 0)
    backend.create(WorkerSpec(Role.TRAINER, 7))
    listed = {(e.name, e.state, e.reason.split(":")[0]) for e in backend.list()}
    assert listed == {
        ("ps-0", WorkerState.RUNNING, ""),
        ("trainer-7", WorkerState.UNSCHEDULABLE, "Unschedulable"),
    }
    backend.delete("trainer-7")
    backend.delete("trainer-7")  # already gone: no error
    assert [e.name for e in backend.list()] == ["ps-0"]


def test_the_master_serves_grpc_health_and_runs_its_on_active_hook(
    etcd_server: EtcdServer, job_name: str, tmp_path: Path
) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"x": list(range(20))}), data)
    job = f"health-{job_name[-8:]}"
    config = MasterConfig(
        common=CommonConfig(job=job, etcd_endpoint=etcd_server.endpoint, lease_ttl_s=5.0),
        data_files=(data,),
        records_per_task=10,
        host=LOOPBACK,
    )
    stop = threading.Event()
    hook_calls: list[str] = []

    def on_active(store: JobStore) -> Any:
        hook_calls.append(store.keys.job)
        return lambda: hook_calls.append("stopped")

    thread = threading.Thread(target=serve_master, args=(config, stop, on_active), daemon=True)
    thread.start()
    try:
        with JobStore(etcd_server.endpoint, job) as store:
            address = store.master_address(timeout_s=15.0)
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "elasticps.v1.Master"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: hook_calls == [job], "the on_active hook")
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
    assert hook_calls == [job, "stopped"]


def test_kubernetes_config_rejects_names_pods_cannot_have() -> None:
    from elasticps.config import check_kubernetes_job_name
    from elasticps.errors import ConfigError

    with pytest.raises(ConfigError):
        check_kubernetes_job_name("My_Job")
    with pytest.raises(ConfigError):
        KubernetesConfig(namespace="Bad_NS")
    assert check_kubernetes_job_name("ok-job-1") == "ok-job-1"
