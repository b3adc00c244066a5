"""Consistent checkpoints of every parameter server, and resuming from them.

A consistent checkpoint is a directory holding one shard file per parameter
server (``shard-<index>.safetensors``, see :mod:`elasticps.pserver.checkpoint`)
and a ``manifest.json`` that ties them together. The coordinator
(:func:`take_consistent_checkpoint`) talks to each server over the tensor
plane with ``CONTROL`` frames:

1. ``{"op": "freeze"}`` on every server: each stops between two steps, and
   pushes wait. In sync mode, a server stopped with a half-collected step
   (one shard had applied step k and another not yet) is sent
   ``{"op": "freeze", "finish_round": true}``: it runs until that round
   completes and stops right after it, so every shard holds the same steps.
2. ``{"op": "snapshot", "dir": ...}`` on every server, in parallel: each
   writes its shard file and answers its CRC-32, size, version and layout.
3. ``{"op": "thaw"}`` on every server (always, even after a failure; a
   server also thaws by itself when the coordinator's connection drops).
4. The manifest is written last, atomically: it is the commit record.

A shard file records its layout as pieces ``(name, param_start, param_end)``,
so :func:`load_consistent_checkpoint` rebuilds every parameter *by name*, and
:func:`shard_state_for_layout` cuts them again for any other layout. That is
what lets a job resume on a different number of parameter servers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, NamedTuple

import torch

from elasticps.errors import (
    AuthenticationError,
    DataError,
    ProtocolError,
    RemoteError,
    ServiceUnavailableError,
)
from elasticps.placement import PAGE_NUMEL, even_split, page_split
from elasticps.pserver.checkpoint import decode_shard
from elasticps.pserver.shard import OPTIM_PREFIX, VALUES_KEY
from elasticps.security import JobSecret, secret_or_env
from elasticps.storage import Location
from elasticps.tls import JobTLS, is_refusal, tls_from_env
from elasticps.wire.auth import client_handshake
from elasticps.wire.frame import (
    HEADER_SIZE,
    ConnectionClosedError,
    MsgType,
    decode_error,
    recv_header,
    recv_json,
    send_json,
)

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT: Final = "elasticps-snapshot/1"
"""Value of the manifest's ``format`` field written by this version."""

MANIFEST_FILE: Final = "manifest.json"

#: Seconds a sync laggard may take to reach the version the others froze at.
DEFAULT_CATCH_UP_TIMEOUT_S: Final = 30.0


def shard_file_name(index: int, version: int | None = None) -> str:
    """Name of shard ``index``'s file in a consistent checkpoint.

    On disk it is ``shard-<index>.safetensors``, replaced in place. In a
    checkpoint at a storage URL the name carries the model ``version``
    (``shard-<index>-v<version>.safetensors``), so that a new checkpoint never
    overwrites a file the previous manifest lists: until the new manifest is
    written, the previous checkpoint stays whole (see
    :func:`take_consistent_checkpoint`).
    """
    if version is None:
        return f"shard-{index}.safetensors"
    return f"shard-{index}-v{version:012d}.safetensors"


# --- a tiny control client -------------------------------------------------------------


