"""Durable files: atomic replacement and content checksums (shared by every checkpoint writer).

:func:`write_atomic` writes to a temporary file in the same directory,
flushes and fsyncs it, renames it over the final name, and fsyncs the
directory, so a reader sees the old file or the new one, never a mix, and the
rename survives a power loss. :func:`content_crc32` is the CRC-32 that shard
and sparse-table files keep in their safetensors metadata.
:func:`read_private` reads a file that only its owner may read (a key, the
job secret).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from elasticps.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["content_crc32", "read_private", "write_atomic"]


def content_crc32(meta_json: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """CRC-32 of ``meta_json`` (UTF-8) then each tensor's bytes, tensors in name order."""
    import torch  # here: write_atomic's users (the launcher before torch loads) need no torch

    crc = zlib.crc32(meta_json.encode("utf-8"))
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy().data, crc)
    return crc


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


def read_private(path: Path, what: str, *, private: bool = True, limit: int = -1) -> bytes:
    """Read ``path``, refusing it, with ``private``, if others than its owner may use it.

    The mode is that of the file read (``fstat`` of the open file), not of a
    name that might be swapped in between.

    Args:
        path: the file.
        what: what it is, for the messages (``the job secret``, ``the TLS key``).
        private: refuse a file whose group or others have any permission.
        limit: read at most this many bytes; -1: all.

    Raises:
        ConfigError: the file cannot be read, or ``private`` and it is not mode 0600
            (or stricter).
    """
    path = Path(path)
    try:
        with path.open("rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            data = handle.read(limit)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{what} {path} is readable by others (mode {stat.filemode(mode)}); it must be 0600"
        )
    return data
