"""The Kubernetes backend: workers are pods, created with the official client.

Two layers:

- Pure builders (:func:`worker_pod`, :func:`master_service`,
  :func:`etcd_pod`, :func:`model_configmap`...) return the client's model
  objects (``V1Pod``, ``V1Service``, ``V1ConfigMap``), so the generated specs
  are checked against the API's schema in unit tests, without a cluster.
- :class:`KubernetesBackend` implements
  :class:`~elasticps.launcher.backend.Backend` with ``CoreV1Api``: create,
  delete, list and watch the job's worker pods; the watch is a
  :class:`~elasticps.launcher.pod_events.PodEventListener`.

Every object of a job carries the labels ``app=elasticps``,
``elasticps/job=<job>`` and ``elasticps/role=<role>`` (pods of workers also
``elasticps/index=<i>``), so ``elasticps delete JOB`` selects them all. Worker
pods (PS, trainers) have an owner reference to the master pod: deleting the
master deletes them (the garbage collector).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elasticps.config import (
    KubernetesConfig,
    ManagerConfig,
    PodResources,
    check_kubernetes_job_name,
)
from elasticps.errors import ConfigError, KubernetesError, UnschedulableError
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
    "etcd_pod",
    "etcd_service",
    "in_cluster_manager",
    "job_labels",
    "job_logs",
    "job_objects",
    "job_selector",
    "job_state",
    "job_status",
    "manifests_yaml",
    "mark_job_failed",
    "master_pod",
    "master_service",
    "model_configmap",
    "pod_name",
    "ps_specs",
    "scale_configmap",
    "set_wanted_trainers",
    "submit_job",
    "to_manifests",
    "trainer_spec",
    "worker_pod",
]

from elasticps.launcher.supervisor import FailJob
from elasticps.storage import Location

if TYPE_CHECKING:
    from elasticps.coord.store import JobStore
    from elasticps.launcher.manager import (
        DesiredCountSource,
        ProgressSource,
        TaskProgressSource,
        WorkerManager,
    )
    from elasticps.launcher.supervisor import Action as PolicyAction

log = logging.getLogger(__name__)

APP = "elasticps"
MASTER_PORT = 50051
"""The master's gRPC port in its pod (and its Service)."""
PS_PORT = 7000
"""A parameter server's tensor-plane port in its pod."""
ETCD_PORT = 2379
"""The job's etcd client port."""
MODEL_DIR = "/etc/elasticps/model"
MODEL_FILE = "model.py"
MODEL_PATH = f"{MODEL_DIR}/{MODEL_FILE}"
"""Where the model file is mounted in every pod."""
DATA_DIR = "/data"
"""Where :attr:`KubernetesConfig.volume_claim` is mounted."""
MAX_CONFIGMAP_BYTES = 1024 * 1024
"""The API server's limit on a ConfigMap's data, bytes (etcd's request size)."""
SCALE_KEY = "trainers"
"""The key of the wanted trainer count in the ``<job>-scale`` ConfigMap."""
LABEL_STATE = "elasticps/state"
"""A label of the master pod: ``failed`` once the supervision policy failed the job."""
ANNOTATION_FAILURE = "elasticps/failure"
"""An annotation of the master pod: why the policy failed the job (one line)."""
MAX_FAILURE_CHARS = 1024
"""Longest failure message kept in :data:`ANNOTATION_FAILURE`, characters."""


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
    """The object that owns a job's worker pods (the master pod).

    Attributes:
        name: its name.
        uid: its uid (``metadata.uid``; in the pod, ``ELASTICPS_POD_UID``).
        kind: its kind.
        api_version: its API version.
    """

    name: str
    uid: str
    kind: str = "Pod"
    api_version: str = "v1"

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
    plain = {"ELASTICPS_ROLE": role.value, "ELASTICPS_JOB": job}
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


