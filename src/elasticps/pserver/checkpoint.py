"""One shard's state on disk: a single safetensors file, written atomically.

A shard file holds the tensors of :meth:`ParameterShard.state
<elasticps.pserver.shard.ParameterShard.state>` (``values`` and the
element-wise optimizer state ``optim.*``, float32) and, in the safetensors
header's string metadata, two entries:

- ``elasticps``: the shard's metadata as JSON (``format``, ``layout``,
  ``fingerprint``, ``version``, ``mode``, ``optimizer``,
  ``optimizer_scalars``, ``created_unix_s``);
- ``crc32``: CRC-32 of the metadata JSON text followed by every tensor's raw
  bytes in name order (see :func:`content_crc32`).

The CRC lives inside the file rather than in a sidecar so that one
``os.replace`` commits a checkpoint: with two files a crash between the two
renames would leave a pair that fails its check, and a restarted server would
have nothing to load. The CRC covers the content, not the file bytes, so it
can be computed before the file is laid out.

Writes go to a temporary file in the same directory, which is flushed and
fsynced, renamed over the final name, and then the directory is fsynced so
the rename survives a power loss. There is no pickle anywhere.

The checkpoint directory may also be a storage URL (``s3://``, ``gs://``,
``hdfs://``; see :mod:`elasticps.storage`). A shard file is then one object,
uploaded whole (or written under a temporary name and renamed, on HDFS), so
it is still the single commit point: it is visible completely or not at all,
and a server killed mid-upload leaves the files before it usable. Sparse
tables are checkpointed to local or mounted directories only.

This module also keeps a parameter server's own checkpoint files
(:class:`ShardFiles`) and runs its periodic checkpoints
(:class:`ShardCheckpointer`).

Sparse tables. A shard that holds sparse embedding tables keeps them beside
its file, in a directory of the same name with ``.tables`` for
``.safetensors`` (:func:`tables_dir_of`), as row-chunked part files
(:mod:`elasticps.pserver.sparse_checkpoint`), never as one tensor. They are
written first and the shard file last, so the shard file stays the one
commit point; its metadata lists the tables (``sparse_tables``), and a load
reads them back into the state it returns.

Fencing and lineage. A server's files are named after the slot epoch it
holds and the version they save, ``ps-<index>/shard-e<epoch>-v<version>.safetensors``,
and are never overwritten. A server that restarts (a new epoch) loads the
newest file of the highest epoch below its own, and first links it under its
own epoch, so that its own lineage is complete on disk. A deposed server
that has not noticed yet (partitioned from etcd) can only add files of its
old epoch, which no successor ever prefers to its own: it can neither
overwrite nor outrank its successor's files. Files of another job run (the
``run_id`` in their metadata) are never loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from elasticps import metrics
from elasticps.errors import DataError, one_line
from elasticps.pserver.atomic import content_crc32
from elasticps.pserver.shard import COVERAGE_KEY, SPARSE_STATE_KEY, VALUES_KEY, ParameterShard
from elasticps.pserver.sparse_checkpoint import load_tables_state, save_tables_state
from elasticps.pserver.sparse_shard import TablesState
from elasticps.storage import Location

log = logging.getLogger(__name__)

SHARD_FORMAT: Final = "elasticps-shard/1"
"""Value of the metadata's ``format`` field written by this version."""

SHARD_FILE: Final = "shard.safetensors"
"""Name of a parameter server's own checkpoint, under ``<checkpoint_dir>/ps-<index>/``."""

_META_KEY: Final = "elasticps"
_CRC_KEY: Final = "crc32"


@dataclass(frozen=True)
class SavedShard:
    """What :func:`save_shard` wrote.

    Attributes:
        path: the file (a ``Location`` if remote).
        crc32: CRC-32 of the whole file's bytes (for manifests).
        nbytes: size of the file in bytes.
        version: the model version saved.
    """

    path: Path | Location
    crc32: int
    nbytes: int
    version: int


def shard_checkpoint_path(checkpoint_dir: Path, index: int) -> Path:
    """``<checkpoint_dir>/ps-<index>/shard.safetensors``: the single file of older versions."""
    return Path(checkpoint_dir) / f"ps-{index}" / SHARD_FILE


