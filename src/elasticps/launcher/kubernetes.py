"""The Kubernetes backend: workers are pods, created with the official client.

Two layers:

- Pure builders (:func:`worker_pod`, :func:`master_deployment`,
  :func:`etcd_statefulset`, :func:`master_service`, :func:`model_configmap`...)
  return the client's model objects (``V1Pod``, ``V1Deployment``,
  ``V1StatefulSet``, ``V1Service``, ``V1ConfigMap``), so the generated specs
  are checked against the API's schema in unit tests, without a cluster.
- :class:`KubernetesBackend` implements
  :class:`~elasticps.launcher.backend.Backend` with ``CoreV1Api``: create,
  delete, list and watch the job's worker pods; the watch is a
  :class:`~elasticps.launcher.pod_events.PodEventListener`.

Every object of a job carries the labels ``app=elasticps``,
``elasticps/job=<job>`` and ``elasticps/role=<role>`` (pods of workers also
``elasticps/index=<i>``), so ``elasticps delete JOB`` selects them all.

What re-creates each pod when its node is lost: the etcd members are a
StatefulSet (data on PersistentVolumeClaims), the masters a Deployment, and
the PS and trainer pods the worker manager of the active master. Worker
pods have an owner reference to the master's Deployment (not to a master
pod, which a lost node takes with it): deleting the Deployment deletes them
(the garbage collector), replacing a master pod does not.

Pods get their settings from the environment: the job-wide ``ELASTICPS_*``
variables come from the ConfigMap ``<job>-env`` (``envFrom``), the pod's own
IP, name and uid from the downward API. The user's model file travels as
the ConfigMap ``<job>-model``, mounted at ``/etc/elasticps/model``: a new
model needs no image rebuild, at the price of the API's 1 MiB limit on a
ConfigMap (:data:`MAX_CONFIGMAP_BYTES`).

Probes: the master has a ``grpc`` readiness probe on its gRPC health service
(``grpc.health.v1``), which reports SERVING only on the active master, so
its Service routes to the active master only; a PS has a ``tcpSocket``
probe on its tensor-plane port; trainers serve nothing and have none (their
liveness is their etcd lease, and stuck detection).

Errors: a 403 ``exceeded quota`` on create, and a 409 (a pod of that name
still terminating), raise :class:`~elasticps.errors.UnschedulableError`, so
the worker manager retries with backoff; other API failures raise
:class:`~elasticps.errors.KubernetesError`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elasticps import metrics
from elasticps.config import (
    KubernetesConfig,
    ManagerConfig,
    PodResources,
    check_kubernetes_job_name,
)
from elasticps.errors import ConfigError, ElasticPSError, KubernetesError, UnschedulableError
from elasticps.launcher.backend import Cancel, Role, WorkerEvent, WorkerSpec
from elasticps.launcher.pod_events import (
    LABEL_APP,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    PodEventListener,
    PodView,
    classify,
    worker_event,
)

__all__ = [
    "ETCD_PEER_PORT",
    "ETCD_PORT",
    "MASTER_PORT",
    "MAX_CONFIGMAP_BYTES",
    "MODEL_PATH",
    "PS_PORT",
    "ConfigMapDesiredCount",
    "JobRequest",
    "KubernetesBackend",
    "OwnerRef",
    "build_manager",
    "delete_job",
    "env_configmap",
    "etcd_peer_service",
    "etcd_service",
    "etcd_statefulset",
    "in_cluster_manager",
    "job_end",
    "job_labels",
    "job_logs",
    "job_objects",
    "job_selector",
    "job_state",
    "job_status",
    "manifests_yaml",
    "mark_job_failed",
    "master_deployment",
    "master_owner",
    "master_service",
    "model_configmap",
    "pod_name",
    "ps_specs",
    "record_job_state",
    "scale_configmap",
    "set_wanted_trainers",
    "state_configmap",
    "submit_job",
    "to_manifests",
    "trainer_spec",
    "worker_pod",
]

from elasticps.launcher.supervisor import FailJob
from elasticps.security import AUTH_OFF_ENV, SECRET_FILE_ENV, SECRET_FILE_NAME, JobSecret
from elasticps.storage import Location

if TYPE_CHECKING:
    from elasticps.coord.store import JobStore
    from elasticps.launcher.manager import (
        Decide,
        DesiredCountSource,
        ProgressSource,
        TaskProgressSource,
        WorkerManager,
    )
    from elasticps.launcher.supervisor import Action as PolicyAction
    from elasticps.launcher.supervisor import Event as PolicyEvent

log = logging.getLogger(__name__)

APP = "elasticps"
MASTER_PORT = 50051
"""The master's gRPC port in its pod (and its Service)."""
PS_PORT = 7000
"""A parameter server's tensor-plane port in its pod."""
METRICS_PORT = 9400
"""Every role's Prometheus metrics port in its pod (named in its scrape annotations)."""
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(METRICS_PORT),
    "prometheus.io/path": "/metrics",
}
"""The annotations that the usual Prometheus ``kubernetes_sd_configs`` pod relabelling
reads: every master, PS and trainer pod carries them."""
ETCD_PORT = 2379
"""The job's etcd client port."""
MODEL_DIR = "/etc/elasticps/model"
MODEL_FILE = "model.py"
MODEL_PATH = f"{MODEL_DIR}/{MODEL_FILE}"
"""Where the model file is mounted in every pod."""
DATA_DIR = "/data"

SECRET_DIR = "/etc/elasticps/secret"
"""Where every pod of a job mounts its Secret ``<job>-secret`` (the job secret)."""
"""Where :attr:`KubernetesConfig.volume_claim` is mounted."""
MAX_CONFIGMAP_BYTES = 1024 * 1024
"""The API server's limit on a ConfigMap's data, bytes (etcd's request size)."""
SCALE_KEY = "trainers"
"""The key of the wanted trainer count in the ``<job>-scale`` ConfigMap."""
ETCD_PEER_PORT = 2380
"""The job's etcd peer port (between the members of a StatefulSet of three)."""
STATE_KEY = "state"
"""The key of the job's state in the ``<job>-state`` ConfigMap: ``failed`` once the
supervision policy failed the job."""
FAILURE_KEY = "failure"
"""The key of why the policy failed the job (one line) in the ``<job>-state`` ConfigMap."""
MAX_FAILURE_CHARS = 1024
"""Longest failure message kept under :data:`FAILURE_KEY`, characters."""
EXIT_CODE_KEY = "exit_code"
"""The key of the failed job's exit status (1, or 2 for a user error) in ``<job>-state``."""
DECISIONS_KEY = "decisions"
"""The key of the supervision policy's decisions (a JSON list, as ``run.json``'s
``decisions``) in ``<job>-state``."""
MAX_DECISIONS = 200
"""Most decisions kept under :data:`DECISIONS_KEY`: the latest ones."""


def pod_name(job: str, worker: str) -> str:
    """The pod (or Service) name of a job's worker, e.g. ``myjob-trainer-3``."""
    return f"{job}-{worker}"


def job_labels(job: str, role: str | None = None, index: int | None = None) -> dict[str, str]:
    """The labels of a job's objects: app, job, and optionally role and index."""
    labels = {LABEL_APP: APP, LABEL_JOB: job}
    if role is not None:
        labels[LABEL_ROLE] = role
    if index is not None:
        labels[LABEL_INDEX] = str(index)
    return labels


def job_selector(job: str, role: str | None = None) -> str:
    """The label selector of a job's objects (of one role if given)."""
    return ",".join(f"{k}={v}" for k, v in job_labels(job, role).items())


@dataclass(frozen=True)
class OwnerRef:
    """The object that owns a job's worker pods (the master's Deployment).

    Attributes:
        name: its name.
        uid: its uid (``metadata.uid``).
        kind: its kind.
        api_version: its API version.
    """

    name: str
    uid: str
    kind: str = "Deployment"
    api_version: str = "apps/v1"

    def to_model(self) -> Any:
        """The ``V1OwnerReference``; ``blockOwnerDeletion`` for foreground deletion."""
        from kubernetes import client

        return client.V1OwnerReference(
            api_version=self.api_version,
            kind=self.kind,
            name=self.name,
            uid=self.uid,
            controller=True,
            block_owner_deletion=True,
        )


# --- pure builders ---------------------------------------------------------------