def worker_pod(
    job: str, spec: WorkerSpec, config: KubernetesConfig, owner: OwnerRef | None = None
) -> Any:
    """The pod of one worker (or of the master), as a ``V1Pod``.

    The container runs ``elasticps <role> <spec.args...>`` with the job's
    ``ELASTICPS_*`` environment (``envFrom`` the ``<job>-env`` ConfigMap),
    ``spec.env`` on top. Master pods restart on failure in place (so their
    uid, which owns the workers, stays); PS and trainer pods never restart:
    the worker manager replaces them.

    Args:
        job: the job name (a DNS label).
        spec: the worker.
        config: image, namespace, resources.
        owner: the owner of the pod (the master pod), or None.

    Returns:
        A ``kubernetes.client.V1Pod``.
    """
    from kubernetes import client

    role = spec.role
    resources = {Role.MASTER: config.master, Role.PS: config.ps, Role.TRAINER: config.trainer}
    volumes, mounts = _volumes(job, config)
    ports: list[Any] = []
    probe = None
    if role is Role.MASTER:
        ports = [client.V1ContainerPort(name="grpc", container_port=MASTER_PORT)]
        probe = client.V1Probe(
            grpc=client.V1GRPCAction(port=MASTER_PORT, service=""),
            initial_delay_seconds=2,
            period_seconds=5,
            failure_threshold=3,
        )
    elif role is Role.PS:
        ports = [client.V1ContainerPort(name="tensor", container_port=PS_PORT)]
        probe = client.V1Probe(
            tcp_socket=client.V1TCPSocketAction(port=PS_PORT),
            initial_delay_seconds=2,
            period_seconds=5,
        )
    container = client.V1Container(
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
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=pod_name(job, spec.name),
            namespace=config.namespace,
            labels=job_labels(job, role.value, spec.index),
            owner_references=[owner.to_model()] if owner is not None else None,
        ),
        spec=client.V1PodSpec(
            containers=[container],
            restart_policy="OnFailure" if role is Role.MASTER else "Never",
            service_account_name=config.service_account if role is Role.MASTER else None,
            volumes=volumes,
            termination_grace_period_seconds=10,
        ),
    )


def master_pod(job: str, args: tuple[str, ...], config: KubernetesConfig) -> Any:
    """The master pod: ``elasticps master <args>`` under the job's ServiceAccount."""
    return worker_pod(job, WorkerSpec(Role.MASTER, 0, args), config)


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


def etcd_pod(job: str, config: KubernetesConfig) -> Any:
    """A single-member etcd for the job (data in an ``emptyDir``), restarted in place."""
    from kubernetes import client

    url = f"http://0.0.0.0:{ETCD_PORT}"
    container = client.V1Container(
        name="etcd",
        image=config.etcd_image,
        image_pull_policy=config.image_pull_policy,
        command=[
            "etcd",
            "--name=etcd0",
            "--data-dir=/var/lib/etcd",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls=http://{job}-etcd:{ETCD_PORT}",
        ],
        ports=[client.V1ContainerPort(name="client", container_port=ETCD_PORT)],
        readiness_probe=client.V1Probe(
            http_get=client.V1HTTPGetAction(path="/health", port=ETCD_PORT),
            initial_delay_seconds=1,
            period_seconds=5,
        ),
        resources=_resources(PodResources("100m", "1", "256Mi", "1Gi")),
        volume_mounts=[client.V1VolumeMount(name="data", mount_path="/var/lib/etcd")],
    )
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=f"{job}-etcd", namespace=config.namespace, labels=job_labels(job, "etcd")
        ),
        spec=client.V1PodSpec(
            containers=[container],
            restart_policy="Always",
            volumes=[client.V1Volume(name="data", empty_dir=client.V1EmptyDirVolumeSource())],
        ),
    )