def tables_dir_of(path: Path | Location) -> Path:
    """Where the sparse tables of shard file ``path`` live: ``<stem>.tables`` beside it.

    Raises:
        ConfigError: ``path`` is not on the local file system (sparse tables are
            checkpointed to a local or mounted directory only).
    """
    path = path.local_path if isinstance(path, Location) else Path(path)
    return path.with_name(path.name.removesuffix(".safetensors") + ".tables")


def _save_tables(path: Location, meta: Mapping[str, object]) -> None:
    """Write the tables of a shard state beside its file ``path`` (before the file itself).

    Raises:
        OSError: the tables cannot be written, or ``path`` is remote (sparse
            tables are checkpointed to local or mounted directories only).
    """
    state = meta.get(SPARSE_STATE_KEY)
    if isinstance(state, TablesState):
        if not path.is_local:
            raise OSError(
                f"sparse tables are checkpointed to a local or mounted directory only, not {path}"
            )
        save_tables_state(tables_dir_of(path.local_path), state)


def _load_tables(path: Location, meta: dict[str, object]) -> None:
    """Read back the tables the shard file ``path`` names into ``meta``.

    Raises:
        DataError: a table the file names is missing or corrupt.
    """
    names = meta.get("sparse_tables")
    if not isinstance(names, dict) or not names:
        return
    if not path.is_local:
        raise DataError(f"{path}: sparse tables cannot be read from remote storage")
    state = load_tables_state([tables_dir_of(path.local_path)], [str(n) for n in names])
    missing = sorted(set(map(str, names)) - set(state.metas))
    if missing:
        raise DataError(f"{path}: its sparse tables {', '.join(missing)} are missing")
    meta[SPARSE_STATE_KEY] = state


def _plain(location: Location) -> Path | Location:
    """A local location as a ``Path`` (what callers had before URLs), a remote one as it is."""
    return location.local_path if location.is_local else location


def encode_shard(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> bytes:
    """Encode a shard state as the bytes of a shard file.

    Args:
        tensors: name -> CPU tensor, as from ``ParameterShard.state()``.
        meta: JSON-ready metadata, as from ``ParameterShard.state()``;
            ``format`` and ``created_unix_s`` are added.

    Raises:
        TypeError: ``meta`` holds a value JSON cannot encode.
    """
    record = dict(meta)
    record.pop(SPARSE_STATE_KEY, None)  # written apart, as row chunks
    record["format"] = SHARD_FORMAT
    record.setdefault("created_unix_s", time.time())
    meta_json = json.dumps(record, sort_keys=True, separators=(",", ":"))
    cpu = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    crc = content_crc32(meta_json, cpu)
    return bytes(save_safetensors(cpu, metadata={_META_KEY: meta_json, _CRC_KEY: str(crc)}))


def save_shard(
    path: Path | Location, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]
) -> SavedShard:
    """Write a shard state to ``path`` atomically and durably.

    Args:
        path: the file to (re)place, local or remote (:mod:`elasticps.storage`);
            a local directory is created if missing.
        tensors: as from ``ParameterShard.state()``.
        meta: as from ``ParameterShard.state()``; must hold ``version``.
            Sparse tables in it are written to :func:`tables_dir_of` first.

    Returns:
        The path, CRC-32 and size of the file, and the version saved.

    Raises:
        TypeError: ``meta`` is not JSON-serialisable.
        OSError: the file cannot be written.
    """
    where = Location.of(path)
    _save_tables(where, meta)
    data = encode_shard(tensors, meta)
    where.write_atomic(data)
    version = meta.get("version")
    return SavedShard(
        _plain(where), zlib.crc32(data), len(data), version if isinstance(version, int) else 0
    )