def _resources(res: PodResources) -> Any:
    from kubernetes import client

    return client.V1ResourceRequirements(
        requests={"cpu": res.cpu_request, "memory": res.memory_request},
        limits={"cpu": res.cpu_limit, "memory": res.memory_limit},
    )


def _field_env(name: str, path: str) -> Any:
    from kubernetes import client

    return client.V1EnvVar(
        name=name,
        value_from=client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path=path)),
    )


def _role_env(job: str, role: Role, index: int, extra: Mapping[str, str]) -> list[Any]:
    from kubernetes import client

    env = [
        _field_env("ELASTICPS_HOST", "status.podIP"),
        _field_env("ELASTICPS_POD_NAME", "metadata.name"),
        _field_env("ELASTICPS_POD_UID", "metadata.uid"),
        _field_env("ELASTICPS_NAMESPACE", "metadata.namespace"),
    ]
    plain = {
        "ELASTICPS_ROLE": role.value,
        "ELASTICPS_JOB": job,
        metrics.METRICS_PORT_ENV: str(METRICS_PORT),
    }
    if role is Role.MASTER:
        plain["ELASTICPS_MASTER_PORT"] = str(MASTER_PORT)
    elif role is Role.PS:
        plain["ELASTICPS_PS_PORT"] = str(PS_PORT)
    else:
        plain["ELASTICPS_TRAINER_ID"] = str(index)
    plain.update(extra)
    env += [client.V1EnvVar(name=k, value=v) for k, v in sorted(plain.items())]
    return env


def _volumes(job: str, config: KubernetesConfig) -> tuple[list[Any], list[Any]]:
    from kubernetes import client

    volumes = [
        client.V1Volume(
            name="model",
            config_map=client.V1ConfigMapVolumeSource(name=f"{job}-model", optional=True),
        )
    ]
    mounts = [client.V1VolumeMount(name="model", mount_path=MODEL_DIR, read_only=True)]
    # The job secret (absent, and so skipped, for a job submitted with --auth off).
    volumes.append(
        client.V1Volume(
            name="secret",
            secret=client.V1SecretVolumeSource(
                secret_name=f"{job}-secret", default_mode=0o400, optional=True
            ),
        )
    )
    mounts.append(client.V1VolumeMount(name="secret", mount_path=SECRET_DIR, read_only=True))
    if config.volume_claim:
        volumes.append(
            client.V1Volume(
                name="data",
                persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(
                    claim_name=config.volume_claim
                ),
            )
        )
        mounts.append(client.V1VolumeMount(name="data", mount_path=DATA_DIR))
    return volumes, mounts


def _container(job: str, spec: WorkerSpec, config: KubernetesConfig) -> Any:
    """The container of a role: ``elasticps <role> <spec.args...>``, its ports and probe."""
    from kubernetes import client

    role = spec.role
    resources = {Role.MASTER: config.master, Role.PS: config.ps, Role.TRAINER: config.trainer}
    _, mounts = _volumes(job, config)
    ports: list[Any] = [client.V1ContainerPort(name="metrics", container_port=METRICS_PORT)]
    probe = None
    if role is Role.MASTER:
        ports.insert(0, client.V1ContainerPort(name="grpc", container_port=MASTER_PORT))
        probe = client.V1Probe(
            grpc=client.V1GRPCAction(port=MASTER_PORT, service=""),
            initial_delay_seconds=2,
            period_seconds=5,
            failure_threshold=3,
        )
    elif role is Role.PS:
        ports.insert(0, client.V1ContainerPort(name="tensor", container_port=PS_PORT))
        probe = client.V1Probe(
            tcp_socket=client.V1TCPSocketAction(port=PS_PORT),
            initial_delay_seconds=2,
            period_seconds=5,
        )
    return client.V1Container(
        name=role.value,
        image=config.image,
        image_pull_policy=config.image_pull_policy,
        command=["elasticps", role.value, *spec.args],
        env=_role_env(job, role, spec.index, spec.env),
        env_from=[
            client.V1EnvFromSource(
                config_map_ref=client.V1ConfigMapEnvSource(name=f"{job}-env", optional=True)
            )
        ],
        ports=ports or None,
        readiness_probe=probe,
        resources=_resources(resources[role]),
        volume_mounts=mounts,
    )


def worker_pod(
    job: str, spec: WorkerSpec, config: KubernetesConfig, owner: OwnerRef | None = None
) -> Any:
    """The pod of one PS or trainer, as a ``V1Pod`` (the worker manager creates it).

    The container runs ``elasticps <role> <spec.args...>`` with the job's
    ``ELASTICPS_*`` environment (``envFrom`` the ``<job>-env`` ConfigMap),
    ``spec.env`` on top. Worker pods never restart in place
    (``restartPolicy: Never``): the worker manager replaces them, on any node.

    Args:
        job: the job name (a DNS label).
        spec: the worker.
        config: image, namespace, resources.
        owner: the owner of the pod (the master's Deployment), or None.

    Returns:
        A ``kubernetes.client.V1Pod``.
    """
    from kubernetes import client

    volumes, _ = _volumes(job, config)
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=pod_name(job, spec.name),
            namespace=config.namespace,
            labels=job_labels(job, spec.role.value, spec.index),
            annotations=dict(SCRAPE_ANNOTATIONS),
            owner_references=[owner.to_model()] if owner is not None else None,
        ),
        spec=client.V1PodSpec(
            containers=[_container(job, spec, config)],
            restart_policy="Never",
            volumes=volumes,
            termination_grace_period_seconds=10,
        ),
    )


def master_deployment(
    job: str, args: tuple[str, ...], config: KubernetesConfig, replicas: int = 1
) -> Any:
    """The master's Deployment ``<job>-master``: ``replicas`` pods of ``elasticps master <args>``.

    A Deployment, so that a master pod lost with its node is re-created on
    another one. More than one replica are standby masters: each waits on the
    master lock in etcd, which fences every ledger write, and only the active
    one is ready (its gRPC health), so the ``<job>-master`` Service routes to
    it alone. The active master runs the worker manager (under the job's
    ServiceAccount); the PS and trainer pods it creates are owned by this
    Deployment, so they outlive a master pod and go with the Deployment.

    Args:
        job: the job name (a DNS label).
        args: the master's flags.
        config: image, namespace, resources, ServiceAccount.
        replicas: masters, >= 1 (1 + standby masters).

    Raises:
        ConfigError: ``replicas`` < 1.
    """
    from kubernetes import client

    if replicas < 1:
        raise ConfigError(f"the master needs at least one replica, got {replicas}")
    spec = WorkerSpec(Role.MASTER, 0, args)
    labels = job_labels(job, Role.MASTER.value)
    volumes, _ = _volumes(job, config)
    template = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels=labels, annotations=dict(SCRAPE_ANNOTATIONS)),
        spec=client.V1PodSpec(
            containers=[_container(job, spec, config)],
            restart_policy="Always",
            service_account_name=config.service_account,
            volumes=volumes,
            termination_grace_period_seconds=10,
        ),
    )
    return client.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=client.V1ObjectMeta(
            name=f"{job}-master", namespace=config.namespace, labels=labels
        ),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=template,
            # The old master goes before the new one starts: no two masters from a rollout.
            strategy=client.V1DeploymentStrategy(type="Recreate"),
        ),
    )


def master_service(job: str, config: KubernetesConfig) -> Any:
    """The master's Service, ``<job>-master:50051``, selecting the (ready) master pod."""
    from kubernetes import client

    return client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=client.V1ObjectMeta(
            name=f"{job}-master", namespace=config.namespace, labels=job_labels(job, "master")
        ),
        spec=client.V1ServiceSpec(
            selector=job_labels(job, "master"),
            ports=[client.V1ServicePort(name="grpc", port=MASTER_PORT, target_port=MASTER_PORT)],
        ),
    )


def etcd_peer_host(job: str, member: int, namespace: str) -> str:
    """The DNS name of etcd member ``member`` (its pod in the headless peer Service)."""
    return f"{job}-etcd-{member}.{job}-etcd-peer.{namespace}.svc"


