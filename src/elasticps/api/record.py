"""The run record of a job started from Python, for ``elasticps status`` and ``list``.

A job that :func:`elasticps.train` runs with ``Local(output=DIR)``, or that
:func:`elasticps.dist.dist_train` launches with ``output=DIR``, records
itself in ``DIR`` the way ``elasticps train --output DIR`` does (see
:mod:`elasticps.jobs`):

- ``DIR/.lock``: held by the calling process while the job runs
  (:class:`~elasticps.launcher.output.OutputLock`), so that a second job
  cannot use the same directory, and a job whose process died reads
  ``failed``;
- ``DIR/run.json``: ``state`` ``running`` (with the job's ``etcd`` once its
  servers are up, from which ``status`` reads the live progress), then
  ``finished``, ``failed`` or ``interrupted``, with the supervision policy's
  ``decisions`` (as :class:`~elasticps.errors.JobFailedError` carries them),
  the ``error`` and ``exit_code`` of a failed job, and ``wall_s``;
- an entry in the registry of runs (:func:`elasticps.jobs.register_run`).

``run.json``'s ``launcher`` names the caller (:data:`LAUNCHERS`). Such a job
has no clean stop from another terminal (``elasticps stop`` refuses it):
interrupting the calling process stops it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from elasticps.errors import ConfigError, JobFailedError, UserError, one_line
from elasticps.jobs import PYTHON_LAUNCHERS, register_run
from elasticps.launcher.output import OutputLock, check_output_location
from elasticps.pserver.atomic import write_atomic

__all__ = ["LAUNCHERS", "RunRecord"]

log = logging.getLogger(__name__)

LAUNCHERS: Final = PYTHON_LAUNCHERS
"""The ``launcher`` of a run record written by this module."""

Decisions = Callable[[], list[dict[str, object]]]


class RunRecord:
    """Record one job run from Python in its output directory (a context manager).

    Entering takes the directory's lock, registers the run and writes
    ``run.json`` with state ``running``; leaving writes the final state and
    releases the lock. An exception leaving the block is recorded, then
    propagates unchanged: :class:`~elasticps.errors.JobFailedError` and any
    other error as ``failed`` (exit code 1; 2 for a
    :class:`~elasticps.errors.UserError`), ``KeyboardInterrupt`` as
    ``interrupted``.

    Args:
        output: the output directory; created if missing.
        job: the job name (etcd prefix ``/elasticps/<job>/``).
        launcher: one of :data:`LAUNCHERS`.
        passes: the passes the job runs, for ``status``'s progress.

    Raises:
        ConfigError (on entering): ``output`` cannot be a writable directory, or
            it holds the run of ``elasticps train`` (a previous record of a
            job started from Python is replaced).
        OutputInUseError (on entering): another job holds ``output``.
    """

    def __init__(self, output: Path, job: str, launcher: str, *, passes: int | None = None) -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
        self.output = Path(output).resolve()
        self.job = job
        self.launcher = launcher
        self._passes = passes
        self._lock = OutputLock(self.output)
        self._etcd: str | None = None
        self._decisions: Decisions = list
        self._started = 0.0

    def __enter__(self) -> RunRecord:
        check_output_location(self.output)
        self._lock.acquire()
        try:
            self._check_previous()
            self._started = time.monotonic()
            register_run(self.output, self.job)
            self._write({"state": "running"})
        except BaseException:
            self._lock.release()
            raise
        return self

    def running(self, etcd: str, decisions: Decisions) -> None:
        """The job's servers are up: record its etcd, and where its decisions come from.

        Args:
            etcd: the job's etcd endpoint, ``host:port``.
            decisions: returns the supervision policy's decisions so far, as
                ``run.json`` lists them (e.g. ``LocalServers.decision_records``).
        """
        self._etcd = etcd
        self._decisions = decisions
        self._write({"state": "running", "etcd": etcd})

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._write(self._final(exc))
        except OSError as err:  # the job's own outcome matters more than its record
            log.warning("cannot write the run record %s: %s", self.output / "run.json", err)
        finally:
            self._lock.release()

    def _final(self, exc: BaseException | None) -> dict[str, Any]:
        decisions = self._decisions()
        if isinstance(exc, JobFailedError) and exc.decisions:
            decisions = list(exc.decisions)
        final: dict[str, Any] = {
            "wall_s": round(time.monotonic() - self._started, 3),
            "decisions": decisions,
        }
        if exc is None:
            return {"state": "finished", "exit_code": 0, **final}
        if isinstance(exc, KeyboardInterrupt):
            return {"state": "interrupted", "exit_code": 130, **final}
        exit_code = 2 if isinstance(exc, UserError) else 1
        return {"state": "failed", "error": one_line(exc), "exit_code": exit_code, **final}

    def _check_previous(self) -> None:
        path = self.output / "run.json"
        try:
            previous = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the previous run record {path}: {exc}") from None
        if not isinstance(previous, dict) or previous.get("launcher") not in LAUNCHERS:
            raise ConfigError(
                f"output {self.output} holds a run of `elasticps train` ({path}); "
                "choose another output directory"
            )

    def _write(self, fields: dict[str, Any]) -> None:
        record = {
            "job": self.job,
            "launcher": self.launcher,
            "etcd": self._etcd,
            **({"progress": {"passes": self._passes}} if self._passes is not None else {}),
            **fields,
        }
        write_atomic(self.output / "run.json", (json.dumps(record, indent=2) + "\n").encode())
