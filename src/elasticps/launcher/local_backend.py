"""The local backend: workers are processes on this machine, "pods" for the worker manager.

It implements :class:`~elasticps.launcher.backend.Backend`:

- ``create`` starts ``elasticps <role> <args>`` through a
  :class:`~elasticps.launcher.spawn.Spawner` (a new interpreter with the
  ``setpriv --pdeathsig TERM`` prefix by default, or a fork of the launcher's
  fork server), so a worker dies with the launcher even if the launcher is
  SIGKILLed. The spawn happens on one long-lived thread owned by the
  backend, because the parent-death signal fires when the *thread* that
  forked the child exits.
- ``delete`` sends SIGTERM by PID, then SIGKILL after ``term_timeout_s``
  seconds; it does not block.
- ``watch`` delivers events from one reaper thread per process: RUNNING on
  start, then SUCCEEDED (exit status 0) or FAILED (reason ``exit N`` or
  ``signal N``; ``message`` is its last closing error line, see
  :func:`~elasticps.launcher.supervisor.error_line`) when it exits, or
  DELETED if it exits after ``delete`` (whatever its status).
- ``set_capacity`` limits how many workers may be alive at once; a create
  beyond it raises :class:`~elasticps.errors.UnschedulableError`, as a full
  cluster would. Tests use it to exercise the manager's backoff.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elasticps.errors import ElasticPSError, UnschedulableError
from elasticps.launcher.backend import Cancel, Role, WorkerEvent, WorkerSpec, WorkerState
from elasticps.launcher.local_processes import returncode_of
from elasticps.launcher.spawn import (
    ExecSpawner,
    ProcessHandle,
    Spawner,
    child_env,
    popen_child,
)
from elasticps.launcher.supervisor import error_line

__all__ = ["LocalBackend", "child_env", "exit_status"]

_REASON = re.compile(r"^(exit|signal) (\d+)$")


def exit_status(event: WorkerEvent) -> int | None:
    """The exit status in a local FAILED/SUCCEEDED event: ``N`` for ``exit N``,
    ``-N`` for ``signal N``; None for other reasons."""
    match = _REASON.match(event.reason)
    if match is None:
        return None
    number = int(match.group(2))
    return number if match.group(1) == "exit" else -number


@dataclass
class _Proc:
    spec: WorkerSpec
    proc: ProcessHandle
    created_at: float
    state: WorkerState = WorkerState.RUNNING
    reason: str = ""
    deleting: bool = False
    reaper: threading.Thread | None = None
    killer: threading.Timer | None = None
    message: str = ""


class LocalBackend:
    """Runs workers as local processes (see the module docstring).

    Args:
        spawner: starts ``elasticps <role> <args>`` for each worker; by default
            an :class:`~elasticps.launcher.spawn.ExecSpawner`.
        command: instead, the argv of any program to run as a worker (tests).
        env: the environment of a worker; by default :func:`child_env` of its
            role plus the spec's ``env``.
        on_output: receives ``(worker name, line)`` for each line the worker
            writes to stdout or stderr; None discards them.
        on_start: receives ``(worker name, pid)`` after each spawn (the local
            launcher records every pid in ``pids.json``).
        capacity: most workers alive at once; None: no limit.
        term_timeout_s: seconds between SIGTERM and SIGKILL on delete.
    """

    def __init__(
        self,
        *,
        spawner: Spawner | None = None,
        command: Callable[[WorkerSpec], Sequence[str]] | None = None,
        env: Callable[[WorkerSpec], Mapping[str, str]] | None = None,
        on_output: Callable[[str, str], None] | None = None,
        on_start: Callable[[str, int], None] | None = None,
        capacity: int | None = None,
        term_timeout_s: float = 10.0,
    ) -> None:
        self._spawner: Spawner = spawner or ExecSpawner()
        self._command = command
        self._env = env or (lambda spec: child_env(spec.name, spec.env))
        self._on_output = on_output
        self._on_start = on_start
        self._capacity = capacity
        self._term_timeout_s = term_timeout_s
        self._lock = threading.Lock()
        self._procs: dict[str, _Proc] = {}
        self._watchers: list[Callable[[WorkerEvent], None]] = []
        self._closed = False
        # One long-lived spawning thread: the parent-death signal of a child
        # fires when the thread that forked it exits.
        self._spawn_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="local-backend-spawn"
        )

    # --- Backend ------------------------------------------------------------------

    def create(self, spec: WorkerSpec) -> None:
        """Spawn a worker.

        Raises:
            UnschedulableError: ``capacity`` workers are alive already.
            ElasticPSError: a live worker has that name, the backend is
                closed, or the process could not be started.
        """
        with self._lock:
            if self._closed:
                raise ElasticPSError("the local backend is closed")
            old = self._procs.get(spec.name)
            if old is not None and old.state in (WorkerState.PENDING, WorkerState.RUNNING):
                raise ElasticPSError(f"worker {spec.name} exists already")
            alive = sum(
                p.state in (WorkerState.PENDING, WorkerState.RUNNING) for p in self._procs.values()
            )
            if self._capacity is not None and alive >= self._capacity:
                raise UnschedulableError(
                    f"no capacity for {spec.name}: {alive} of {self._capacity} slots in use"
                )
        try:
            proc = self._spawn_thread.submit(self._start, spec).result()
        except OSError as exc:
            raise ElasticPSError(f"could not start {spec.name}: {exc}") from exc
        entry = _Proc(spec, proc, time.time())
        with self._lock:
            self._procs[spec.name] = entry
        if self._on_start is not None:
            self._on_start(spec.name, proc.pid)
        self._emit(entry)
        entry.reaper = threading.Thread(
            target=self._reap, args=(entry,), name=f"reap-{spec.name}", daemon=True
        )
        entry.reaper.start()

    def delete(self, name: str) -> None:
        """SIGTERM the worker now and SIGKILL it ``term_timeout_s`` later; no-op if gone."""
        with self._lock:
            entry = self._procs.get(name)
            if entry is None or entry.state not in (WorkerState.PENDING, WorkerState.RUNNING):
                return
            entry.deleting = True
        self._signal(entry, signal.SIGTERM)
        killer = threading.Timer(self._term_timeout_s, self._signal, (entry, signal.SIGKILL))
        killer.daemon = True
        entry.killer = killer
        killer.start()

    def list(self) -> list[WorkerEvent]:
        """The last known state of every worker ever created (latest per name)."""
        with self._lock:
            return [self._event(p) for p in self._procs.values()]

    def watch(self, on_event: Callable[[WorkerEvent], None]) -> Cancel:
        """Deliver every later state change to ``on_event`` (on a reaper or caller thread)."""
        with self._lock:
            self._watchers.append(on_event)

        def cancel() -> None:
            with self._lock:
                if on_event in self._watchers:
                    self._watchers.remove(on_event)

        return cancel

    # --- local extras --------------------------------------------------------------------

    def set_capacity(self, capacity: int | None) -> None:
        """Allow at most ``capacity`` live workers from now on (None: no limit)."""
        with self._lock:
            self._capacity = capacity

    def pids(self, role: Role | None = None) -> dict[str, int]:
        """Name -> pid of the live workers (of ``role``, if given), oldest first."""
        with self._lock:
            return {
                name: p.proc.pid
                for name, p in sorted(self._procs.items(), key=lambda kv: kv[1].created_at)
                if p.state is WorkerState.RUNNING and (role is None or p.spec.role is role)
            }

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every live worker (SIGTERM, then SIGKILL after ``timeout_s``) and wait for them.

        No create succeeds afterwards. Idempotent.
        """
        with self._lock:
            self._closed = True
            entries = list(self._procs.values())
        for entry in entries:
            with self._lock:
                entry.deleting = entry.deleting or entry.state is WorkerState.RUNNING
            self._signal(entry, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for entry in entries:
            try:
                entry.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(entry, signal.SIGKILL)
                entry.proc.wait()
        for entry in entries:
            if entry.reaper is not None:
                entry.reaper.join(timeout=5)
            if entry.killer is not None:
                entry.killer.cancel()
        self._spawn_thread.shutdown(wait=True)

    # --- internals ----------------------------------------------------------------------------

    def _start(self, spec: WorkerSpec) -> ProcessHandle:
        if self._command is None:
            return self._spawner.start([spec.role.value, *spec.args], self._env(spec))
        return popen_child(self._command(spec), self._env(spec))

    def _reap(self, entry: _Proc) -> None:
        stdout = entry.proc.stdout
        if stdout is not None:
            for raw in iter(stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                message = error_line(line)
                if message is not None:
                    entry.message = message  # its closing error line, for the policy
                if self._on_output is not None:
                    self._on_output(entry.spec.name, line)
            stdout.close()
        code = returncode_of(entry.proc, entry.proc.wait())  # ssh: 128+N is signal N
        if entry.killer is not None:
            entry.killer.cancel()
        with self._lock:
            entry.reason = f"exit {code}" if code >= 0 else f"signal {-code}"
            if entry.deleting:
                entry.state = WorkerState.DELETED
            elif code == 0:
                entry.state = WorkerState.SUCCEEDED
            else:
                entry.state = WorkerState.FAILED
        self._emit(entry)

    def _signal(self, entry: _Proc, signum: int) -> None:
        if entry.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                entry.proc.send_signal(signum)

    def _event(self, entry: _Proc) -> WorkerEvent:
        return WorkerEvent(
            name=entry.spec.name,
            role=entry.spec.role,
            index=entry.spec.index,
            state=entry.state,
            reason=entry.reason,
            created_at=entry.created_at,
            message=entry.message,
        )

    def _emit(self, entry: _Proc) -> None:
        with self._lock:
            event = self._event(entry)
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher(event)