def etcd_statefulset(
    job: str, config: KubernetesConfig, replicas: int = 1, storage: str = "1Gi"
) -> Any:
    """The job's etcd: a StatefulSet ``<job>-etcd`` of ``replicas`` members, data on PVCs.

    Each member keeps its data on its own PersistentVolumeClaim
    (``data-<job>-etcd-<i>``, from ``volumeClaimTemplates``, in the
    namespace's default StorageClass), so a member re-created on another node
    finds its data again (where the storage can follow it across nodes).
    With three members, etcd keeps its quorum while one node is lost. The
    members find each other through the headless Service ``<job>-etcd-peer``
    (:func:`etcd_peer_service`); ``podManagementPolicy: Parallel`` starts them
    together, as a new cluster must.

    Args:
        job: the job name.
        config: namespace, etcd image, pull policy.
        replicas: members: 1, 3, 5 or 7.
        storage: each member's claim size (a Kubernetes quantity, e.g. ``1Gi``).

    Raises:
        ConfigError: ``replicas`` is not an odd number in 1..7.
    """
    from kubernetes import client

    if replicas not in (1, 3, 5, 7):
        raise ConfigError(f"--etcd-replicas must be 1, 3, 5 or 7, got {replicas}")
    ns = config.namespace
    labels = job_labels(job, "etcd")
    cluster = ",".join(
        f"{job}-etcd-{i}=http://{etcd_peer_host(job, i, ns)}:{ETCD_PEER_PORT}"
        for i in range(replicas)
    )
    # The kubelet expands $(POD_NAME). Not ETCD_NAME: etcd reads ETCD_* variables as its
    # flags, and refuses to start when one is also given on the command line.
    me = f"$(POD_NAME).{job}-etcd-peer.{ns}.svc"
    container = client.V1Container(
        name="etcd",
        image=config.etcd_image,
        image_pull_policy=config.image_pull_policy,
        command=[
            "etcd",
            "--name=$(POD_NAME)",
            "--data-dir=/var/lib/etcd/data",
            f"--listen-client-urls=http://0.0.0.0:{ETCD_PORT}",
            f"--advertise-client-urls=http://{me}:{ETCD_PORT}",
            f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
            f"--initial-advertise-peer-urls=http://{me}:{ETCD_PEER_PORT}",
            f"--initial-cluster={cluster}",
            f"--initial-cluster-token={job}-etcd",
            "--initial-cluster-state=new",  # ignored once the data dir holds a member
        ],
        env=[_field_env("POD_NAME", "metadata.name")],
        ports=[
            client.V1ContainerPort(name="client", container_port=ETCD_PORT),
            client.V1ContainerPort(name="peer", container_port=ETCD_PEER_PORT),
        ],
        readiness_probe=client.V1Probe(
            http_get=client.V1HTTPGetAction(path="/health", port=ETCD_PORT),
            initial_delay_seconds=1,
            period_seconds=5,
        ),
        resources=_resources(PodResources("100m", "1", "256Mi", "1Gi")),
        volume_mounts=[client.V1VolumeMount(name="data", mount_path="/var/lib/etcd")],
    )
    claim = client.V1PersistentVolumeClaim(
        api_version="v1",
        kind="PersistentVolumeClaim",
        metadata=client.V1ObjectMeta(name="data", labels=labels),
        spec=client.V1PersistentVolumeClaimSpec(
            access_modes=["ReadWriteOnce"],
            resources=client.V1VolumeResourceRequirements(requests={"storage": storage}),
        ),
    )
    return client.V1StatefulSet(
        api_version="apps/v1",
        kind="StatefulSet",
        metadata=client.V1ObjectMeta(name=f"{job}-etcd", namespace=ns, labels=labels),
        spec=client.V1StatefulSetSpec(
            replicas=replicas,
            service_name=f"{job}-etcd-peer",
            pod_management_policy="Parallel",
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    containers=[container],
                    restart_policy="Always",
                    termination_grace_period_seconds=10,
                ),
            ),
            volume_claim_templates=[claim],
            # The claims go with the job (elasticps delete), not with a lost pod.
            persistent_volume_claim_retention_policy=(
                client.V1StatefulSetPersistentVolumeClaimRetentionPolicy(
                    when_deleted="Delete", when_scaled="Retain"
                )
            ),
        ),
    )


def etcd_peer_service(job: str, config: KubernetesConfig) -> Any:
    """The headless Service ``<job>-etcd-peer`` that names each etcd member in DNS.

    ``publishNotReadyAddresses``: members must resolve each other before
    they are ready (a member is ready only once the cluster has a leader).
    """
    from kubernetes import client

    return client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=client.V1ObjectMeta(
            name=f"{job}-etcd-peer", namespace=config.namespace, labels=job_labels(job, "etcd")
        ),
        spec=client.V1ServiceSpec(
            cluster_ip="None",
            publish_not_ready_addresses=True,
            selector=job_labels(job, "etcd"),
            ports=[
                client.V1ServicePort(name="client", port=ETCD_PORT, target_port=ETCD_PORT),
                client.V1ServicePort(name="peer", port=ETCD_PEER_PORT, target_port=ETCD_PEER_PORT),
            ],
        ),
    )


def etcd_service(job: str, config: KubernetesConfig) -> Any:
    """The etcd client Service, ``<job>-etcd:2379``, routing to the ready members."""
    from kubernetes import client

    return client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=client.V1ObjectMeta(
            name=f"{job}-etcd", namespace=config.namespace, labels=job_labels(job, "etcd")
        ),
        spec=client.V1ServiceSpec(
            selector=job_labels(job, "etcd"),
            ports=[client.V1ServicePort(name="client", port=ETCD_PORT, target_port=ETCD_PORT)],
        ),
    )


def model_configmap(job: str, model_source: str, config: KubernetesConfig) -> Any:
    """The ConfigMap ``<job>-model`` holding the model file as ``model.py``.

    Raises:
        ConfigError: the file is larger than :data:`MAX_CONFIGMAP_BYTES`.
    """
    from kubernetes import client

    size = len(model_source.encode())
    if size > MAX_CONFIGMAP_BYTES:
        raise ConfigError(
            f"the model file is {size} bytes; a ConfigMap holds at most {MAX_CONFIGMAP_BYTES} "
            "(bake large models into the image instead, see docs/kubernetes.md)"
        )
    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(
            name=f"{job}-model", namespace=config.namespace, labels=job_labels(job, "model")
        ),
        data={MODEL_FILE: model_source},
    )


def secret_object(job: str, secret: JobSecret, config: KubernetesConfig) -> Any:
    """The Secret ``<job>-secret``: the job secret, mounted into every pod at :data:`SECRET_DIR`."""
    from kubernetes import client

    return client.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=client.V1ObjectMeta(
            name=f"{job}-secret", namespace=config.namespace, labels=job_labels(job, "secret")
        ),
        type="Opaque",
        string_data={SECRET_FILE_NAME: secret.key.hex() + "\n"},
    )


def network_policy(job: str, config: KubernetesConfig) -> Any:
    """The NetworkPolicy ``<job>-network``: only the job's pods reach its pods (etcd, master, PS).

    It selects every pod labelled with the job and admits ingress only from
    pods labelled with the job, but for the metrics port (:data:`METRICS_PORT`),
    open to a Prometheus anywhere in the cluster: metrics carry counts and
    timings, never parameters, records or credentials. It takes effect where
    the cluster's network plugin enforces NetworkPolicies; the kubelet's probes
    come from the node, which most plugins admit.
    """
    from kubernetes import client

    labels = job_labels(job)
    return client.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=client.V1ObjectMeta(
            name=f"{job}-network", namespace=config.namespace, labels=job_labels(job, "network")
        ),
        spec=client.V1NetworkPolicySpec(
            pod_selector=client.V1LabelSelector(match_labels=labels),
            policy_types=["Ingress"],
            ingress=[
                client.V1NetworkPolicyIngressRule(
                    _from=[
                        client.V1NetworkPolicyPeer(
                            pod_selector=client.V1LabelSelector(match_labels=labels)
                        )
                    ]
                ),
                client.V1NetworkPolicyIngressRule(
                    ports=[client.V1NetworkPolicyPort(port=METRICS_PORT, protocol="TCP")]
                ),
            ],
        ),
    )


def env_configmap(job: str, env: Mapping[str, str], config: KubernetesConfig) -> Any:
    """The ConfigMap ``<job>-env``: job-wide ``ELASTICPS_*`` variables of every pod."""
    from kubernetes import client

    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(
            name=f"{job}-env", namespace=config.namespace, labels=job_labels(job, "env")
        ),
        data=dict(sorted(env.items())),
    )


