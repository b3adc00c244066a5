"""Pod events -> worker states: one declarative table, and the watch that feeds it.

The pure core is :data:`TRANSITIONS`, an ordered table of rules over a
:class:`PodView` (the fields of a pod that matter, parsed from the API's
JSON). The first rule that matches gives the worker's state and reason;
:func:`advance` then applies the only constraints on the order of states:
a deleted worker stays deleted, and a finished one (succeeded or failed)
can only be deleted next. Both are unit-tested without sockets.

The thin shell is :class:`PodEventListener`: it lists the job's pods by
label, then watches from the list's ``resourceVersion``, keeping the newest
version it has seen. When the API server answers 410 Gone (its event
history was compacted past our version) it lists again, diffs the list
against what it knew (a pod missing from the list was deleted while we
were not watching), and watches from the new version. This is the
list-then-watch protocol of Kubernetes informers.

Who causes the events does not matter to the table, only what they do to
the pod:

- the worker manager's own deletes and ``kubectl delete`` set
  ``deletionTimestamp`` (graceful deletion) and end with a ``DELETED``
  event: both map to :attr:`WorkerState.DELETED` as soon as the timestamp
  appears;
- the scheduler leaves a pod ``Pending`` with ``PodScheduled=False,
  reason=Unschedulable``: :attr:`WorkerState.UNSCHEDULABLE`;
- preemption and API-initiated eviction add the ``DisruptionTarget``
  condition (reason ``PreemptionByScheduler``, ``EvictionByEvictionAPI``...)
  before deleting the pod: :attr:`WorkerState.DELETED` with reason
  ``Preempted`` or ``Evicted``; the kubelet's node-pressure eviction leaves a
  ``Failed`` pod with ``status.reason=Evicted``: :attr:`WorkerState.FAILED`,
  reason ``Evicted``.

See https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/ and
https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elasticps.launcher.backend import Role, WorkerEvent, WorkerState

__all__ = [
    "LABEL_INDEX",
    "LABEL_JOB",
    "LABEL_ROLE",
    "TRANSITIONS",
    "PodEventListener",
    "PodView",
    "Rule",
    "advance",
    "classify",
    "worker_event",
]

log = logging.getLogger(__name__)

LABEL_APP = "app"
LABEL_JOB = "elasticps/job"
LABEL_ROLE = "elasticps/role"
LABEL_INDEX = "elasticps/index"

#: Container ``waiting`` reasons after which the pod will not start by itself.
FATAL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)

#: ``DisruptionTarget`` condition reasons, as the worker's reason.
DISRUPTION_REASONS: Mapping[str, str] = {
    "PreemptionByScheduler": "Preempted",
    "PreemptionByKubeScheduler": "Preempted",
    "EvictionByEvictionAPI": "Evicted",
    "TerminationByKubelet": "Evicted",
    "DeletionByTaintManager": "Evicted",
    "DeletionByPodGC": "Deleted",
}


@dataclass(frozen=True)
class Condition:
    """One pod condition: ``status`` is ``"True"``, ``"False"`` or ``"Unknown"``."""

    status: str
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class PodView:
    """The parts of a pod that decide a worker's state.

    Attributes:
        name: the pod's name.
        uid: the pod's uid (a re-created pod of the same name has a new one).
        labels: the pod's labels.
        phase: ``status.phase``: Pending, Running, Succeeded, Failed, Unknown.
        removed: the pod is gone from the API (a ``DELETED`` event, or missing
            from a re-list).
        deleting: ``metadata.deletionTimestamp`` is set (graceful deletion).
        status_reason: ``status.reason`` (e.g. ``Evicted``), or empty.
        conditions: ``status.conditions`` by type.
        waiting: ``reason`` of every container in the ``waiting`` state.
        exit_codes: ``exitCode`` of every terminated container.
        terminated_reasons: ``reason`` of every terminated container (``OOMKilled``...).
        created_at: ``metadata.creationTimestamp``, seconds since the epoch.
        resource_version: ``metadata.resourceVersion``.
    """

    name: str
    uid: str
    labels: Mapping[str, str]
    phase: str
    removed: bool = False
    deleting: bool = False
    status_reason: str = ""
    conditions: Mapping[str, Condition] = field(default_factory=dict)
    waiting: tuple[str, ...] = ()
    exit_codes: tuple[int, ...] = ()
    terminated_reasons: tuple[str, ...] = ()
    created_at: float = 0.0
    resource_version: str = ""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, removed: bool = False) -> PodView:
        """Parse a pod as the API serves it (camelCase JSON).

        Raises:
            ValueError: the object has no ``metadata.name``.
        """
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("pod without metadata.name")
        conditions = {
            str(c.get("type")): Condition(
                str(c.get("status", "")), str(c.get("reason") or ""), str(c.get("message") or "")
            )
            for c in status.get("conditions") or []
            if isinstance(c, dict)
        }
        waiting: list[str] = []
        exit_codes: list[int] = []
        term_reasons: list[str] = []
        for cs in (status.get("initContainerStatuses") or []) + (
            status.get("containerStatuses") or []
        ):
            state = (cs or {}).get("state") or {}
            if state.get("waiting"):
                waiting.append(str(state["waiting"].get("reason") or ""))
            if state.get("terminated"):
                exit_codes.append(int(state["terminated"].get("exitCode") or 0))
                term_reasons.append(str(state["terminated"].get("reason") or ""))
        return cls(
            name=name,
            uid=str(meta.get("uid") or ""),
            labels=dict(meta.get("labels") or {}),
            phase=str(status.get("phase") or "Pending"),
            removed=removed,
            deleting=bool(meta.get("deletionTimestamp")),
            status_reason=str(status.get("reason") or ""),
            conditions=conditions,
            waiting=tuple(waiting),
            exit_codes=tuple(exit_codes),
            terminated_reasons=tuple(term_reasons),
            created_at=_parse_time(meta.get("creationTimestamp")),
            resource_version=str(meta.get("resourceVersion") or ""),
        )

    def condition(self, ctype: str) -> Condition | None:
        """The condition of type ``ctype``, or None."""
        return self.conditions.get(ctype)

    @property
    def disruption(self) -> str:
        """``Preempted``, ``Evicted``... if ``DisruptionTarget=True`` is set, else ``""``."""
        cond = self.condition("DisruptionTarget")
        if cond is None or cond.status != "True":
            return ""
        return DISRUPTION_REASONS.get(cond.reason, cond.reason or "Disrupted")


def _parse_time(value: object) -> float:
    """RFC 3339 (``2026-11-22T03:00:00Z``) -> seconds since the epoch; 0.0 if absent."""
    if not isinstance(value, str) or not value:
        return 0.0
    try:
        return float(calendar.timegm(time.strptime(value[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return 0.0


def _unschedulable(pod: PodView) -> bool:
    cond = pod.condition("PodScheduled")
    return (
        pod.phase == "Pending"
        and cond is not None
        and cond.status == "False"
        and cond.reason == "Unschedulable"
    )


def _failure_reason(pod: PodView) -> str:
    if pod.status_reason:  # Evicted, NodeLost, DeadlineExceeded...
        return pod.status_reason
    reasons = [r for r in pod.terminated_reasons if r and r != "Error"]
    if reasons:  # OOMKilled, ContainerCannotRun...
        return reasons[0]
    codes = [c for c in pod.exit_codes if c != 0]
    return f"exit {codes[0]}" if codes else "Failed"


def _unschedulable_reason(pod: PodView) -> str:
    cond = pod.condition("PodScheduled")
    message = cond.message if cond is not None else ""
    return f"Unschedulable: {message}" if message else "Unschedulable"


@dataclass(frozen=True)
class Rule:
    """One row of the transition table.

    Attributes:
        when: what the row means, for people and for logs.
        match: whether the row applies to a pod.
        state: the worker state it gives.
        reason: the worker's reason for that pod.
    """

    when: str
    match: Callable[[PodView], bool]
    state: WorkerState
    reason: Callable[[PodView], str]


#: The pod -> worker state table: the first matching row wins. The order is
#: the precedence: gone beats finished beats terminating beats preempted beats
#: unschedulable beats running beats pending.
TRANSITIONS: tuple[Rule, ...] = (
    Rule(
        "removed from the API server (DELETED event, or missing from a re-list)",
        lambda p: p.removed,
        WorkerState.DELETED,
        lambda p: p.disruption or "Deleted",
    ),
    Rule(
        "every container exited 0 (phase Succeeded)",
        lambda p: p.phase == "Succeeded",
        WorkerState.SUCCEEDED,
        lambda p: "Completed",
    ),
    Rule(
        "a container failed, or the kubelet evicted the pod (phase Failed)",
        lambda p: p.phase == "Failed",
        WorkerState.FAILED,
        _failure_reason,
    ),
    Rule(
        "being deleted: deletionTimestamp set by the manager, kubectl delete or preemption",
        lambda p: p.deleting,
        WorkerState.DELETED,
        lambda p: p.disruption or "Terminating",
    ),
    Rule(
        "chosen for preemption or eviction (DisruptionTarget=True)",
        lambda p: bool(p.disruption),
        WorkerState.DELETED,
        lambda p: p.disruption,
    ),
    Rule(
        "the scheduler cannot place it (PodScheduled=False, reason Unschedulable)",
        _unschedulable,
        WorkerState.UNSCHEDULABLE,
        _unschedulable_reason,
    ),
    Rule(
        "its container cannot start (image pull error, bad config, crash loop)",
        lambda p: any(r in FATAL_WAITING for r in p.waiting),
        WorkerState.FAILED,
        lambda p: next(r for r in p.waiting if r in FATAL_WAITING),
    ),
    Rule(
        "its node stopped reporting (phase Unknown)",
        lambda p: p.phase == "Unknown",
        WorkerState.FAILED,
        lambda p: "NodeLost",
    ),
    Rule(
        "its containers run (phase Running)",
        lambda p: p.phase == "Running",
        WorkerState.RUNNING,
        lambda p: "",
    ),
    Rule(
        "accepted, not running yet (scheduling, pulling the image)",
        lambda p: True,
        WorkerState.PENDING,
        lambda p: next((r for r in p.waiting if r), ""),
    ),
)

_FINISHED = frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED})


def classify(pod: PodView) -> tuple[WorkerState, str]:
    """The worker state and reason of a pod, by the first matching row of :data:`TRANSITIONS`."""
    for rule in TRANSITIONS:
        if rule.match(pod):
            return rule.state, rule.reason(pod)
    raise AssertionError("the last row of TRANSITIONS matches every pod")  # pragma: no cover


def advance(
    previous: tuple[WorkerState, str] | None, pod: PodView
) -> tuple[WorkerState, str] | None:
    """The worker's next (state, reason) after observing ``pod``, or None if nothing changes.

    A deleted worker stays deleted; a finished one (succeeded or failed) can
    only become deleted. Observing the same state and reason again is no
    change. ``previous`` is None for a pod not seen before.
    """
    observed = classify(pod)
    if previous is None:
        return observed
    if observed == previous or previous[0] is WorkerState.DELETED:
        return None
    if previous[0] in _FINISHED and observed[0] is not WorkerState.DELETED:
        return None
    return observed


def worker_identity(labels: Mapping[str, str]) -> tuple[Role, int] | None:
    """The (role, index) a pod's labels name, or None for pods that are not workers (etcd)."""
    try:
        role = Role(labels.get(LABEL_ROLE, ""))
        index = int(labels.get(LABEL_INDEX, ""))
    except ValueError:
        return None
    return (role, index) if index >= 0 else None


