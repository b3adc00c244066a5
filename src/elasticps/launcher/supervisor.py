"""What a process death means: the one supervision policy of every launcher (pure).

Every way to launch a job (``elasticps train``, :func:`elasticps.train` with
:class:`elasticps.Local`, :func:`elasticps.dist_train`, and the worker
manager inside a Kubernetes master) feeds the same :class:`Supervisor` with
*events* (a process exited with this status or signal; a role was deleted on
purpose; the job's tasks progressed; the job finished; a restart could not
be carried out) and applies the *action* it returns (restart this role under
the same index; replace this trainer; fail the job with this one-line
message and exit status; ignore). The supervisor does no I/O and reads no
clock: how to start, signal and watch a process or a pod is each backend's
business (:mod:`elasticps.launcher.local`, :mod:`elasticps.api.servers`,
:mod:`elasticps.launcher.manager` over a
:class:`~elasticps.launcher.backend.Backend`). This is the split of torch
elastic's agent (a policy loop over worker states) and of Horovod elastic's
driver (the decision to reset is separate from how workers are run).

The policy:

- **Servers** (etcd, a master, a parameter server): one that dies is
  restarted under the same name (the same index: a PS reclaims its slot and
  reloads its checkpoint), up to ``max_restarts`` times each, unless it
  exited with status 2 (a user error, which a restart would repeat). The
  death after the last restart fails the job (exit status 1).
- **Trainers**: one that dies is replaced by a new one (a new trainer id;
  its tasks go back to the queue at the last reported offset), whatever the
  cause (killed by a signal, evicted, status 75 "try again", status 1), with
  two exceptions:

  - status 2 (an error in the user's code or data) fails the job with exit
    status 2 and the trainer's own one-line message: every trainer would
    hit the same error;
  - trainers that keep failing with an *internal* error (status 1, or any
    status other than 0, 2 and 75, or ``OOMKilled`` and the like) fail the
    job: :data:`MAX_TRAINER_FAILURES` (3) such exits in a row with no task
    progress in between mean a bug that a replacement will hit again. Any
    progress of the job's tasks resets the count. Deaths caused from
    outside (a signal, an eviction, a preemption) and status 75 (a server
    was unreachable: it is being restarted under its own budget) never
    count: they say nothing about the trainer's code.

  A trainer that exits 0 was told by the master that the job is finished.
  The job goes on while at least one trainer lives or can be started: there
  is no minimum below which it fails.
- A role **deleted on purpose** (scaled down, stuck, the job ending) is
  not a failure: ignored.
- Once **training finished** (the master says every pass is done), trainer
  deaths are ignored: their work is done. Servers are still restarted: the
  launcher needs them for the final checkpoint, until it stops them on
  purpose. After the job **failed**, every event is ignored.

Exit statuses of role processes (:func:`exit_status_for`): 0 done, 1 an
internal error (a bug), 2 a user error (:class:`~elasticps.errors.UserError`),
3 a master that stepped down, 75 (``EX_TEMPFAIL`` of BSD's ``sysexits.h``:
"try again") an infrastructure error: etcd, the master or a PS could not be
reached (:class:`~elasticps.errors.CoordinationError`,
:class:`~elasticps.errors.ServiceUnavailableError`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from elasticps.errors import (
    ConfigError,
    CoordinationError,
    ServiceUnavailableError,
    UserError,
)

__all__ = [
    "CAUSE_WINDOW_S",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_STEPPED_DOWN",
    "EXIT_TEMPFAIL",
    "EXIT_USER_ERROR",
    "LOST_CAUSES",
    "MAX_TRAINER_FAILURES",
    "Action",
    "Decision",
    "Deleted",
    "Event",
    "Exited",
    "FailJob",
    "Ignore",
    "JobFinished",
    "Kind",
    "Progressed",
    "Replace",
    "Restart",
    "RestartFailed",
    "Supervisor",
    "SupervisorConfig",
    "decision_of",
    "error_line",
    "exit_status_for",
    "exited_from_reason",
    "failing_worker",
    "relayed_returncode",
    "root_cause",
]

EXIT_OK: Final = 0
"""A role finished its work (a trainer told by the master that the job is finished)."""

EXIT_FAILURE: Final = 1
"""An internal error: a bug, or anything not classified below."""

EXIT_USER_ERROR: Final = 2
"""A user error (model contract, data, flags): one ``elasticps: error:`` line."""

EXIT_STEPPED_DOWN: Final = 3
"""A master that lost its lease or lock (:data:`elasticps.master.main.EXIT_STEPPED_DOWN`)."""

EXIT_TEMPFAIL: Final = 75
"""``EX_TEMPFAIL`` (BSD ``sysexits.h``): etcd, the master or a PS could not be reached."""

MAX_TRAINER_FAILURES: Final = 3
"""Internal trainer errors in a row, with no task progress in between, that fail the job.

