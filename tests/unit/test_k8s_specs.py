"""The generated Kubernetes objects, checked against the client's model classes.

Every object goes through the official client's serializer and deserializer
(``sanitize_for_serialization`` -> JSON -> ``ApiClient().deserialize`` into
``V1Pod``/``V1Deployment``/``V1StatefulSet``/``V1Service``/``V1ConfigMap``)
and must come back identical. When
``kubectl`` is installed, ``kubectl create --dry-run=client -o yaml`` must
accept them too (it needs an API server for discovery: the fake one).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from elasticps.config import KubernetesConfig
from elasticps.errors import ConfigError
from elasticps.launcher.backend import Role, WorkerSpec
from elasticps.launcher.kubernetes import (
    MASTER_PORT,
    MAX_CONFIGMAP_BYTES,
    METRICS_PORT,
    MODEL_PATH,
    PS_PORT,
    SCRAPE_ANNOTATIONS,
    SECRET_DIR,
    JobRequest,
    OwnerRef,
    job_objects,
    model_configmap,
    to_manifests,
    worker_pod,
)
from elasticps.security import SECRET_FILE_ENV, JobSecret

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CONFIG = KubernetesConfig(namespace="ml", image="elasticps:1", volume_claim="data")
OWNER = OwnerRef("j-master", "5f0c6a1e-0000-4000-8000-000000000001")
REQUEST = JobRequest(
    job="j",
    model_source="class Model: ...\n",
    min_trainers=2,
    max_trainers=4,
    initial_trainers=4,
    ps=2,
    data=("/data/train.parquet",),
    env={"ELASTICPS_MODE": "async"},
    stuck_after_s=60.0,
)


def round_trip(obj: Any) -> dict[str, Any]:
    """Serialize, deserialize into the model class of its kind, serialize again: same JSON."""
    api = client.ApiClient()
    payload = api.sanitize_for_serialization(obj)
    back = api.deserialize(json.dumps(payload), f"V1{payload['kind']}", "application/json")
    assert type(back).__name__ == f"V1{payload['kind']}"
    assert api.sanitize_for_serialization(back) == payload
    return dict(payload)


def template_pods(objects: list[Any]) -> list[dict[str, Any]]:
    """The pods the controllers among ``objects`` make: their templates, named ``<name>-0``."""
    pods = []
    for obj in objects:
        if obj.kind in ("Deployment", "StatefulSet"):
            controller = round_trip(obj)
            template = controller["spec"]["template"]
            meta = {**template["metadata"], "name": f"{controller['metadata']['name']}-0"}
            pods.append({"kind": "Pod", "metadata": meta, "spec": template["spec"]})
    return pods


def all_pods(request: JobRequest = REQUEST, config: KubernetesConfig = CONFIG) -> list[Any]:
    pods = template_pods(job_objects(request, config))
    for spec in (WorkerSpec(Role.PS, 1), WorkerSpec(Role.TRAINER, 12, ("--trainer-id", "12"))):
        pods.append(round_trip(worker_pod("j", spec, config, OWNER)))
    return pods


def by_name(objects: list[Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o.kind, o.metadata.name): round_trip(o) for o in objects}


def test_every_object_survives_the_clients_model_classes() -> None:
    kinds = [round_trip(o)["kind"] for o in job_objects(REQUEST, CONFIG)]
    assert kinds == ["ConfigMap"] * 3 + [
        "NetworkPolicy", "Secret", "Service", "Service", "StatefulSet", "Service", "Deployment",
    ]  # fmt: skip


def test_etcd_is_a_statefulset_with_its_data_on_claims_and_a_headless_peer_service() -> None:
    request = JobRequest(**{**REQUEST.__dict__, "etcd_replicas": 3, "etcd_storage": "5Gi"})
    objects = by_name(job_objects(request, CONFIG))
    etcd = objects[("StatefulSet", "j-etcd")]["spec"]
    assert etcd["replicas"] == 3 and etcd["podManagementPolicy"] == "Parallel"
    assert etcd["serviceName"] == "j-etcd-peer"
    (claim,) = etcd["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"] == {"storage": "5Gi"}
    assert etcd["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    container = etcd["template"]["spec"]["containers"][0]
    assert {"name": "data", "mountPath": "/var/lib/etcd"} in container["volumeMounts"]
    assert "volumes" not in etcd["template"]["spec"]  # no emptyDir: the claim is the data
    flags = dict(f.split("=", 1) for f in container["command"][1:])
    assert flags["--initial-cluster"] == ",".join(
        f"j-etcd-{i}=http://j-etcd-{i}.j-etcd-peer.ml.svc:2380" for i in range(3)
    )
    assert flags["--name"] == "$(POD_NAME)"
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    peer = objects[("Service", "j-etcd-peer")]["spec"]
    assert peer["clusterIP"] == "None" and peer["publishNotReadyAddresses"] is True
    assert {p["port"] for p in peer["ports"]} == {2379, 2380}
    assert objects[("Service", "j-etcd")]["spec"]["ports"][0]["port"] == 2379
    with pytest.raises(ConfigError, match="1, 3, 5 or 7"):
        JobRequest(**{**REQUEST.__dict__, "etcd_replicas": 2})


def test_with_an_existing_etcd_no_etcd_objects_are_made() -> None:
    request = JobRequest(**{**REQUEST.__dict__, "etcd_endpoint": "http://etcd.infra:2379"})
    objects = by_name(job_objects(request, CONFIG))
    assert not [key for key in objects if "etcd" in key[1]]
    assert objects[("ConfigMap", "j-env")]["data"]["ELASTICPS_ETCD"] == "http://etcd.infra:2379"
    with pytest.raises(ConfigError):
        JobRequest(**{**REQUEST.__dict__, "etcd_endpoint": "https://etcd.infra:2379"})


def test_the_masters_are_a_deployment_of_one_plus_the_standbys() -> None:
    request = JobRequest(**{**REQUEST.__dict__, "standby_masters": 2})
    master = by_name(job_objects(request, CONFIG))[("Deployment", "j-master")]
    assert master["spec"]["replicas"] == 3
    assert master["spec"]["strategy"] == {"type": "Recreate"}
    labels = {"app": "elasticps", "elasticps/job": "j", "elasticps/role": "master"}
    assert master["spec"]["selector"]["matchLabels"] == labels
    assert master["spec"]["template"]["metadata"]["labels"] == labels  # no index: not a worker


def test_every_container_has_cpu_and_memory_requests_and_limits() -> None:
    for pod in all_pods():
        for container in pod["spec"]["containers"]:
            resources = container["resources"]
            assert set(resources["requests"]) == {"cpu", "memory"}, pod["metadata"]["name"]
            assert set(resources["limits"]) == {"cpu", "memory"}, pod["metadata"]["name"]


def test_readiness_probes_master_grpc_health_ps_tcp_trainers_none() -> None:
    probes = {
        p["metadata"]["labels"]["elasticps/role"]: p["spec"]["containers"][0].get("readinessProbe")
        for p in all_pods()
    }
    assert probes["master"]["grpc"] == {"port": MASTER_PORT, "service": ""}
    assert probes["ps"]["tcpSocket"] == {"port": PS_PORT}
    assert probes["etcd"]["httpGet"]["path"] == "/health"
    assert probes["trainer"] is None


def test_every_role_pod_carries_the_prometheus_scrape_annotations_of_its_metrics_port() -> None:
    for pod in all_pods():
        role = pod["metadata"]["labels"]["elasticps/role"]
        if role == "etcd":
            continue
        assert pod["metadata"]["annotations"] == SCRAPE_ANNOTATIONS, role
        container = pod["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == METRICS_PORT == int(SCRAPE_ANNOTATIONS["prometheus.io/port"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["ELASTICPS_METRICS_PORT"] == str(METRICS_PORT), role


def test_the_network_policy_admits_only_the_jobs_pods_but_to_the_metrics_port() -> None:
    objects = by_name(job_objects(REQUEST, CONFIG))
    policy = objects[("NetworkPolicy", "j-network")]["spec"]
    job = {"app": "elasticps", "elasticps/job": "j"}
    assert policy["podSelector"] == {"matchLabels": job}
    assert policy["policyTypes"] == ["Ingress"]
    from_job, metrics_port = policy["ingress"]
    assert from_job == {"from": [{"podSelector": {"matchLabels": job}}]}
    assert metrics_port == {"ports": [{"port": METRICS_PORT, "protocol": "TCP"}]}


def test_worker_pods_are_owned_by_the_master_deployment_and_never_restart_in_place() -> None:
    pod = round_trip(worker_pod("j", WorkerSpec(Role.TRAINER, 3), CONFIG, OWNER))
    meta = pod["metadata"]
    assert meta["name"] == "j-trainer-3" and DNS_LABEL.match(meta["name"])
    assert meta["labels"] == {
        "app": "elasticps",
        "elasticps/job": "j",
        "elasticps/role": "trainer",
        "elasticps/index": "3",
    }
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": OWNER.name,
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    assert container["command"][:2] == ["elasticps", "trainer"]
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTICPS_TRAINER_ID"]["value"] == "3"
    assert env["ELASTICPS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["envFrom"] == [{"configMapRef": {"name": "j-env", "optional": True}}]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"model": str(Path(MODEL_PATH).parent), "data": "/data", "secret": SECRET_DIR}


def test_the_master_runs_the_kubernetes_worker_manager_under_its_service_account() -> None:
    (master,) = [p for p in template_pods(job_objects(REQUEST, CONFIG))
                 if p["metadata"]["name"] == "j-master-0"]  # fmt: skip
    assert master["spec"]["serviceAccountName"] == "elasticps"
    assert master["spec"]["restartPolicy"] == "Always"  # a Deployment's pods
    assert "ownerReferences" not in master["metadata"]
    command = master["spec"]["containers"][0]["command"]
    assert command[:8] == ["elasticps", "master", "--backend", "kubernetes",
                           "--trainers", "2:4", "--ps", "2"]  # fmt: skip
    assert command[-2:] == ["--stuck-after-s", "60.0"]
    env = {e["name"]: e for e in master["spec"]["containers"][0]["env"]}
    assert env["ELASTICPS_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_the_env_and_scale_configmaps_carry_the_job_settings() -> None:
    maps = {
        o.metadata.name: round_trip(o)["data"]
        for o in job_objects(REQUEST, CONFIG)
        if o.kind == "ConfigMap"
    }
    assert maps["j-model"] == {"model.py": "class Model: ...\n"}
    assert maps["j-scale"] == {"trainers": "4"}
    assert maps["j-env"]["ELASTICPS_ETCD"] == "j-etcd:2379"
    assert maps["j-env"]["ELASTICPS_MODEL"] == MODEL_PATH
    assert maps["j-env"]["ELASTICPS_MODE"] == "async"
    assert maps["j-env"]["ELASTICPS_CHECKPOINT_DIR"] == "/data/checkpoints/j"


def test_a_model_file_over_one_mebibyte_is_refused() -> None:
    model_configmap("j", "x" * MAX_CONFIGMAP_BYTES, CONFIG)
    with pytest.raises(ConfigError, match="1048576"):
        model_configmap("j", "x" * (MAX_CONFIGMAP_BYTES + 1), CONFIG)


@pytest.mark.parametrize(
    "change",
    [
        {"job": "Upper_Case"},
        {"min_trainers": 0},
        {"initial_trainers": 5},
        {"ps": 0},
        {"data": ()},
    ],
)
def test_job_requests_are_validated(change: dict[str, Any]) -> None:
    fields = {**REQUEST.__dict__, **change}
    with pytest.raises(ConfigError):
        JobRequest(**fields)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_example_job_is_what_submit_dry_run_generates() -> None:
    """deploy/kubernetes/example-job.yaml stays in sync with the builders (model text aside)."""
    example = _documents(DEPLOY / "example-job.yaml")
    request = JobRequest(
        job="mnist",
        model_source="",
        min_trainers=2,
        max_trainers=8,
        initial_trainers=8,
        ps=2,
        data=("/data/mnist/train.parquet",),
        master_args=("--epochs", "5", "--records-per-task", "512",
                     "--task-timeout-s", "60.0", "--max-task-timeouts", "3"),
        env={k: v for k, v in {doc["metadata"]["name"]: doc for doc in example}["mnist-env"][
            "data"].items() if k != SECRET_FILE_ENV},
        secret=JobSecret(bytes(32)),  # the example's placeholder
    )  # fmt: skip
    config = KubernetesConfig(
        namespace="ml", image="elasticps:latest", volume_claim="elasticps-data"
    )
    generated = to_manifests(job_objects(request, config))
    for doc in (*example, *generated):
        if doc["metadata"]["name"] == "mnist-model":
            assert "model.py" in doc["data"]
            doc["data"] = {}
    assert example == generated


def test_the_rbac_manifest_grants_the_manager_what_it_uses() -> None:
    docs = {d["kind"]: d for d in _documents(DEPLOY / "rbac.yaml")}
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding"}
    rules = {res: set(r["verbs"]) for r in docs["Role"]["rules"] for res in r["resources"]}
    assert {"create", "delete", "list", "watch", "get"} <= rules["pods"]
    assert {"get", "patch", "create"} <= rules["configmaps"]
    assert {"create", "delete", "list"} <= rules["services"]
    assert {"get", "create", "delete", "list"} <= rules["deployments"]  # the owner, submit
    assert {"create", "delete", "list"} <= rules["statefulsets"]
    assert {"list", "delete"} <= rules["persistentvolumeclaims"]
    assert docs["RoleBinding"]["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_create_dry_run_accepts_every_generated_object(tmp_path: Path) -> None:
    """``kubectl create --dry-run=client``; discovery from the fake API server.

    ``--validate=false``: the fake serves no OpenAPI document, so kubectl's
    schema validation cannot run; the model-class round trip above stands in.
    """
    from fake_k8s import FakeKubeServer

    objects = [
        *to_manifests(job_objects(REQUEST, CONFIG)),
        *to_manifests([worker_pod("j", WorkerSpec(Role.PS, 0), CONFIG, OWNER)]),
        *_documents(DEPLOY / "rbac.yaml"),
    ]
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    with FakeKubeServer() as kube:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
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
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(kubeconfig), "create", "--dry-run=client",
             "--validate=false", "-o", "yaml", "-f", str(manifest)],
            capture_output=True, text=True, timeout=45, check=False,
        )  # fmt: skip
        assert not kube.objects("pods"), "a client dry run must not create anything"
    assert result.returncode == 0, result.stderr
    names = {
        d["metadata"]["name"]
        for d in yaml.safe_load_all(result.stdout)
        if d and d.get("kind") != "List"
    } | {
        item["metadata"]["name"]
        for d in yaml.safe_load_all(result.stdout)
        if d and d.get("kind") == "List"
        for item in d["items"]
    }
    assert names >= {o["metadata"]["name"] for o in objects}


def test_each_pods_command_parses_with_the_environment_the_pod_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pods' ``elasticps <role> ...`` lines and ``ELASTICPS_*`` variables fit the CLI."""
    from elasticps.cli import build_parser

    env_map = next(o.data for o in job_objects(REQUEST, CONFIG) if o.metadata.name == "j-env")
    downward = {"status.podIP": "10.244.0.7", "metadata.name": "pod", "metadata.uid": "u",
                "metadata.namespace": "ml"}  # fmt: skip
    parsed = {}
    for pod in all_pods():
        role = pod["metadata"]["labels"]["elasticps/role"]
        if role == "etcd":
            continue
        container = pod["spec"]["containers"][0]
        with monkeypatch.context() as m:
            for key, value in env_map.items():
                m.setenv(key, value)
            for var in container["env"]:  # env wins over envFrom, as in Kubernetes
                value = var.get("value") or downward[var["valueFrom"]["fieldRef"]["fieldPath"]]
                m.setenv(var["name"], value)
            parsed[role] = build_parser().parse_args(container["command"][1:])
    master, ps, trainer = parsed["master"], parsed["ps"], parsed["trainer"]
    assert (master.backend, master.trainers, master.ps) == ("kubernetes", "2:4", 2)
    assert (master.etcd, master.host, master.master_port) == ("j-etcd:2379", "10.244.0.7", 50051)
    assert (master.namespace, master.volume_claim, master.stuck_after_s) == ("ml", "data", 60.0)
    assert (ps.host, ps.ps_port, ps.mode) == ("10.244.0.7", PS_PORT, "async")
    assert str(ps.checkpoint_dir) == "/data/checkpoints/j"
    assert (int(trainer.trainer_id), trainer.ps, trainer.mode) == (12, 2, "async")
    assert str(trainer.model) == MODEL_PATH