def worker_event(pod: PodView, state: WorkerState, reason: str) -> WorkerEvent | None:
    """The :class:`WorkerEvent` of a pod in a state, or None if the pod is not a worker."""
    identity = worker_identity(pod.labels)
    if identity is None:
        return None
    role, index = identity
    return WorkerEvent(
        name=f"{role.value}-{index}",
        role=role,
        index=index,
        state=state,
        reason=reason,
        created_at=pod.created_at,
    )


class PodEventListener:
    """Watch the pods matching a label selector and report worker state changes.

    Runs one daemon thread: list, then watch from the list's
    ``resourceVersion``; on 410 Gone, list again and diff. Every change of a
    pod's (state, reason), as :func:`advance` decides, is delivered to
    ``on_event`` from that thread, in the order the API server produced them.
    The first list delivers the current state of every existing pod.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        selector: str,
        on_event: Callable[[WorkerEvent], None],
        *,
        watch_timeout_s: int = 30,
        retry_delay_s: float = 0.5,
    ) -> None:
        """Args:
        api: a ``kubernetes.client.CoreV1Api``.
        namespace: the job's namespace.
        selector: label selector of the job's pods.
        on_event: receives each change.
        watch_timeout_s: server-side length of one watch request, seconds.
        retry_delay_s: wait after a failed request before retrying, seconds.
        """
        self._api = api
        self._namespace = namespace
        self._selector = selector
        self._on_event = on_event
        self._watch_timeout_s = watch_timeout_s
        self._retry_delay_s = retry_delay_s
        self._known: dict[str, tuple[PodView, tuple[WorkerState, str]]] = {}
        self._stop = threading.Event()
        self._resp: Any = None
        self._resp_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pod-events", daemon=True)
        self.relists = 0
        """How many times the listener listed the pods (1 + one per 410 Gone or error)."""

    def start(self) -> PodEventListener:
        """Start the watch thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; no event is delivered once this returns (from another thread)."""
        self._stop.set()
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            # Unblocks the read in the watch thread (urllib3 >= 2.3); best effort,
            # as the read times out anyway.
            with contextlib.suppress(Exception):
                resp.shutdown()
        if threading.current_thread() is not self._thread:
            self._thread.join(self._watch_timeout_s + 10)

    __call__ = stop

    # --- the shell ------------------------------------------------------------

    def _run(self) -> None:
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._watch(version)
            except Exception as exc:  # the watch must outlive API hiccups
                if self._stop.is_set():
                    return
                if getattr(exc, "status", None) == 410:
                    log.info("pod watch of %s: 410 Gone; re-listing", self._selector)
                    version = None
                    continue
                log.warning("pod watch of %s failed (%s); retrying", self._selector, exc)
                version = None
                self._stop.wait(self._retry_delay_s)

    def _relist(self) -> str:
        """List the pods, report what changed since we last knew, return the list's version."""
        resp = self._api.list_namespaced_pod(
            self._namespace, label_selector=self._selector, _preload_content=False
        )
        body = json.loads(resp.data)
        self.relists += 1
        present: set[str] = set()
        for obj in body.get("items") or []:
            pod = PodView.from_json(obj)
            present.add(pod.uid)
            self._observe(pod)
        for uid, (pod, _) in list(self._known.items()):
            if uid not in present:  # deleted while we were not watching
                self._observe(replace(pod, removed=True))
                del self._known[uid]
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """One watch request from ``version``; returns the newest version seen.

        Raises:
            kubernetes.client.ApiException: with status 410 when the version is too old.
        """
        from kubernetes.client import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._api.list_namespaced_pod(
            self._namespace,
            label_selector=self._selector,
            watch=True,
            resource_version=version,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=(5, self._watch_timeout_s + 5),
        )
        with self._resp_lock:
            self._resp = resp
        try:
            for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                etype, obj = event.get("type"), event.get("object") or {}
                if etype == "ERROR":
                    raise ApiException(
                        status=int(obj.get("code") or 500),
                        reason=f"{obj.get('reason')}: {obj.get('message')}",
                    )
                if etype == "BOOKMARK":
                    version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                    continue
                if etype not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                pod = PodView.from_json(obj, removed=etype == "DELETED")
                version = pod.resource_version or version
                self._observe(pod)
        finally:
            with self._resp_lock:
                self._resp = None
            resp.release_conn()
        return version

    def _observe(self, pod: PodView) -> None:
        if self._stop.is_set():
            return
        known = self._known.get(pod.uid)
        change = advance(known[1] if known else None, pod)
        if change is None:
            return
        if known is None and pod.removed:
            return  # gone before we ever saw it: nothing to report
        # Deleted pods stay known (as DELETED, which advance() never leaves) until
        # a re-list no longer shows them, so a late event cannot revive them.
        self._known[pod.uid] = (pod, change)
        event = worker_event(pod, *change)
        if event is None:
            return
        log.info("worker %s: %s %s", event.name, event.state.value, event.reason)
        self._on_event(event)
