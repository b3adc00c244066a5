"""Checkpoints on disk: tensors as safetensors, metadata as a JSON manifest.

A checkpoint is a directory holding two files:

- ``model.safetensors``: the tensors (safetensors format, no pickle);
- ``manifest.json``: the caller's metadata (model version, shard map, task
  ledger revision, ...) plus the fields this module adds: ``format``,
  ``tensors_file``, ``crc32`` of the tensors file, ``parameters`` (name ->
  shape and dtype) and ``created_unix_s``.

Each file is written to a temporary file in the same directory, flushed and
fsynced, renamed over its final name with ``os.replace``, and then the
directory itself is fsynced so the rename survives a power loss. The manifest
is written last: it is the commit record, and its CRC and parameter list tie
it to exactly one tensors file, so a crash between the two renames is detected
on load rather than silently mixing two checkpoints.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from elasticps.errors import DataError, one_line
from elasticps.storage import Location

CHECKPOINT_FORMAT = "elasticps-checkpoint/1"
"""Value of the manifest's ``format`` field written by this version."""

TENSORS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"

RESERVED_FIELDS = frozenset({"format", "tensors_file", "crc32", "parameters", "created_unix_s"})
"""Manifest fields set by :func:`save_checkpoint`; caller values for them are replaced."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename.

    The caller fsyncs the directory afterwards.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(
    out_dir: Path | Location,
    tensors: Mapping[str, Tensor],
    manifest: Mapping[str, object],
) -> Path | Location:
    """Write a checkpoint durably and atomically (per file).

    Args:
        out_dir: checkpoint directory, or a storage URL (:mod:`elasticps.storage`);
            created if missing. Use one directory per checkpoint (e.g.
            ``ckpt/v000123``): an existing checkpoint in it is replaced. The
            tensors file is written first and the manifest last, each whole.
        tensors: name -> tensor, any dtype and device; written from CPU,
            contiguous copies. Tensors must not share storage.
        manifest: caller metadata; must be JSON-serialisable. The fields in
            :data:`RESERVED_FIELDS` are set by this function.

    Returns:
        The path of the written ``manifest.json`` (its URL, if remote).

    Raises:
        TypeError: ``manifest`` holds a value JSON cannot encode.
        OSError: the directory cannot be written.
    """
    where = Location.of(out_dir)
    where.makedirs()
    cpu = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    data = save_safetensors(cpu)
    record: dict[str, object] = dict(manifest)
    record.update(
        {
            "format": CHECKPOINT_FORMAT,
            "tensors_file": TENSORS_FILE,
            "crc32": zlib.crc32(data),
            "parameters": {
                name: {"shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype)}
                for name, tensor in cpu.items()
            },
            "created_unix_s": time.time(),
        }
    )
    # Encode before touching the disk, so a bad manifest leaves no partial checkpoint.
    manifest_bytes = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()

    if not where.is_local:
        (where / TENSORS_FILE).write_atomic(bytes(data))
        (where / MANIFEST_FILE).write_atomic(manifest_bytes)
        return where / MANIFEST_FILE
    out_dir = where.local_path
    manifest_path = out_dir / MANIFEST_FILE
    _write_atomic(out_dir / TENSORS_FILE, data)
    _write_atomic(manifest_path, manifest_bytes)
    _fsync_dir(out_dir)
    return manifest_path


def read_manifest(ckpt_dir: Path | Location) -> dict[str, object]:
    """Read and check the manifest of a checkpoint without reading its tensors.

    Args:
        ckpt_dir: a checkpoint directory written by :func:`save_checkpoint`.

    Returns:
        The manifest, including the fields :func:`save_checkpoint` adds.

    Raises:
        DataError: the directory or manifest is missing, the manifest is not
            valid JSON, or its format is not ``elasticps-checkpoint/1``.
    """
    ckpt_dir = Location.of(ckpt_dir)
    path = ckpt_dir / MANIFEST_FILE
    if not ckpt_dir.is_dir():
        raise DataError(f"checkpoint directory not found: {ckpt_dir}")
    if not path.is_file():
        raise DataError(f"checkpoint manifest not found: {path}")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read checkpoint manifest {path}: {one_line(exc)}") from exc
    if not isinstance(manifest, dict):
        raise DataError(f"checkpoint manifest {path} is not a JSON object")
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise DataError(
            f"checkpoint manifest {path} has format {manifest.get('format')!r}; "
            f"expected {CHECKPOINT_FORMAT!r}"
        )
    return manifest


def load_checkpoint(ckpt_dir: Path | Location) -> tuple[dict[str, Tensor], dict[str, object]]:
    """Read a checkpoint and verify it against its manifest.

    The tensors file is read once; its CRC-32 is checked against the manifest
    and the same bytes are then decoded with ``safetensors.torch.load``, so the
    verified bytes are the decoded bytes.

    Args:
        ckpt_dir: a checkpoint directory written by :func:`save_checkpoint`.

    Returns:
        ``(tensors, manifest)``: tensors on CPU keyed by name, and the full
        manifest.

    Raises:
        DataError: a file is missing or unreadable, the CRC-32 does not match,
            or the tensors in the file differ from the manifest's
            ``parameters`` (names, shapes or dtypes).
    """
    ckpt_dir = Location.of(ckpt_dir)
    manifest = read_manifest(ckpt_dir)

    tensors_file = manifest.get("tensors_file")
    if not isinstance(tensors_file, str) or Path(tensors_file).name != tensors_file:
        raise DataError(
            f"checkpoint manifest in {ckpt_dir} has an invalid tensors_file: {tensors_file!r}"
        )
    path = ckpt_dir / tensors_file
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read checkpoint tensors {path}: {exc.strerror or exc}") from exc
    crc = zlib.crc32(data)
    if crc != manifest.get("crc32"):
        raise DataError(
            f"checkpoint {path} is corrupt: CRC-32 {crc} does not match "
            f"the manifest's {manifest.get('crc32')}"
        )
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as exc:
        raise DataError(f"cannot decode checkpoint tensors {path}: {one_line(exc)}") from exc

    expected = manifest.get("parameters")
    if not isinstance(expected, dict):
        raise DataError(f"checkpoint manifest in {ckpt_dir} has no parameters table")
    if set(expected) != set(tensors):
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise DataError(
            f"checkpoint {path} does not match its manifest: "
            f"missing from file {missing[:5]}, not in manifest {extra[:5]}"
        )
    for name, tensor in tensors.items():
        entry = expected[name]
        actual = {"shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype)}
        if not isinstance(entry, dict) or {k: entry.get(k) for k in actual} != actual:
            raise DataError(
                f"checkpoint {path} does not match its manifest: tensor {name!r} is "
                f"{actual['dtype']} {actual['shape']}, manifest says {entry!r}"
            )
    return tensors, manifest