def decode_shard(data: bytes, where: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Decode and verify the bytes of a shard file.

    Args:
        data: the file's bytes.
        where: the file's name, for error messages.

    Returns:
        ``(tensors, meta)`` as accepted by ``ParameterShard.from_state``.

    Raises:
        DataError: the bytes are not a shard file, the CRC-32 does not
            match, or the metadata or tensor sizes are inconsistent. The
            message is one line.
    """
    try:
        tensors = load_safetensors(data)
        meta_text, crc_text = _read_metadata(data)
    except (SafetensorError, ValueError, KeyError, OSError) as exc:
        raise DataError(f"shard checkpoint {where} is unreadable: {one_line(exc)}") from exc
    if meta_text is None or crc_text is None:
        raise DataError(f"shard checkpoint {where} has no elasticps metadata")
    crc = content_crc32(meta_text, tensors)
    if str(crc) != crc_text:
        raise DataError(
            f"shard checkpoint {where} is corrupt: CRC-32 {crc} does not match the recorded "
            f"{crc_text}"
        )
    try:
        meta = json.loads(meta_text)
    except ValueError as exc:  # unreachable unless the CRC collides
        raise DataError(f"shard checkpoint {where} has invalid metadata JSON") from exc
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"shard checkpoint {where} has format {got!r}, expected {SHARD_FORMAT!r}")
    _check_consistent(meta, tensors, where)
    return tensors, meta


def load_shard(path: Path | Location) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Read and verify a shard file written by :func:`save_shard`.

    Returns:
        ``(tensors, meta)`` as accepted by ``ParameterShard.from_state``
        (with the sparse tables saved beside the file, if it names any).

    Raises:
        DataError: the file is missing or unreadable, or fails verification
            (see :func:`decode_shard`), or its sparse tables are missing or
            corrupt. The message is one line.
    """
    where = Location.of(path)
    try:
        data = where.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read shard checkpoint {where}: {exc.strerror or exc}") from exc
    tensors, meta = decode_shard(data, str(where))
    _load_tables(where, meta)
    return tensors, meta


def _read_metadata(data: bytes) -> tuple[str | None, str | None]:
    """The ``elasticps`` and ``crc32`` entries of a safetensors header's metadata."""
    if len(data) < 8:
        raise ValueError("file is shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError("safetensors header length exceeds the file")
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("safetensors __metadata__ is not an object")
    meta_text = metadata.get(_META_KEY)
    crc_text = metadata.get(_CRC_KEY)
    return (
        meta_text if isinstance(meta_text, str) else None,
        crc_text if isinstance(crc_text, str) else None,
    )


def _check_consistent(
    meta: dict[str, object], tensors: Mapping[str, torch.Tensor], where: str
) -> None:
    layout = meta.get("layout")
    if not isinstance(layout, dict) or not isinstance(meta.get("fingerprint"), str):
        raise DataError(f"shard checkpoint {where} lacks its layout or fingerprint")
    numel = layout.get("numel")
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise DataError(f"shard checkpoint {where} has an invalid layout numel {numel!r}")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise DataError(f"shard checkpoint {where} has an invalid version {version!r}")
    if VALUES_KEY not in tensors:
        raise DataError(f"shard checkpoint {where} has no {VALUES_KEY!r} tensor")
    for name, tensor in tensors.items():
        if name == COVERAGE_KEY:
            if tensor.dtype != torch.int64 or tensor.dim() != 2 or tensor.shape[1] != 4:
                raise DataError(f"shard checkpoint {where}: malformed {COVERAGE_KEY!r} tensor")
            continue
        if tensor.dtype != torch.float32 or tensor.numel() != numel:
            raise DataError(
                f"shard checkpoint {where}: tensor {name!r} is {tensor.dtype} with "
                f"{tensor.numel()} elements, expected float32 with {numel}"
            )


# --- one slot's own files ---------------------------------------------------------------

_FILE_RE = re.compile(r"shard-e(\d{12})-v(\d{12})\.safetensors")

KEEP_CHECKPOINTS = 3
"""How many of its newest checkpoint files a parameter server keeps."""


class ShardFiles:
    """The checkpoint files of one parameter-server slot, for one job run and one epoch.

    Files live in ``<checkpoint_dir>/ps-<index>/`` (a local directory or a
    storage URL, see :mod:`elasticps.storage`) and are named
    ``shard-e<epoch>-v<version>.safetensors`` (zero-padded, so names sort by
    epoch then version). See the module docstring for why.

    Args:
        checkpoint_dir: the job's checkpoint directory, a path or a URL.
        index: the slot index.
        epoch: the slot epoch this server holds (> 0; 0 without etcd).
        run_id: the job run the files belong to; files of other runs are
            ignored. Empty: any run.
        keep: newest files of this epoch to keep, >= 2 (a sync job rolls back
            to a version every shard has saved).
        may_write: checked before every write; False refuses (the server's
            lease is not known to be valid: a successor may hold the slot).

    Raises:
        ValueError: ``keep`` < 2.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path | Location,
        index: int,
        epoch: int,
        run_id: str = "",
        *,
        keep: int = KEEP_CHECKPOINTS,
        may_write: Callable[[], bool] = lambda: True,
    ) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2, got {keep}")
        self.directory = Location.of(checkpoint_dir) / f"ps-{index}"
        self.index = index
        self.epoch = epoch
        self.run_id = run_id
        self._keep = keep
        self._may_write = may_write
        self._lock = threading.Lock()

    def path_of(self, version: int, epoch: int | None = None) -> Location:
        """The file of ``version`` under ``epoch`` (default: this server's)."""
        e = self.epoch if epoch is None else epoch
        return self.directory / f"shard-e{e:012d}-v{version:012d}.safetensors"

    def _listing(self) -> list[tuple[int, int, Location]]:
        """``(epoch, version, path)`` of every checkpoint file here, newest first.

        Raises:
            OSError: the directory cannot be listed (remote storage unreachable).
        """
        out = []
        for name in self.directory.listdir():
            m = _FILE_RE.fullmatch(name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), self.directory / name))
        return sorted(out, reverse=True)

    def durable_versions(self) -> list[int]:
        """Versions saved under this server's epoch, newest first."""
        return [v for e, v, _ in self._listing() if e == self.epoch]

    def save(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, object],
        *,
        prune: bool = True,
    ) -> SavedShard | None:
        """Write a new checkpoint file (never overwriting one), then prune old ones.

        Args:
            tensors: as from ``ParameterShard.state()``.
            meta: as from ``ParameterShard.state()``; must hold ``version``.
            prune: remove the files beyond the newest ``keep`` now. False
                leaves it to a later :meth:`prune` (a caller that answers
                first: removing a file takes about a millisecond).

        Returns:
            What was written, or None if writing is not allowed now.

        Raises:
            OSError: the file cannot be written (a full disk, say); the
                previous files are untouched.
            TypeError: ``meta`` is not JSON-serialisable.
        """
        record = {**meta, "epoch": self.epoch, "run_id": self.run_id}
        version = record.get("version")
        if not isinstance(version, int):
            raise TypeError("shard meta needs an integer 'version'")
        started = time.monotonic()
        with self._lock:
            if not self._may_write():
                return None
            data = encode_shard(tensors, record)
            if not self._may_write():
                return None
            path = self.path_of(version)
            _save_tables(path, meta)
            path.write_atomic(data)
            if prune:
                self._prune()
        shard = str(self.index)
        metrics.PS_CHECKPOINT_SECONDS.labels(shard).observe(time.monotonic() - started)
        metrics.PS_CHECKPOINT_BYTES.labels(shard).set(len(data))
        return SavedShard(_plain(path), zlib.crc32(data), len(data), version)

    def prune(self) -> None:
        """Remove this epoch's files beyond the newest ``keep``, and older epochs'
        files once ``keep`` of this epoch exist (see :meth:`save`).

        Raises:
            OSError: the directory cannot be listed (remote storage unreachable).
        """
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        # Caller holds self._lock. Keep the newest `keep` of our epoch; older
        # epochs' files stay until we have `keep` of our own (we may still
        # need to fall back to them).
        listing = self._listing()
        ours = [p for e, _, p in listing if e == self.epoch]
        for path in ours[self._keep :]:
            with contextlib.suppress(OSError):
                path.remove()
        if len(ours) >= self._keep:
            for e, _, path in listing:
                if e < self.epoch:
                    with contextlib.suppress(OSError):
                        path.remove()
        if not self.directory.is_local:
            return  # sparse tables are never written there
        # Tables directories whose shard file is gone (pruned, or a save that died).
        directory = self.directory.local_path
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                if entry.name.endswith(".tables") and not os.path.exists(
                    directory / (entry.name.removesuffix(".tables") + ".safetensors")
                ):
                    shutil.rmtree(entry.path, ignore_errors=True)

    def load_version(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """Load this epoch's checkpoint of ``version``.

        Raises:
            DataError: there is none, or it fails verification.
        """
        path = self.path_of(version)
        if not path.exists():
            raise DataError(
                f"parameter server {self.index} has no checkpoint of version {version} "
                f"(it has {self.durable_versions()})"
            )
        return self._load(path)

    def _load(self, path: Location) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        tensors, meta = load_shard(path)
        if self.run_id and meta.get("run_id") != self.run_id:
            raise DataError(
                f"{path} belongs to job run {meta.get('run_id')!r}, not {self.run_id!r}"
            )
        layout = meta.get("layout")
        if not isinstance(layout, dict) or layout.get("shard") != self.index:
            got = layout.get("shard") if isinstance(layout, dict) else None
            raise DataError(f"{path} holds the shard of parameter server {got!r}, not {self.index}")
        return tensors, meta

    def restore(self) -> tuple[dict[str, torch.Tensor], dict[str, object], list[str]] | None:
        """Load the newest good checkpoint of an earlier epoch, and adopt it as ours.

        Files are tried newest first by (epoch, version), among those of
        earlier epochs than this server's. A file that fails verification,
        or belongs to another run, is skipped with a reason. The one loaded
        is hard-linked (copied where links are impossible, and on remote
        storage) under this server's epoch before it is used.

        Returns:
            ``(tensors, meta, skipped)`` with a line per skipped file, or
            None if no file could be loaded (``skipped`` is then lost; call
            :meth:`skipped_files` for the reasons).

        Raises:
            OSError: the adopted copy cannot be written.
        """
        self._skipped: list[str] = []
        self._restored_from: str | None = None
        for epoch, version, path in self._listing():
            if epoch >= self.epoch and self.epoch:
                continue
            try:
                tensors, meta = self._load(path)
            except DataError as exc:
                self._skipped.append(str(exc))
                continue
            if self.epoch:
                target = self.path_of(version)
                if not target.exists():
                    if path.is_local:
                        _adopt_tables(
                            tables_dir_of(path.local_path), tables_dir_of(target.local_path)
                        )
                    path.copy_to(target)
                    if self.directory.is_local:
                        dir_fd = os.open(self.directory.local_path, os.O_RDONLY)
                        try:
                            os.fsync(dir_fd)
                        finally:
                            os.close(dir_fd)

            self._restored_from = path.name
            return tensors, meta, list(self._skipped)
        return None

    def skipped_files(self) -> list[str]:
        """Why each file passed over by the last :meth:`restore` was skipped."""
        return list(getattr(self, "_skipped", []))

    @property
    def restored_from(self) -> str | None:
        """The name of the file the last :meth:`restore` loaded (None: none, or not called)."""
        return getattr(self, "_restored_from", None)

    def spoil_newest(self, count: int, how: str) -> list[str]:
        """Damage this slot's ``count`` newest checkpoint files, of any epoch (fault injection).

        For tests and ``--chaos damage|drop``: call it only while no server
        holds the slot. ``"damage"`` flips 64 bytes in the middle of each
        file (the CRC-32 check then refuses it, as it would after bit rot or
        a torn write); ``"drop"`` deletes the files (a checkpoint deleted,
        or one that was never finished).

        Returns:
            The names of the files damaged or deleted, newest first.

        Raises:
            ValueError: ``how`` is neither ``"damage"`` nor ``"drop"``, or ``count`` < 1.
            OSError: a file cannot be read, written or deleted.
        """
        if how not in ("damage", "drop") or count < 1:
            raise ValueError(f"spoil_newest needs damage or drop and count >= 1, got {how} {count}")
        spoiled = []
        for _, _, path in self._listing()[:count]:
            if how == "drop":
                path.remove()
            else:
                data = bytearray(path.read_bytes())
                middle = max(0, len(data) // 2 - 32)
                for i in range(middle, min(len(data), middle + 64)):
                    data[i] ^= 0xFF
                path.write_atomic(bytes(data))
            spoiled.append(path.name)
        return spoiled


def _adopt_tables(source: Path, target: Path) -> None:
    """Hard-link (or copy) a shard file's tables directory under a new name, before the file."""
    if not source.is_dir():
        return
    shutil.rmtree(target, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)


# --- periodic checkpoints ------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointHealth:
    """Whether a parameter server's checkpoints are being written.

    Attributes:
        failing_since_unix_s: wall-clock time of the first failed write since
            the last success, or None while writes succeed.
        error: the last failure, one line, or "".
        failures: failed writes since the last success.
        saved_version: the version of the last successful save, or None.
    """

    failing_since_unix_s: float | None
    error: str
    failures: int
    saved_version: int | None

    @property
    def ok(self) -> bool:
        """Whether the last write succeeded (or none failed yet)."""
        return self.failing_since_unix_s is None


class ShardCheckpointer:
    """Saves a parameter server's shard now and then, from a daemon thread.

    A save is due every ``every_s`` seconds if the version moved since the
    last save, and as soon as the version is ``every_versions`` past it (if
    ``every_versions`` > 0). The shard's state is copied under its lock (a
    short pause for pushes) and written outside it, so pushes never wait for
    the disk. A failed write is logged loudly, recorded in :attr:`health`
    (reported through ``on_health``) and retried at the next due time.

    Args:
        files: where to write (:class:`ShardFiles`).
        get_shard: returns the shard, or None while it is not initialized.
        every_s: seconds between time-based saves, > 0.
        every_versions: save once the version moved this far; 0 disables.
        saved_version: the version already on disk (a server that restored
            from it), or None.
        on_health: called with the new :class:`CheckpointHealth` whenever a
            write fails, or succeeds after failing.
    """

    def __init__(
        self,
        files: ShardFiles,
        get_shard: Callable[[], ParameterShard | None],
        *,
        every_s: float,
        every_versions: int = 0,
        saved_version: int | None = None,
        on_health: Callable[[CheckpointHealth], None] | None = None,
    ) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        if every_versions < 0:
            raise ValueError(f"every_versions must be >= 0, got {every_versions}")
        self.files = files
        self._get_shard = get_shard
        self._every_s = every_s
        self._every_versions = every_versions
        self._saved_version = saved_version
        self._on_health = on_health
        self._failing_since: float | None = None
        self._failures = 0
        self._error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def saved_version(self) -> int | None:
        """The version of the last successful save (or the one given at start)."""
        with self._lock:
            return self._saved_version

    @property
    def health(self) -> CheckpointHealth:
        """Whether writes succeed, and since when they fail."""
        with self._lock:
            return CheckpointHealth(
                self._failing_since, self._error, self._failures, self._saved_version
            )

    def start(self) -> None:
        """Start the background thread."""
        self._thread = threading.Thread(target=self._run, name="ps-checkpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, waiting for a save in progress to finish. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def save_now(self) -> SavedShard | None:
        """Save the shard now if it exists and writing is allowed.

        Returns:
            What was written, or None if there was no shard or writing is not allowed.

        Raises:
            OSError: the file cannot be written (also recorded in :attr:`health`).
        """
        with self._lock:
            shard = self._get_shard()
            if shard is None:
                return None
            tensors, meta = shard.state()
            try:
                saved = self.files.save(tensors, meta)
            except OSError as exc:
                self._record_failure(exc)
                raise
            if saved is None:
                return None
            recovered = self._failing_since is not None
            self._saved_version = saved.version
            self._failing_since, self._failures, self._error = None, 0, ""
            health = CheckpointHealth(None, "", 0, saved.version)
        if recovered:
            log.warning("checkpoints of the shard are written again (version %d)", saved.version)
            if self._on_health is not None:
                self._on_health(health)
        log.debug("checkpointed shard version %d to %s", saved.version, saved.path)
        return saved

    def _record_failure(self, exc: OSError) -> None:
        # Caller holds self._lock.
        if self._failing_since is None:
            self._failing_since = time.time()
        self._failures += 1
        self._error = f"{exc.strerror or exc} ({self.files.directory})"
        health = CheckpointHealth(
            self._failing_since, self._error, self._failures, self._saved_version
        )
        if self._on_health is not None:
            self._on_health(health)

    def _due(self, shard: ParameterShard, time_due: bool) -> bool:
        version = shard.version
        saved = self.saved_version
        if self._every_versions and version - (saved or 0) >= self._every_versions:
            return True
        # Nothing on disk yet: save on time even if no step was taken.
        return time_due and (saved is None or version != saved)

    def _run(self) -> None:
        poll_s = min(self._every_s, 0.05) if self._every_versions else self._every_s
        next_due = time.monotonic() + self._every_s
        while not self._stop.wait(max(0.0, min(poll_s, next_due - time.monotonic()))):
            shard = self._get_shard()
            now = time.monotonic()
            time_due = now >= next_due
            if shard is None or not self._due(shard, time_due):
                if time_due:
                    next_due = now + self._every_s
                continue
            try:
                self.save_now()
            except (OSError, ValueError, TypeError) as exc:
                log.error(
                    "CHECKPOINT FAILED for the shard in %s: %s; training goes on, but updates "
                    "since version %s are not on stable storage; retrying in %g s",
                    self.files.directory, exc, self.saved_version, self._every_s,
                )  # fmt: skip
            next_due = time.monotonic() + self._every_s
