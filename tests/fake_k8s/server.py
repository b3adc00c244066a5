"""A fake Kubernetes API server: pods, services, configmaps, claims and two controllers.

It is *not* Kubernetes. It keeps just enough of the API's behaviour for the
elasticps Kubernetes backend to be tested with the official ``kubernetes``
client, on loopback, in milliseconds:

- REST paths ``/api/v1/namespaces/{ns}/{pods|services|configmaps|secrets|persistentvolumeclaims}
  [/{name}]`` (and ``/apis/apps/v1/...`` for the controllers below, and
  ``/apis/networking.k8s.io/v1/.../networkpolicies``, stored only):
  create (POST), get, list, replace (PUT), patch (PATCH, JSON merge patch
  for objects, JSON patch for lists), delete and delete-collection, with
  ``labelSelector`` (equality-based: ``a=b``, ``a==b``, ``a!=b``, ``a``,
  ``!a``). ``/pods/{name}/log`` returns the text set by :meth:`set_log`.
- Objects are shaped like real ones: ``metadata.name``, ``namespace``,
  ``labels``, ``uid``, ``resourceVersion``, ``creationTimestamp``,
  ``ownerReferences``; pods get ``status.phase``, ``conditions``,
  ``containerStatuses``, ``podIP``. Errors are ``Status`` objects with the
  real codes (404 NotFound, 409 AlreadyExists, 403 Forbidden, 410 Expired).
- ``?watch=true`` streams newline-delimited JSON events (``ADDED``,
  ``MODIFIED``, ``DELETED``) after the given ``resourceVersion`` (or, with
  none or ``"0"``, synthetic ``ADDED`` events for the current objects
  first), for ``timeoutSeconds`` (default 30 s). A resourceVersion older
  than the compaction point (:meth:`compact`) gets an ``ERROR`` event with
  code 410, as the real server sends.
- Deleting an object deletes, at once, the objects whose
  ``ownerReferences`` name its uid (the garbage collector, background
  propagation). Deleting a pod is graceful: a ``MODIFIED`` event with
  ``deletionTimestamp`` comes before ``DELETED``.

Scheduling: a new pod goes ``Pending`` (ADDED) and at once ``Running``
(MODIFIED, Ready) unless :meth:`set_capacity` limits the pods matching a
selector; pods over the limit stay ``Pending`` with ``PodScheduled=False,
reason=Unschedulable`` until capacity frees up (a scheduled pod matching the
selector is deleted or finishes, or the limit is raised or removed).
:meth:`set_pod_quota` makes creates fail with 403 ``exceeded quota`` like a
``ResourceQuota`` on pod count. :meth:`finish`, :meth:`preempt` and
:meth:`evict` play the kubelet and the scheduler.

Controllers (a test fake, far simpler than the real ones, and synchronous:
they run inside the request that changed something, before it answers):

- ``/apis/apps/v1/namespaces/{ns}/{deployments|statefulsets}`` are stored
  like the core kinds. After every change, :meth:`FakeKubeServer._reconcile`
  gives each StatefulSet and Deployment ``spec.replicas`` pods made from its
  ``spec.template`` (counting only the pods it owns that match its
  ``selector.matchLabels``), owned by it (``ownerReferences``, so the garbage
  collector above deletes them with it). A StatefulSet's pods are
  ``<name>-<ordinal>``, each with the PersistentVolumeClaims of its
  ``volumeClaimTemplates`` (``<claim>-<name>-<ordinal>``, created once and
  kept across pods, owned by the StatefulSet when its
  ``persistentVolumeClaimRetentionPolicy.whenDeleted`` is ``Delete``); a
  missing ordinal is re-created only once no pod of that name exists, the
  real controller's at-most-one rule. A Deployment's pods are
  ``<name>-<random>`` (no ReplicaSet in between); pods being deleted do not
  count, so a replacement starts at once, as with a real ReplicaSet.
  Scaling down deletes the highest ordinals, or the newest pods.
- :meth:`lose_node` plays a node that stopped answering: its pod is marked
  for deletion (``deletionTimestamp`` in the past, condition ``Ready=False``
  reason ``NodeLost``) but stays, since no kubelet confirms; only a delete
  with ``gracePeriodSeconds=0`` (``kubectl delete --force``) removes it.

Nothing is validated beyond what the tests need (no schema, no admission).

Usage::

    with FakeKubeServer() as kube:
        cfg = kubernetes.client.Configuration(host=kube.url)
        api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cfg))
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["FakeKubeServer", "parse_selector"]

Obj = dict[str, Any]

#: REST resource name -> (kind, list kind).
KINDS = {
    "pods": ("Pod", "PodList"),
    "services": ("Service", "ServiceList"),
    "configmaps": ("ConfigMap", "ConfigMapList"),
    "secrets": ("Secret", "SecretList"),
    "networkpolicies": ("NetworkPolicy", "NetworkPolicyList"),
    "persistentvolumeclaims": ("PersistentVolumeClaim", "PersistentVolumeClaimList"),
    "deployments": ("Deployment", "DeploymentList"),
    "statefulsets": ("StatefulSet", "StatefulSetList"),
}
#: REST resource name -> the API path prefix (group/version) that serves it.
GROUPS = {
    "pods": "api/v1",
    "services": "api/v1",
    "configmaps": "api/v1",
    "secrets": "api/v1",
    "networkpolicies": "apis/networking.k8s.io/v1",
    "persistentvolumeclaims": "api/v1",
    "deployments": "apis/apps/v1",
    "statefulsets": "apis/apps/v1",
}
CONTROLLERS = ("statefulsets", "deployments")


def _api_version(resource: str) -> str:
    return GROUPS[resource].removeprefix("api/").removeprefix("apis/")


_TERMINAL = ("Succeeded", "Failed")

_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

#: Legacy discovery documents, so that ``kubectl`` can map kinds to these paths.
_DISCOVERY: dict[str, Obj] = {
    "/api": {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
    },
    "/apis": {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            {
                "name": "apps",
                "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"},
            },
            {
                "name": "networking.k8s.io",
                "versions": [{"groupVersion": "networking.k8s.io/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": "networking.k8s.io/v1", "version": "v1"},
            },
            {
                "name": "rbac.authorization.k8s.io",
                "versions": [{"groupVersion": "rbac.authorization.k8s.io/v1", "version": "v1"}],
                "preferredVersion": {
                    "groupVersion": "rbac.authorization.k8s.io/v1",
                    "version": "v1",
                },
            },
        ],
    },
    "/api/v1": {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            {
                "name": resource,
                "singularName": kind.lower(),
                "namespaced": True,
                "kind": kind,
                "verbs": _VERBS,
            }
            for resource, (kind, _) in [*KINDS.items(), ("serviceaccounts", ("ServiceAccount", ""))]
            if GROUPS.get(resource, "api/v1") == "api/v1"
        ],
    },
    "/apis/apps/v1": {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "apps/v1",
        "resources": [
            {
                "name": n,
                "singularName": KINDS[n][0].lower(),
                "namespaced": True,
                "kind": KINDS[n][0],
                "verbs": _VERBS,
            }
            for n in CONTROLLERS
        ],
    },
    "/apis/networking.k8s.io/v1": {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "networking.k8s.io/v1",
        "resources": [
            {
                "name": "networkpolicies",
                "singularName": "networkpolicy",
                "namespaced": True,
                "kind": "NetworkPolicy",
                "verbs": _VERBS,
            }
        ],
    },
    # Served for kubectl's discovery only (no REST paths): the RBAC manifests.
    "/apis/rbac.authorization.k8s.io/v1": {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "rbac.authorization.k8s.io/v1",
        "resources": [
            {"name": n, "singularName": k.lower(), "namespaced": True, "kind": k, "verbs": _VERBS}
            for n, k in (("roles", "Role"), ("rolebindings", "RoleBinding"))
        ],
    },
    "/version": {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake"},
}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An error answered as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


Requirement = tuple[str, str, str]  # (key, op, value); op in "=", "!=", "exists", "!exists"


def parse_selector(text: str) -> list[Requirement]:
    """Parse an equality-based label selector (``a=b,c!=d,e,!f``).

    Raises:
        ApiError: 400 for set-based or malformed selectors.
    """
    reqs: list[Requirement] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        if " in " in part or " notin " in part or "(" in part:
            raise ApiError(400, "BadRequest", f"set-based selector not supported: {part}")
        if "!=" in part:
            key, value = part.split("!=", 1)
            reqs.append((key.strip(), "!=", value.strip()))
        elif "==" in part:
            key, value = part.split("==", 1)
            reqs.append((key.strip(), "=", value.strip()))
        elif "=" in part:
            key, value = part.split("=", 1)
            reqs.append((key.strip(), "=", value.strip()))
        elif part.startswith("!"):
            reqs.append((part[1:].strip(), "!exists", ""))
        else:
            reqs.append((part, "exists", ""))
    return reqs


def _matches(labels: Mapping[str, str], reqs: list[Requirement]) -> bool:
    for key, op, value in reqs:
        present = key in labels
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if (op == "exists" and not present) or (op == "!exists" and present):
            return False
    return True


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _json_patch(target: Obj, ops: list[Obj]) -> Obj:
    """The ``add``/``replace``/``remove`` operations of RFC 6902 JSON patch."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            else:
                parent[last] = op["value"]
        elif op["op"] == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON patch op {op['op']!r}")
    return doc


