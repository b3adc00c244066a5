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

This module also runs the periodic checkpoints of a parameter server
(:class:`ShardCheckpointer`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
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

from elasticps.errors import DataError
from elasticps.pserver.shard import VALUES_KEY, ParameterShard

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
        path: the file.
        crc32: CRC-32 of the whole file's bytes (for manifests).
        nbytes: size of the file in bytes.
        version: the model version saved.
    """

    path: Path
    crc32: int
    nbytes: int
    version: int


def shard_checkpoint_path(checkpoint_dir: Path, index: int) -> Path:
    """``<checkpoint_dir>/ps-<index>/shard.safetensors``: where PS ``index`` keeps its state."""
    return Path(checkpoint_dir) / f"ps-{index}" / SHARD_FILE


def content_crc32(meta_json: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """CRC-32 of ``meta_json`` (UTF-8) then each tensor's bytes, tensors in name order."""
    crc = zlib.crc32(meta_json.encode("utf-8"))
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy().data, crc)
    return crc


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
    record["format"] = SHARD_FORMAT
    record.setdefault("created_unix_s", time.time())
    meta_json = json.dumps(record, sort_keys=True, separators=(",", ":"))
    cpu = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    crc = content_crc32(meta_json, cpu)
    return bytes(save_safetensors(cpu, metadata={_META_KEY: meta_json, _CRC_KEY: str(crc)}))


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` durably: temp file, fsync, ``os.replace``, fsync dir.

    A reader sees the old file or the new one, never a mix. The directory
    is created if missing.

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_shard(
    path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]
) -> SavedShard:
    """Write a shard state to ``path`` atomically and durably.

    Args:
        path: the file to (re)place; its directory is created if missing.
        tensors: as from ``ParameterShard.state()``.
        meta: as from ``ParameterShard.state()``; must hold ``version``.

    Returns:
        The path, CRC-32 and size of the file, and the version saved.

    Raises:
        TypeError: ``meta`` is not JSON-serialisable.
        OSError: the file cannot be written.
    """
    data = encode_shard(tensors, meta)
    write_atomic(Path(path), data)
    version = meta.get("version")
    return SavedShard(
        Path(path), zlib.crc32(data), len(data), version if isinstance(version, int) else 0
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
        raise DataError(f"shard checkpoint {where} is unreadable: {_one_line(exc)}") from exc
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


def load_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Read and verify a shard file written by :func:`save_shard`.

    Returns:
        ``(tensors, meta)`` as accepted by ``ParameterShard.from_state``.

    Raises:
        DataError: the file is missing or unreadable, or fails verification
            (see :func:`decode_shard`). The message is one line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read shard checkpoint {path}: {exc.strerror or exc}") from exc
    return decode_shard(data, str(path))


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
        if tensor.dtype != torch.float32 or tensor.numel() != numel:
            raise DataError(
                f"shard checkpoint {where}: tensor {name!r} is {tensor.dtype} with "
                f"{tensor.numel()} elements, expected float32 with {numel}"
            )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --- periodic checkpoints ------------------------------------------------------------


class ShardCheckpointer:
    """Saves a parameter server's shard now and then, from a daemon thread.

    A save is due every ``every_s`` seconds if the version moved since the
    last save, and as soon as the version is ``every_versions`` past it (if
    ``every_versions`` > 0). The shard's state is copied under its lock (a
    short pause for pushes) and written outside it, so pushes never wait for
    the disk. A failed write is logged and retried at the next due time.

    Args:
        path: the file to keep up to date.
        get_shard: returns the shard, or None while it is not initialized.
        every_s: seconds between time-based saves, > 0.
        every_versions: save once the version moved this far; 0 disables.
        may_write: checked before every write; False stops writing (the
            server lost its lease: another server may own the file now).
        saved_version: the version already in ``path`` (a server that
            restored from it), or None.
    """

    def __init__(
        self,
        path: Path,
        get_shard: Callable[[], ParameterShard | None],
        *,
        every_s: float,
        every_versions: int = 0,
        may_write: Callable[[], bool] = lambda: True,
        saved_version: int | None = None,
    ) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        if every_versions < 0:
            raise ValueError(f"every_versions must be >= 0, got {every_versions}")
        self.path = Path(path)
        self._get_shard = get_shard
        self._every_s = every_s
        self._every_versions = every_versions
        self._may_write = may_write
        self._saved_version = saved_version
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def saved_version(self) -> int | None:
        """The version of the last successful save (or the one given at start)."""
        with self._lock:
            return self._saved_version

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
            OSError: the file cannot be written.
        """
        with self._lock:
            shard = self._get_shard()
            if shard is None or not self._may_write():
                return None
            tensors, meta = shard.state()
            if not self._may_write():
                return None
            saved = save_shard(self.path, tensors, meta)
            self._saved_version = saved.version
        log.debug("checkpointed shard version %d to %s", saved.version, self.path)
        return saved

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
            if not self._may_write():
                return
            try:
                self.save_now()
            except (OSError, ValueError, TypeError):
                log.exception("checkpoint of the shard to %s failed; retrying later", self.path)
            next_due = time.monotonic() + self._every_s