def etcd_service(job: str, config: KubernetesConfig) -> Any:
    """The etcd Service, ``<job>-etcd:2379``."""
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
        """Delete pod ``pod`` if it has finished (Succeeded/Failed), to free its name.

        A replaced PS reuses its name; its old pod, if it exited rather than
        being deleted, stays in the API (with its logs) until removed.
        """
        from kubernetes.client import ApiException

        try:
            phase = self.api.read_namespaced_pod(pod, self.namespace).status.phase
            if phase in ("Succeeded", "Failed"):
                log.info("deleting finished pod %s (%s) to reuse its name", pod, phase)
                self.api.delete_namespaced_pod(pod, self.namespace)
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
        """The state of every worker pod of the job (PS, trainers, and the master).

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
    )


def in_cluster_manager(
    job: str,
    manager_config: ManagerConfig,
    ps: int,
    config: KubernetesConfig,
) -> Callable[[JobStore], Callable[[], None]]:
    """The master's ``on_active`` hook: run the worker manager in the master pod.

    Uses the pod's ServiceAccount (``load_incluster_config``), and the pod's
    own name and uid (``ELASTICPS_POD_NAME``, ``ELASTICPS_POD_UID``, from the
    downward API) as the owner of the worker pods. Sets ``ps_desired`` in
    etcd if unset, reads the wanted trainer count from ``<job>-scale``, and
    trainer progress from the task ledger when ``stuck_after_s`` is set.

    Returns:
        The hook: called with the job's store once the master serves; it
        returns the function that stops the manager.
    """

    def on_active(store: JobStore) -> Callable[[], None]:
        import os

        from kubernetes import client
        from kubernetes import config as kube_config

        from elasticps.launcher.manager import LedgerProgress, LedgerTaskProgress

        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
        api_client = client.ApiClient()
        name, uid = os.environ.get("ELASTICPS_POD_NAME"), os.environ.get("ELASTICPS_POD_UID")
        owner = OwnerRef(name, uid) if name and uid else None
        backend = KubernetesBackend(
            config.namespace, job, config.image, api_client, owner, config=config
        )
        if store.ps_desired() is None:
            store.set_ps_desired(ps)
        progress = LedgerProgress(store) if manager_config.stuck_after_s is not None else None
        desired = ConfigMapDesiredCount(backend.api, config.namespace, job)

        def on_decision(event: WorkerEvent, action: PolicyAction) -> None:
            if isinstance(action, FailJob):
                # Nothing more is created; the job's state says why it stopped:
                # in etcd for the roles, on the master pod for status and list.
                log.error("job %s fails: %s", job, action.message)
                store.set_job_state("failed")
                if name:
                    try:
                        mark_job_failed(backend.api, config.namespace, name, action.message)
                    except KubernetesError as exc:
                        log.error("could not mark the master pod failed: %s", exc)

        manager = build_manager(
            backend,
            manager_config,
            ps,
            desired,
            progress,
            task_progress=LedgerTaskProgress(store),
            on_decision=on_decision,
        )
        manager.start()
        log.info(
            "worker manager of job %s: %d PS, trainers %d..%d, namespace %s",
            job,
            ps,
            manager_config.min_trainers,
            manager_config.max_trainers,
            config.namespace,
        )

        def stop() -> None:
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
        etcd_endpoint: an existing etcd ``host:port``; None starts one pod.
        stuck_after_s: replace trainers without progress for this long, seconds.
        checkpoint_dir: where the parameter servers keep their shard
            checkpoints: a storage URL, or a path inside the pods; empty: on
            the volume claim (``/data/checkpoints/<job>``) if there is one,
            else none. With URLs for the data and the checkpoints a job needs
            no shared volume; the pods read their credentials from the
            standard places (their environment, or the role of their service
            account or node).
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
    stuck_after_s: float | None = None
    checkpoint_dir: str = ""

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


def job_objects(request: JobRequest, config: KubernetesConfig) -> list[Any]:
    """The objects ``elasticps submit`` creates, in creation order (client model objects).

    The ConfigMaps (model, job-wide environment, wanted trainer count), the
    etcd pod and Service (unless ``request.etcd_endpoint``), then the master
    pod and Service. The master pod creates the PS and trainer pods itself.

    Raises:
        ConfigError: the model file is too large for a ConfigMap.
    """
    job = request.job
    etcd = request.etcd_endpoint or f"{job}-etcd:{ETCD_PORT}"
    env = {
        "ELASTICPS_JOB": job,
        "ELASTICPS_ETCD": etcd,
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
    ]
    if request.etcd_endpoint is None:
        objects += [etcd_pod(job, config), etcd_service(job, config)]
    objects += [master_pod(job, tuple(master_args), config), master_service(job, config)]
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


def submit_job(api: Any, request: JobRequest, config: KubernetesConfig) -> dict[str, Any]:
    """Create the objects of :func:`job_objects` in the namespace; returns at once.

    Args:
        api: a ``kubernetes.client.CoreV1Api``.
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
    create = {
        "ConfigMap": api.create_namespaced_config_map,
        "Pod": api.create_namespaced_pod,
        "Service": api.create_namespaced_service,
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
    etcd = request.etcd_endpoint or f"{request.job}-etcd:{ETCD_PORT}"
    return {"job": request.job, "namespace": ns, "etcd": etcd, "created": created}


def mark_job_failed(api: Any, namespace: str, master_pod: str, message: str) -> None:
    """Record on the master pod that the supervision policy failed the job.

    The pod keeps running (its logs stay readable); ``elasticps status`` and
    ``elasticps list`` read the label :data:`LABEL_STATE` and the annotation
    :data:`ANNOTATION_FAILURE` (:func:`job_state`).

    Args:
        api: a ``CoreV1Api``.
        namespace: the job's namespace.
        master_pod: the master pod's name.
        message: the one-line reason (cut to :data:`MAX_FAILURE_CHARS`).

    Raises:
        KubernetesError: the API refused the patch.
    """
    body = {
        "metadata": {
            "labels": {LABEL_STATE: "failed"},
            "annotations": {ANNOTATION_FAILURE: " ".join(message.split())[:MAX_FAILURE_CHARS]},
        }
    }
    try:
        api.patch_namespaced_pod(master_pod, namespace, body)
    except _request_errors() as exc:
        raise _api_error(exc, f"marking pod {master_pod} failed") from exc


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    """An object's labels (API JSON); empty if it has none."""
    return (obj.get("metadata") or {}).get("labels") or {}


def job_state(master: Mapping[str, Any] | None) -> tuple[str, str]:
    """A job's state from its master pod (API JSON), and why it failed (or ``""``).

    ``failed`` once :func:`mark_job_failed` marked the pod, or its phase is
    ``Failed`` (or unknown); else ``starting`` (``Pending``, or no master pod
    yet), ``running`` or ``finished`` (``Succeeded``).
    """
    if master is None:
        return "starting", ""
    if _labels(master).get(LABEL_STATE) == "failed":
        annotations = (master.get("metadata") or {}).get("annotations") or {}
        return "failed", str(annotations.get(ANNOTATION_FAILURE, ""))
    phase = (master.get("status") or {}).get("phase", "Pending")
    return _JOB_STATES.get(phase, "failed"), ""


def job_status(api: Any, namespace: str, job: str) -> dict[str, Any]:
    """The job's state, its pods and their states, and the wanted trainer count.

    Returns:
        ``{"job", "namespace", "state", "failure", "wanted_trainers", "pods":
        [{"name", "role", "phase", "state", "reason"}...]}``, pods sorted by
        name; ``state`` and ``failure`` as :func:`job_state` reads them from
        the master pod.

    Raises:
        KubernetesError: the API failed.
    """
    try:
        resp = api.list_namespaced_pod(
            namespace, label_selector=job_selector(job), _preload_content=False
        )
        items = json.loads(resp.data).get("items") or []
    except _request_errors() as exc:
        raise _api_error(exc, "listing pods") from exc
    pods = []
    masters = [o for o in items if _labels(o).get(LABEL_ROLE) == "master"]
    overall, failure = job_state(masters[0] if masters else None)
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
    """Delete every pod, Service and ConfigMap labelled with the job.

    Returns:
        How many objects of each kind were deleted.

    Raises:
        KubernetesError: the API failed.
    """
    selector = job_selector(job)
    counts: dict[str, int] = {}
    try:
        # The master first: its worker manager must not replace the pods deleted next.
        masters = api.list_namespaced_pod(namespace, label_selector=job_selector(job, "master"))
        for pod in masters.items:
            api.delete_namespaced_pod(pod.metadata.name, namespace)
        pods = api.list_namespaced_pod(namespace, label_selector=selector).items
        for pod in pods:
            api.delete_namespaced_pod(pod.metadata.name, namespace)
        counts["pods"] = len(masters.items) + len(pods)
        services = api.list_namespaced_service(namespace, label_selector=selector).items
        for svc in services:
            api.delete_namespaced_service(svc.metadata.name, namespace)
        counts["services"] = len(services)
        cms = api.list_namespaced_config_map(namespace, label_selector=selector).items
        for cm in cms:
            api.delete_namespaced_config_map(cm.metadata.name, namespace)
        counts["configmaps"] = len(cms)
    except _request_errors() as exc:
        if getattr(exc, "status", None) == 404:  # deleted meanwhile (garbage collector)
            return delete_job(api, namespace, job)
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


_JOB_STATES = {"Pending": "starting", "Running": "running", "Succeeded": "finished"}


def list_jobs(api: Any, namespace: str) -> list[dict[str, Any]]:
    """The elasticps jobs of a namespace, one row per job, by their pods' labels.

    Returns:
        ``[{"job", "state", "pass", "accuracy", "started", "pods"}...]`` sorted
        by start: ``state`` from the master pod (:func:`job_state`:
        ``starting``, ``running``, ``finished``, ``failed``), ``started`` its
        creation time;
        ``pass`` and ``accuracy`` are not known from outside the cluster
        (None), ``pods`` is the number of pods.

    Raises:
        KubernetesError: the API failed.
    """
    try:
        resp = api.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_APP}={APP}", _preload_content=False
        )
        items = json.loads(resp.data).get("items") or []
    except _request_errors() as exc:
        raise _api_error(exc, "listing pods") from exc
    jobs: dict[str, dict[str, Any]] = {}
    for obj in items:
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        job = labels.get(LABEL_JOB)
        if not job:
            continue
        row = jobs.setdefault(
            job,
            {"job": job, "state": "starting", "pass": None, "accuracy": None,
             "started": "", "pods": 0},
        )  # fmt: skip
        row["pods"] += 1
        if labels.get(LABEL_ROLE) == "master":
            row["state"], _ = job_state(obj)
            row["started"] = metadata.get("creationTimestamp", "")
    return sorted(jobs.values(), key=lambda r: (r["started"], r["job"]))