def scale_configmap(job: str, trainers: int, config: KubernetesConfig) -> Any:
    """The ConfigMap ``<job>-scale`` holding the wanted trainer count."""
    from kubernetes import client

    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(
            name=f"{job}-scale", namespace=config.namespace, labels=job_labels(job, "scale")
        ),
        data={SCALE_KEY: str(trainers)},
    )


# --- the shell ------------------------------------------------------------------------


def _api_error(exc: Exception, what: str) -> KubernetesError:
    return KubernetesError(f"{what}: {_describe(exc)}")


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    if status is not None:
        message = ""
        if body:
            try:
                message = str(json.loads(body).get("message", ""))
            except (ValueError, AttributeError):
                message = str(body)[:200]
        return f"HTTP {status} {getattr(exc, 'reason', '')} {message}".strip()
    return f"{type(exc).__name__}: {exc}"


def _request_errors() -> tuple[type[Exception], ...]:
    from kubernetes.client import ApiException
    from urllib3.exceptions import HTTPError

    return (ApiException, HTTPError, OSError)


FORCE_DELETE_AFTER_S = 30.0
"""How long past its ``deletionTimestamp`` a terminating pod that blocks a PS's name may
stay before it is deleted with grace period 0 (its node is taken as lost), seconds."""


def deletion_overdue(deletion_timestamp: Any, now: Any) -> bool:
    """Whether a pod's graceful deletion is :data:`FORCE_DELETE_AFTER_S` overdue.

    Args:
        deletion_timestamp: the pod's ``metadata.deletionTimestamp``, an aware
            ``datetime`` (the end of its grace period).
        now: the current time, an aware ``datetime`` (UTC).
    """
    return bool((now - deletion_timestamp).total_seconds() > FORCE_DELETE_AFTER_S)


