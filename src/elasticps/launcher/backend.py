"""The interface between the worker manager and what runs workers.

A *backend* creates, deletes, lists and watches *workers*: Kubernetes pods
(:mod:`elasticps.launcher.kubernetes`) or local processes
(:mod:`elasticps.launcher.local`). The worker manager
(:mod:`elasticps.launcher.manager`) only talks to this interface, so the
same elastic logic (trainer count in range, backoff, stuck detection,
scaling) runs, and is tested, on both.

Everything here is plain data: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class Role(enum.Enum):
    """The kind of process a worker runs."""

    MASTER = "master"
    PS = "ps"
    TRAINER = "trainer"


class WorkerState(enum.Enum):
    """What the backend knows of one worker, whatever it runs on.

    PENDING: asked for, not running yet (pod not scheduled or image pulling;
        process not started).
    UNSCHEDULABLE: the backend refused to place it (pod Pending with reason
        ``Unschedulable``, or a quota error on create). Retried with backoff.
    RUNNING: its process runs.
    SUCCEEDED: it exited with status 0.
    FAILED: it exited with a non-zero status, or was killed by a signal.
    DELETED: it is gone (deleted by the manager, by a user, or preempted).
    """

    PENDING = "pending"
    UNSCHEDULABLE = "unschedulable"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DELETED = "deleted"


@dataclass(frozen=True)
class WorkerSpec:
    """What to run.

    Attributes:
        role: master, PS or trainer.
        index: the PS index (``ps/<index>`` slot) or a trainer's sequence
            number; unique per role within a job.
        args: the ``elasticps <role>`` command-line arguments.
        env: extra environment variables (``ELASTICPS_*``).
    """

    role: Role
    index: int
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The worker's name within its job, e.g. ``trainer-3`` or ``ps-0``."""
        return f"{self.role.value}-{self.index}"


@dataclass(frozen=True)
class WorkerEvent:
    """A change in one worker's state, as the backend observed it.

    Attributes:
        name: the worker's name (:attr:`WorkerSpec.name`).
        role: its role.
        index: its index.
        state: the new state.
        reason: the backend's reason, e.g. ``Unschedulable``, ``OOMKilled``,
            ``exit 1``; empty when there is none.
        created_at: when the worker was created, seconds since the epoch
            (used to delete the newest trainers first).
        message: for an ended worker, its last one-line error (an
            ``elasticps: error: ...`` line without the prefix), if known.
    """

    name: str
    role: Role
    index: int
    state: WorkerState
    reason: str = ""
    created_at: float = 0.0
    message: str = ""


class Cancel(Protocol):
    """Stops a watch."""

    def __call__(self) -> None: ...


class Backend(Protocol):
    """Creates, deletes, lists and watches the workers of one job.

    Implementations must be thread-safe: the worker manager calls ``create``
    and ``delete`` from its own thread while ``watch`` delivers events from
    another.
    """

    def create(self, spec: WorkerSpec) -> None:
        """Start a worker.

        Raises:
            elasticps.errors.UnschedulableError: the backend cannot place it
                now (quota, no capacity); the manager retries with backoff.
            elasticps.errors.ElasticPSError: any other failure.
        """
        ...

    def delete(self, name: str) -> None:
        """Stop and remove a worker; a no-op if it is already gone."""
        ...

    def list(self) -> list[WorkerEvent]:
        """The current state of every worker of the job."""
        ...

    def watch(self, on_event: Callable[[WorkerEvent], None]) -> Cancel:
        """Deliver every later state change to ``on_event`` until cancelled."""
        ...