One can be a race with a server being restarted; two in a row can still be a
coincidence of faults; a third with no task done or advanced meanwhile means
the next replacement will fail the same way.
"""

LOST_CAUSES: Final = frozenset(
    {"Evicted", "Preempted", "NodeLost", "Deleted", "Disrupted", "Terminating", "Shutdown"}
)
"""Backend reasons of a worker that was taken away from outside (like a signal)."""


def exit_status_for(exc: BaseException) -> int:
    """The exit status a role process ends with after ``exc`` (the mapping of role entry points).

    Args:
        exc: what ended the role.

    Returns:
        :data:`EXIT_USER_ERROR` for a :class:`~elasticps.errors.UserError`,
        :data:`EXIT_TEMPFAIL` for an unreachable service
        (:class:`~elasticps.errors.CoordinationError`,
        :class:`~elasticps.errors.ServiceUnavailableError`), else
        :data:`EXIT_FAILURE`.
    """
    if isinstance(exc, UserError):
        return EXIT_USER_ERROR
    if isinstance(exc, CoordinationError | ServiceUnavailableError):
        return EXIT_TEMPFAIL
    return EXIT_FAILURE


class Kind(enum.Enum):
    """The kind of process an event is about."""

    ETCD = "etcd"
    MASTER = "master"
    PS = "ps"
    TRAINER = "trainer"

    @property
    def is_server(self) -> bool:
        """etcd, a master or a PS: restarted under the same name."""
        return self is not Kind.TRAINER


# --- events ------------------------------------------------------------------------


@dataclass(frozen=True)
class Exited:
    """A process (or pod) ended without being asked to.

    Attributes:
        name: the role's name within the job (``etcd``, ``master-0``, ``ps-1``,
            ``trainer-7``).
        kind: its kind.
        status: its exit status, or None if it was killed by a signal or taken
            away (evicted, node lost).
        signal: the signal that killed it, if known.
        cause: the backend's reason when there is no status (``OOMKilled``,
            ``Evicted``...), else empty.
        message: its last one-line error (``elasticps: error: ...`` without the
            prefix), if it printed one.
    """

    name: str
    kind: Kind
    status: int | None = None
    signal: int | None = None
    cause: str = ""
    message: str = ""

    @classmethod
    def of_returncode(
        cls, name: str, kind: Kind, returncode: int | None, message: str = ""
    ) -> Exited:
        """The end of a local process from its ``returncode`` (as ``Popen`` gives it).

        Args:
            name: the role's name.
            kind: its kind.
            returncode: the exit status, ``-N`` if signal N killed it, or None
                if it is not known (it did not start).
            message: its last one-line error, if any.
        """
        if returncode is None:
            return cls(name, kind, message=message)
        if returncode < 0:
            return cls(name, kind, signal=-returncode, message=message)
        return cls(name, kind, status=returncode, message=message)

    @property
    def internal(self) -> bool:
        """Whether this is an internal error of the process itself (counted for trainers)."""
        if self.status is not None:
            return self.status not in (EXIT_OK, EXIT_USER_ERROR, EXIT_TEMPFAIL)
        return self.signal is None and self.cause not in LOST_CAUSES

    def describe(self) -> str:
        """``exit 1``, ``signal 9``, ``OOMKilled``..."""
        if self.status is not None:
            return f"exit {self.status}"
        if self.signal is not None:
            return f"signal {self.signal}"
        return self.cause or "ended"


@dataclass(frozen=True)
class Deleted:
    """A role was stopped on purpose (scaled down, stuck, the job ending): not a failure.

    Attributes:
        name: the role's name.
        kind: its kind.
    """

    name: str
    kind: Kind


@dataclass(frozen=True)
class Progressed:
    """The job's tasks progressed (a task done, or a task's offset advanced) since the last one."""


@dataclass(frozen=True)
class JobFinished:
    """The master says every pass is done: trainer deaths no longer matter."""


@dataclass(frozen=True)
class RestartFailed:
    """The backend could not carry out a :class:`Restart` (the process did not come up).

    Counted as one more death of that role.

    Attributes:
        name: the role's name.
        kind: its kind.
        reason: what went wrong, one line.
    """

    name: str
    kind: Kind
    reason: str


Event = Exited | Deleted | Progressed | JobFinished | RestartFailed
"""What the supervisor is told."""


# --- actions -----------------------------------------------------------------------


@dataclass(frozen=True)
class Restart:
    """Start the role again under the same name (same index, same arguments).

    Attributes:
        name: the role's name.
        kind: its kind.
        attempt: this is the role's ``attempt``-th restart (1-based).
        limit: its restart budget, or None for no limit.
    """

    name: str
    kind: Kind
    attempt: int
    limit: int | None


@dataclass(frozen=True)
class Replace:
    """Start a new trainer (with a new id) in place of this one.

    Attributes:
        name: the trainer that died.
    """

    name: str


@dataclass(frozen=True)
class FailJob:
    """Stop the job: every process is stopped, the launcher exits with ``exit_code``.

    Attributes:
        message: one line saying what failed and why.
        exit_code: :data:`EXIT_USER_ERROR` or :data:`EXIT_FAILURE`.
    """

    message: str
    exit_code: int


@dataclass(frozen=True)
class Ignore:
    """Nothing to do.

    Attributes:
        reason: why, for the logs.
    """

    reason: str


Action = Restart | Replace | FailJob | Ignore
"""What the supervisor answers."""


# --- the policy ------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisorConfig:
    """The knobs of the policy.

    Attributes:
        max_restarts: restarts allowed per server role (etcd, each master,
            each PS), >= 0; None: no limit (Kubernetes' own restart policy).
        max_trainer_failures: internal trainer errors in a row, with no task
            progress in between, that fail the job, >= 1.
        replace_trainers: False where a trainer's work is not a task of the
            ledger (``dist_train``'s workers run the user's whole script): a
            replacement would train its data again, so any trainer death
            other than exit 0 fails the job.

    Raises:
        ConfigError: a value is out of range.
    """

    max_restarts: int | None = 3
    max_trainer_failures: int = MAX_TRAINER_FAILURES
    replace_trainers: bool = True

    def __post_init__(self) -> None:
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_trainer_failures < 1:
            raise ConfigError(f"max_trainer_failures must be >= 1, got {self.max_trainer_failures}")


@dataclass
class Supervisor:
    """The supervision policy as a state machine (see the module docstring).

    Not thread-safe: a shell that feeds it from several threads holds a lock.

    Args:
        config: the policy's knobs.
    """

    config: SupervisorConfig = field(default_factory=SupervisorConfig)
    _restarts: dict[str, int] = field(default_factory=dict, init=False)
    _streak: int = field(default=0, init=False)
    _failed: FailJob | None = field(default=None, init=False)
    _finished: bool = field(default=False, init=False)

    # --- what it knows -----------------------------------------------------------

    @property
    def restarts(self) -> Mapping[str, int]:
        """Restarts decided so far, by role name (roles never restarted are absent)."""
        return dict(self._restarts)

    @property
    def failed(self) -> FailJob | None:
        """The decision that failed the job, or None."""
        return self._failed

    @property
    def finished(self) -> bool:
        """Whether training finished (told by :class:`JobFinished`)."""
        return self._finished

    @property
    def trainer_failure_streak(self) -> int:
        """Internal trainer errors since the last task progress."""
        return self._streak

    # --- the one transition --------------------------------------------------------

    def handle(self, event: Event) -> Action:
        """Decide what ``event`` calls for.

        Args:
            event: what happened.

        Returns:
            The action to apply; at most one :class:`FailJob` is ever
            returned, and everything after it is :class:`Ignore`.
        """
        if self._failed is not None:
            return Ignore("the job has failed already")
        if isinstance(event, Progressed):
            self._streak = 0
            return Ignore("progress")
        if isinstance(event, JobFinished):
            self._finished = True
            return Ignore("the job is finished")
        if isinstance(event, Deleted):
            return Ignore(f"{event.name} was stopped on purpose")
        if self._finished and event.kind is Kind.TRAINER:
            return Ignore(f"{event.name} ended after training finished")
        if isinstance(event, RestartFailed):
            return self._server_died(event.name, event.kind, f"could not restart: {event.reason}")
        if event.kind is Kind.TRAINER:
            return self._trainer_died(event)
        if event.status == EXIT_USER_ERROR:
            return self._fail(_user_error_message(event), EXIT_USER_ERROR)
        return self._server_died(event.name, event.kind, event.describe())

    # --- internals ---------------------------------------------------------------------

    def _fail(self, message: str, exit_code: int) -> FailJob:
        self._failed = FailJob(message, exit_code)
        return self._failed

    def _server_died(self, name: str, kind: Kind, how: str) -> Action:
        done = self._restarts.get(name, 0)
        limit = self.config.max_restarts
        if limit is not None and done >= limit:
            return self._fail(
                f"{name} died ({how}) after {done} restart{'s' if done != 1 else ''}; "
                f"no restarts left (--max-restarts {limit})",
                EXIT_FAILURE,
            )
        self._restarts[name] = done + 1
        return Restart(name, kind, done + 1, limit)

    def _trainer_died(self, event: Exited) -> Action:
        if event.status == EXIT_OK:
            return Ignore(f"{event.name} finished (the master said the job is done)")
        if event.status == EXIT_USER_ERROR:
            return self._fail(_user_error_message(event), EXIT_USER_ERROR)
        if not self.config.replace_trainers:
            return self._fail(
                f"{event.name} ended ({event.describe()})"
                + (f": {event.message}" if event.message else "")
                + "; its work cannot be given to another trainer",
                EXIT_FAILURE,
            )
        if event.internal:
            self._streak += 1
            limit = self.config.max_trainer_failures
            if self._streak >= limit:
                return self._fail(
                    f"trainers keep failing: {self._streak} in a row ended with an internal "
                    f"error and no task progressed in between; the last, {event.name}, "
                    f"{event.describe()}" + (f": {event.message}" if event.message else ""),
                    EXIT_FAILURE,
                )
        return Replace(event.name)


def _user_error_message(event: Exited) -> str:
    if event.message:
        return f"{event.name}: {event.message}"
    return f"{event.name} stopped on a user error (exit status 2); its log says which"


_CLOSING = re.compile(r"^elasticps: (?:error: |unavailable: )?(?P<message>\S.*)$")


def error_line(line: str) -> str | None:
    """The message of a role's closing error line, or None for any other line.

    A role process ends on an error with one line ``elasticps: error: ...``
    (a user error), ``elasticps: unavailable: ...`` (status 75) or
    ``elasticps: <Type>: ...`` (an internal error); the launchers keep the
    last such line of each process for the :class:`Exited` event. Pure.

    Args:
        line: one line of the process's output, without the newline.
    """
    match = _CLOSING.match(line)
    return match["message"] if match is not None else None


_REASON = re.compile(r"^(exit|signal) (\d+)$")


def exited_from_reason(name: str, kind: Kind, reason: str, message: str = "") -> Exited:
    """The :class:`Exited` event of a backend's reason for a worker's end.

    Understands the local backend's ``exit N`` / ``signal N`` and the
    Kubernetes reasons (``exit N``, ``OOMKilled``, ``Evicted``, ``NodeLost``,
    ``Preempted``, ``ErrImagePull``...). Pure.

    Args:
        name: the worker's name.
        kind: its kind.
        reason: the backend's reason.
        message: its last one-line error, if known.
    """
    match = _REASON.match(reason)
    if match is not None:
        number = int(match.group(2))
        if match.group(1) == "exit":
            return Exited(name, kind, status=number, message=message)
        return Exited(name, kind, signal=number, message=message)
    return Exited(name, kind, cause=reason or "ended", message=message)


_MAX_SIGNAL: Final = 64
"""The highest signal number (``SIGRTMAX`` on Linux)."""


def relayed_returncode(status: int) -> int:
    """The ``Popen``-style return code of an exit status relayed by a shell or an ssh session.

    A process relayed through another (``ssh``, a shell, the host's end of
    :mod:`elasticps.launcher.remote`) ends with ``128 + N`` when signal ``N``
    killed the role; a local child's ``Popen`` says ``-N``. This maps the
    former to the latter, so a role SIGKILLed on another host reads as
    ``signal 9`` (a death from outside), not ``exit 137`` (an internal
    error). 255 (ssh's lost connection) and any other status are kept. Pure.

    Args:
        status: the relayed exit status (negative values pass through).

    Returns:
        ``-N`` for ``128 + N`` with ``1 <= N <= 64``, else ``status``.
    """
    if 128 < status <= 128 + _MAX_SIGNAL:
        return 128 - status
    return status


@dataclass(frozen=True)
class Decision:
    """One supervision decision, as a launcher records it (in ``run.json``'s ``decisions``).

    Attributes:
        at: when it was decided, seconds since the epoch (the launcher's clock).
        role: the kind of the worker it is about (``etcd``, ``master``, ``ps``,
            ``trainer``), or ``job`` for job-wide events.
        worker: the worker's name (``trainer-7``, ``ps-1``), or ``job``.
        happened: what happened (``exit 1``, ``signal 9``, ``deleted``,
            ``restart failed: ...``, ``finished``).
        decided: what the policy decided (``restart 1/3``, ``replace``,
            ``fail (exit 2): ...``, ``ignore: ...``).
        message: the process's last error line, if it printed one.
    """

    at: float
    role: str
    worker: str
    happened: str
    decided: str
    message: str = ""

    def as_dict(self) -> dict[str, object]:
        """The record as JSON-ready values (``at`` rounded to milliseconds; ``message``
        only if there is one)."""
        record: dict[str, object] = {
            "at": round(self.at, 3),
            "role": self.role,
            "worker": self.worker,
            "happened": self.happened,
            "decided": self.decided,
        }
        if self.message:
            record["message"] = self.message
        return record

    @classmethod
    def from_dict(cls, record: object) -> Decision | None:
        """The decision :meth:`as_dict` wrote (``run.json``'s, a state record's), or None
        for a record that is not one (missing or ill-typed fields). Pure."""
        if not isinstance(record, dict) or not isinstance(record.get("at"), int | float):
            return None
        fields = [record.get(k) for k in ("role", "worker", "happened", "decided")]
        message = record.get("message", "")
        if not all(isinstance(f, str) for f in fields) or not isinstance(message, str):
            return None
        role, worker, happened, decided = (str(f) for f in fields)
        return cls(float(record["at"]), role, worker, happened, decided, message)


def decision_of(at: float, event: Event, action: Action) -> Decision | None:
    """The record of the policy's ``action`` on ``event``, or None for task progress.

    Task progress (:class:`Progressed`) comes once a second and only resets
    a count: it is not recorded. Pure.

    Args:
        at: when, seconds since the epoch.
        event: what the supervisor was told.
        action: what it answered.
    """
    if isinstance(event, Progressed):
        return None
    if isinstance(event, JobFinished):
        role, worker, happened = "job", "job", "finished"
    elif isinstance(event, Exited):
        role, worker, happened = event.kind.value, event.name, event.describe()
        return Decision(at, role, worker, happened, _describe_action(action), event.message)
    elif isinstance(event, Deleted):
        role, worker, happened = event.kind.value, event.name, "deleted"
    else:
        role, worker, happened = event.kind.value, event.name, f"restart failed: {event.reason}"
    return Decision(at, role, worker, happened, _describe_action(action))


# Which faults may cause which: a trainer ends when its parameter server or its master
# does, and every role when etcd does; not the other way round.
_DEPTH: Final[dict[str, int]] = {"etcd": 0, "master": 1, "ps": 1, "trainer": 2}

CAUSE_WINDOW_S: Final = 10.0
"""How long before the failing role's first fault another role's fault may have caused
it, seconds (a few lease TTLs)."""


def failing_worker(decisions: Sequence[Decision]) -> str | None:
    """The worker of the last decision that failed the job, or None. Pure."""
    return next((d.worker for d in reversed(decisions) if d.decided.startswith("fail")), None)


def root_cause(
    decisions: Sequence[Decision], failed: str | None, *, window_s: float = CAUSE_WINDOW_S
) -> tuple[Decision | None, list[Decision]]:
    """The first fault of a failed job, and the faults that followed it. Pure.

    The chain starts at the first fault of the worker whose end failed the
    job (``failed``; without one, the worker of the decision that failed it).
    A fault of a role it depends on (etcd for every role; a parameter server
    or the master for a trainer) within ``window_s`` seconds before that is
    the cause instead, the earliest of the deepest: a trainer that ends
    because its parameter server vanished is not the root cause.

    Args:
        decisions: the supervision decisions, oldest first (``run.json``'s).
        failed: the worker whose end failed the job, or None.
        window_s: how far back a cause may lie, seconds.

    Returns:
        The root cause (None when no process fault is recorded: the job failed
        on its own, a full disk say), and every later fault, oldest first.
    """
    faults = [d for d in decisions if d.role != "job"]
    if failed is None:
        failed = failing_worker(faults)
    own = [d for d in faults if d.worker == failed]
    if not own:
        return (faults[0], faults[1:]) if faults else (None, [])
    first = own[0]
    depth = _DEPTH.get(first.role, 2)
    causes = [
        d
        for d in faults
        if first.at - window_s <= d.at <= first.at
        and d.worker != failed
        and _DEPTH.get(d.role, 2) < depth
    ]
    if causes:
        deepest = min(_DEPTH.get(d.role, 2) for d in causes)
        first = next(d for d in causes if _DEPTH.get(d.role, 2) == deepest)
    after = [d for d in faults if d is not first and d.at >= first.at]
    return first, after


def _describe_action(action: Action) -> str:
    if isinstance(action, Restart):
        limit = "unlimited" if action.limit is None else str(action.limit)
        return f"restart {action.attempt}/{limit}"
    if isinstance(action, Replace):
        return "replace"
    if isinstance(action, FailJob):
        return f"fail (exit {action.exit_code}): {action.message}"
    return f"ignore: {action.reason}"
