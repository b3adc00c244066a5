"""A local job's output directory: checks before launch, the job's lock, a previous run.

The local launcher writes everything a job produces under ``--output``: the
parameter servers' periodic checkpoints (``ps-checkpoints/``), the final
consistent checkpoint (``snapshot/``), ``model.safetensors`` with its
``manifest.json``, ``run.json``, ``pids.json`` and the logs (``logs/``).
Before it starts anything it checks, here, that:

- the directory exists or can be created (no file on its path) and is writable;
- no other job uses it: the launcher holds an ``fcntl.flock`` on
  ``OUTPUT/.lock`` (:class:`OutputLock`) for the job's whole life; the kernel
  drops it when the launcher exits in any way, SIGKILL included, so a lock
  is never left behind;
- it holds no previous run's state (:func:`previous_run_files`), unless the
  user asked to replace it (``--overwrite``) or to resume (``--resume``);
- its file system has room for the checkpoints the job will write
  (:func:`checkpoint_bytes_estimate`), sparse tables included
  (:func:`table_checkpoint_bytes`).

Every failure is a one-line :class:`~elasticps.errors.UserError`.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from elasticps.config import OptimizerConfig
from elasticps.errors import ConfigError, OutputInUseError
from elasticps.storage import Location

if TYPE_CHECKING:
    from elasticps.pserver.sparse import TableSpec

__all__ = [
    "CHECKPOINT_COPIES",
    "LOCK_FILE",
    "PREVIOUS_RUN_FILES",
    "RUN_FILES",
    "SPACE_MARGIN_BYTES",
    "STOP_FILE",
    "OutputLock",
    "check_free_space",
    "check_output_location",
    "checkpoint_bytes_estimate",
    "optimizer_state_tensors",
    "previous_run_files",
    "remote_run_files",
    "remove_previous_run",
    "remove_remote_run",
    "table_checkpoint_bytes",
]

LOCK_FILE: Final = ".lock"
"""The lock file in the output directory; it holds the holder's host, pid and start time."""

STOP_FILE: Final = ".stop"
"""Created in a running job's output directory by ``elasticps stop``: the launcher then
ends the job cleanly (a final checkpoint and ``run.json`` with state ``stopped``)."""

PREVIOUS_RUN_FILES: Final = (
    "run.json",
    "manifest.json",
    "model.safetensors",
    "snapshot",
    "ps-checkpoints",
)
"""Entries whose presence means the directory holds a previous run's state."""

RUN_FILES: Final = (
    *PREVIOUS_RUN_FILES, "pids.json", "logs", "config.toml", "latest", "models",
    "events.jsonl", "report.html",
)  # fmt: skip
"""Everything a job writes in its output directory (``--overwrite`` removes these, nothing else)."""

CHECKPOINT_COPIES: Final = 3
"""Copies of the model (with its optimizer state) a job keeps on disk at once: the
parameter servers' checkpoints, the final snapshot, and ``model.safetensors``
(which has no optimizer state, but a PS checkpoint is rewritten through a
temporary file that is as large for a moment)."""

SPACE_MARGIN_BYTES: Final = 16 << 20
"""Added to the estimate: safetensors headers, manifests, run.json and logs, bytes."""


# --- location --------------------------------------------------------------------------------


