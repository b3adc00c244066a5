"""Log files: full records (tracebacks included) in a file, one line per record on stderr.

A local job writes its logs under ``OUTPUT/logs/``: ``launcher.log`` (the
launcher's own records, and a transcript of every line it shows on the
terminal) and one ``<role>.log`` per role process (``trainer-0.log``,
``ps-1.log``...). The launcher tells each role process its file in
``ELASTICPS_LOG_FILE``.

Once :func:`log_to_file` has run in a process, every log record goes in
full to that file, and the handlers that write to the terminal print it
without its traceback, ending in ``(traceback in FILE)`` instead. So a
user's terminal shows what happened, one line each, and the traceback
waits in the file for a bug report.

``elasticps --log-format json`` (or ``ELASTICPS_LOG_FORMAT=json``, which the
launchers pass to every role process, on every host) writes each record as
one JSON object a line, on the terminal and in the files
(:func:`use_json_logs`, through :mod:`pythonjsonlogger`): ``time`` (ISO 8601,
UTC), ``level``, ``logger``, ``message``, and the process's ``role``,
``index``, ``host`` and ``job``; a traceback is ``exc_info`` in the file, and
``traceback_in`` (the file) on the terminal.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO, Final

__all__ = [
    "DEFAULT_FORMAT",
    "LOG_FILE_ENV",
    "LOG_FORMATS",
    "LOG_FORMAT_ENV",
    "PROCESS_ENV",
    "JsonLineFormatter",
    "NonBlockingStream",
    "OneLineFormatter",
    "active_log_file",
    "environment_log_file",
    "file_only",
    "json_line",
    "log_to_file",
    "process_fields",
    "use_json_logs",
]

LOG_FILE_ENV: Final = "ELASTICPS_LOG_FILE"
"""The environment variable that names a role process's log file."""

DEFAULT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Record format when the process has no stderr handler to copy it from."""

LOG_FORMAT_ENV: Final = "ELASTICPS_LOG_FORMAT"
"""The environment variable of ``--log-format``: ``text`` or ``json``."""

LOG_FORMATS: Final = ("text", "json")
"""The choices of ``--log-format``."""

_JSON_RENAMES: Final = {"levelname": "level", "name": "logger"}


class JsonLineFormatter(logging.Formatter):
    """Formats a record as one JSON object (:class:`pythonjsonlogger.json.JsonFormatter`).

    Args:
        fields: added to every record (``role``, ``index``, ``host``, ``job``).
        log_file: the file holding the full records, for a terminal's
            formatter: a traceback is left out and named by ``traceback_in``.
            None: the traceback is kept, as ``exc_info``.
    """

    def __init__(self, fields: dict[str, object], log_file: Path | None = None) -> None:
        super().__init__()
        from pythonjsonlogger.json import JsonFormatter

        self.fields = dict(fields)
        self.log_file = log_file
        self._json = JsonFormatter(
            "{levelname}{name}{message}",
            style="{",
            timestamp="time",
            rename_fields=_JSON_RENAMES,
            static_fields=self.fields,
        )

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        if self.log_file is None or not (record.exc_info or record.exc_text or record.stack_info):
            return self._json.format(record)
        bare = logging.makeLogRecord(record.__dict__)
        bare.exc_info = bare.exc_text = bare.stack_info = None
        bare.traceback_in = str(self.log_file)
        return self._json.format(bare)


def json_line(message: str, fields: dict[str, object], *, level: str = "INFO") -> str:
    """``message`` as the JSON line a :class:`JsonLineFormatter` with ``fields`` writes
    (the launcher's own terminal lines, and a role's lines that are not JSON)."""
    record = logging.LogRecord(
        "elasticps", logging.getLevelName(level), "", 0, "%s", (message,), None
    )
    return JsonLineFormatter(fields).format(record)


PROCESS_ENV: Final = "ELASTICPS_PROCESS"
"""The launcher's name of a role process (``ps-1``, ``trainer-7``), set in its environment."""


def process_fields(role: str, job: str | None) -> dict[str, object]:
    """The fields of every JSON log line of this process: ``role``, ``index`` (from the
    launcher's name of it in ``ELASTICPS_PROCESS``, else None), ``host`` (this machine's
    name) and ``job`` (``job``, else ``ELASTICPS_JOB``, else None)."""
    name = os.environ.get(PROCESS_ENV, "")
    suffix = name.rpartition("-")[2]
    return {
        "role": role,
        "index": int(suffix) if suffix.isdigit() else None,
        "host": socket.gethostname(),
        "job": job or os.environ.get("ELASTICPS_JOB") or None,
    }