def test_a_job_on_object_storage_needs_no_volume() -> None:
    config = KubernetesConfig(namespace="ml", image="elasticps:1")
    request = JobRequest(
        job="j",
        model_source="class Model: ...\n",
        min_trainers=2,
        max_trainers=2,
        initial_trainers=2,
        ps=2,
        data=("s3://bucket/mnist/train.parquet",),
        checkpoint_dir="s3://bucket/checkpoints/j",
    )
    objects = [round_trip(o) for o in job_objects(request, config)]
    pods = template_pods(job_objects(request, config))
    pods += [
        round_trip(worker_pod("j", WorkerSpec(role, 0), config, OWNER))
        for role in (Role.PS, Role.TRAINER)
    ]
    for pod in pods:
        assert all("persistentVolumeClaim" not in v for v in pod["spec"].get("volumes", []))
        for container in pod["spec"]["containers"]:
            assert "/data" not in {m["mountPath"] for m in container.get("volumeMounts", [])}
    (env,) = [o["data"] for o in objects if o["metadata"]["name"] == "j-env"]
    assert env["ELASTICPS_CHECKPOINT_DIR"] == "s3://bucket/checkpoints/j"
    assert "ELASTICPS_VOLUME_CLAIM" not in env
    (master,) = [o for o in pods if o["metadata"]["name"] == "j-master-0"]
    command = master["spec"]["containers"][0]["command"]
    assert command[command.index("--data") + 1] == "s3://bucket/mnist/train.parquet"