def check_output_location(output: Path) -> None:
    """Check that ``output`` is a writable directory, or can be created as one.

    Args:
        output: the ``--output`` directory.

    Raises:
        ConfigError: a file is on its path, or the directory (or the nearest
            existing one above it, where it would be created) is not writable.
    """
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--output {output} is a file, not a directory")
    existing = path
    while not existing.exists():
        parent = existing.parent
        if parent == existing:
            break
        existing = parent
    if not existing.is_dir():
        raise ConfigError(f"cannot create --output {output}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "--output" if existing == path else f"cannot create --output {output}:"
        raise ConfigError(f"{what} {existing} is not writable")


# --- free space ------------------------------------------------------------------------------


def optimizer_state_tensors(optimizer: OptimizerConfig) -> int:
    """Optimizer state tensors per parameter, each as large as the parameter.

    SGD 0 (1 with a non-zero ``momentum`` option), momentum 1
    (``momentum_buffer``), Adam and AdamW 2 (``exp_avg``, ``exp_avg_sq``; 3
    with ``amsgrad``), AdaGrad 1 (``sum``). For another ``torch.optim``
    class the number is not known beforehand, and 2 is assumed.
    """
    options: dict[str, object] = {}
    if optimizer.options:
        with contextlib.suppress(ValueError):
            parsed = json.loads(optimizer.options)
            if isinstance(parsed, dict):
                options = parsed
    if optimizer.name == "sgd":
        return 1 if options.get("momentum") else 0
    if optimizer.name in ("momentum", "adagrad"):
        return 1
    if optimizer.name == "adam":
        return 3 if options.get("amsgrad") else 2
    return 2


_ROW_OVERHEAD_BYTES: Final = 8 + 3 * 8
"""Bytes a sparse table's checkpoint stores per row besides its values and optimizer
slots: the int64 id and three int64 counters (count, created and last version)."""


def table_checkpoint_bytes(tables: Iterable[TableSpec], state_tensors: int) -> int:
    """Bytes one checkpoint of a model's sparse tables takes at most.

    Each stored row takes its int64 id, its ``dim`` float32 values,
    ``state_tensors`` optimizer slots of ``dim`` float32 each and three int64
    counters: ``32 + 4 x dim x (1 + state_tensors)`` bytes. A fixed table
    counts all its ``num_embeddings`` rows (rows never updated are not
    stored, so this bounds it from above). A hashed table has no size to
    count: it grows with the keys it meets, and adds nothing here.

    Args:
        tables: the model's tables (:func:`elasticps.nn.table_specs`).
        state_tensors: optimizer slots per row, as per dense parameter
            (:func:`optimizer_state_tensors`; the lazy rules keep the same
            slots as their dense counterparts).

    Returns:
        Bytes.
    """
    return sum(
        t.num_embeddings * (_ROW_OVERHEAD_BYTES + 4 * t.dim * (1 + state_tensors))
        for t in tables
        if t.num_embeddings is not None
    )


def checkpoint_bytes_estimate(num_parameters: int, state_tensors: int, table_bytes: int = 0) -> int:
    """Bytes of checkpoints a job writes into its output directory (an estimate).

    (``num_parameters`` x 4 bytes (float32) x (1 + ``state_tensors``) +
    ``table_bytes``) x :data:`CHECKPOINT_COPIES`, plus
    :data:`SPACE_MARGIN_BYTES`: the sparse tables are kept in as many copies
    as the dense parameters (beside each server checkpoint and the final
    snapshot's shard files).

    Args:
        num_parameters: elements over all of the model's parameters.
        state_tensors: optimizer state tensors per parameter
            (:func:`optimizer_state_tensors`).
        table_bytes: one checkpoint of the sparse tables, bytes
            (:func:`table_checkpoint_bytes`).

    Returns:
        The estimate, bytes.
    """
    dense = num_parameters * 4 * (1 + state_tensors)
    return (dense + table_bytes) * CHECKPOINT_COPIES + SPACE_MARGIN_BYTES


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_free_space(
    output: Path, needed_bytes: int, *, free_bytes: Callable[[Path], int] = _free_bytes
) -> None:
    """Check that the file system of ``output`` has ``needed_bytes`` free.

    Args:
        output: the output directory (it must exist).
        needed_bytes: from :func:`checkpoint_bytes_estimate`.
        free_bytes: bytes free on the file system of a path (tests inject it).

    Raises:
        ConfigError: less is free; the message gives both figures.
    """
    free = free_bytes(output)
    if free < needed_bytes:
        raise ConfigError(
            f"not enough free space for --output {output}: the job writes about "
            f"{_mib(needed_bytes)} of checkpoints, {_mib(free)} is free"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


# --- previous runs ---------------------------------------------------------------------------


def previous_run_files(output: Path) -> list[str]:
    """The entries of :data:`PREVIOUS_RUN_FILES` present in ``output``, in that order."""
    return [name for name in PREVIOUS_RUN_FILES if (Path(output) / name).exists()]


def remove_previous_run(output: Path, *, keep: Path | None = None) -> list[str]:
    """Remove the files a previous job left in ``output`` (:data:`RUN_FILES` only).

    Nothing else in the directory is touched, and neither is the lock file.

    Args:
        output: the output directory.
        keep: a path to leave in place, with everything above it (the
            ``--resume`` directory, when it is ``OUTPUT/snapshot``).

    Returns:
        The names removed.

    Raises:
        ConfigError: an entry cannot be removed.
    """
    removed = []
    kept = Path(keep).resolve() if keep is not None else None
    for name in RUN_FILES:
        path = Path(output) / name
        if not path.exists() and not path.is_symlink():
            continue
        resolved = path.resolve()
        if kept is not None and (kept == resolved or resolved in kept.parents):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            raise ConfigError(f"cannot remove {path} of the previous run: {exc}") from exc
        removed.append(name)
    return removed


def remote_run_files(output: Location) -> list[str]:
    """The entries of :data:`PREVIOUS_RUN_FILES` present under a storage URL, in that order.

    Raises:
        ConfigError: the storage cannot be reached.
    """
    try:
        present = set(output.listdir())
    except OSError as exc:
        raise ConfigError(f"cannot reach --output {output}: {exc}") from exc
    return [name for name in PREVIOUS_RUN_FILES if name in present]


def remove_remote_run(output: Location, *, keep: str | Path | None = None) -> list[str]:
    """Remove the files a previous job left under a storage URL (:data:`RUN_FILES` only).

    Args:
        output: the ``--output`` URL.
        keep: a location to leave in place, with everything above it (the
            ``--resume`` checkpoint, when it is ``OUTPUT/snapshot``).

    Returns:
        The names removed.

    Raises:
        ConfigError: the storage cannot be reached, or an entry cannot be removed.
    """
    kept = None if keep is None else Location.of(keep).url.rstrip("/") + "/"
    removed: list[str] = []
    try:
        present = set(output.listdir())
    except OSError as exc:
        raise ConfigError(f"cannot reach --output {output}: {exc}") from exc
    for name in RUN_FILES:
        if name not in present:
            continue
        entry = output / name
        if kept is not None and kept.startswith(entry.url + "/"):
            continue
        try:
            if entry.is_dir():
                entry.remove_tree()
            else:
                entry.remove()
        except OSError as exc:
            raise ConfigError(f"cannot remove {entry} of the previous run: {exc}") from exc
        removed.append(name)
    return removed


# --- the lock --------------------------------------------------------------------------------


class OutputLock:
    """An exclusive ``fcntl.flock`` on ``OUTPUT/.lock``, held by the launcher process.

    The kernel releases it when the file is closed, or when the process ends
    in any way (SIGKILL included): a dead job never leaves its lock behind.
    The file is never deleted (deleting a lock file another process has open
    would let two processes lock two different files); it keeps the last
    holder's host, pid and start time, for the error message of the next job
    that finds it held. The descriptor is not inherited by child processes.

    Args:
        output: the output directory; created if missing.
    """

    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self.path = self.output / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock without waiting, and write this process's identity into it.

        Raises:
            OutputInUseError: another process holds it; the message names its
                host, pid and start time.
            ConfigError: the directory or the lock file cannot be created.
        """
        try:
            self.output.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot create the lock file {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"cannot lock {self.path}: {exc}") from exc
            raise OutputInUseError(
                f"--output {self.output} is in use by another job ({self._holder()}); "
                "wait for it to end, or choose another --output"
            ) from None
        started = time.time()
        when = datetime.datetime.fromtimestamp(started).astimezone()
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_unix_s": round(started, 3),
            "started": when.isoformat("T", "seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Release the lock (closing the file); a no-op if it is not held."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _holder(self) -> str:
        """Who holds the lock, as its file says (the holder writes it right after locking)."""
        deadline = time.monotonic() + 1.0
        while True:
            try:
                info = json.loads(self.path.read_text())
                return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
            except (OSError, ValueError, KeyError, TypeError):
                if time.monotonic() > deadline:
                    return "its holder did not record itself"
                time.sleep(0.05)  # it is writing its identity right now

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