def use_json_logs(fields: dict[str, object]) -> None:
    """Format this process's terminal handlers as JSON lines with ``fields`` (see the
    module docstring); :func:`log_to_file` then writes its file as JSON too."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setFormatter(JsonLineFormatter(fields))


class OneLineFormatter(logging.Formatter):
    """Formats a record without its traceback or stack, naming the file that has them.

    Args:
        fmt: the record format.
        log_file: the file holding the full records.
    """

    def __init__(self, fmt: str, log_file: Path) -> None:
        super().__init__(fmt)
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        """The record on one line; `` (traceback in FILE)`` if it carried one."""
        if not (record.exc_info or record.exc_text or record.stack_info):
            return super().format(record)
        bare = logging.makeLogRecord(record.__dict__)
        bare.exc_info = None
        bare.exc_text = None
        bare.stack_info = None
        return f"{super().format(bare)} (traceback in {self.log_file})"


class _LogFileHandler(logging.FileHandler):
    """The handler :func:`log_to_file` installs (found again by :func:`active_log_file`).

    A record it cannot write (a full disk, say) is dropped without the
    traceback that :mod:`logging` would print on stderr; the first such
    failure is said once, in one line, on stderr.
    """

    _failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if not self._failed:
            self._failed = True
            with contextlib.suppress(OSError, ValueError):
                print(
                    f"elasticps: warning: cannot write the log file {self.baseFilename} "
                    "(records it cannot take are dropped)",
                    file=sys.stderr,
                    flush=True,
                )


def _format_of(handler: logging.Handler) -> str:
    formatter = handler.formatter
    fmt = getattr(formatter, "_fmt", None) if formatter is not None else None
    return fmt if isinstance(fmt, str) else DEFAULT_FORMAT


def log_to_file(path: Path) -> Path:
    """Send this process's log records to ``path`` in full, and to stderr without tracebacks.

    The file is appended to (a restarted role process continues its file).
    Handlers writing to a stream (stderr) keep their format but get a
    :class:`OneLineFormatter`. Calling it again with the same path does
    nothing.

    Args:
        path: the log file; its directory is created.

    Returns:
        ``path``.

    Raises:
        OSError: the file cannot be created.
    """
    root = logging.getLogger()
    if active_log_file() == path:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    streams = [
        h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    handler = _LogFileHandler(path, encoding="utf-8")
    json_fields = next(
        (h.formatter.fields for h in streams if isinstance(h.formatter, JsonLineFormatter)), None
    )
    if json_fields is not None:
        handler.setFormatter(JsonLineFormatter(json_fields))
        root.addHandler(handler)
        for stream in streams:
            stream.setFormatter(JsonLineFormatter(json_fields, log_file=path))
        return path
    fmt = _format_of(streams[0]) if streams else DEFAULT_FORMAT
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    for stream in streams:
        stream.setFormatter(OneLineFormatter(_format_of(stream), path))
    return path


def active_log_file() -> Path | None:
    """The file :func:`log_to_file` set up in this process, or None."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _LogFileHandler):
            return Path(handler.baseFilename)
    return None


def file_only(
    level: int,
    message: str,
    *,
    exc_info: BaseException | None = None,
    name: str = "elasticps",
) -> None:
    """Write one record to the log file only (not to the terminal); a no-op without a file.

    Args:
        level: a ``logging`` level.
        message: the message (not a format string).
        exc_info: an exception whose traceback goes with the record.
        name: the logger name shown in the record.
    """
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _LogFileHandler):
            info = (type(exc_info), exc_info, exc_info.__traceback__) if exc_info else None
            record = logging.LogRecord(name, level, __file__, 0, "%s", (message,), info)
            handler.handle(record)


def environment_log_file() -> Path | None:
    """The log file ``ELASTICPS_LOG_FILE`` names, or None."""
    value = os.environ.get(LOG_FILE_ENV, "")
    return Path(value) if value else None


class NonBlockingStream(io.TextIOBase):
    """A text stream whose writes never block the writing thread: one thread copies them out.

    The launcher writes its terminal lines from the threads that supervise the
    job. When the terminal, or the pipe that stands for it, stops reading, a
    plain write blocks as soon as the pipe's buffer is full (64 KiB on Linux),
    and supervision would stop with it: no dead host noticed, no PS restarted.
    Here a write is queued and returns at once; a daemon thread writes the
    queue to ``target`` in order. When ``max_queued`` writes are waiting, later
    ones are dropped and counted, and once ``target`` takes writes again a line
    says how many were lost (the log file keeps every record).

    Args:
        target: the stream written to (normally ``sys.stderr``).
        max_queued: how many writes may wait; at least 1.

    Raises:
        ValueError: ``max_queued`` < 1.
    """

    def __init__(self, target: IO[str], max_queued: int = 10_000) -> None:
        super().__init__()
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.target = target
        self._queue: queue.Queue[str] = queue.Queue(max_queued)
        self._lock = threading.Lock()
        self._dropped = 0
        self._thread = threading.Thread(target=self._copy, name="terminal-writer", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """How many writes were dropped so far because ``max_queued`` were waiting."""
        with self._lock:
            return self._dropped

    def write(self, text: str) -> int:
        """Queue ``text``; returns ``len(text)`` even when it is dropped."""
        if text:
            try:
                self._queue.put_nowait(text)
            except queue.Full:
                with self._lock:
                    self._dropped += 1
        return len(text)

    def flush(self) -> None:
        """Return at once: the writing thread flushes ``target`` after each write."""

    def writable(self) -> bool:
        """Always True."""
        return True

    def isatty(self) -> bool:
        """Whether ``target`` is a terminal."""
        return bool(getattr(self.target, "isatty", lambda: False)())

    def fileno(self) -> int:
        """``target``'s file descriptor (for terminal-size queries)."""
        return self.target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """``target``'s encoding."""
        return str(getattr(self.target, "encoding", None) or "utf-8")

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued write has reached ``target``, at most ``timeout_s`` seconds.

        Returns:
            Whether the queue emptied in time.
        """
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _copy(self) -> None:
        reported = 0
        while True:
            text = self._queue.get()
            try:
                with self._lock:
                    dropped = self._dropped
                if dropped > reported:
                    self.target.write(
                        f"elasticps: {dropped - reported} line(s) not shown here: nothing read "
                        "them in time (the log file has every record)\n"
                    )
                    reported = dropped
                self.target.write(text)
                self.target.flush()
            except (OSError, ValueError):
                pass  # a closed terminal: nothing to show it on
            finally:
                self._queue.task_done()
