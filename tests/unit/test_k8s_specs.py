"""The generated Kubernetes objects, checked against the client's model classes.

Every object goes through the official client's serializer and deserializer
(``sanitize_for_serialization`` -> JSON -> ``ApiClient().deserialize`` into
``V1Pod``/``V1Service``/``V1ConfigMap``) and must come back identical. When
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
    MODEL_PATH,
    PS_PORT,
    JobRequest,
    OwnerRef,
    job_objects,
    model_configmap,
    to_manifests,
    worker_pod,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CONFIG = KubernetesConfig(namespace="ml", image="elasticps:1", volume_claim="data")
OWNER = OwnerRef("j-master-0", "5f0c6a1e-0000-4000-8000-000000000001")
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


def all_pods() -> list[dict[str, Any]]:
    pods = [round_trip(o) for o in job_objects(REQUEST, CONFIG) if o.kind == "Pod"]
    for spec in (WorkerSpec(Role.PS, 1), WorkerSpec(Role.TRAINER, 12, ("--trainer-id", "12"))):
        pods.append(round_trip(worker_pod("j", spec, CONFIG, OWNER)))
    return pods


def test_every_object_survives_the_clients_model_classes() -> None:
    kinds = [round_trip(o)["kind"] for o in job_objects(REQUEST, CONFIG)]
    assert kinds == ["ConfigMap"] * 3 + ["Pod", "Service", "Pod", "Service"]


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


def test_worker_pods_are_owned_by_the_master_and_never_restart_in_place() -> None:
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
            "apiVersion": "v1",
            "kind": "Pod",
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
    assert mounts == {"model": str(Path(MODEL_PATH).parent), "data": "/data"}


def test_the_master_runs_the_kubernetes_worker_manager_under_its_service_account() -> None:
    master = next(
        round_trip(o) for o in job_objects(REQUEST, CONFIG) if o.metadata.name == "j-master-0"
    )
    assert master["spec"]["serviceAccountName"] == "elasticps"
    assert master["spec"]["restartPolicy"] == "OnFailure"
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
        env={doc["metadata"]["name"]: doc for doc in example}["mnist-env"]["data"],
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
    rules = {r["resources"][0]: set(r["verbs"]) for r in docs["Role"]["rules"]}
    assert {"create", "delete", "list", "watch", "get"} <= rules["pods"]
    assert {"get", "patch", "create"} <= rules["configmaps"]
    assert {"create", "delete", "list"} <= rules["services"]
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
    pods = [o for o in objects if o["kind"] == "Pod"]
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
