"""A job's event log: ``OUTPUT/events.jsonl``, written by its launcher as things happen.

One JSON object a line, appended and flushed as each event happens, so that a
reader (``elasticps dashboard``, ``elasticps report``) sees a running job's
faults without asking any of its processes, and a failed job's history
survives the launcher. Every object has ``at`` (seconds since the epoch, the
launcher's clock) and ``kind``:

- ``"decision"``: a supervision decision, the fields of
  :meth:`elasticps.launcher.supervisor.Decision.as_dict` (a process's exit or
  signal, and the restart, replacement or failure that followed);
- ``"chaos"``: a fault injected by ``--chaos`` or ``--random-chaos``, the
  record ``run.json``'s ``chaos`` holds (``action``, ``target``, ``pid``...);
- ``"evaluation"``: a pass's test evaluation (``pass``, ``metrics``);
- ``"pass"``: a pass sealed, its audit (``pass``, ``records_trained``...).

The file is a record, not a protocol: readers skip a line they cannot parse
(the last one, when the launcher died while writing it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

__all__ = ["EVENTS_FILE", "JobEvents", "read_events"]

log = logging.getLogger(__name__)

EVENTS_FILE: Final = "events.jsonl"
"""The event log's name in a job's output directory."""


class JobEvents:
    """Appends a job's events to ``OUTPUT/events.jsonl`` (thread-safe).

    The file is opened on the first event, so that a launcher can make one
    before its output directory is prepared. A write that fails is logged
    once and the log goes on without it: the job never fails for its record.

    Args:
        output: the job's local output directory.
    """

    def __init__(self, output: Path) -> None:
        self.path = output / EVENTS_FILE
        self._lock = threading.Lock()
        self._file: Any = None
        self._failed = False

    def append(self, kind: str, fields: Mapping[str, object], *, at: float | None = None) -> None:
        """Write one event: ``{"at": at, "kind": kind, **fields}`` (``at`` defaults to now,
        or to ``fields["at"]``)."""
        when = at if at is not None else fields.get("at", time.time())
        line = json.dumps({**fields, "at": when, "kind": kind}, default=str) + "\n"
        with self._lock:
            if self._failed:
                return
            try:
                if self._file is None:
                    self._file = self.path.open("a", encoding="utf-8")
                self._file.write(line)
                self._file.flush()
            except OSError as exc:
                self._failed = True
                log.warning("cannot write the job's event log %s: %s", self.path, exc)

    def close(self) -> None:
        """Close the file (a later :meth:`append` opens it again)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(output: Path) -> list[dict[str, Any]]:
    """Every event in ``output``'s event log, oldest first ([] when it has none).

    Lines that are not a JSON object with ``at`` and ``kind`` are skipped.
    """
    try:
        text = (output / EVENTS_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("at"), int | float) and "kind" in event:
            events.append(event)
    return events