class ControlClient:
    """One connection to a parameter server for ``CONTROL`` requests only.

    Args:
        address: ``host:port`` of the server.
        timeout_s: connect timeout and default reply deadline, seconds.
        epoch: the slot epoch the server must hold (the server refuses the
            request otherwise); 0 for any.
        secret: the job secret the connection proves (:mod:`elasticps.wire.auth`);
            None: this process's (:func:`~elasticps.security.secret_from_env`).
        tls: the connection's TLS setup (:mod:`elasticps.tls`); None: this
            process's (:func:`~elasticps.tls.tls_from_env`).

    Raises:
        ServiceUnavailableError: the server cannot be reached.
        AuthenticationError: the server and this client disagree on the job secret,
            or one refused the other's certificate.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        epoch: int = 0,
        secret: JobSecret | None = None,
        tls: JobTLS | None = None,
    ) -> None:
        self.address = address
        self.epoch = epoch
        self._timeout_s = timeout_s
        self._scratch = bytearray(HEADER_SIZE)
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad address {address!r}, expected host:port")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise ServiceUnavailableError(
                f"cannot connect to parameter server at {address}: {exc}"
            ) from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        job_secret = secret_or_env(secret)
        job_tls = tls if tls is not None else tls_from_env()
        key = None if job_secret is None else job_secret.tensor_plane_key()
        try:
            if job_tls is not None:
                self._sock = job_tls.wrap_client(self._sock, "ps", timeout_s)
            # Any epoch here: a server of another epoch answers the first request
            # with ERROR wrong_epoch, which callers expect.
            client_handshake(self._sock, key, 0, timeout_s=timeout_s)
        except AuthenticationError as exc:
            self._sock.close()
            raise AuthenticationError(exc.reason, f"parameter server at {address}: {exc}") from exc
        except OSError as exc:
            self._sock.close()
            if is_refusal(exc):
                raise AuthenticationError("tls", f"parameter server at {address}: {exc}") from exc
            raise ServiceUnavailableError(
                f"parameter server at {address}: handshake failed: {exc}"
            ) from exc

    def request(
        self, body: Mapping[str, object], *, timeout_s: float | None = None
    ) -> dict[str, object]:
        """Send one ``CONTROL`` frame and return the ``CONTROL_OK`` answer.

        Raises:
            RemoteError: the server answered ERROR.
            ServiceUnavailableError: the connection broke or the reply was late.
            ProtocolError: the server answered another frame type.
        """
        try:
            self._sock.settimeout(self._timeout_s if timeout_s is None else timeout_s)
            send_json(self._sock, MsgType.CONTROL, body, epoch=self.epoch)
            header = recv_header(self._sock, self._scratch, max_body_bytes=0)
            answer = recv_json(self._sock, header)
        except (OSError, ConnectionClosedError) as exc:  # TimeoutError included
            raise ServiceUnavailableError(
                f"parameter server at {self.address} did not answer {body.get('op')!r}: {exc}"
            ) from exc
        if header.msg_type is MsgType.ERROR:
            raise decode_error(answer)
        if header.msg_type is not MsgType.CONTROL_OK:
            raise ProtocolError(
                f"parameter server at {self.address} answered {header.msg_type.name} to CONTROL"
            )
        return answer

    def interrupt(self) -> None:
        """Make a request blocked on this connection fail at once (from another thread)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection (a server thaws a freeze this connection held)."""
        with contextlib.suppress(OSError):
            self._sock.close()


# --- taking a checkpoint -------------------------------------------------------------------


def take_consistent_checkpoint(
    addresses: Sequence[str],
    out_dir: Path | Location,
    *,
    ledger_revision: int | None,
    extra: Mapping[str, object],
    timeout_s: float = 60.0,
    catch_up_timeout_s: float = DEFAULT_CATCH_UP_TIMEOUT_S,
    while_frozen: Callable[[Sequence[ControlClient]], Mapping[str, object]] | None = None,
) -> dict[str, object]:
    """Freeze every parameter server, snapshot each shard, thaw, write the manifest.

    The servers write their files themselves, so ``out_dir`` must be the
    same place for them as for the caller: one machine, a shared file
    system, or a storage URL (``s3://``, ``gs://``, ``hdfs://``; see
    :mod:`elasticps.storage`). Each shard file is written whole or not at
    all, and the manifest last. At a URL the shard files are new objects
    named after the version (:func:`shard_file_name`), and those of the
    previous checkpoint are deleted only once the new manifest is written,
    so a crash mid-checkpoint leaves the previous one whole.

    Args:
        addresses: ``host:port`` of server ``i`` at index ``i``.
        out_dir: the checkpoint directory or URL; created if missing. Shard
            files and ``manifest.json`` in it are replaced.
        ledger_revision: etcd revision of the task ledger this checkpoint goes
            with, recorded in the manifest (None if unknown).
        extra: more JSON-ready fields, recorded under ``"extra"``.
        timeout_s: deadline of each request (a snapshot writes a file), seconds.
        catch_up_timeout_s: sync mode: how long a shard may take to reach
            the version the others froze at.
        while_frozen: called with the servers' clients (index ``i`` at ``i``)
            after the snapshots, before the thaw; what it returns joins
            ``extra`` (a stream's trained offsets, from what the servers hold).

    Returns:
        The manifest written to ``out_dir/manifest.json``.

    Raises:
        ServiceUnavailableError: a server cannot be reached or did not answer.
        RemoteError: a server refused (for example a freeze timed out).
        DataError: the servers could not be brought to one version (sync).
        OSError: the manifest cannot be written.
    """
    if not addresses:
        raise ValueError("no parameter server to checkpoint")
    out_dir = Location.of(out_dir).resolve()
    out_dir.makedirs()
    clients: list[ControlClient] = []
    frozen: list[ControlClient] = []
    snaps: dict[int, dict[str, object]] = {}
    try:
        for address in addresses:
            clients.append(ControlClient(address, timeout_s=timeout_s))
        freezes = []
        for client in clients:
            frozen.append(client)
            freezes.append(client.request({"op": "freeze"}))
        freezes = _align_sync_versions(clients, freezes, catch_up_timeout_s)
        todo = [i for i, f in enumerate(freezes) if f.get("initialized")]
        if not todo:
            raise DataError("no parameter server holds parameters yet; nothing to checkpoint")
        request = {"op": "snapshot", "dir": str(out_dir)}
        with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix="snapshot") as pool:
            futures = {i: pool.submit(clients[i].request, request) for i in todo}
            snaps = {i: f.result() for i, f in futures.items()}
        if while_frozen is not None:
            extra = {**extra, **while_frozen(clients)}
    finally:
        for client in frozen:
            try:
                client.request({"op": "thaw"})
            except Exception as exc:  # the server also thaws when we close
                log.warning("thawing parameter server at %s failed: %s", client.address, exc)
        for client in clients:
            client.close()
    entries = [
        _shard_entry(i, address, freeze, snaps.get(i))
        for i, (address, freeze) in enumerate(zip(addresses, freezes, strict=True))
    ]
    manifest = build_manifest(entries, ledger_revision=ledger_revision, extra=extra)
    write_manifest(out_dir, manifest)
    if not out_dir.is_local:
        _remove_unlisted_shards(out_dir, manifest)
    log.info("consistent checkpoint of %d shards at version %s in %s", len(entries),
             manifest["version"], out_dir)  # fmt: skip
    return manifest


def _remove_unlisted_shards(out_dir: Location, manifest: Mapping[str, object]) -> None:
    """Delete the shard files of earlier checkpoints in ``out_dir`` (after the new manifest).

    A failure is logged: the files are only stale, never read.
    """
    shards = manifest.get("shards")
    listed = {
        e.get("file") for e in (shards if isinstance(shards, list) else []) if isinstance(e, dict)
    }
    try:
        for name in out_dir.listdir():
            if name.startswith("shard-") and name.endswith(".safetensors") and name not in listed:
                (out_dir / name).remove()
    except OSError as exc:
        log.warning("cannot remove the previous checkpoint's files in %s: %s", out_dir, exc)


def shards_mid_step(freezes: Sequence[Mapping[str, object]]) -> list[int]:
    """Which frozen shards must first finish their open sync round (pure).

    In sync mode every trainer pushes each step to every shard at once, so a
    shard frozen with a half-collected step (``open_round`` > 0: some
    trainers' pushes for it are in, others are on their way) may be one step
    behind shards that already applied it. Such a shard runs on until that
    round completes. Versions alone cannot tell this, because a shard
    restored from its periodic checkpoint keeps its own version count; and
    the round may close without a step (when only idle trainers' empty
    pushes joined it and the others left), so the version is no target
    either. In async mode every push is applied on arrival and nothing is
    half-done.

    Args:
        freezes: the ``freeze`` answers, in server order (``initialized``,
            ``mode``, ``open_round``).

    Returns:
        The indices of the shards mid-step; empty if none (or not every
        initialized shard runs in sync mode).
    """
    live = {i: f for i, f in enumerate(freezes) if f.get("initialized")}
    if not live or not all(f.get("mode") == "sync" for f in live.values()):
        return []
    return [i for i, f in live.items() if _int(f.get("open_round", 0), "open_round") > 0]


def _align_sync_versions(
    clients: Sequence[ControlClient],
    freezes: list[dict[str, object]],
    timeout_s: float,
) -> list[dict[str, object]]:
    """Let the shards :func:`shards_mid_step` names finish their round, then freeze."""
    out = list(freezes)
    for i in shards_mid_step(freezes):
        client = clients[i]
        try:
            out[i] = client.request(
                {"op": "freeze", "finish_round": True, "timeout_s": timeout_s},
                timeout_s=timeout_s + 10.0,
            )
        except RemoteError as exc:
            if exc.code != "freeze_timeout":
                raise
            # A trainer died mid-step and the step can only complete once its
            # lease expires; take the checkpoint without that step, and say so.
            log.warning("parameter server %d: open step not applied in time: %s", i, exc)
            out[i] = {**client.request({"op": "freeze"}), "incomplete_step": True}
            continue
        log.info("parameter server %d finished its open round: version %s", i, out[i]["version"])
    return out


def _shard_entry(
    index: int,
    address: str,
    freeze: Mapping[str, object],
    snap: Mapping[str, object] | None,
) -> dict[str, object]:
    if snap is None:
        return {"index": index, "address": address, "initialized": False, "version": None,
                "file": None, "crc32": None, "bytes": 0, "numel": 0, "pieces": [],
                "mode": freeze.get("mode"), "optimizer": None}  # fmt: skip
    layout = snap.get("layout")
    if not isinstance(layout, dict):
        raise ProtocolError(f"parameter server {index} sent a snapshot answer without a layout")
    return {
        "index": index,
        "address": address,
        "initialized": True,
        "version": _int(snap.get("version"), "version"),
        "file": snap.get("file"),
        "crc32": _int(snap.get("crc32"), "crc32"),
        "bytes": _int(snap.get("bytes"), "bytes"),
        "numel": layout.get("numel"),
        "pieces": layout.get("pieces", []),
        "mode": snap.get("mode", freeze.get("mode")),
        "optimizer": snap.get("optimizer"),
        "incomplete_step": bool(freeze.get("incomplete_step", False)),
    }


def build_manifest(
    shards: Sequence[Mapping[str, object]],
    *,
    ledger_revision: int | None,
    extra: Mapping[str, object],
    created_unix_s: float | None = None,
) -> dict[str, object]:
    """The manifest of a consistent checkpoint (pure).

    Args:
        shards: one entry per server, in index order: ``index``, ``address``,
            ``initialized``, ``version``, ``file``, ``crc32``, ``bytes``,
            ``numel``, ``pieces`` (``[name, param_start, param_end]``),
            ``mode`` and ``optimizer`` (the config as a dict).
        ledger_revision: the task ledger's etcd revision, or None.
        extra: recorded under ``"extra"``.
        created_unix_s: creation time; now if None.

    Returns:
        ``{"format", "created_unix_s", "version" (max over shards), "versions"
        (per shard, None if not initialized), "num_ps", "mode", "optimizer"
        (None if the shards disagree), "parameters" (name -> numel),
        "ledger_revision", "complete_steps", "shards", "extra"}``.

    Raises:
        DataError: the pieces do not tile each parameter exactly.
    """
    versions = [s.get("version") for s in shards]
    known = [v for v in versions if isinstance(v, int)]
    initialized = [s for s in shards if s.get("initialized")]
    modes = {s.get("mode") for s in initialized}
    optimizers = {json.dumps(s.get("optimizer"), sort_keys=True) for s in initialized}
    pieces = [(str(p[0]), int(p[1]), int(p[2])) for s in initialized for p in _pieces(s)]
    return {
        "format": SNAPSHOT_FORMAT,
        "created_unix_s": time.time() if created_unix_s is None else created_unix_s,
        "version": max(known) if known else 0,
        "versions": versions,
        "num_ps": len(shards),
        "mode": modes.pop() if len(modes) == 1 else None,
        "optimizer": json.loads(optimizers.pop()) if len(optimizers) == 1 else None,
        "parameters": _parameter_sizes(pieces),
        "ledger_revision": ledger_revision,
        # False when a sync step was half-collected on some shard at freeze
        # time and did not complete in time (a trainer died mid-step).
        "complete_steps": not any(s.get("incomplete_step") for s in shards),
        "shards": [dict(s) for s in shards],
        "extra": dict(extra),
    }


def write_manifest(out_dir: Path | Location, manifest: Mapping[str, object]) -> Location:
    """Write ``out_dir/manifest.json`` atomically and durably; return its location.

    Raises:
        OSError: it cannot be written (a previous manifest is untouched).
    """
    path = Location.of(out_dir) / MANIFEST_FILE
    path.write_atomic((json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return path


# --- loading a checkpoint --------------------------------------------------------------------


class ConsistentCheckpoint(NamedTuple):
    """A consistent checkpoint, parameters reassembled by name.

    Attributes:
        values: parameter name -> float32 ``[numel]`` (the flattened parameter).
        optimizer_state: parameter name -> state key -> tensor: element-wise
            state (``exp_avg``...) float32 ``[numel]``, scalars (``step``) as
            0-d tensors. Empty if the shards ran different optimizers.
        meta: the manifest.
    """

    values: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, object]


def read_snapshot_manifest(ckpt_dir: Path | Location) -> dict[str, object]:
    """Read and check a consistent checkpoint's manifest (a directory or a URL).

    Raises:
        DataError: missing, not JSON, or not ``elasticps-snapshot/1``.
    """
    path = Location.of(ckpt_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise DataError(f"no consistent checkpoint in {ckpt_dir}: {path} not found") from exc
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read checkpoint manifest {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != SNAPSHOT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path} has format {got!r}, expected {SNAPSHOT_FORMAT!r}")
    if not isinstance(manifest.get("shards"), list):
        raise DataError(f"{path} has no shards list")
    return manifest


def verify_snapshot_files(
    ckpt_dir: Path | Location, *, chunk_bytes: int = 1 << 20
) -> dict[str, object]:
    """Check a consistent checkpoint's shard files against its manifest, without decoding them.

    Every shard file the manifest lists must exist with the recorded size
    and CRC-32 (read in chunks of ``chunk_bytes``; the tensors are not
    decoded). :func:`load_consistent_checkpoint` checks the same and more;
    this is the cheap check a launcher runs before it starts anything.

    Args:
        ckpt_dir: a directory (or URL) written by :func:`take_consistent_checkpoint`.
        chunk_bytes: read size, bytes.

    Returns:
        The manifest.

    Raises:
        DataError: the manifest is missing or malformed, lists no shard
            holding parameters, or a shard file is missing, has another size
            or another CRC-32. The message is one line naming the file.
    """
    ckpt_dir = Location.of(ckpt_dir)
    manifest = read_snapshot_manifest(ckpt_dir)
    shards = manifest["shards"]
    assert isinstance(shards, list)  # checked by read_snapshot_manifest
    entries = [e for e in shards if isinstance(e, dict) and e.get("initialized")]
    if not entries:
        raise DataError(f"{ckpt_dir / MANIFEST_FILE} lists no shard holding parameters")
    for entry in entries:
        name = entry.get("file")
        if not isinstance(name, str) or Path(name).name != name:
            raise DataError(f"{ckpt_dir}: shard {entry.get('index')} has an invalid file {name!r}")
        path = ckpt_dir / name
        crc, size = 0, 0
        try:
            with path.open_input() as f:
                while chunk := f.read(chunk_bytes):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
        except OSError as exc:
            raise DataError(f"cannot read shard file {path}: {exc.strerror or exc}") from exc
        if size != entry.get("bytes"):
            raise DataError(
                f"shard file {path} has {size:,} bytes, the manifest says {entry.get('bytes')!r}: "
                "it is truncated or was replaced"
            )
        if crc != entry.get("crc32"):
            raise DataError(
                f"shard file {path} is corrupt: its CRC-32 is {crc}, "
                f"the manifest says {entry.get('crc32')!r}"
            )
    return manifest


def load_consistent_checkpoint(ckpt_dir: Path | Location) -> ConsistentCheckpoint:
    """Read a consistent checkpoint and rebuild every parameter by name.

    Every shard file is checked against the manifest's CRC-32 and size (and
    its own embedded CRC), and its layout against the manifest's pieces.

    Args:
        ckpt_dir: a directory (or URL) written by :func:`take_consistent_checkpoint`.

    Returns:
        ``(values, optimizer_state, meta)``; see :class:`ConsistentCheckpoint`.
        A scalar state (Adam's ``step``) of a parameter split over shards is
        the largest among them (they are equal in sync mode).

    Raises:
        DataError: a file is missing or corrupt, or the pieces do not tile
            each parameter exactly. The message is one line.
    """
    ckpt_dir = Location.of(ckpt_dir)
    manifest = read_snapshot_manifest(ckpt_dir)
    # name -> [(param_start, param_end, source tensors, source offset, source scalars)]
    parts: dict[str, list[tuple[int, int, dict[str, torch.Tensor], int, dict[str, object]]]] = {}
    opt_names: set[object] = set()
    shards = manifest["shards"]
    assert isinstance(shards, list)  # checked by read_snapshot_manifest
    for entry in shards:
        if not isinstance(entry, dict) or not entry.get("initialized"):
            continue
        tensors, meta = _load_entry(ckpt_dir, entry)
        optimizer = meta.get("optimizer")
        opt_names.add(optimizer.get("name") if isinstance(optimizer, dict) else None)
        scalars = meta.get("optimizer_scalars")
        offset = 0
        for name, lo, hi in _pieces(entry):
            parts.setdefault(name, []).append(
                (lo, hi, tensors, offset, scalars if isinstance(scalars, dict) else {})
            )
            offset += hi - lo
    sizes = _parameter_sizes([(n, lo, hi) for n, ps in parts.items() for lo, hi, *_ in ps])
    declared = manifest.get("parameters")
    if isinstance(declared, dict) and declared != sizes:
        raise DataError(f"{ckpt_dir}: the shards' pieces do not match the manifest's parameters")
    keep_optimizer = len(opt_names) == 1
    values: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, ps in parts.items():
        values[name] = torch.empty(sizes[name], dtype=torch.float32)
        keys = {k for _, _, t, _, _ in ps for k in t if k.startswith(OPTIM_PREFIX)}
        state = {k.removeprefix(OPTIM_PREFIX): torch.zeros(sizes[name]) for k in keys}
        scalar_state: dict[str, torch.Tensor] = {}
        for lo, hi, tensors, off, scalars in ps:
            values[name][lo:hi] = tensors[VALUES_KEY][off : off + hi - lo]
            for key in keys:
                if key in tensors:
                    state[key.removeprefix(OPTIM_PREFIX)][lo:hi] = tensors[key][off : off + hi - lo]
            for key, raw in scalars.items():
                scalar = _scalar_tensor(key, raw)
                old = scalar_state.get(key)
                scalar_state[key] = scalar if old is None or scalar > old else old
        if keep_optimizer:
            opt_state[name] = {**state, **scalar_state}
    return ConsistentCheckpoint(values, opt_state, manifest)


def _load_entry(
    ckpt_dir: Location, entry: Mapping[str, object]
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    name = entry.get("file")
    if not isinstance(name, str) or Path(name).name != name:
        raise DataError(f"{ckpt_dir}: shard {entry.get('index')} has an invalid file {name!r}")
    path = ckpt_dir / name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read shard file {path}: {exc.strerror or exc}") from exc
    if len(data) != entry.get("bytes") or zlib.crc32(data) != entry.get("crc32"):
        raise DataError(
            f"shard file {path} is corrupt: {len(data)} bytes with CRC-32 {zlib.crc32(data)}, "
            f"the manifest says {entry.get('bytes')} bytes with CRC-32 {entry.get('crc32')}"
        )
    tensors, meta = decode_shard(data, str(path))
    layout = meta["layout"]
    assert isinstance(layout, dict)  # checked by decode_shard
    if [list(p) for p in layout.get("pieces", [])] != [list(p) for p in _pieces(entry)]:
        raise DataError(f"shard file {path} holds other pieces than the manifest lists")
    return tensors, meta


def _pieces(entry: Mapping[str, object]) -> list[tuple[str, int, int]]:
    raw = entry.get("pieces")
    out = []
    for piece in raw if isinstance(raw, list) else []:
        if (
            not isinstance(piece, list | tuple)
            or len(piece) != 3
            or not isinstance(piece[0], str)
            or not all(isinstance(x, int) for x in piece[1:])
            or not 0 <= piece[1] <= piece[2]
        ):
            raise DataError(f"shard {entry.get('index')} has a malformed piece {piece!r:.80}")
        out.append((piece[0], piece[1], piece[2]))
    return out


def _parameter_sizes(pieces: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """name -> numel, checking that each parameter's pieces tile ``[0, numel)`` exactly."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, lo, hi in pieces:
        ranges.setdefault(name, []).append((lo, hi))
    sizes = {}
    for name, rs in sorted(ranges.items()):
        end = 0
        for lo, hi in sorted(rs):
            if lo != end:
                raise DataError(
                    f"parameter {name!r}: its pieces {sorted(rs)} leave a gap or overlap at {end}"
                )
            end = hi
        sizes[name] = end
    return sizes


def _scalar_tensor(key: str, raw: object) -> torch.Tensor:
    if not isinstance(raw, dict) or not isinstance(raw.get("value"), int | float):
        raise DataError(f"optimizer scalar {key!r} is malformed: {raw!r:.80}")
    dtype = getattr(torch, str(raw.get("dtype")), None) if raw.get("dtype") else None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise DataError(f"optimizer scalar {key!r} has an unknown dtype {raw.get('dtype')!r}")
    return torch.tensor(raw["value"], dtype=dtype)


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"expected an integer {what}, got {value!r:.40}")
    return value


# --- resuming onto a layout ---------------------------------------------------------------


def piece_fits(param_start: int, param_end: int, numel: int, shard_index: int) -> bool:
    """Whether a layout piece can belong to a parameter of ``numel`` elements.

    A piece is the whole parameter, the ``shard_index``-th slice of
    ``even_split(numel, n)``, or any slice of ``page_split(numel, n)``, for
    some number of servers ``n`` (how :mod:`elasticps.placement` slices
    parameters).
    """
    if (param_start, param_end) == (0, numel):
        return True
    if _page_slice_fits(param_start, param_end, numel):
        return True
    size = param_end - param_start
    if size <= 0 or param_end > numel:
        return False
    # even_split's slices have floor(numel / n) or one more elements.
    lo_n = max(shard_index + 1, numel // (size + 1))
    hi_n = numel // max(size - 1, 1) + 1
    if hi_n - lo_n > 1 << 16:
        return True  # too many candidates to check; accept (tiny slices of a huge array)
    return any(
        n > shard_index and even_split(numel, n)[shard_index] == (param_start, param_end)
        for n in range(lo_n, hi_n + 1)
    )


def _page_slice_fits(param_start: int, param_end: int, numel: int) -> bool:
    """Whether ``[param_start, param_end)`` is a slice of ``page_split(numel, n)``, some ``n``."""
    if param_start % PAGE_NUMEL or not 0 <= param_start < param_end <= numel:
        return False
    end = param_end if param_end < numel else numel - numel % PAGE_NUMEL
    if end % PAGE_NUMEL or end < param_start:
        return False
    pages, size = numel // PAGE_NUMEL, (end - param_start) // PAGE_NUMEL
    # even_split gives floor(pages / n) or one more pages to each slice.
    lo_n = max(2, pages // (size + 1))
    hi_n = pages // max(size - 1, 1) + 1
    if hi_n - lo_n > 1 << 12:
        return True  # too many candidates to check; accept
    return any((param_start, param_end) in page_split(numel, n) for n in range(lo_n, hi_n + 1))


def shard_state_for_layout(
    layout: Mapping[str, object], checkpoint: ConsistentCheckpoint
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Cut a shard's state for ``layout`` out of a consistent checkpoint.

    Args:
        layout: a HELLO layout (``ShardLayout.describe()``): ``shard``,
            ``numel`` and ``pieces`` ``[name, param_start, param_end]``.
        checkpoint: from :func:`load_consistent_checkpoint`.

    Returns:
        ``(tensors, meta)`` for ``ParameterShard.load_state``: the values and
        element-wise optimizer state in the layout's order, the checkpoint's
        version (the largest over its shards), its optimizer config, and the
        scalar optimizer state (the largest over the layout's parameters).

    Raises:
        DataError: a parameter of the layout is not in the checkpoint, or has
            another size there.
    """
    shard_index = layout.get("shard")
    numel = layout.get("numel")
    if not isinstance(shard_index, int) or not isinstance(numel, int):
        raise DataError("the layout needs integer 'shard' and 'numel'")
    pieces = _pieces({"index": shard_index, "pieces": layout.get("pieces")})
    if sum(hi - lo for _, lo, hi in pieces) != numel:
        raise DataError(f"layout of shard {shard_index}: its pieces do not add up to {numel}")
    values = torch.empty(numel, dtype=torch.float32)
    keys = {k for name, _, _ in pieces for k, t in checkpoint.optimizer_state.get(name, {}).items()
            if t.dim() == 1}  # fmt: skip
    opt = {OPTIM_PREFIX + k: torch.zeros(numel, dtype=torch.float32) for k in keys}
    scalars: dict[str, torch.Tensor] = {}
    offset = 0
    for name, lo, hi in pieces:
        full = checkpoint.values.get(name)
        if full is None:
            raise DataError(f"parameter {name!r} of the model is not in the checkpoint")
        if not piece_fits(lo, hi, full.numel(), shard_index):
            raise DataError(
                f"parameter {name!r} has {full.numel()} elements in the checkpoint, which does "
                f"not match the model's (its elements {lo}..{hi} are placed on shard {shard_index})"
            )
        values[offset : offset + hi - lo] = full[lo:hi]
        for key, tensor in checkpoint.optimizer_state.get(name, {}).items():
            if tensor.dim() == 1:
                opt[OPTIM_PREFIX + key][offset : offset + hi - lo] = tensor[lo:hi]
            elif key not in scalars or tensor > scalars[key]:
                scalars[key] = tensor
        offset += hi - lo
    meta: dict[str, object] = {
        "version": _int(checkpoint.meta.get("version", 0), "version"),
        "optimizer": checkpoint.meta.get("optimizer") if checkpoint.optimizer_state else None,
        "optimizer_scalars": {
            k: {"value": t.item(), "dtype": str(t.dtype).removeprefix("torch.")}
            for k, t in scalars.items()
        },
    }
    return {VALUES_KEY: values, **opt}, meta