@dataclass
class _Capacity:
    reqs: list[Requirement]
    limit: int
    message: str


@dataclass
class _State:
    """Everything the server holds; guarded by ``cond``."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    rv: int = 0
    compacted_rv: int = 0
    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    # (resourceVersion, resource, namespace, event type, object snapshot)
    events: list[tuple[int, str, str, str, Obj]] = field(default_factory=list)
    capacities: list[_Capacity] = field(default_factory=list)
    pod_quota: int | None = None
    logs: dict[tuple[str, str], str] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lost: set[tuple[str, str]] = field(default_factory=set)  # pods on lost nodes
    closed: bool = False


class FakeKubeServer:
    """The fake API server, serving on ``127.0.0.1`` at a free port.

    All test hooks are thread-safe and emit the watch events a real cluster
    would. Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, *, auto_run: bool = True) -> None:
        """Args:
        auto_run: schedule and start new pods at once (``Running``, Ready);
            if False they stay ``Pending`` until :meth:`run_pod`.
        """
        self.auto_run = auto_run
        self._s = _State()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, for ``kubernetes.client.Configuration(host=...)``."""
        assert self._httpd is not None, "not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> FakeKubeServer:
        """Bind a free loopback port and serve from a daemon thread."""
        server = self

        class Handler(_Handler):
            kube = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="fake-k8s", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; open watch streams end."""
        with self._s.cond:
            self._s.closed = True
            self._s.cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FakeKubeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- test hooks --------------------------------------------------------------

    def objects(self, resource: str, namespace: str | None = None, selector: str = "") -> list[Obj]:
        """Copies of the stored objects of ``resource`` (``pods``...) matching ``selector``."""
        reqs = parse_selector(selector)
        with self._s.cond:
            return [
                copy.deepcopy(obj)
                for (res, ns, _), obj in sorted(self._s.objects.items())
                if res == resource
                and (namespace is None or ns == namespace)
                and _matches(obj["metadata"].get("labels") or {}, reqs)
            ]

    def pod(self, namespace: str, name: str) -> Obj | None:
        """A copy of one pod, or None."""
        with self._s.cond:
            obj = self._s.objects.get(("pods", namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion."""
        with self._s.cond:
            return self._s.rv

    def request_log(self) -> list[tuple[str, str]]:
        """``(method, path)`` of every request served so far."""
        with self._s.cond:
            return list(self._s.requests)

    def compact(self) -> int:
        """Forget the event history up to now, as etcd compaction does.

        A later watch from an older resourceVersion gets 410 Gone. Returns the
        compaction point.
        """
        with self._s.cond:
            self._s.compacted_rv = self._s.rv
            self._s.events.clear()
            return self._s.rv

    def delete_unseen(self, namespace: str, name: str) -> int:
        """Delete a pod and compact the history at once; returns the compaction point.

        Watchers never see its ``DELETED`` event: they get 410 Gone and must
        re-list to notice (as a client whose watch broke across a compaction).
        """
        with self._s.cond:
            self._delete("pods", namespace, name)
            self._reconcile()
            self._s.compacted_rv = self._s.rv
            self._s.events.clear()
            return self._s.rv

    def set_capacity(self, selector: str, limit: int | None, message: str = "") -> None:
        """Let at most ``limit`` scheduled pods match ``selector``; None removes the limit.

        Pods created over the limit stay ``Pending``/``Unschedulable``; they
        are scheduled (oldest first) when capacity frees up.
        """
        reqs = parse_selector(selector)
        with self._s.cond:
            self._s.capacities = [c for c in self._s.capacities if c.reqs != reqs]
            if limit is not None:
                self._s.capacities.append(
                    _Capacity(
                        reqs,
                        limit,
                        message or "0/3 nodes are available: 3 Insufficient cpu.",
                    )
                )
            self._schedule_pending()

    def set_pod_quota(self, limit: int | None) -> None:
        """Refuse pod creates (403 ``exceeded quota``) once a namespace holds ``limit`` pods."""
        with self._s.cond:
            self._s.pod_quota = limit

    def run_pod(self, namespace: str, name: str) -> None:
        """Schedule and start a pending pod (when ``auto_run`` is False)."""
        with self._s.cond:
            self._start(self._get("pods", namespace, name))

    def finish(self, namespace: str, name: str, exit_code: int = 0, reason: str = "") -> None:
        """End a pod's container: ``Succeeded`` with exit 0, else ``Failed``."""
        with self._s.cond:
            pod = self._get("pods", namespace, name)
            pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            term = {
                "exitCode": exit_code,
                "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                "startedAt": pod["metadata"]["creationTimestamp"],
                "finishedAt": _now(),
            }
            for cs in pod["status"].get("containerStatuses", []):
                cs["state"] = {"terminated": term}
                cs["ready"] = False
            self._set_condition(pod, "Ready", "False", "PodCompleted")
            self._modified("pods", pod)
            self._schedule_pending()

    def preempt(self, namespace: str, name: str) -> None:
        """Preempt a pod as the scheduler does: ``DisruptionTarget``, then deletion."""
        with self._s.cond:
            pod = self._get("pods", namespace, name)
            self._set_condition(
                pod,
                "DisruptionTarget",
                "True",
                "PreemptionByScheduler",
                "default-scheduler: preempting to accommodate a higher priority pod",
            )
            self._modified("pods", pod)
            self._delete("pods", namespace, name)
            self._reconcile()

    def evict(self, namespace: str, name: str) -> None:
        """Evict a pod as the kubelet does under node pressure: ``Failed``, reason ``Evicted``."""
        with self._s.cond:
            pod = self._get("pods", namespace, name)
            self._set_condition(pod, "DisruptionTarget", "True", "TerminationByKubelet")
            pod["status"]["phase"] = "Failed"
            pod["status"]["reason"] = "Evicted"
            pod["status"]["message"] = "The node was low on resource: memory."
            self._modified("pods", pod)
            self._schedule_pending()

    def lose_node(self, namespace: str, name: str, evicted_s_ago: float = 600.0) -> None:
        """The node of pod ``name`` stops answering: the pod is evicted but never goes.

        As the node lifecycle controller does once the node's ``unreachable``
        taint outlasts the pod's toleration: the pod is marked for deletion
        (``deletionTimestamp`` = eviction time + its grace period, here
        ``evicted_s_ago`` seconds back) with ``Ready=False``, reason
        ``NodeLost``. No kubelet confirms the deletion, so the pod stays until
        deleted with ``gracePeriodSeconds=0``. Controllers see it as deleted.
        """
        with self._s.cond:
            pod = self._get("pods", namespace, name)
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
            when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(
                seconds=evicted_s_ago - grace
            )
            pod["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
            pod["metadata"]["deletionGracePeriodSeconds"] = grace
            self._set_condition(pod, "Ready", "False", "NodeLost", "Node is not ready")
            self._s.lost.add((namespace, name))
            self._modified("pods", pod)
            self._reconcile()

    def set_log(self, namespace: str, name: str, text: str) -> None:
        """The text ``/pods/{name}/log`` returns."""
        with self._s.cond:
            self._s.logs[(namespace, name)] = text

    # --- storage (callers hold the lock) ------------------------------------------

    def _get(self, resource: str, namespace: str, name: str) -> Obj:
        obj = self._s.objects.get((resource, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
        return obj

    def _record(self, resource: str, etype: str, obj: Obj) -> None:
        self._s.rv += 1
        obj["metadata"]["resourceVersion"] = str(self._s.rv)
        ns = obj["metadata"]["namespace"]
        self._s.events.append((self._s.rv, resource, ns, etype, copy.deepcopy(obj)))
        self._s.cond.notify_all()

    def _modified(self, resource: str, obj: Obj) -> None:
        self._record(resource, "MODIFIED", obj)

    def _create(self, resource: str, namespace: str, body: Obj) -> Obj:
        kind, _ = KINDS[resource]
        meta = body.setdefault("metadata", {}) or {}
        body["metadata"] = meta
        name = meta.get("name") or (
            meta["generateName"] + uuid.uuid4().hex[:5] if meta.get("generateName") else None
        )
        if not name:
            raise ApiError(422, "Invalid", f"{kind} is invalid: metadata.name: Required value")
        if (resource, namespace, name) in self._s.objects:
            raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists')
        if resource == "pods" and self._s.pod_quota is not None:
            used = sum(1 for (r, ns, _) in self._s.objects if r == "pods" and ns == namespace)
            if used >= self._s.pod_quota:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'pods "{name}" is forbidden: exceeded quota: compute-quota, '
                    f"requested: pods=1, used: pods={used}, limited: pods={self._s.pod_quota}",
                )
        body["kind"] = kind
        body["apiVersion"] = _api_version(resource)
        meta.update(
            name=name,
            namespace=namespace,
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
        )
        meta.pop("deletionTimestamp", None)
        if resource == "pods":
            body["status"] = {"phase": "Pending", "qosClass": "Burstable", "conditions": []}
        elif resource == "services":
            spec = body.setdefault("spec", {})
            if spec.get("clusterIP") != "None":
                spec["clusterIP"] = f"10.96.{self._s.rv % 250}.{len(self._s.objects) % 250 + 1}"
        self._s.objects[(resource, namespace, name)] = body
        self._record(resource, "ADDED", body)
        created = copy.deepcopy(body)  # as created, before the scheduler moves it on
        if resource == "pods":
            self._schedule(body)
        return created

    def _capacity_for(self, pod: Obj) -> _Capacity | None:
        """The first capacity rule that is full for ``pod``, or None."""
        labels = pod["metadata"].get("labels") or {}
        for cap in self._s.capacities:
            if not _matches(labels, cap.reqs):
                continue
            scheduled = sum(
                1
                for (r, _, _), o in self._s.objects.items()
                if r == "pods"
                and o is not pod
                and o["spec"].get("nodeName")
                and o["status"]["phase"] not in _TERMINAL
                and _matches(o["metadata"].get("labels") or {}, cap.reqs)
            )
            if scheduled >= cap.limit:
                return cap
        return None

    def _schedule(self, pod: Obj) -> None:
        full = self._capacity_for(pod)
        if full is not None:
            changed = self._set_condition(
                pod, "PodScheduled", "False", "Unschedulable", full.message
            )
            if changed:
                self._modified("pods", pod)
        elif self.auto_run:
            self._start(pod)

    def _schedule_pending(self) -> None:
        pending = sorted(
            (
                o
                for (r, _, _), o in self._s.objects.items()
                if r == "pods"
                and o["status"]["phase"] == "Pending"
                and not o["spec"].get("nodeName")
                and "deletionTimestamp" not in o["metadata"]
            ),
            key=lambda o: int(o["metadata"]["resourceVersion"]),
        )
        for pod in pending:
            self._schedule(pod)

    def _start(self, pod: Obj) -> None:
        """Bind the pod to a node and run its containers (Ready at once: no probes)."""
        if pod["status"]["phase"] != "Pending":
            return
        spec = pod["spec"]
        spec["nodeName"] = "fake-node-1"
        status = pod["status"]
        status.update(
            phase="Running",
            hostIP="192.168.0.10",
            podIP=f"10.244.0.{int(pod['metadata']['resourceVersion']) % 250 + 2}",
            startTime=_now(),
        )
        for ctype in ("PodScheduled", "Initialized", "ContainersReady", "Ready"):
            self._set_condition(pod, ctype, "True", "")
        status["containerStatuses"] = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": _now()}},
            }
            for c in spec.get("containers", [])
        ]
        self._modified("pods", pod)

    @staticmethod
    def _set_condition(pod: Obj, ctype: str, status: str, reason: str, message: str = "") -> bool:
        """Set a pod condition; return whether it changed."""
        conds = pod["status"].setdefault("conditions", [])
        new = {"type": ctype, "status": status, "lastTransitionTime": _now()}
        if reason:
            new["reason"] = reason
        if message:
            new["message"] = message
        for i, cond in enumerate(conds):
            if cond["type"] == ctype:
                if (cond.get("status"), cond.get("reason"), cond.get("message")) == (
                    status,
                    new.get("reason"),
                    new.get("message"),
                ):
                    return False
                conds[i] = new
                return True
        conds.append(new)
        return True

    def _delete(self, resource: str, namespace: str, name: str, *, force: bool = False) -> Obj:
        obj = self._get(resource, namespace, name)
        if resource == "pods" and (namespace, name) in self._s.lost and not force:
            return obj  # no kubelet confirms: it stays, marked for deletion
        self._s.lost.discard((namespace, name))
        if resource == "pods" and "deletionTimestamp" not in obj["metadata"]:
            # Graceful deletion: the pod is marked, its containers stop, then it goes.
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["deletionGracePeriodSeconds"] = 30
            self._modified(resource, obj)
        del self._s.objects[(resource, namespace, name)]
        self._record(resource, "DELETED", obj)
        # The garbage collector: dependents of the deleted object go too.
        uid = obj["metadata"]["uid"]
        for res, ns, dep_name in list(self._s.objects):
            dep = self._s.objects.get((res, ns, dep_name))
            if dep is not None and any(
                ref.get("uid") == uid for ref in dep["metadata"].get("ownerReferences") or []
            ):
                self._delete(res, ns, dep_name)
        if resource == "pods":
            self._schedule_pending()
        return obj

    # --- the controllers (callers hold the lock) ---------------------------------------

    def _reconcile(self) -> None:
        """Give every StatefulSet and Deployment its ``spec.replicas`` pods (see the module doc)."""
        for (res, ns, name), ctrl in list(self._s.objects.items()):
            if res in CONTROLLERS and (res, ns, name) in self._s.objects:
                # A quota refusal: the real controller records an event and retries later.
                with contextlib.suppress(ApiError):
                    self._reconcile_one(res, ns, name, ctrl)

    def _reconcile_one(self, resource: str, namespace: str, name: str, ctrl: Obj) -> None:
        spec = ctrl.get("spec") or {}
        replicas = int(spec.get("replicas", 1))
        uid = ctrl["metadata"]["uid"]
        selector = [
            (key, "=", value)
            for key, value in ((spec.get("selector") or {}).get("matchLabels") or {}).items()
        ]
        owner = {
            "apiVersion": ctrl["apiVersion"], "kind": ctrl["kind"], "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip
        owned = sorted(
            (
                o
                for (r, ns, _), o in self._s.objects.items()
                if r == "pods"
                and ns == namespace
                and _matches(o["metadata"].get("labels") or {}, selector)  # its own pods only
                and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
            ),
            key=lambda o: int(o["metadata"]["resourceVersion"]),
        )
        if resource == "statefulsets":
            for ordinal in range(replicas):
                pod_name = f"{name}-{ordinal}"
                if ("pods", namespace, pod_name) not in self._s.objects:
                    self._create("pods", namespace, self._stateful_pod(ctrl, owner, ordinal))
            for pod in owned:
                ordinal = int(pod["metadata"]["name"].rsplit("-", 1)[1])
                if ordinal >= replicas and "deletionTimestamp" not in pod["metadata"]:
                    self._delete("pods", namespace, pod["metadata"]["name"])
            return
        live = [o for o in owned if "deletionTimestamp" not in o["metadata"]]
        for _ in range(replicas - len(live)):
            self._create("pods", namespace, self._template_pod(ctrl, owner, f"{name}-"))
        for pod in live[replicas:][::-1]:
            self._delete("pods", namespace, pod["metadata"]["name"])

    @staticmethod
    def _template_pod(ctrl: Obj, owner: Obj, generate_name: str) -> Obj:
        template = copy.deepcopy(ctrl["spec"]["template"])
        meta = template.get("metadata") or {}
        return {
            "metadata": {
                "generateName": generate_name,
                "labels": dict(meta.get("labels") or {}),
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [owner],
            },
            "spec": template["spec"],
        }

    def _stateful_pod(self, ctrl: Obj, owner: Obj, ordinal: int) -> Obj:
        """The pod ``<name>-<ordinal>`` of a StatefulSet, with its claims (created if missing)."""
        name, namespace = ctrl["metadata"]["name"], ctrl["metadata"]["namespace"]
        pod = self._template_pod(ctrl, owner, "")
        pod["metadata"].pop("generateName")
        pod["metadata"]["name"] = f"{name}-{ordinal}"
        pod["spec"]["hostname"] = f"{name}-{ordinal}"
        pod["spec"]["subdomain"] = ctrl["spec"].get("serviceName", "")
        retention = ctrl["spec"].get("persistentVolumeClaimRetentionPolicy") or {}
        volumes = pod["spec"].setdefault("volumes", [])
        for template in ctrl["spec"].get("volumeClaimTemplates") or []:
            claim = f"{template['metadata']['name']}-{name}-{ordinal}"
            if ("persistentvolumeclaims", namespace, claim) not in self._s.objects:
                body = copy.deepcopy(template)
                body["metadata"] = {
                    "name": claim,
                    "labels": dict(template["metadata"].get("labels") or {}),
                }
                if retention.get("whenDeleted") == "Delete":
                    body["metadata"]["ownerReferences"] = [owner]
                body["status"] = {"phase": "Bound"}
                self._create("persistentvolumeclaims", namespace, body)
            source = {"claimName": claim}
            volumes.append({"name": template["metadata"]["name"], "persistentVolumeClaim": source})
        return pod

    def _list(self, resource: str, namespace: str, reqs: list[Requirement]) -> list[Obj]:
        return [
            obj
            for (res, ns, _), obj in sorted(self._s.objects.items())
            if res == resource
            and ns == namespace
            and _matches(obj["metadata"].get("labels") or {}, reqs)
        ]

    # --- request dispatch (called by the handler) -----------------------------

    def handle(
        self, method: str, path: str, query: Mapping[str, str], body: Any
    ) -> tuple[int, Obj | str]:
        """Serve one non-watch request; returns (HTTP status, JSON object or text)."""
        if method == "GET" and path.rstrip("/") in _DISCOVERY:
            return 200, _DISCOVERY[path.rstrip("/")]
        with self._s.cond:
            self._s.requests.append((method, path))
            code, payload = self._handle(method, path, query, body)
            if method in ("POST", "PUT", "PATCH", "DELETE"):
                self._reconcile()  # the controllers act before the answer (see the module doc)
            return code, payload

    def _handle(
        self, method: str, path: str, query: Mapping[str, str], body: Any
    ) -> tuple[int, Obj | str]:
        namespace, resource, name, sub = _route(path)
        reqs = parse_selector(query.get("labelSelector", ""))
        kind, list_kind = KINDS[resource]
        api_version = _api_version(resource)
        grace = query.get("gracePeriodSeconds")
        if grace is None and isinstance(body, dict):
            grace = body.get("gracePeriodSeconds")
        force = grace is not None and int(grace) == 0
        if name is None:
            if method == "GET":
                items = [copy.deepcopy(o) for o in self._list(resource, namespace, reqs)]
                return 200, {
                    "kind": list_kind,
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self._s.rv)},
                    "items": items,
                }
            if method == "POST":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the body must be an object")
                return 201, copy.deepcopy(self._create(resource, namespace, body))
            if method == "DELETE":
                gone = [
                    copy.deepcopy(self._delete(resource, namespace, o["metadata"]["name"]))
                    for o in list(self._list(resource, namespace, reqs))
                    if (resource, namespace, o["metadata"]["name"]) in self._s.objects
                ]
                return 200, {
                    "kind": list_kind,
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self._s.rv)},
                    "items": gone,
                }
        elif sub == "log" and resource == "pods" and method == "GET":
            self._get(resource, namespace, name)
            return 200, self._s.logs.get((namespace, name), "")
        elif sub is None:
            if method == "GET":
                return 200, copy.deepcopy(self._get(resource, namespace, name))
            if method == "DELETE":
                return 200, copy.deepcopy(self._delete(resource, namespace, name, force=force))
            if method in ("PUT", "PATCH"):
                obj = self._get(resource, namespace, name)
                if method == "PUT":
                    new = copy.deepcopy(body)
                elif isinstance(body, list):
                    new = _json_patch(obj, body)
                else:
                    new = _merge_patch(obj, body)
                # Identity fields are the server's.
                for key in ("name", "namespace", "uid", "creationTimestamp"):
                    new.setdefault("metadata", {})[key] = obj["metadata"][key]
                new["kind"], new["apiVersion"] = kind, api_version
                if resource == "pods":
                    new["status"] = obj["status"]
                self._s.objects[(resource, namespace, name)] = new
                self._modified(resource, new)
                return 200, copy.deepcopy(new)
        raise ApiError(405, "MethodNotAllowed", f"{method} {path} is not supported")

    def watch(self, path: str, query: Mapping[str, str]) -> Iterator[Obj]:
        """The events of a ``?watch=true`` request, ending after ``timeoutSeconds``."""
        namespace, resource, name, _ = _route(path)
        if name is not None:
            raise ApiError(404, "NotFound", f"cannot watch {path}")
        reqs = parse_selector(query.get("labelSelector", ""))
        timeout_s = float(query.get("timeoutSeconds", "30"))
        rv_text = query.get("resourceVersion", "")
        expired: ApiError | None = None
        with self._s.cond:
            self._s.requests.append(("WATCH", path))
            if rv_text in ("", "0"):
                start = self._s.rv
                initial = [copy.deepcopy(o) for o in self._list(resource, namespace, reqs)]
            else:
                start = int(rv_text)
                initial = []
                if start < self._s.compacted_rv:
                    expired = ApiError(
                        410,
                        "Expired",
                        f"too old resource version: {start} ({self._s.compacted_rv})",
                    )
        if expired is not None:
            yield {"type": "ERROR", "object": expired.status()}
            return
        for obj in initial:
            yield {"type": "ADDED", "object": obj}
        deadline = time.monotonic() + timeout_s
        seen = start
        while True:
            with self._s.cond:
                while True:
                    if self._s.closed:
                        return
                    if seen < self._s.compacted_rv:
                        # Compacted while we were behind: real servers end the stream with 410.
                        expired = ApiError(410, "Expired", f"too old resource version: {seen}")
                        break
                    batch = [
                        (rv, etype, obj)
                        for rv, res, ns, etype, obj in self._s.events
                        if rv > seen
                        and res == resource
                        and ns == namespace
                        and _matches(obj["metadata"].get("labels") or {}, reqs)
                    ]
                    newest = self._s.rv
                    if batch or newest > seen:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._s.cond.wait(left)
            if expired is not None:
                yield {"type": "ERROR", "object": expired.status()}
                return
            seen = newest
            for _, etype, obj in batch:
                yield {"type": etype, "object": copy.deepcopy(obj)}