def test_a_checkpoint_url_with_credentials_is_refused() -> None:
    with pytest.raises(ConfigError, match="credentials"):
        JobRequest(
            job="j",
            model_source="",
            min_trainers=1,
            max_trainers=1,
            initial_trainers=1,
            ps=1,
            data=("s3://b/d",),
            checkpoint_dir="s3://KEY:SECRET@bucket/x",
        )


def test_a_terminating_pod_is_taken_as_lost_only_well_past_its_grace_period() -> None:
    import datetime

    from elasticps.launcher.kubernetes import FORCE_DELETE_AFTER_S, deletion_overdue

    end = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    later = end + datetime.timedelta(seconds=FORCE_DELETE_AFTER_S)
    assert not deletion_overdue(end, end - datetime.timedelta(seconds=5))  # still in its grace
    assert not deletion_overdue(end, later)
    assert deletion_overdue(end, later + datetime.timedelta(seconds=1))


def test_the_state_record_keeps_the_failed_jobs_exit_status_and_latest_decisions() -> None:
    from elasticps.launcher.kubernetes import MAX_DECISIONS, job_end, job_state, state_configmap

    decisions = [
        {"at": float(i), "role": "trainer", "worker": f"trainer-{i}", "happened": "exit 1",
         "decided": "replace"}
        for i in range(MAX_DECISIONS + 5)
    ]  # fmt: skip
    record = round_trip(
        state_configmap("j", "ml", "failed", "trainers keep failing", exit_code=1,
                        decisions=decisions)
    )  # fmt: skip
    assert job_state([], record) == ("failed", "trainers keep failing")
    code, kept = job_end(record)
    assert code == 1
    assert kept == decisions[-MAX_DECISIONS:]
    # Written without them (a finished job, an older manager): nothing, and no error.
    assert job_end(round_trip(state_configmap("j", "ml", "finished"))) == (None, [])
    assert job_end({"data": {"exit_code": "x", "decisions": "{not json"}}) == (None, [])
    assert job_end(None) == (None, [])