class KubernetesBackend:
    """A :class:`~elasticps.launcher.backend.Backend` whose workers are pods.

    Thread-safe: the client's ``ApiClient`` pools connections per thread-safe
    urllib3 pool, and the backend keeps no other mutable state than its
    watches.

    Args:
        namespace: the job's namespace.
        job: the job name (a DNS label, see
            :func:`~elasticps.config.check_kubernetes_job_name`).
        image: the container image of the worker pods.
        api_client: a ``kubernetes.client.ApiClient`` (in the master pod:
            ``kubernetes.config.load_incluster_config()``; in tests: the fake
            API server's address).
        owner: the owner of the worker pods (the master pod), or None.
        config: everything else (resources, volume, pull policy); its
            ``namespace`` and ``image`` are replaced by the arguments.
        watch_timeout_s: length of one watch request, seconds.
    """

    def __init__(
        self,
        namespace: str,
        job: str,
        image: str,
        api_client: Any,
        owner: OwnerRef | None = None,
        *,
        config: KubernetesConfig | None = None,
        watch_timeout_s: int = 30,
    ) -> None:
        from dataclasses import replace

        from kubernetes import client

        self.job = job
        self.config = replace(config or KubernetesConfig(), namespace=namespace, image=image)
        self.owner = owner
        self.api: Any = client.CoreV1Api(api_client)
        self._watch_timeout_s = watch_timeout_s
        self._listeners: list[PodEventListener] = []
        self._lock = threading.Lock()

    @property
    def namespace(self) -> str:
        """The job's namespace."""
        return self.config.namespace

    def pod_spec(self, spec: WorkerSpec) -> Any:
        """The ``V1Pod`` :meth:`create` submits for ``spec``."""
        return worker_pod(self.job, spec, self.config, self.owner)

    def create(self, spec: WorkerSpec) -> None:
        """Create the worker's pod.

        Raises:
            UnschedulableError: the namespace's quota is exhausted (403
                ``exceeded quota``), or a pod of that name still exists (409:
                a replaced PS whose old pod is terminating, or has exited; an
                exited one is deleted, so the retry succeeds).
            KubernetesError: any other API failure.
        """
        from kubernetes.client import ApiException

        name = pod_name(self.job, spec.name)
        try:
            self.api.create_namespaced_pod(self.namespace, self.pod_spec(spec))
        except ApiException as exc:
            text = _describe(exc)
            if exc.status == 403 and "exceeded quota" in text:
                raise UnschedulableError(f"pod {name}: {text}") from exc
            if exc.status == 409:
                self._remove_finished(name)
                raise UnschedulableError(f"pod {name} still exists (terminating?)") from exc
            raise _api_error(exc, f"creating pod {name}") from exc
        except _request_errors() as exc:
            raise _api_error(exc, f"creating pod {name}") from exc
        log.info("created pod %s", name)

    def _remove_finished(self, pod: str) -> None:
        """Delete pod ``pod`` if it has finished, or its node never confirmed its deletion.

        A replaced PS reuses its name. Its old pod, if it exited rather than
        being deleted, stays in the API (with its logs) until removed: it is
        deleted. If it was being deleted but is still there
        :data:`FORCE_DELETE_AFTER_S` past its ``deletionTimestamp`` (the end
        of its grace period), its node is not answering (a lost node): it is
        deleted at once (grace period 0), as ``kubectl delete pod --force``
        does, so that the replacement can run on another node. A PS that
        comes back on that node is fenced by the epoch of its slot in etcd.
        """
        import datetime

        from kubernetes.client import ApiException

        try:
            found = self.api.read_namespaced_pod(pod, self.namespace)
            phase = found.status.phase if found.status else None
            deleting = found.metadata.deletion_timestamp
            now = datetime.datetime.now(datetime.UTC)
            if phase in ("Succeeded", "Failed"):
                log.info("deleting finished pod %s (%s) to reuse its name", pod, phase)
                self.api.delete_namespaced_pod(pod, self.namespace)
            elif deleting is not None and deletion_overdue(deleting, now):
                log.warning(
                    "pod %s is still terminating %.0f s after its grace period (its node is "
                    "lost?): deleting it with grace period 0",
                    pod,
                    (now - deleting).total_seconds(),
                )
                self.api.delete_namespaced_pod(pod, self.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("could not remove finished pod %s: %s", pod, _describe(exc))
        except _request_errors() as exc:
            log.warning("could not remove finished pod %s: %s", pod, _describe(exc))

    def delete(self, name: str) -> None:
        """Delete the worker's pod (graceful); a no-op if it is gone.

        Raises:
            KubernetesError: the API failed.
        """
        from kubernetes.client import ApiException

        pod = pod_name(self.job, name)
        try:
            self.api.delete_namespaced_pod(pod, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status == 404:
                return
            raise _api_error(exc, f"deleting pod {pod}") from exc
        except _request_errors() as exc:
            raise _api_error(exc, f"deleting pod {pod}") from exc

    def list(self) -> list[WorkerEvent]:
        """The state of every worker pod of the job (PS and trainers; not etcd or the masters).

        Raises:
            KubernetesError: the API failed.
        """
        try:
            resp = self.api.list_namespaced_pod(
                self.namespace, label_selector=job_selector(self.job), _preload_content=False
            )
            items = json.loads(resp.data).get("items") or []
        except _request_errors() as exc:
            raise _api_error(exc, "listing pods") from exc
        events: list[WorkerEvent] = []
        for obj in items:
            pod = PodView.from_json(obj)
            event = worker_event(pod, *classify(pod))
            if event is not None:
                events.append(event)
        return sorted(events, key=lambda e: (e.role.value, e.index))

    def watch(self, on_event: Callable[[WorkerEvent], None]) -> Cancel:
        """Deliver every state change of the job's pods to ``on_event`` until cancelled.

        Starts with the current state of every pod (as :meth:`list`), from
        the watch thread.
        """
        listener = PodEventListener(
            self.api,
            self.namespace,
            job_selector(self.job),
            on_event,
            watch_timeout_s=self._watch_timeout_s,
        ).start()
        with self._lock:
            self._listeners.append(listener)
        return listener.stop

    def close(self) -> None:
        """Cancel every watch."""
        with self._lock:
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener.stop()


class ConfigMapDesiredCount:
    """The wanted trainer count in the ConfigMap ``<job>-scale`` (key ``trainers``).

    The Kubernetes counterpart of
    :class:`~elasticps.launcher.manager.EtcdDesiredCount`: ``elasticps scale
    JOB --trainers N`` on the user's machine cannot reach the job's etcd, but
    can patch a ConfigMap (:func:`set_wanted_trainers`). The master polls it
    (every ``poll_s`` seconds), which costs one GET and needs no watch.

    Args:
        api: a ``kubernetes.client.CoreV1Api``.
        namespace: the job's namespace.
        job: the job name.
        poll_s: seconds between two reads, > 0.
    """

    def __init__(self, api: Any, namespace: str, job: str, poll_s: float = 2.0) -> None:
        self._api = api
        self._namespace = namespace
        self._name = f"{job}-scale"
        self._poll_s = poll_s

    def get(self) -> int | None:
        """The wanted count, or None if the ConfigMap or the key is missing or malformed.

        Raises:
            KubernetesError: the API failed (other than 404).
        """
        from kubernetes.client import ApiException

        try:
            cm = self._api.read_namespaced_config_map(self._name, self._namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _api_error(exc, f"reading configmap {self._name}") from exc
        except _request_errors() as exc:
            raise _api_error(exc, f"reading configmap {self._name}") from exc
        raw = (cm.data or {}).get(SCALE_KEY)
        try:
            value = int(raw) if raw is not None else None
        except ValueError:
            log.warning("configmap %s: %s=%r is not an integer", self._name, SCALE_KEY, raw)
            return None
        return value if value is not None and value >= 0 else None

    def watch(self, on_change: Callable[[int | None], None]) -> Cancel:
        """Call ``on_change`` with each new value until cancelled (polls ``poll_s``)."""
        stop = threading.Event()

        def run() -> None:
            last: int | None = None
            first = True
            while not stop.wait(0 if first else self._poll_s):
                try:
                    value = self.get()
                except KubernetesError as exc:
                    log.warning("could not read the wanted trainer count: %s", exc)
                    continue
                if first or value != last:
                    if not first or value is not None:
                        on_change(value)
                    last, first = value, False

        threading.Thread(target=run, name="scale-configmap", daemon=True).start()
        return stop.set


def set_wanted_trainers(api: Any, namespace: str, job: str, trainers: int) -> None:
    """Write the wanted trainer count of a job (``elasticps scale`` on Kubernetes).

    Creates the ``<job>-scale`` ConfigMap if it does not exist, else patches it.

    Raises:
        ConfigError: ``trainers`` < 0.
        KubernetesError: the API failed.
    """
    from kubernetes.client import ApiException

    if trainers < 0:
        raise ConfigError(f"--trainers must be >= 0, got {trainers}")
    name = f"{job}-scale"
    try:
        try:
            api.patch_namespaced_config_map(name, namespace, {"data": {SCALE_KEY: str(trainers)}})
        except ApiException as exc:
            if exc.status != 404:
                raise
            api.create_namespaced_config_map(
                namespace, scale_configmap(job, trainers, KubernetesConfig(namespace=namespace))
            )
    except _request_errors() as exc:
        raise _api_error(exc, f"writing configmap {name}") from exc


# --- the master's worker manager ------------------------------------------------------


def trainer_spec(index: int) -> WorkerSpec:
    """The spec of trainer ``index``: its id is the index; the rest comes from ``<job>-env``."""
    return WorkerSpec(Role.TRAINER, index, ("--trainer-id", str(index)))


def ps_specs(count: int) -> list[WorkerSpec]:
    """The fixed PS workers ``ps-0 .. ps-<count-1>``; each claims a free slot in etcd."""
    return [WorkerSpec(Role.PS, index) for index in range(count)]


def build_manager(
    backend: KubernetesBackend,
    manager_config: ManagerConfig,
    ps: int,
    desired: DesiredCountSource,
    progress: ProgressSource | None,
    *,
    clock: Callable[[], float] | None = None,
    task_progress: TaskProgressSource | None = None,
    on_decision: Callable[[WorkerEvent, PolicyAction], None] | None = None,
    decide: Decide | None = None,
) -> WorkerManager:
    """The worker manager of a Kubernetes job (not started).

    What a worker's end means is the job's supervision policy
    (:mod:`elasticps.launcher.supervisor`, the one of every launcher), with
    no restart limit for the PS (as Kubernetes restarts pods): a trainer is
    replaced unless it stopped on a user error (exit status 2), or trainers
    keep failing with internal errors while no task progresses.

    Args:
        backend: the job's backend.
        manager_config: trainer range, stuck threshold, backoff.
        ps: number of parameter servers (fixed workers, replaced with the same index).
        desired: the wanted trainer count (:class:`ConfigMapDesiredCount` in a cluster).
        progress: each trainer's last progress (``LedgerProgress`` in a cluster), or None.
        clock: monotonic clock, seconds.
        task_progress: whether the job's tasks progressed (``LedgerTaskProgress``
            in a cluster), told to the policy; or None.
        on_decision: called with each worker end and the policy's answer.
        decide: the policy; by default the worker manager's own (no restart
            limit).
    """
    import time

    from elasticps.launcher.manager import WorkerManager

    return WorkerManager(
        backend,
        manager_config,
        desired,
        progress,
        clock or time.monotonic,
        trainer_spec=trainer_spec,
        fixed=ps_specs(ps),
        task_progress=task_progress,
        on_decision=on_decision,
        decide=decide,
    )


def master_owner(api_client: Any, namespace: str, job: str) -> OwnerRef | None:
    """The master's Deployment ``<job>-master`` as the owner of worker pods, or None.

    None (with a warning) when there is no such Deployment (a master started
    by hand): the worker pods then have no owner.

    Raises:
        KubernetesError: the API failed (other than 404).
    """
    from kubernetes import client
    from kubernetes.client import ApiException

    name = f"{job}-master"
    try:
        deployment: Any = client.AppsV1Api(api_client).read_namespaced_deployment(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            log.warning("no deployment %s: the worker pods get no owner", name)
            return None
        raise _api_error(exc, f"reading deployment {name}") from exc
    except _request_errors() as exc:
        raise _api_error(exc, f"reading deployment {name}") from exc
    return OwnerRef(name, str(deployment.metadata.uid))


def in_cluster_manager(
    job: str,
    manager_config: ManagerConfig,
    ps: int,
    config: KubernetesConfig,
    *,
    state_poll_s: float = 2.0,
) -> Callable[[JobStore], Callable[[], None]]:
    """The master's ``on_active`` hook: run the worker manager in the master pod.

    Uses the pod's ServiceAccount (``load_incluster_config``), and the
    master's Deployment ``<job>-master`` as the owner of the worker pods (so
    that they outlive this pod: a master re-created elsewhere, or a standby
    taking over, finds them and goes on). Sets ``ps_desired`` in etcd if
    unset, reads the wanted trainer count from ``<job>-scale``, and trainer
    progress from the task ledger when ``stuck_after_s`` is set. When the
    policy fails the job, writes so, with the exit status and the policy's
    decisions, in the ``<job>-state`` ConfigMap (:func:`mark_job_failed`)
    and in etcd; when the master finishes the job's last pass (the job state
    in etcd, read every ``state_poll_s`` seconds), writes ``finished`` there
    (:func:`record_job_state`), so that ``status`` and ``list``, which cannot
    reach etcd, read it.

    Returns:
        The hook: called with the job's store once the master serves; it
        returns the function that stops the manager.
    """

    def on_active(store: JobStore) -> Callable[[], None]:
        from kubernetes import client
        from kubernetes import config as kube_config

        from elasticps.launcher.local_processes import DecisionLog
        from elasticps.launcher.manager import LedgerProgress, LedgerTaskProgress
        from elasticps.launcher.supervisor import Supervisor, SupervisorConfig

        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
        api_client = client.ApiClient()
        owner = master_owner(api_client, config.namespace, job)
        backend = KubernetesBackend(
            config.namespace, job, config.image, api_client, owner, config=config
        )
        if store.ps_desired() is None:
            store.set_ps_desired(ps)
        progress = LedgerProgress(store) if manager_config.stuck_after_s is not None else None
        desired = ConfigMapDesiredCount(backend.api, config.namespace, job)

        ended = threading.Event()  # failed or finished: recorded once, failure first
        policy = Supervisor(SupervisorConfig(max_restarts=None))  # pods restart without limit
        decisions = DecisionLog()

        def decide(event: PolicyEvent) -> PolicyAction:
            return decisions.decide(policy, event)

        def on_decision(event: WorkerEvent, action: PolicyAction) -> None:
            if isinstance(action, FailJob):
                # Nothing more is created; the job's state says why it stopped:
                # in etcd for the roles, in <job>-state for status and list.
                log.error("job %s fails: %s", job, action.message)
                ended.set()
                store.set_job_state("failed")
                try:
                    mark_job_failed(
                        backend.api,
                        config.namespace,
                        job,
                        action.message,
                        exit_code=action.exit_code,
                        decisions=decisions.as_json(),
                    )
                except KubernetesError as exc:
                    log.error("could not record the job's failure: %s", exc)

        manager = build_manager(
            backend,
            manager_config,
            ps,
            desired,
            progress,
            task_progress=LedgerTaskProgress(store),
            on_decision=on_decision,
            decide=decide,
        )
        manager.start()
        stopping = threading.Event()

        def watch_finished() -> None:
            while not stopping.wait(state_poll_s) and not ended.is_set():
                try:
                    finished = store.job_state() == "finished"
                    if finished and not ended.is_set():
                        record_job_state(backend.api, config.namespace, job, "finished")
                        ended.set()
                except ElasticPSError as exc:
                    log.warning("could not record whether job %s finished: %s", job, exc)

        threading.Thread(target=watch_finished, name="job-finished", daemon=True).start()
        log.info(
            "worker manager of job %s: %d PS, trainers %d..%d, namespace %s",
            job,
            ps,
            manager_config.min_trainers,
            manager_config.max_trainers,
            config.namespace,
        )

        def stop() -> None:
            stopping.set()
            manager.stop()
            backend.close()

        return stop

    return on_active


# --- the user's commands: submit, status, logs, delete ---------------------------------


@dataclass(frozen=True)
class JobRequest:
    """A job to submit to a cluster (``elasticps submit``).

    Attributes:
        job: the job name (a DNS label of at most 40 characters).
        model_source: the model file's text (goes to the ``<job>-model`` ConfigMap).
        min_trainers: fewest trainers, >= 1.
        max_trainers: most trainers, >= min_trainers.
        initial_trainers: the wanted count at the start, in the range.
        ps: parameter servers, >= 1.
        data: Parquet paths as seen inside the pods, or storage URLs
            (``s3://``, ``gs://``, ``hdfs://``; see :mod:`elasticps.storage`),
            which need no volume.
        master_args: more ``elasticps master`` flags (epochs, task sizes...).
        env: job-wide ``ELASTICPS_*`` variables (mode, optimizer, batch size...).
        etcd_endpoint: an existing etcd (``host:port`` or ``http://host:port``);
            None: the job's own etcd StatefulSet.
        etcd_replicas: members of the job's own etcd: 1, 3, 5 or 7.
        etcd_storage: each etcd member's PersistentVolumeClaim size (a
            Kubernetes quantity such as ``1Gi``).
        standby_masters: masters beside the active one, waiting on the master
            lock (the master Deployment has ``1 + standby_masters`` replicas).
        stuck_after_s: replace trainers without progress for this long, seconds.
        checkpoint_dir: where the parameter servers keep their shard
            checkpoints: a storage URL, or a path inside the pods; empty: on
            the volume claim (``/data/checkpoints/<job>``) if there is one,
            else none. With URLs for the data and the checkpoints a job needs
            no shared volume; the pods read their credentials from the
            standard places (their environment, or the role of their service
            account or node).
        secret: the job secret, which every pod reads from the Secret
            ``<job>-secret``; a new one by default. None: the job runs with
            ``--auth off`` (its pods serve anyone).

    Raises:
        ConfigError: a bad job name, trainer range, PS count, etcd endpoint
            or replica count, no data, or credentials in ``checkpoint_dir``.
    """

    job: str
    model_source: str
    min_trainers: int
    max_trainers: int
    initial_trainers: int
    ps: int
    data: tuple[str, ...]
    master_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    etcd_endpoint: str | None = None
    etcd_replicas: int = 1
    etcd_storage: str = "1Gi"
    standby_masters: int = 0
    stuck_after_s: float | None = None
    checkpoint_dir: str = ""
    secret: JobSecret | None = field(default_factory=JobSecret.generate)

    def __post_init__(self) -> None:
        check_kubernetes_job_name(self.job)
        if self.checkpoint_dir:
            Location.of(self.checkpoint_dir)  # refuses credentials in the URL
        if not 1 <= self.min_trainers <= self.initial_trainers <= self.max_trainers:
            raise ConfigError(
                f"--trainers needs 1 <= MIN <= initial <= MAX, got {self.min_trainers} <= "
                f"{self.initial_trainers} <= {self.max_trainers}"
            )
        if self.ps < 1:
            raise ConfigError(f"--ps must be >= 1, got {self.ps}")
        if not self.data:
            raise ConfigError("--data needs at least one Parquet path (as seen in the pods)")
        if self.etcd_endpoint is not None:
            from elasticps.coord.etcd_server import parse_endpoint

            parse_endpoint(self.etcd_endpoint)
            if self.etcd_endpoint.strip().startswith("https://"):
                raise ConfigError(
                    f"--etcd {self.etcd_endpoint}: an etcd over TLS is not supported on "
                    "Kubernetes: the pods hold no client certificate for it"
                )
        if self.etcd_replicas not in (1, 3, 5, 7):
            raise ConfigError(f"--etcd-replicas must be 1, 3, 5 or 7, got {self.etcd_replicas}")
        if not self.etcd_storage.strip():
            raise ConfigError("--etcd-storage must be a quantity such as 1Gi")
        if self.standby_masters < 0:
            raise ConfigError(f"--standby-masters must be >= 0, got {self.standby_masters}")

    @property
    def etcd(self) -> str:
        """The etcd endpoint the pods use: the given one, or the job's etcd Service."""
        return self.etcd_endpoint or f"{self.job}-etcd:{ETCD_PORT}"


def job_objects(request: JobRequest, config: KubernetesConfig) -> list[Any]:
    """The objects ``elasticps submit`` creates, in creation order (client model objects).

    The ConfigMaps (model, job-wide environment, wanted trainer count); the
    job's etcd (unless ``request.etcd_endpoint``): its headless peer Service,
    its client Service and its StatefulSet, with the data on
    PersistentVolumeClaims; then the master's Service and Deployment. The
    active master creates the PS and trainer pods itself (its worker
    manager), owned by its Deployment.

    Raises:
        ConfigError: the model file is too large for a ConfigMap.
    """
    job = request.job
    env = {
        "ELASTICPS_JOB": job,
        "ELASTICPS_ETCD": request.etcd,
        "ELASTICPS_MODEL": MODEL_PATH,
        "ELASTICPS_PS": str(request.ps),
        **dict(request.env),
    }
    # For the master's worker manager: its worker pods look like this job's.
    env["ELASTICPS_IMAGE_PULL_POLICY"] = config.image_pull_policy
    if request.checkpoint_dir:
        env["ELASTICPS_CHECKPOINT_DIR"] = request.checkpoint_dir
    if config.volume_claim:
        env["ELASTICPS_VOLUME_CLAIM"] = config.volume_claim
        env.setdefault("ELASTICPS_CHECKPOINT_DIR", f"{DATA_DIR}/checkpoints/{job}")
    if request.secret is not None:
        env[SECRET_FILE_ENV] = f"{SECRET_DIR}/{SECRET_FILE_NAME}"
    else:
        env[AUTH_OFF_ENV] = "1"
    master_args = [
        "--backend", "kubernetes",
        "--trainers", f"{request.min_trainers}:{request.max_trainers}",
        "--ps", str(request.ps),
        "--image", config.image,
        "--data", *request.data,
        *request.master_args,
    ]  # fmt: skip
    if request.stuck_after_s is not None:
        master_args += ["--stuck-after-s", str(request.stuck_after_s)]
    objects = [
        model_configmap(job, request.model_source, config),
        env_configmap(job, env, config),
        scale_configmap(job, request.initial_trainers, config),
        network_policy(job, config),
    ]
    if request.secret is not None:
        objects.append(secret_object(job, request.secret, config))
    if request.etcd_endpoint is None:
        objects += [
            etcd_peer_service(job, config),
            etcd_service(job, config),
            etcd_statefulset(job, config, request.etcd_replicas, request.etcd_storage),
        ]
    objects += [
        master_service(job, config),
        master_deployment(job, tuple(master_args), config, 1 + request.standby_masters),
    ]
    return objects


def to_manifests(objects: list[Any]) -> list[dict[str, Any]]:
    """The objects as API JSON (camelCase dicts, no nulls), e.g. for YAML or ``kubectl``."""
    from kubernetes import client

    api_client: Any = client.ApiClient()
    return [api_client.sanitize_for_serialization(obj) for obj in objects]


def manifests_yaml(objects: list[Any]) -> str:
    """The objects as a multi-document YAML stream (multi-line strings as ``|`` blocks)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(to_manifests(objects), Dumper=Dumper, sort_keys=False)


def _apps(api: Any) -> Any:
    """The ``AppsV1Api`` on the same connection as the ``CoreV1Api`` ``api``."""
    from kubernetes import client

    return client.AppsV1Api(api.api_client)


def _networking(api: Any) -> Any:
    """The ``NetworkingV1Api`` on the same connection as the ``CoreV1Api`` ``api``."""
    from kubernetes import client

    return client.NetworkingV1Api(api.api_client)


def submit_job(api: Any, request: JobRequest, config: KubernetesConfig) -> dict[str, Any]:
    """Create the objects of :func:`job_objects` in the namespace; returns at once.

    Args:
        api: a ``kubernetes.client.CoreV1Api`` (Deployments and StatefulSets
            go through an ``AppsV1Api`` on its connection).
        request: the job.
        config: namespace, image, resources.

    Returns:
        ``{"job", "namespace", "etcd", "created": ["kind/name"...]}``.

    Raises:
        ConfigError: an object of the job already exists (409), or the model
            file is too large for a ConfigMap.
        KubernetesError: the API failed.
    """
    from kubernetes.client import ApiException

    ns = config.namespace
    apps = _apps(api)
    networking = _networking(api)
    create = {
        "ConfigMap": api.create_namespaced_config_map,
        "Secret": api.create_namespaced_secret,
        "NetworkPolicy": networking.create_namespaced_network_policy,
        "Service": api.create_namespaced_service,
        "StatefulSet": apps.create_namespaced_stateful_set,
        "Deployment": apps.create_namespaced_deployment,
    }
    created: list[str] = []
    for body in job_objects(request, config):
        kind, name = body.kind, body.metadata.name
        try:
            create[kind](ns, body)
        except ApiException as exc:
            if exc.status == 409:
                raise ConfigError(
                    f"{kind} {name} already exists in namespace {ns}: is job {request.job} "
                    f"running? (elasticps delete {request.job} --namespace {ns} removes it)"
                ) from exc
            raise _api_error(exc, f"creating {kind} {name}") from exc
        except _request_errors() as exc:
            raise _api_error(exc, f"creating {kind} {name}") from exc
        created.append(f"{kind.lower()}/{name}")
    return {"job": request.job, "namespace": ns, "etcd": request.etcd, "created": created}


def state_configmap(
    job: str,
    namespace: str,
    state: str,
    failure: str = "",
    *,
    exit_code: int | None = None,
    decisions: Sequence[Mapping[str, object]] = (),
) -> Any:
    """The ConfigMap ``<job>-state``: the job's state as the worker manager decided it.

    ``exit_code`` and ``decisions`` (the latest :data:`MAX_DECISIONS`) are
    kept only when given.
    """
    from kubernetes import client

    data = {STATE_KEY: state, FAILURE_KEY: failure}
    if exit_code is not None:
        data[EXIT_CODE_KEY] = str(exit_code)
    if decisions:
        data[DECISIONS_KEY] = json.dumps(list(decisions)[-MAX_DECISIONS:])
    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(
            name=f"{job}-state", namespace=namespace, labels=job_labels(job, "state")
        ),
        data=data,
    )


def record_job_state(
    api: Any,
    namespace: str,
    job: str,
    state: str,
    failure: str = "",
    *,
    exit_code: int | None = None,
    decisions: Sequence[Mapping[str, object]] = (),
) -> None:
    """Write the job's state into the ConfigMap ``<job>-state`` (created if missing).

    The record outlives any pod (a master re-created on another node keeps
    it); ``elasticps status`` and ``elasticps list`` read it
    (:func:`job_state`).

    Args:
        api: a ``CoreV1Api``.
        namespace: the job's namespace.
        job: the job name.
        state: ``failed`` or ``finished``.
        failure: why it failed, one line (cut to :data:`MAX_FAILURE_CHARS`).
        exit_code: the failed job's exit status, if known.
        decisions: the supervision policy's decisions, as ``run.json``'s
            ``decisions`` (:class:`~elasticps.launcher.supervisor.Decision`
            ``as_dict``).

    Raises:
        KubernetesError: the API refused the write.
    """
    from kubernetes.client import ApiException

    one_line = " ".join(failure.split())[:MAX_FAILURE_CHARS]
    body = state_configmap(
        job, namespace, state, one_line, exit_code=exit_code, decisions=decisions
    )
    try:
        try:
            api.create_namespaced_config_map(namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            api.patch_namespaced_config_map(f"{job}-state", namespace, {"data": body.data})
    except _request_errors() as exc:
        raise _api_error(exc, f"recording job {job} {state}") from exc


def mark_job_failed(
    api: Any,
    namespace: str,
    job: str,
    message: str,
    *,
    exit_code: int | None = None,
    decisions: Sequence[Mapping[str, object]] = (),
) -> None:
    """Record that the supervision policy failed the job (:func:`record_job_state`).

    The master keeps running, so its logs stay readable.

    Args:
        api: a ``CoreV1Api``.
        namespace: the job's namespace.
        job: the job name.
        message: the one-line reason.
        exit_code: the policy's exit status for the job (1, or 2 for a user error).
        decisions: the policy's decisions so far (``Decision.as_dict``).

    Raises:
        KubernetesError: the API refused the write.
    """
    record_job_state(
        api, namespace, job, "failed", message, exit_code=exit_code, decisions=decisions
    )


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    """An object's labels (API JSON); empty if it has none."""
    return (obj.get("metadata") or {}).get("labels") or {}


_PHASE_STATES = {"Pending": "starting", "Running": "running", "Succeeded": "finished"}
# The master pod that speaks for the job, when there are several (standbys, a replacement).
_STATE_ORDER = ("running", "starting", "finished", "failed")


def job_state(
    masters: Sequence[Mapping[str, Any]], record: Mapping[str, Any] | None = None
) -> tuple[str, str]:
    """A job's state, and why it failed (or ``""``).

    ``failed`` or ``finished`` as :func:`record_job_state` wrote ``record``
    (the ConfigMap ``<job>-state``, API JSON); else from the master pods
    (API JSON): the
    best of their phases, ``running`` before ``starting`` (``Pending``, or no
    master pod yet, as while a lost master is re-created), ``finished``
    (``Succeeded``) and ``failed`` (``Failed`` or unknown).
    """
    data = (record or {}).get("data") or {}
    if data.get(STATE_KEY) == "failed":
        return "failed", str(data.get(FAILURE_KEY, ""))
    if data.get(STATE_KEY) == "finished":
        return "finished", ""
    states = [
        _PHASE_STATES.get((m.get("status") or {}).get("phase", "Pending"), "failed")
        for m in masters
        if not (m.get("metadata") or {}).get("deletionTimestamp")
    ]
    if not states:
        return "starting", ""
    return min(states, key=_STATE_ORDER.index), ""


def job_end(record: Mapping[str, Any] | None) -> tuple[int | None, list[dict[str, Any]]]:
    """The exit status and the policy's decisions that ``record`` (``<job>-state``, API
    JSON) keeps: ``(None, [])`` where it keeps none, or is unreadable. Pure."""
    data = (record or {}).get("data") or {}
    code = str(data.get(EXIT_CODE_KEY, ""))
    try:
        decisions = json.loads(data.get(DECISIONS_KEY) or "[]")
    except ValueError:
        decisions = []
    return (int(code) if code.lstrip("-").isdigit() else None), (
        decisions if isinstance(decisions, list) else []
    )


def _list_json(list_call: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    resp = list_call(namespace, label_selector=selector, _preload_content=False)
    items: list[dict[str, Any]] = json.loads(resp.data).get("items") or []
    return items


def job_status(api: Any, namespace: str, job: str) -> dict[str, Any]:
    """The job's state, its pods and their states, and the wanted trainer count.

    Returns:
        ``{"job", "namespace", "state", "failure", "exit_code", "decisions",
        "wanted_trainers", "pods": [{"name", "role", "phase", "state",
        "reason"}...]}``, pods sorted by name; ``state`` and ``failure`` as
        :func:`job_state` reads them, ``exit_code`` (None while not failed)
        and ``decisions`` (the supervision policy's, as ``run.json``'s, once
        it failed the job) as :func:`job_end` does.

    Raises:
        KubernetesError: the API failed.
    """
    try:
        items = _list_json(api.list_namespaced_pod, namespace, job_selector(job))
        records = _list_json(api.list_namespaced_config_map, namespace, job_selector(job, "state"))
    except _request_errors() as exc:
        raise _api_error(exc, "listing pods") from exc
    pods = []
    masters = [o for o in items if _labels(o).get(LABEL_ROLE) == "master"]
    overall, failure = job_state(masters, records[0] if records else None)
    exit_code, decisions = job_end(records[0] if records else None)
    for obj in items:
        view = PodView.from_json(obj)
        state, reason = classify(view)
        pods.append(
            {
                "name": view.name,
                "role": view.labels.get(LABEL_ROLE, ""),
                "phase": view.phase,
                "state": state.value,
                "reason": reason,
            }
        )
    wanted = ConfigMapDesiredCount(api, namespace, job).get()
    return {
        "job": job,
        "namespace": namespace,
        "state": overall,
        "failure": failure,
        "exit_code": exit_code,
        "decisions": decisions,
        "wanted_trainers": wanted,
        "pods": sorted(pods, key=lambda p: p["name"]),
    }


def job_logs(
    api: Any, namespace: str, job: str, role: str, tail_lines: int | None = None
) -> list[tuple[str, str]]:
    """The logs of the job's pods of one role, as ``(pod name, text)``, sorted by name.

    Raises:
        KubernetesError: the API failed.
    """
    from kubernetes.client import ApiException

    try:
        pods = api.list_namespaced_pod(namespace, label_selector=job_selector(job, role)).items
        result = []
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            try:
                text = api.read_namespaced_pod_log(
                    pod.metadata.name, namespace, tail_lines=tail_lines
                )
            except ApiException as exc:
                if exc.status not in (400, 404):  # not started yet, or gone
                    raise
                text = ""
            result.append((pod.metadata.name, str(text or "")))
    except _request_errors() as exc:
        raise _api_error(exc, "reading logs") from exc
    return result


def delete_job(api: Any, namespace: str, job: str) -> dict[str, int]:
    """Delete every object labelled with the job: controllers, pods, Services, ConfigMaps,
    its Secret and NetworkPolicy, PVCs.

    The master's Deployment goes first (its worker manager must not replace
    the pods deleted next), then the etcd StatefulSet, the pods left, the
    Services, the ConfigMaps, the Secret, the NetworkPolicy and etcd's
    PersistentVolumeClaims.

    Returns:
        How many objects of each kind were deleted.

    Raises:
        KubernetesError: the API failed.
    """
    from kubernetes.client import ApiException

    selector = job_selector(job)
    apps = _apps(api)
    networking = _networking(api)
    kinds = (
        ("deployments", apps.list_namespaced_deployment, apps.delete_namespaced_deployment),
        ("statefulsets", apps.list_namespaced_stateful_set, apps.delete_namespaced_stateful_set),
        ("pods", api.list_namespaced_pod, api.delete_namespaced_pod),
        ("services", api.list_namespaced_service, api.delete_namespaced_service),
        ("configmaps", api.list_namespaced_config_map, api.delete_namespaced_config_map),
        ("secrets", api.list_namespaced_secret, api.delete_namespaced_secret),
        (
            "networkpolicies",
            networking.list_namespaced_network_policy,
            networking.delete_namespaced_network_policy,
        ),
        (
            "persistentvolumeclaims",
            api.list_namespaced_persistent_volume_claim,
            api.delete_namespaced_persistent_volume_claim,
        ),
    )
    counts: dict[str, int] = {}
    try:
        for kind, list_call, delete_call in kinds:
            counts[kind] = 0
            for obj in list_call(namespace, label_selector=selector).items:
                try:
                    delete_call(obj.metadata.name, namespace, propagation_policy="Foreground")
                    counts[kind] += 1
                except ApiException as exc:
                    if exc.status != 404:  # deleted meanwhile (the garbage collector)
                        raise
    except _request_errors() as exc:
        raise _api_error(exc, f"deleting job {job}") from exc
    return counts


def follow_job_logs(
    api: Any,
    namespace: str,
    job: str,
    role: str,
    *,
    tail_lines: int | None,
    emit: Callable[[str, str], None],
) -> None:
    """Stream the logs of the job's pods of one role until every stream ends.

    One thread per pod reads ``read_namespaced_pod_log(follow=True)``; lines
    reach ``emit(pod name, line)`` from the calling thread, in arrival order.

    Raises:
        KubernetesError: the API failed.
    """
    import queue

    from kubernetes.client import ApiException

    try:
        pods = api.list_namespaced_pod(namespace, label_selector=job_selector(job, role)).items
    except _request_errors() as exc:
        raise _api_error(exc, "listing pods") from exc
    lines: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()

    def read(name: str) -> None:
        try:
            resp = api.read_namespaced_pod_log(
                name, namespace, follow=True, tail_lines=tail_lines, _preload_content=False
            )
            pending = b""
            for chunk in resp.stream(4096):
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    lines.put((name, line.decode(errors="replace")))
            if pending:
                lines.put((name, pending.decode(errors="replace")))
        except ApiException as exc:
            if exc.status not in (400, 404):  # not started yet, or gone
                lines.put((name, f"(cannot read the log: {_describe(exc)})"))
        except _request_errors() as exc:
            lines.put((name, f"(cannot read the log: {_describe(exc)})"))
        finally:
            lines.put(None)

    names = sorted(pod.metadata.name for pod in pods)
    for name in names:
        threading.Thread(target=read, args=(name,), name=f"logs-{name}", daemon=True).start()
    open_streams = len(names)
    while open_streams:
        item = lines.get()
        if item is None:
            open_streams -= 1
        else:
            emit(*item)


def list_jobs(api: Any, namespace: str) -> list[dict[str, Any]]:
    """The elasticps jobs of a namespace, one row per job, by their objects' labels.

    A job is known by its ConfigMaps (``submit`` creates them first) and its
    pods.

    Returns:
        ``[{"job", "state", "pass", "accuracy", "started", "pods"}...]`` sorted
        by start: ``state`` as :func:`job_state` reads it (``starting``,
        ``running``, ``finished``, ``failed``), ``started`` the creation time
        of the job's ``<job>-env`` ConfigMap (else of its oldest pod);
        ``pass`` and ``accuracy`` are not known from outside the cluster
        (None), ``pods`` is the number of pods.

    Raises:
        KubernetesError: the API failed.
    """
    selector = f"{LABEL_APP}={APP}"
    try:
        items = _list_json(api.list_namespaced_pod, namespace, selector)
        maps = _list_json(api.list_namespaced_config_map, namespace, selector)
    except _request_errors() as exc:
        raise _api_error(exc, "listing pods") from exc
    masters: dict[str, list[dict[str, Any]]] = {}
    records: dict[str, dict[str, Any]] = {}
    jobs: dict[str, dict[str, Any]] = {}
    started_by_env: set[str] = set()

    def row(job: str) -> dict[str, Any]:
        return jobs.setdefault(
            job,
            {"job": job, "state": "starting", "pass": None, "accuracy": None,
             "started": "", "pods": 0},
        )  # fmt: skip

    for obj in maps:
        labels, created = _labels(obj), (obj.get("metadata") or {}).get("creationTimestamp", "")
        job = labels.get(LABEL_JOB)
        if not job:
            continue
        if labels.get(LABEL_ROLE) == "state":
            records[job] = obj
        elif labels.get(LABEL_ROLE) == "env":
            row(job)["started"] = created
            started_by_env.add(job)
    for obj in items:
        labels = _labels(obj)
        job = labels.get(LABEL_JOB)
        if not job:
            continue
        entry = row(job)
        entry["pods"] += 1
        created = (obj.get("metadata") or {}).get("creationTimestamp", "")
        if job not in started_by_env:
            entry["started"] = min(filter(None, (entry["started"], created)), default="")
        if labels.get(LABEL_ROLE) == "master":
            masters.setdefault(job, []).append(obj)
    for job, entry in jobs.items():
        entry["state"], _ = job_state(masters.get(job, []), records.get(job))
    return sorted(jobs.values(), key=lambda r: (r["started"], r["job"]))