def _route(path: str) -> tuple[str, str, str | None, str | None]:
    """``(namespace, resource, name, subresource)`` of a namespaced REST path.

    Raises:
        ApiError: 404 for any other path.
    """
    parts = [p for p in path.split("/") if p]
    group = 2 if parts[:1] == ["api"] else 3
    if (
        len(parts) < group + 3
        or parts[group] != "namespaces"
        or parts[group + 2] not in KINDS
        or GROUPS[parts[group + 2]] != "/".join(parts[:group])
    ):
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    rest = parts[group + 3 :]
    return (
        parts[group + 1],
        parts[group + 2],
        rest[0] if rest else None,
        rest[1] if len(rest) > 1 else None,
    )


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1; watch streams use chunked encoding, one event per chunk, as the real server."""

    protocol_version = "HTTP/1.1"
    kube: FakeKubeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet

    def _send_json(self, code: int, payload: Obj | str) -> None:
        if isinstance(payload, str):
            data = payload.encode()
            ctype = "text/plain"
        else:
            data = json.dumps(payload).encode()
            ctype = "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if method == "GET" and query.get("watch") in ("true", "1"):
                self._serve_watch(url.path, query)
                return
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            code, payload = self.kube.handle(method, url.path, query, body)
        except ApiError as exc:
            code, payload = exc.code, exc.status()
        except (ValueError, KeyError, TypeError) as exc:
            code, payload = 400, ApiError(400, "BadRequest", str(exc)).status()
        self._send_json(code, payload)

    def _serve_watch(self, path: str, query: Mapping[str, str]) -> None:
        events = self.kube.watch(path, query)
        try:
            first = next(events, None)
        except ApiError as exc:
            self._send_json(exc.code, exc.status())
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            if first is not None:
                self._chunk(json.dumps(first).encode() + b"\n")
            for event in events:
                self._chunk(json.dumps(event).encode() + b"\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away
            pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")
