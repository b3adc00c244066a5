"""Durable files: atomic replacement and content checksums (shared by every checkpoint writer).

:func:`write_atomic` writes to a temporary file in the same directory,
flushes and fsyncs it, renames it over the final name, and fsyncs the
directory, so a reader sees the old file or the new one, never a mix, and the
rename survives a power loss. :func:`content_crc32` is the CRC-32 that shard
and sparse-table files keep in their safetensors metadata.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["content_crc32", "write_atomic"]


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
