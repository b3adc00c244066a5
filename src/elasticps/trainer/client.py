"""The trainer's side of the tensor plane: push gradients, pull parameters.

The trainer keeps every parameter in one flat float32 buffer and every
gradient in another (see :mod:`elasticps.placement`); the model's parameters
and their ``.grad`` are views into them. A push sends, for each parameter
server at once, the ranges of the gradient buffer that server owns, with
``sendall(memoryview)``; a pull receives each server's reply with
``recv_into`` straight into the parameter buffer. Nothing is copied or
allocated per step.

Three options change that path, all chosen at construction:

- ``transport``: on the same host as a server (same hostname and boot id, see
  :func:`~elasticps.wire.frame.local_host_id`) the client asks the server for
  its AF_UNIX path (CONTROL ``endpoints``) and talks over the Unix socket
  instead of TCP (``"auto"``, the default); ``"tcp"`` and ``"unix"`` force one.
- ``overlap_push``: a push that does not want the parameters back (async
  mode) and says what to do once acknowledged (``push(...,
  on_acknowledged=...)``, e.g. report progress to the master) copies the
  gradient into a staging buffer allocated once and is sent by a background
  thread while the trainer computes the next mini-batches; the next call on
  the client waits for it first. Without the callback a push is sent in the
  foreground, so a caller that reports progress after ``push`` returns is
  never ahead of what the servers acknowledged. :meth:`ParameterClient.push`
  returns a :class:`PushHandle`; :attr:`ParameterClient.acknowledged_pushes`
  and :meth:`ParameterClient.when_acknowledged` tell what was acknowledged.
- ``overlap_pull``: pushes that want the parameters back are
  sent in the background too. Everything a server sends back (parameters,
  and the rows a push prefetches) lands in a staging copy of the parameter
  buffer, which the calling thread adopts at its next call on the client;
  so the trainer computes mini-batch ``k + 1`` on the parameters pulled by
  push ``k - 1`` (one step staler than without it) while push ``k`` travels.
  In sync mode that is a pipelined step: push ``k + 1`` joins the step after
  push ``k``'s (it is sent once push ``k`` is answered), with a gradient
  computed one version earlier.
- ``grad_compression``: ``"fp16"`` or ``"bf16"`` converts the float32
  gradient into a reused 16-bit buffer and sends that (half the bytes); the
  server widens it back to float32. Parameters always travel as float32.
- ``shared_memory`` (on by default): over AF_UNIX, each connection hands its
  server a memfd holding the shard's gradients and parameters; a float32
  push then gathers the gradient into it and sends a bare header, and the
  server writes the parameters back into it (see
  :mod:`elasticps.wire.frame`, "Shared memory"). With every server reached
  so, a push is exchanged by one thread: it sends the push to every server,
  then reads the answers, so the servers still work at once but no thread
  is woken per server (what that saves is measured in
  ``benchmarks/README.md``). Otherwise a thread per server moves its
  bodies. A push sent in the
  background has its gradient copied into the shared memory by the caller
  (and into the staging buffer, for a server reconnected meanwhile, whose
  new memory holds nothing yet); compressed pushes travel in bodies.
- ``map_buffers``: with buffers from
  :func:`~elasticps.trainer.pages.page_aligned_zeros`, a paged placement
  (:func:`~elasticps.placement.page_runs`) and no background pushes or
  compression, each connection's shared memory is mapped page by page
  into the flat buffers, so a push gathers and scatters nothing: the server
  reads the gradient autograd wrote and writes the parameters the model
  uses. The gradient is then zeroed only once every server answered. A new
  connection maps its new memory over the same pages; a connection that
  ends gives them private memory again (same contents), so a server that
  outlives its connection never writes into the trainer's buffers.

Exactly-once. A push may carry a :class:`~elasticps.pserver.coverage.PushKey`
(the records whose gradients it sums). Servers apply a key at most once, so
the client re-sends a push freely after reconnecting, and every reply says
whether the push was applied, a duplicate (held already) or stale (computed on
a model the server no longer has: the trainer computes it again on fresh
parameters). :attr:`PushHandle.statuses` holds the servers' answers.

Sparse tables. With ``tables`` (the model's sparse tables and how their
rows are partitioned), the client talks to every server (also one that holds
no dense parameter), declares the tables in its HELLO layout, and moves rows
only: :meth:`ParameterClient.pull_rows` asks each server for the rows of the
ids it holds (one ROW_PULL per server, in parallel) and
:meth:`ParameterClient.push` sends each server the gradient rows of its ids
with its dense gradient (one push, one push key). The client never holds a
whole table.

Fencing. Servers are reached through the slot they claimed in etcd and the
slot's epoch (:class:`~elasticps.coord.store.PSSlot`); every request carries
the epoch, and a server refuses another. When the slot is claimed anew (a
restarted server), :meth:`ParameterClient.slots_changed` drops the old
connection at once, even in the middle of a blocked request, and the request
is repeated on the new server. The first connection to a server waits for
its slot like a reconnection does.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from elasticps.coord.store import PSSlot
from elasticps.errors import (
    AuthenticationError,
    ConfigError,
    ElasticPSError,
    ProtocolError,
    RemoteError,
    ServiceUnavailableError,
)
from elasticps.placement import PAGE_NUMEL, Placement, ShardLayout, page_runs
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.sparse import check_id_range
from elasticps.pserver.sparse_shard import TABLES_KEY, TableEntry
from elasticps.security import JobSecret, secret_or_env
from elasticps.tls import JobTLS, is_refusal, tls_from_env
from elasticps.trainer import pages as flat_pages
from elasticps.trainer.pages import PAGE_BYTES, map_file_pages, unmap_pages
from elasticps.wire.auth import check_peer_uid, client_handshake
from elasticps.wire.frame import (
    HEADER_SIZE,
    ConnectionClosedError,
    DType,
    Flags,
    FrameHeader,
    MsgType,
    PushStatus,
    discard_body,
    dtype_from_torch,
    local_host_id,
    map_shared_region,
    recv_body_into,
    recv_header,
    recv_json,
    send_frame,
    send_json,
    shared_region_nbytes,
    tensor_view,
)

T = TypeVar("T")
S = TypeVar("S")

TRANSPORTS = ("auto", "tcp", "unix", "shm")
"""Values of ``ParameterClient(transport=...)``."""

GRAD_COMPRESSIONS: dict[str, torch.dtype] = {
    "none": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""Values of ``ParameterClient(grad_compression=...)`` and the dtype pushed."""

log = logging.getLogger(__name__)

# Error codes after which the request is repeated on the slot's current server.
_RESOLVE_AGAIN = frozenset({"wrong_epoch", "fenced"})

SERIAL_EXCHANGE_MAX_BYTES = 16 << 20
"""Largest model (float32 bytes) whose shared-memory pushes one thread exchanges with
every server when it copies them (see ``ParameterClient._exchange``); a bigger one uses
a thread per server, unless the shared memory is mapped into its flat buffers."""

_RECENT_SPLITS = 4
"""Splits of ids by server kept per sparse table (see ``ParameterClient._table_split``)."""


@dataclass(frozen=True)
class _Rows:
    """What one server gets of a push's or a pull's rows: per-table counts and the ids.

    ``rows`` (gradient rows, float32, concatenated in the ids' order) is set
    for a push only.
    """

    counts: np.ndarray
    ids: np.ndarray
    rows: np.ndarray | None = None
    # Per table (client order): where this server's ids sit in the caller's
    # ids of that table, to put the pulled rows back (empty: none here).
    positions: tuple[np.ndarray, ...] = ()

    @property
    def empty(self) -> bool:
        return not len(self.ids)


class _ReconnectError(Exception):
    """A connection must be replaced (lost, or its server refused our epoch)."""


# After these, a request is repeated on the slot's current server (ParameterClient._robust).
_CONNECTION_ERRORS = (ConnectionClosedError, OSError, _ReconnectError)


LAGGING_LOOKS = 4
"""Inconsistent pulls in a row (about 75 ms) after which a sync trainer joins the open
step of the shards one version behind (see ``ParameterClient._join_lagging``)."""


def _backoff(first_s: float = 0.02, max_s: float = 0.5) -> Iterator[float]:
    """Exponential delays between reconnection attempts, seconds."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port``; ValueError if malformed."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, expected host:port")
    return host, int(port)


class _SentPush(NamedTuple):
    """A push sent on a connection, whose answer is still to be read."""

    want_params: bool
    row_pull: _Rows | None


class _ShardConnection:
    """One connection (TCP or AF_UNIX) to one parameter server, with its views of the
    flat buffers.

    A push sends either ``grads`` (the trainer's float32 gradient buffer) or
    ``staging`` (the client's copy of it, float32, float16 or bfloat16).
    ``sock`` is None until the first connection succeeds.
    """

    def __init__(
        self,
        layout: ShardLayout,
        params: torch.Tensor,
        grads: torch.Tensor,
        *,
        staging: torch.Tensor | None = None,
        transport: str = "auto",
        tables: Sequence[TableEntry] = (),
        shared_memory: bool = False,
        page_runs: tuple[tuple[int, int, int], ...] | None = None,
        auth_key: bytes | None = None,
        tls: JobTLS | None = None,
    ) -> None:
        self.layout = layout
        self.auth_key = auth_key
        self.tls = tls
        self.hello_layout: dict[str, object] = layout.describe()
        self.fingerprint = layout.fingerprint
        self.tables = tuple(tables)
        if self.tables:
            self.hello_layout[TABLES_KEY] = [t.describe() for t in self.tables]
            text = json.dumps(self.hello_layout, sort_keys=True, separators=(",", ":"))
            self.fingerprint = hashlib.sha256(text.encode()).hexdigest()
        self.rows_version = 0
        self.rows_generation = 0
        self.address = ""
        self.epoch = 0
        self.version = 0
        self.generation = 0
        self.status = PushStatus.APPLIED
        self.scratch = bytearray(HEADER_SIZE)
        self.param_views = [tensor_view(params[lo:hi]) for lo, hi in layout.ranges]
        self.grad_views = [tensor_view(grads[lo:hi]) for lo, hi in layout.ranges]
        self.body_nbytes = layout.numel * 4
        self.staged_views: list[memoryview] = []
        self.staged_dtype = DType.FLOAT32
        if staging is not None:
            self.staged_views = [tensor_view(staging[lo:hi]) for lo, hi in layout.ranges]
            self.staged_dtype = dtype_from_torch(staging.dtype)
        self.wanted_transport = transport
        self.transport = "tcp"
        self._params = params
        self._grads = grads
        # Shared memory with a server on this host (see elasticps.wire.frame,
        # "Shared memory"): wanted, offered by the server, and (once the server
        # agreed) attached to this connection.
        self.wants_shared = shared_memory and layout.numel > 0
        self.server_offers_shared = False
        self._shared: _SharedMemory | None = None
        # With page runs, the shared memory's pages are mapped into the flat
        # buffers (see elasticps.trainer.pages): then nothing is gathered or scattered.
        self.page_runs = page_runs
        self.mapped = False
        self.sock: socket.socket | None = None
        # Set by slots_changed (another thread) when the slot was claimed anew.
        self.superseded = False

    def connect(self, slot: PSSlot, timeout_s: float) -> None:
        """Open a connection to the server holding ``slot`` (closing any old one).

        A new connection gets new shared memory: a server still handling a
        request of the old one (a deposed server, or one whose connection was
        cut) may write into the old memory later, which nothing reads any more.
        """
        self.release()
        self.server_offers_shared = False
        self.sock = self._connect(slot.address, slot.epoch, timeout_s)
        self.address = slot.address
        self.epoch = slot.epoch
        self.superseded = False

    def _connect(self, address: str, epoch: int, timeout_s: float) -> socket.socket:
        try:
            sock = socket.create_connection(parse_address(address), timeout=timeout_s)
        except OSError as exc:
            raise ServiceUnavailableError(
                f"cannot connect to parameter server {self.layout.index} at {address}: {exc}"
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = "tcp"
        try:
            if self.tls is not None:
                sock = self._wrap_tls(sock, address, timeout_s)
            self._authenticate(sock, address, epoch, timeout_s)
            unix = None
            if self.wanted_transport != "tcp":
                unix = self._unix_peer(sock, address, timeout_s)
                if unix is not None:
                    try:
                        check_peer_uid(unix)
                        self._authenticate(unix, address, epoch, timeout_s)
                    except BaseException:
                        unix.close()
                        raise
        except BaseException:
            sock.close()
            raise
        if unix is not None:
            sock.close()
            sock = unix
            self.transport = "unix"
        # Blocking from here on: a sync push waits for the slowest trainer.
        sock.settimeout(None)
        return sock

    def _wrap_tls(self, sock: socket.socket, address: str, timeout_s: float) -> socket.socket:
        """TLS on the new TCP connection ``sock`` (:mod:`elasticps.tls`).

        Raises:
            AuthenticationError: ``tls``: a certificate was refused (not retried).
            ServiceUnavailableError: the connection broke during the handshake.
        """
        assert self.tls is not None
        try:
            return self.tls.wrap_client(sock, "ps", timeout_s)
        except AuthenticationError as exc:
            raise AuthenticationError(
                exc.reason, f"parameter server {self.layout.index} at {address}: {exc}"
            ) from exc
        except OSError as exc:
            raise ServiceUnavailableError(
                f"parameter server {self.layout.index} at {address}: TLS handshake failed: {exc}"
            ) from exc

    def _authenticate(
        self, sock: socket.socket, address: str, epoch: int, timeout_s: float
    ) -> None:
        """The tensor plane's handshake on a new connection (:mod:`elasticps.wire.auth`).

        Raises:
            AuthenticationError: the two sides disagree on the secret (not retried).
            _ReconnectError: the server holds another epoch (resolve the slot again).
            ServiceUnavailableError: the connection broke during the handshake.
        """
        try:
            client_handshake(sock, self.auth_key, epoch, timeout_s=timeout_s)
        except AuthenticationError as exc:
            if exc.reason == "wrong_epoch":
                raise _ReconnectError(f"parameter server {self.layout.index}: {exc}") from exc
            raise AuthenticationError(
                exc.reason, f"parameter server {self.layout.index} at {address}: {exc}"
            ) from exc
        except OSError as exc:
            if is_refusal(exc):  # the server refused this side's certificate
                raise AuthenticationError(
                    "tls", f"parameter server {self.layout.index} at {address}: {exc}"
                ) from exc
            raise ServiceUnavailableError(
                f"parameter server {self.layout.index} at {address}: handshake failed: {exc}"
            ) from exc
        sock.settimeout(timeout_s)

    def _unix_peer(
        self, tcp: socket.socket, address: str, timeout_s: float
    ) -> socket.socket | None:
        """Open the server's AF_UNIX socket if it is on this host; else None (or raise).

        Asks over ``tcp`` (before HELLO) with CONTROL ``endpoints``.

        Raises:
            ServiceUnavailableError: ``transport="unix"`` and the server has no
                Unix socket reachable from here.
        """
        forced = self.wanted_transport == "unix"
        reason: str
        try:
            send_json(tcp, MsgType.CONTROL, {"op": "endpoints"})
            header = recv_header(tcp, self.scratch, max_body_bytes=0)
            answer = recv_json(tcp, header)
        except (ElasticPSError, OSError) as exc:
            raise ServiceUnavailableError(
                f"parameter server {self.layout.index} at {address}: {exc}"
            ) from exc
        path = answer.get("unix") if header.msg_type is MsgType.CONTROL_OK else None
        if not isinstance(path, str) or not path:
            reason = "it does not listen on a Unix socket"
        elif answer.get("host_id") != local_host_id():
            reason = "it runs on another host"
        else:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.settimeout(timeout_s)
            try:
                unix.connect(path)
            except OSError as exc:
                unix.close()
                reason = f"cannot connect to {path}: {exc}"
            else:
                self.server_offers_shared = answer.get("shm") is True
                log.info("parameter server %d: AF_UNIX at %s (same host)", self.layout.index, path)
                return unix
        if forced:
            raise ServiceUnavailableError(
                f"transport 'unix' was asked for, but parameter server {self.layout.index} "
                f"at {address} cannot be reached over AF_UNIX: {reason}"
            )
        log.info("parameter server %d: TCP to %s (%s)", self.layout.index, address, reason)
        return None

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()

    def interrupt(self) -> None:
        """Make a request blocked on this connection fail at once (from another thread)."""
        self.superseded = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def _sock(self) -> socket.socket:
        if self.sock is None or self.superseded:
            raise _ReconnectError(f"parameter server {self.layout.index}: not connected")
        return self.sock

    def _reply(self, max_body_bytes: int | None = None) -> FrameHeader:
        limit = self.body_nbytes if max_body_bytes is None else max_body_bytes
        header = recv_header(self._sock(), self.scratch, max_body_bytes=limit)
        if header.msg_type is MsgType.ERROR:
            body = recv_json(self._sock(), header)
            code = str(body.get("code", "error"))
            if code in _RESOLVE_AGAIN:
                raise _ReconnectError(str(body.get("message", "")))
            raise RemoteError(code, str(body.get("message", "")))
        if header.epoch != self.epoch:
            raise _ReconnectError(
                f"parameter server {self.layout.index} answered for epoch {header.epoch}, "
                f"expected {self.epoch}"
            )
        return header

    def _expect(self, header: FrameHeader, kind: MsgType) -> None:
        if header.msg_type is not kind:
            raise ProtocolError(
                f"parameter server {self.layout.index} answered {header.msg_type.name}, "
                f"expected {kind.name}"
            )

    def hello(self, trainer_id: int, initial_values: Callable[[], torch.Tensor] | None) -> None:
        """Say hello; if the server asks for values, send those of ``initial_values()``.

        ``initial_values`` returns the job's initial parameters, a flat
        float32 tensor laid out as the parameter buffer (None: refuse to
        initialize the shard).
        """
        send_json(
            self._sock(),
            MsgType.HELLO,
            {
                "trainer_id": trainer_id,
                "layout": self.hello_layout,
                "fingerprint": self.fingerprint,
            },
            epoch=self.epoch,
        )
        header = self._reply()
        self._expect(header, MsgType.HELLO_OK)
        answer = recv_json(self._sock(), header)
        if answer.get("need_values"):
            if initial_values is None:
                raise ProtocolError(f"parameter server {self.layout.index} holds no parameters yet")
            flat = initial_values()
            send_frame(
                self._sock(),
                FrameHeader(
                    MsgType.INIT_VALUES,
                    dtype=DType.FLOAT32,
                    body_nbytes=self.body_nbytes,
                    epoch=self.epoch,
                ),
                [tensor_view(flat[lo:hi].contiguous()) for lo, hi in self.layout.ranges],
            )
            header = self._reply()
            self._expect(header, MsgType.HELLO_OK)
            answer = recv_json(self._sock(), header)
        version = answer.get("version")
        generation = answer.get("generation")
        self.version = version if isinstance(version, int) else 0
        self.generation = generation if isinstance(generation, int) else 0
        if self.wants_shared and self.server_offers_shared and self.transport == "unix":
            self._attach_shared()

    @property
    def shared(self) -> bool:
        """Whether dense float32 pushes on this connection go through shared memory."""
        return self._shared is not None

    @property
    def shared_memory(self) -> _SharedMemory | None:
        """The connection's shared memory, if the server attached it."""
        return self._shared

    def _attach_shared(self) -> None:
        """Hand the server new shared memory for this connection; keep it if it agrees.

        Once per connection: the server keeps it across HELLOs.
        """
        if self._shared is not None:
            return
        paged = self.page_runs is not None
        try:
            memory = _SharedMemory(self.layout, paged=paged)
        except OSError as exc:
            log.info("parameter server %d: no shared memory (%s)", self.layout.index, exc)
            self.wants_shared = False
            return
        try:
            request: dict[str, object] = {"op": "attach_shm", "numel": self.layout.numel}
            if paged:
                request["params_at"] = memory.params_at
            send_json(self._sock(), MsgType.CONTROL, request, epoch=self.epoch)
            socket.send_fds(self._sock(), [b"\0"], [memory.fd])
            header = self._reply()
            self._expect(header, MsgType.CONTROL_OK)
            answer = recv_json(self._sock(), header)
        except BaseException:
            memory.close()
            raise
        if answer.get("attached") is True:
            self._shared = memory
            if self.page_runs is not None:
                try:
                    memory.map_into(self._params, self._grads, self.page_runs)
                    self.mapped = True
                except OSError as exc:
                    log.info(
                        "parameter server %d: cannot map shared memory into the flat "
                        "buffers (%s); copying", self.layout.index, exc,
                    )  # fmt: skip
            return
        memory.close()
        log.info(
            "parameter server %d: shared memory refused (%s); sending bodies",
            self.layout.index, answer.get("reason"),
        )  # fmt: skip

    def release(self) -> None:
        """Close the connection and free its shared memory (the flat buffers get
        private pages again first, with the same contents, if it was mapped there).

        Raises:
            OSError: the pages could not be given back (the flat buffers still
                share them with a server that may write into them).
        """
        self.close()
        if self._shared is not None:
            memory, self._shared = self._shared, None
            try:
                if self.mapped:
                    self.mapped = False
                    memory.unmap()
            finally:
                memory.close()

    def send_push(
        self,
        trainer_id: int,
        num_samples: int,
        step: int,
        *,
        empty: bool,
        want_params: bool,
        staged: bool = False,
        shared: _SharedMemory | None = None,
        key: PushKey | None = None,
        computed_on: tuple[int, int] | None = None,
        rows: _Rows | None = None,
        row_pull: _Rows | None = None,
    ) -> _SentPush:
        """Send one push; with ``row_pull``, a ROW_PULL right behind it (pipelined).

        ``staged`` sends the staging buffer; ``shared`` is this connection's
        shared memory if the caller has written the gradient into it already
        (a background push): then it goes through shared memory, unless the
        connection has new memory since (a reconnection), which gets the
        staged copy.

        The server answers the frames of a connection in order, so the rows
        read are those after this push (applied, or refused). Returns what
        :meth:`finish_push` needs to read the answer.
        """
        with_rows = rows is not None and not empty and not rows.empty
        flags = (
            (Flags.EMPTY if empty else Flags.NONE)
            | (Flags.WANT_PARAMS if want_params else Flags.NONE)
            | (Flags.ROWS if with_rows else Flags.NONE)
        )
        memory = None if empty else self._shared
        if memory is not None and shared is not None and memory is shared:
            staged = False  # written by the caller (see ParameterClient.push)
        elif memory is not None and not staged:
            if not self.mapped:  # mapped: the gradient is in the shared memory already
                memory.write_grads(self._grads)
        else:
            memory = None
        if memory is not None:
            flags |= Flags.SHARED
        via_memory = memory is not None
        dtype, views = (
            (self.staged_dtype, self.staged_views) if staged else (DType.FLOAT32, self.grad_views)
        )
        k = key
        send_frame(
            self._sock(),
            FrameHeader(
                MsgType.PUSH,
                dtype=dtype,
                flags=flags,
                sender=trainer_id,
                num_samples=num_samples,
                model_version=self.version if computed_on is None else computed_on[0],
                step=step,
                body_nbytes=0 if empty or via_memory else self.layout.numel * dtype.itemsize,
                epoch=self.epoch,
                task_id=0 if k is None else k.task_id,
                pass_id=0 if k is None else k.pass_id,
                key_lo=0 if k is None else k.lo,
                key_hi=0 if k is None else k.hi,
                generation=self.generation if computed_on is None else computed_on[1],
            ),
            () if empty or via_memory else views,
        )
        if with_rows:
            assert rows is not None and rows.rows is not None
            body = [rows.counts.data.cast("B"), rows.ids.data.cast("B"), rows.rows.data.cast("B")]
            send_frame(
                self._sock(),
                FrameHeader(
                    MsgType.ROW_GRADS,
                    dtype=DType.FLOAT32,
                    body_nbytes=sum(v.nbytes for v in body),
                    epoch=self.epoch,
                ),
                body,
            )
        if row_pull is not None:
            self._send_row_pull(row_pull)
        return _SentPush(want_params, row_pull)

    def finish_push(self, sent: _SentPush) -> np.ndarray | None:
        """Read the answer to the push :meth:`send_push` sent.

        Returns the pulled rows (float32, concatenated as :meth:`pull_rows`),
        or None.
        """
        want_params, row_pull = sent
        try:
            header = self._reply()
        except RemoteError:
            if row_pull is not None:
                # The ROW_PULL's answer: read it, to keep the stream in step.
                self._discard_reply(4 * self._row_elements(row_pull))
            raise
        self.status = header.status
        if want_params:
            self._receive_params(header)
        else:
            self._expect(header, MsgType.PUSH_OK)
            # Async: our copy stays at the version we last pulled; the server
            # tells us how far it has moved, which we keep only for staleness.
        return None if row_pull is None else self._recv_rows(row_pull)

    def pull(self) -> None:
        send_frame(self._sock(), FrameHeader(MsgType.PULL, epoch=self.epoch))
        self._receive_params(self._reply())

    def pull_rows(self, request: _Rows) -> np.ndarray:
        """The rows of ``request``'s ids from this server: float32, concatenated."""
        self._send_row_pull(request)
        return self._recv_rows(request)

    def _send_row_pull(self, request: _Rows) -> None:
        body = [request.counts.data.cast("B"), request.ids.data.cast("B")]
        send_frame(
            self._sock(),
            FrameHeader(
                MsgType.ROW_PULL,
                dtype=DType.INT64,
                body_nbytes=sum(v.nbytes for v in body),
                epoch=self.epoch,
            ),
            body,
        )

    def _row_elements(self, request: _Rows) -> int:
        return int(
            sum(
                int(c) * t.spec.dim
                for c, t in zip(request.counts.tolist(), self.tables, strict=True)
            )
        )

    def _recv_rows(self, request: _Rows) -> np.ndarray:
        elements = self._row_elements(request)
        header = self._reply(max_body_bytes=4 * elements)
        self._expect(header, MsgType.ROWS)
        out = np.empty(elements, dtype=np.float32)
        recv_body_into(self._sock(), header, [out.data.cast("B")])
        self.rows_version = header.model_version
        self.rows_generation = header.generation
        return out

    def _discard_reply(self, max_body_bytes: int) -> None:
        """Read and drop one reply (an answer no longer wanted after an error)."""
        limit = max(self.body_nbytes, max_body_bytes)
        header = recv_header(self._sock(), self.scratch, max_body_bytes=limit)
        discard_body(self._sock(), header, self.scratch)

    def _receive_params(self, header: FrameHeader) -> None:
        self._expect(header, MsgType.PARAMS)
        if header.body_nbytes == 0 and self.layout.numel:
            # The answer to a SHARED push: the server wrote them into shared memory.
            if self._shared is None:
                raise ProtocolError(
                    f"parameter server {self.layout.index} sent PARAMS without a body "
                    "on a connection without shared memory"
                )
            if not self.mapped:  # mapped: the parameters are in the flat buffer already
                self._shared.read_params(self._params)
        else:
            recv_body_into(self._sock(), header, self.param_views)
        self.version = header.model_version
        self.generation = header.generation

    def control(self, op: str) -> dict[str, object]:
        send_json(self._sock(), MsgType.CONTROL, {"op": op}, epoch=self.epoch)
        header = self._reply()
        self._expect(header, MsgType.CONTROL_OK)
        return recv_json(self._sock(), header)


# A server maps only a file that cannot shrink under it (SIGBUS); nor may it grow.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy float32 ``src`` into ``dst`` (same size), to or from shared memory.

    With one torch thread (trainers' default) torch copies; with more, numpy
    does, on this thread alone: a torch copy of a shard's size is split over
    the intra-op threads, which then spin while this thread waits for the
    server's answer, taking the CPU the servers need. numpy releases the GIL
    while it copies, which lets the process's other threads in: measured
    slower with one thread (``benchmarks/README.md``).
    """
    if torch.get_num_threads() > 1:
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


class _SharedMemory:
    """The shared memory of one connection (see elasticps.wire.frame, "Shared memory").

    A memfd, sealed against resizing, holding float32 gradients ``[numel]`` then
    float32 parameters ``[numel]`` of one shard, in the shard's order; the
    trainer's flat buffers are gathered into it and scattered from it, one
    copy per range of the layout, unless its pages are mapped into them
    (:meth:`map_into`). ``paged`` puts the parameters on a page and makes the
    file whole pages, so that it can be.

    Raises:
        OSError: the system has no memfd or cannot seal it.
    """

    def __init__(self, layout: ShardLayout, *, paged: bool = False) -> None:
        numel = layout.numel
        self.params_at = -(-numel // PAGE_NUMEL) * PAGE_NUMEL if paged else numel
        self.fd = os.memfd_create(
            f"elasticps-ps{layout.index}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        try:
            # Both regions params_at elements long: whole pages when paged.
            os.ftruncate(self.fd, shared_region_nbytes(self.params_at, self.params_at))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map, grads, params = map_shared_region(self.fd, numel, self.params_at)
        except BaseException:
            os.close(self.fd)
            raise
        self._mapped: list[tuple[torch.Tensor, int, int]] = []
        # (flat buffer range, shared region piece) pairs, in the shard's order.
        self._pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        offset = 0
        for lo, hi in layout.ranges:
            n = hi - lo
            self._pieces.append((lo, hi, grads[offset : offset + n], params[offset : offset + n]))
            offset += n

    def write_grads(self, grads: torch.Tensor) -> None:
        """Gather the shard's ranges of the flat gradient buffer into the shared region."""
        for lo, hi, g, _ in self._pieces:
            _copy(g, grads[lo:hi])

    def write_params(self, params: torch.Tensor) -> None:
        """Gather the shard's ranges of the flat parameter buffer into the shared region."""
        for lo, hi, _, p in self._pieces:
            _copy(p, params[lo:hi])

    def read_params(self, params: torch.Tensor) -> None:
        """Scatter the parameters the server wrote into the flat parameter buffer."""
        for lo, hi, _, p in self._pieces:
            _copy(params[lo:hi], p)

    def restore_grads(self, grads: torch.Tensor) -> None:
        """Scatter the gradient last written here back into the flat gradient buffer."""
        for lo, hi, g, _ in self._pieces:
            _copy(grads[lo:hi], g)

    def map_into(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        """Make the flat buffers' pages of this shard the pages of this memory.

        Their current contents are copied in first. ``runs`` are
        ``(flat_page, shard_page, pages)`` (see :func:`~elasticps.placement.page_runs`).

        Raises:
            OSError: a mapping failed (those made are undone).
        """
        self.write_grads(grads)
        self.write_params(params)
        try:
            for flat_page, shard_page, pages in runs:
                offset = shard_page * PAGE_BYTES
                map_file_pages(grads, flat_page, pages, self.fd, offset)
                self._mapped.append((grads, flat_page, pages))
                map_file_pages(params, flat_page, pages, self.fd, self.params_at * 4 + offset)
                self._mapped.append((params, flat_page, pages))
        except OSError:
            self.unmap()
            raise

    def unmap(self) -> None:
        """Give the pages :meth:`map_into` mapped private memory again, keeping their contents.

        Raises:
            OSError: a page could not be given back.
        """
        while self._mapped:
            buf, first_page, pages = self._mapped[-1]
            unmap_pages(buf, first_page, pages)
            self._mapped.pop()

    def close(self) -> None:
        self._pieces = []
        with contextlib.suppress(BufferError):
            self._map.close()  # still exported if a tensor view outlives us: GC frees it
        os.close(self.fd)


class _EarlyWork:
    """What a push does once every server has its request (see :meth:`ParameterClient.push`).

    ``zero_grad`` zeroes the flat gradient buffer, which the push then no
    longer reads; ``while_waiting`` is the caller's own work. When it ran
    before the answers were read, a connection that failed and is retried
    needs its gradient again: :meth:`restore` copies it back from the
    connection's shared memory (it is still mapped there, untouched by the
    server, until the connection is replaced) and :meth:`rezero` zeroes it
    once the retry is over.
    """

    def __init__(
        self,
        grads: torch.Tensor,
        *,
        zero_grad: bool,
        while_waiting: Callable[[], None] | None,
    ) -> None:
        self._grads = grads
        self._zero_grad = zero_grad
        self._while_waiting = while_waiting
        self.ran = False

    def run(self) -> None:
        """Do the work, once."""
        if self.ran:
            return
        self.ran = True
        if self._zero_grad:
            self._grads.zero_()
        if self._while_waiting is not None:
            self._while_waiting()

    def restore(self, conn: _ShardConnection) -> None:
        """Put ``conn``'s shard of the gradient back before its request is sent again."""
        if self.ran and self._zero_grad:
            memory = conn.shared_memory
            assert memory is not None  # the early work runs only when every push is shared
            memory.restore_grads(self._grads)

    def rezero(self, conn: _ShardConnection) -> None:
        """Zero ``conn``'s shard of the gradient again after :meth:`restore`."""
        if self.ran and self._zero_grad:
            for lo, hi in conn.layout.ranges:
                self._grads[lo:hi].zero_()


class PushHandle:
    """One push, as returned by :meth:`ParameterClient.push`.

    A push is *acknowledged* once every parameter server has answered it
    (PUSH_OK or PARAMS) with APPLIED or DUPLICATE: then every server holds
    its records. A push sent in the background is acknowledged later; one
    sent in the foreground when ``push`` returns. A push that some server
    answered STALE is not acknowledged: the caller computes it again. Only
    acknowledged pushes may be reported to the master as trained records.

    Attributes:
        index: 1-based number of the push on its client.
        statuses: each server's answer, once done (in connection order).
        rows: with ``push(prefetch=...)`` in the foreground, the rows of the
            prefetched ids read right after the push (table name -> float32
            ``[k, dim]``, as :meth:`ParameterClient.pull_rows`); else None.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.statuses: list[PushStatus] = []
        self.rows: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []

    @property
    def acknowledged(self) -> bool:
        """Whether every server holds the push's records (not while in flight, failed, stale)."""
        return self._done.is_set() and self._error is None and not self.stale

    @property
    def done(self) -> bool:
        """Whether every server has answered (or the push failed)."""
        return self._done.is_set()

    @property
    def stale(self) -> bool:
        """Whether a server answered STALE: the gradient must be computed again."""
        return PushStatus.STALE in self.statuses

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the push is answered by every server.

        Args:
            timeout_s: longest wait, seconds; None waits as long as it takes.

        Raises:
            TimeoutError: still in flight after ``timeout_s``.
            ServiceUnavailableError / RemoteError / ProtocolError: the push
                failed (the same error the client raises on its next call).
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"push {self.index} still in flight after {timeout_s} s")
        if self._error is not None:
            raise self._error

    def add_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the push is acknowledged (now, if it is); never if it
        fails or is stale."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
            ok = self._error is None and not self.stale
        if ok:
            fn()

    def _finish(self, error: BaseException | None, statuses: list[PushStatus]) -> None:
        with self._lock:
            self._error = error
            self.statuses = statuses
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        if error is None and not self.stale:
            for fn in callbacks:
                fn()


def _as_slot(index: int, where: PSSlot | str) -> PSSlot:
    return where if isinstance(where, PSSlot) else PSSlot(index, where, 0)


class ParameterClient:
    """Pushes gradients to and pulls parameters from every parameter server.

    When a parameter server goes away (its connection breaks, it refuses our
    epoch, or the slot is claimed anew), the client asks ``resolve`` for the
    server that holds its slot now, reconnects, says hello again
    (initializing the shard if it came back empty), pulls, and repeats the
    interrupted request. A push is re-sent with its key, so a server that
    applied it already answers DUPLICATE; in sync mode it keeps the version
    it was computed on, so a server that lost that version answers STALE and
    the trainer computes it again. This waits at most
    ``reconnect_timeout_s`` seconds, then raises
    :class:`~elasticps.errors.ServiceUnavailableError`. The first connection
    to each server goes through the same path: a server that is restarting
    when the client starts is waited for.

    Args:
        placement: where each parameter lives.
        addresses: the server of slot ``i`` at index ``i``: a
            :class:`~elasticps.coord.store.PSSlot` (address and epoch), or a
            ``host:port`` string (epoch 0: a server run without etcd).
        params: the flat parameter buffer, float32 ``[placement.total_numel]``.
        grads: the flat gradient buffer, float32 ``[placement.total_numel]``.
        trainer_id: this trainer's id, sent with every push.
        timeout_s: connect timeout, seconds.
        resolve: given a slot index, its current server (a PSSlot, or an
            address string); ``None`` disables reconnection. It may raise
            ElasticPSError while there is none.
        reconnect_timeout_s: how long to wait for a lost server, seconds.
        stop: when set, reconnection gives up at once.
        transport: ``"auto"`` (AF_UNIX and shared memory to servers on this
            host, TCP to the others), ``"tcp"``, ``"unix"`` (AF_UNIX, every
            tensor in a body) or ``"shm"`` (AF_UNIX and shared memory); the
            last two fail for a server that is not reachable over AF_UNIX.
        overlap_push: send pushes that do not want parameters back and come
            with an ``on_acknowledged`` callback (see :meth:`push`) from a
            background thread, overlapping the next mini-batch's compute (the
            gradient is first copied into a staging buffer, so the caller may
            zero ``grads`` at once).
            A push interrupted by a lost server is re-sent by the background
            thread after reconnecting (whose pull then writes ``params`` while
            the trainer may be computing: async SGD tolerates it). Measured
            1.10-1.25x faster with spare CPU, 0.8-0.9x on a saturated machine
            (benchmarks/push_options.py).
        overlap_pull: pushes that want parameters back (with an
            ``on_acknowledged`` callback) are sent in the background as well;
            what they pull is received into a staging copy of ``params`` and
            copied into ``params`` on the caller's thread at its next call on
            the client (see the module docstring). A push's header then
            carries the version of the parameters the caller computed on
            (adopted before the previous push), so bounded staleness counts
            the extra step; in sync mode it carries the current version (the
            step it joins), see the module docstring.
        grad_compression: ``"none"`` (float32), ``"fp16"`` or ``"bf16"``: the
            dtype gradients travel in (converted into a reused staging buffer).
        initial_values: returns the job's initial parameters (float32
            ``[placement.total_numel]``), sent to a server whose shard is
            empty; None sends ``params`` as they are.
        sync: sync-SGD: a re-sent push keeps the version it was computed on.
        tables: the model's sparse tables, partitioned over
            ``placement.num_shards`` servers (see :meth:`pull_rows`).
        shared_memory: with ``transport`` ``"auto"`` or ``"shm"``, move
            float32 gradients and parameters through shared memory with
            servers reached over AF_UNIX (see the module docstring); False
            always sends bodies.
        map_buffers: ``params`` and ``grads`` come from
            :func:`~elasticps.trainer.pages.page_aligned_zeros` (as
            :func:`~elasticps.trainer.flat.bind_flat_buffers` makes them), so
            the shared memory may be mapped into them (see the module
            docstring); ignored where it cannot be (a packed placement, a
            staging buffer, not Linux).
        secret: the job secret each connection proves (:mod:`elasticps.wire.auth`);
            None: this process's (:func:`~elasticps.security.secret_from_env`).
        tls: the TLS setup of TCP connections (:mod:`elasticps.tls`); None: this
            process's (:func:`~elasticps.tls.tls_from_env`).

    Raises:
        AuthenticationError: a server and this client disagree on the job secret,
            or one refused the other's certificate.
        ConfigError: an unknown ``transport`` or ``grad_compression``.
        ServiceUnavailableError: a parameter server cannot be reached (at
            once if ``resolve`` is None, else after ``reconnect_timeout_s``).
    """

    def __init__(
        self,
        placement: Placement,
        addresses: Sequence[PSSlot | str],
        params: torch.Tensor,
        grads: torch.Tensor,
        trainer_id: int,
        *,
        timeout_s: float = 30.0,
        resolve: Callable[[int], PSSlot | str] | None = None,
        reconnect_timeout_s: float = 60.0,
        stop: threading.Event | None = None,
        transport: str = "auto",
        overlap_push: bool = False,
        overlap_pull: bool = False,
        grad_compression: str = "none",
        initial_values: Callable[[], torch.Tensor] | None = None,
        sync: bool = False,
        tables: Sequence[TableEntry] = (),
        shared_memory: bool = True,
        map_buffers: bool = False,
        secret: JobSecret | None = None,
        tls: JobTLS | None = None,
    ) -> None:
        job_secret = secret_or_env(secret)
        job_tls = tls if tls is not None else tls_from_env()
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if grad_compression not in GRAD_COMPRESSIONS:
            raise ConfigError(
                f"grad_compression must be one of {tuple(GRAD_COMPRESSIONS)}, "
                f"got {grad_compression!r}"
            )
        if len(addresses) != placement.num_shards:
            raise ValueError(
                f"{len(addresses)} addresses for {placement.num_shards} parameter servers"
            )
        for name, buf in (("params", params), ("grads", grads)):
            if buf.dtype != torch.float32 or buf.numel() != placement.total_numel:
                raise ValueError(f"{name} must be float32 [{placement.total_numel}]")
            if not buf.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        self.trainer_id = trainer_id
        self._step = 0
        self._timeout_s = timeout_s
        self._resolve = resolve
        self._reconnect_timeout_s = reconnect_timeout_s
        self._stop = stop if stop is not None else threading.Event()
        self._sync = sync
        self.reconnects = 0
        self._params = params
        self._grads = grads
        self._initial_values = initial_values if initial_values is not None else lambda: params
        wire_dtype = GRAD_COMPRESSIONS[grad_compression]
        # What pushes send: the gradient itself, or a staging copy (allocated
        # once) for compressed or background pushes.
        self._staging: torch.Tensor | None = None
        self._compressed = wire_dtype != torch.float32
        if overlap_push or overlap_pull or self._compressed:
            self._staging = torch.empty(placement.total_numel, dtype=wire_dtype)
        # overlap_pull: servers' answers land here; adopted into params by _adopt.
        self._received: torch.Tensor | None = params.clone() if overlap_pull else None
        self._overlap_pull = overlap_pull
        self._acknowledged = 0
        self._last_push: PushHandle | None = None
        self._inflight: tuple[Future[None], PushHandle] | None = None
        self._conns: list[_ShardConnection] = []
        self.tables = tuple(tables)
        self._table_index = {t.spec.name: i for i, t in enumerate(self.tables)}
        self._partitioners = [t.partitioner for t in self.tables]
        # Table index -> (ids, positions by server) of its last splits, newest first
        # (see _table_split).
        self._last_split: dict[int, tuple[tuple[np.ndarray, list[np.ndarray]], ...]] = {}
        self._background: ThreadPoolExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        runs = (
            page_runs(placement)
            if map_buffers
            and self._staging is None
            and self._received is None
            and flat_pages.supported()
            and all(flat_pages.is_page_aligned(b) for b in (params, grads))
            else None
        )
        try:
            first: list[tuple[_ShardConnection, PSSlot]] = []
            for layout in placement.shards:
                # A shard that holds nothing (hash placement left it empty) is
                # still pushed to, with empty bodies: it must hold every record's
                # push key, or the master's pass check would re-open them forever.
                conn = _ShardConnection(
                    layout,
                    params if self._received is None else self._received,
                    grads,
                    staging=self._staging,
                    transport="unix" if transport == "shm" else transport,
                    tables=self.tables,
                    shared_memory=shared_memory and transport in ("auto", "shm"),
                    page_runs=None if runs is None else runs[layout.index],
                    auth_key=None if job_secret is None else job_secret.tensor_plane_key(),
                    tls=job_tls,
                )
                self._conns.append(conn)
                first.append((conn, _as_slot(layout.index, addresses[layout.index])))
            for conn, slot in first:
                self._connect_first(conn, slot)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self._conns) - 1), thread_name_prefix="ps-fanout"
        )
        if overlap_push or overlap_pull:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-push")
        # The (version, generation) of each shard's parameters in ``params``:
        # those received, or with overlap_pull those adopted.
        self._adopted = [(c.version, c.generation) for c in self._conns]

    def _connect_first(self, conn: _ShardConnection, slot: PSSlot) -> None:
        """Connect to ``slot``; if that fails, wait for the slot as a reconnection does."""
        try:
            conn.connect(slot, self._timeout_s)
        except (ServiceUnavailableError, _ReconnectError) as exc:
            if self._resolve is None:
                raise
            log.info("parameter server %d is not reachable yet (%s); waiting", slot.index, exc)
            self._reconnect(conn, time.monotonic() + self._reconnect_timeout_s, hello=False)

    @property
    def versions(self) -> list[int]:
        """Model version of each connected shard, as in ``params`` (last pulled or adopted)."""
        if self._received is not None:
            return [v for v, _ in self._adopted]
        return [c.version for c in self._conns]

    def _adopt(self) -> None:
        """overlap_pull: copy what the servers sent into ``params`` (the caller's thread only).

        Called once nothing is in flight, so the staging copy is complete.
        """
        if self._received is None:
            return
        self._params.copy_(self._received)
        self._adopted = [(c.version, c.generation) for c in self._conns]

    @property
    def generations(self) -> list[int]:
        """Sync generation of each connected shard, as last pulled."""
        return [c.generation for c in self._conns]

    @property
    def epochs(self) -> list[int]:
        """The slot epoch of each connected shard."""
        return [c.epoch for c in self._conns]

    @property
    def consistent(self) -> bool:
        """Whether the parameters in ``params`` form one model (one version and generation).

        With ``overlap_pull``, the versions adopted into ``params``, not those
        a push in flight is receiving.
        """
        if self._received is not None:
            return len(set(self._adopted)) <= 1
        return len({(c.version, c.generation) for c in self._conns}) <= 1

    @property
    def transports(self) -> list[str]:
        """``"tcp"`` or ``"unix"``: the transport of each connected shard."""
        return [c.transport for c in self._conns]

    @property
    def acknowledged_pushes(self) -> int:
        """Pushes every server has acknowledged so far (excludes one in flight)."""
        return self._acknowledged

    def slots_changed(self, slots: Mapping[int, PSSlot]) -> None:
        """Tell the client the current slot claims (from a watch on etcd; any thread).

        A connection to a slot claimed anew (another epoch) is dropped at
        once, even under a blocked request, which is then repeated on the
        slot's new server.
        """
        for conn in self._conns:
            slot = slots.get(conn.layout.index)
            if slot is not None and conn.epoch and slot.epoch != conn.epoch:
                log.info(
                    "parameter server %d was replaced (epoch %d -> %d); reconnecting",
                    conn.layout.index, conn.epoch, slot.epoch,
                )  # fmt: skip
                conn.interrupt()

    def when_acknowledged(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every push made so far is acknowledged.

        Now (on this thread) if none is in flight; else from the background
        sender once the push in flight is acknowledged; never if it fails.
        This is how a trainer reports progress: only for acknowledged pushes.
        """
        last = self._last_push
        if last is None:
            fn()
        else:
            last.add_callback(fn)

    def flush(self) -> None:
        """Wait until the push in flight, if any, is answered.

        Raises:
            ServiceUnavailableError / RemoteError / ProtocolError: it failed.
        """
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            try:
                inflight[0].result()
            finally:
                self._adopt()

    def _fan_out(
        self,
        fn: Callable[[_ShardConnection], T],
        conns: Sequence[_ShardConnection] | None = None,
    ) -> list[T]:
        # The calling thread serves the last connection itself: one thread
        # hand-off fewer per exchange than waiting for the pool to do it all.
        targets = self._conns if conns is None else conns
        if not targets:
            return []
        assert self._pool is not None
        *others, last = targets
        futures = [self._pool.submit(self._robust, fn, c) for c in others]
        try:
            mine = self._robust(fn, last)
        finally:
            results = [f.result() for f in futures]  # waits for all, even on error
        return [*results, mine]

    def _exchange(
        self,
        start: Callable[[_ShardConnection], S],
        finish: Callable[[_ShardConnection, S], T],
        early: _EarlyWork | None = None,
    ) -> list[T]:
        """One request to every server (``start`` sends it, ``finish`` reads the answer).

        When every connection moves its tensors through shared memory, the
        frames are small: the calling thread sends every request first, then
        reads the answers, so the servers work in parallel without a thread
        hand-off on this side. ``early`` (if any) runs between the two, once
        every request went out, while the servers work. A connection that
        fails is then served as :meth:`_robust` does, after the others: it
        reconnects and sends the whole request again. Otherwise, or when the
        model is bigger than :data:`SERIAL_EXCHANGE_MAX_BYTES` and the shared
        memory is not mapped into the flat buffers (its copies into and out
        of it then take longer than a hand-off, and run in parallel), each
        connection goes on its own thread (:meth:`_fan_out`), and ``early``
        is left to the caller.

        Raises:
            The first error of any server (or of ``early``), once every
            answer has been read.
        """
        targets = self._conns
        if (
            not targets
            or not all(c.shared for c in targets)
            or (
                self._grads.numel() * 4 > SERIAL_EXCHANGE_MAX_BYTES
                and not all(c.mapped for c in targets)  # mapped: nothing to copy
            )
        ):
            return self._fan_out(lambda c: finish(c, start(c)))
        sent: list[tuple[S] | None] = []
        for c in targets:
            try:
                sent.append((start(c),))
            except _CONNECTION_ERRORS:
                sent.append(None)
        error: BaseException | None = None
        if early is not None and all(request is not None for request in sent):
            try:
                early.run()
            except BaseException as exc:  # raised below, once every answer is read
                error = exc
        results: list[T | None] = []
        retry: list[int] = []
        for i, (c, request) in enumerate(zip(targets, sent, strict=True)):
            results.append(None)
            if request is None:
                retry.append(i)
                continue
            try:
                results[i] = finish(c, request[0])
            except _CONNECTION_ERRORS:
                retry.append(i)
            except BaseException as exc:  # raised below, once every answer is read
                error = error or exc
        for i in retry:
            try:
                if early is not None:
                    early.restore(targets[i])
                try:
                    results[i] = self._robust(lambda c: finish(c, start(c)), targets[i])
                finally:
                    if early is not None:
                        early.rezero(targets[i])
            except BaseException as exc:  # raised below
                error = error or exc
        if error is not None:
            raise error
        return results  # type: ignore[return-value]  # every entry set when no error

    def _robust(self, fn: Callable[[_ShardConnection], T], conn: _ShardConnection) -> T:
        deadline: float | None = None
        while True:
            try:
                return fn(conn)
            except _CONNECTION_ERRORS as exc:
                if self._resolve is None:
                    raise ServiceUnavailableError(
                        f"lost parameter server {conn.layout.index} at {conn.address}: {exc}"
                    ) from exc
                if deadline is None:
                    deadline = time.monotonic() + self._reconnect_timeout_s
                    log.warning(
                        "lost parameter server %d at %s (%s); waiting for it to come back",
                        conn.layout.index, conn.address, exc,
                    )  # fmt: skip
                self._reconnect(conn, deadline)

    def _reconnect(self, conn: _ShardConnection, deadline: float, *, hello: bool = True) -> None:
        """Reconnect ``conn`` to whichever server now holds its slot, or raise."""
        assert self._resolve is not None
        delays = _backoff()
        while True:
            try:
                slot = _as_slot(conn.layout.index, self._resolve(conn.layout.index))
                conn.connect(slot, self._timeout_s)
                if hello:
                    conn.hello(self.trainer_id, self._initial_values)
                    conn.pull()
                    self.reconnects += 1
                log.info(
                    "connected to parameter server %d at %s (epoch %d, version %d)",
                    conn.layout.index, slot.address, slot.epoch, conn.version,
                )  # fmt: skip
                return
            except AuthenticationError:
                raise  # the same secret next time: waiting cannot help
            except (ElasticPSError, OSError, _ReconnectError) as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    raise ServiceUnavailableError(
                        f"parameter server {conn.layout.index} did not come back within "
                        f"{self._reconnect_timeout_s:.0f} s: {exc}"
                    ) from exc
                self._stop.wait(min(next(delays), remaining))

    def hello(self, *, initialize: bool = True) -> None:
        """Introduce ourselves to every PS, initializing empty shards with initial values.

        Then pulls, so that ``params`` holds the servers' current values.

        Raises:
            RemoteError: a server refused (for example a layout mismatch).
        """
        self.flush()
        initial = self._initial_values if initialize else None
        self._fan_out(lambda c: c.hello(self.trainer_id, initial))
        self.pull()

    def push(
        self,
        num_samples: int,
        *,
        want_params: bool,
        on_acknowledged: Callable[[], None] | None = None,
        key: PushKey | None = None,
        rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        prefetch: Mapping[str, torch.Tensor] | None = None,
        zero_grad: bool = False,
        while_waiting: Callable[[], None] | None = None,
    ) -> PushHandle:
        """Push the gradient buffer (the mean gradient over ``num_samples`` samples).

        Waits for the previous push first. A push is sent in the background
        only with an ``on_acknowledged`` callback and either ``overlap_push``
        and ``want_params=False``, or ``overlap_pull``: the gradient is
        copied into the staging buffer, this returns at once (``grads`` may
        be overwritten) and the callback runs on the sender thread once
        every server acknowledged. The parameters it pulls (``overlap_pull``)
        reach ``params`` at the next call on the client.
        Otherwise the push is sent here, and returns once answered (after
        running the callback, if acknowledged). So a caller that reports
        progress right after ``push`` returns, when the handle is
        acknowledged, is always right.

        Args:
            num_samples: samples behind the gradient, weighting it in sync mode.
            want_params: receive the updated parameters in the reply (in sync
                mode, after the step is applied).
            on_acknowledged: what to do once the push is acknowledged (e.g.
                report the trained records to the master); never called if
                the push fails or is stale.
            key: the records the gradient sums; servers apply it at most once.
            rows: sparse-table gradients, table name -> ``(ids int64 [k]
                unique, grads float32 [k, dim])`` (the same mean as the dense
                gradient); each server gets the rows of its ids, in the same
                push.
            prefetch: sparse-table ids (as :meth:`pull_rows` takes them)
                whose rows to read right after this push: each server gets a
                ROW_PULL behind the push on the same connection, without
                waiting for the push's answer (one round trip for both), and
                answers it after the push. The rows are in
                :attr:`PushHandle.rows` once the push is done (None for a
                push sent in the background without ``overlap_pull``, which
                does not pull).
            zero_grad: zero the gradient buffer once the push no longer
                needs it, before returning: while the servers work on the
                push when every server takes it through shared memory (the
                trainer's core would otherwise wait), else after the answers
                (also when the servers read it in place, from shared memory
                mapped into the buffer), or, in the background, once it is
                staged. A server that
                fails and is retried gets the same gradient again.
            while_waiting: the caller's work for the same moment (for
                example reading the next mini-batch), run once on the calling
                thread before this returns. It must not touch the gradient
                buffer or this client; if it raises, the push is still
                answered first, then the error is raised.

        Returns:
            The push's handle; see :class:`PushHandle` for what acknowledged
            and stale mean.

        Raises:
            ServiceUnavailableError / RemoteError / ProtocolError: this push
                failed, or the previous one (sent in the background) did.
        """
        # What the caller computed on: with overlap_pull, the parameters
        # adopted before the push in flight is answered (flush adopts its).
        adopted = self._adopted
        self.flush()
        self._step += 1
        step = self._step
        background = (
            self._background is not None
            and on_acknowledged is not None
            and (not want_params or self._overlap_pull)
        )
        staged = background or self._compressed
        if staged:
            assert self._staging is not None
            self._staging.copy_(self._grads)  # converts to the wire dtype if compressed
        # A float32 background push goes through shared memory where there is
        # some: the gradient is written into it here, on the caller's thread.
        written: dict[int, _SharedMemory] = {}
        if background and not self._compressed:
            for c in self._conns:
                memory = c.shared_memory
                if memory is not None:
                    memory.write_grads(self._grads)
                    written[id(c)] = memory
        handle = PushHandle(step)
        if on_acknowledged is not None:
            handle.add_callback(on_acknowledged)
        self._last_push = handle
        # Sync: a re-sent push keeps the version it was computed on, so that a
        # server that no longer has that version answers STALE.
        computed_on = (
            {id(c): (c.version, c.generation) for c in self._conns} if self._sync else None
        )
        if self._received is not None and computed_on is None:
            computed_on = {id(c): a for c, a in zip(self._conns, adopted, strict=True)}
        by_shard = self._split_rows(rows, with_grads=True) if rows else {}
        pulls = bool(prefetch) and (not background or self._overlap_pull)
        wanted = self._split_rows(prefetch, with_grads=False) if prefetch and pulls else {}
        pulled: dict[int, np.ndarray] = {}

        def start(c: _ShardConnection) -> _SentPush:
            return c.send_push(
                self.trainer_id,
                num_samples,
                step,
                empty=False,
                want_params=want_params,
                staged=staged,
                shared=written.get(id(c)),
                key=key,
                computed_on=None if computed_on is None else computed_on[id(c)],
                rows=by_shard.get(c.layout.index),
                row_pull=wanted.get(c.layout.index),
            )

        def finish(c: _ShardConnection, sent: _SentPush) -> PushStatus:
            flat = c.finish_push(sent)
            if flat is not None:
                pulled[c.layout.index] = flat
            return c.status

        def rows_pulled() -> None:
            if pulls and prefetch:
                handle.rows = self._assemble_rows(prefetch, wanted, pulled)

        # Mapped shared memory is read by the servers until they answer: zero after.
        zero_late = zero_grad and any(c.mapped for c in self._conns)
        zero_early = zero_grad and not zero_late
        early = (
            _EarlyWork(self._grads, zero_grad=zero_early, while_waiting=while_waiting)
            if zero_early or while_waiting is not None
            else None
        )
        if background:
            assert self._background is not None
            future = self._background.submit(
                self._push_and_acknowledge, start, finish, handle, rows_pulled
            )
            self._inflight = (future, handle)
        else:
            try:
                self._push_and_acknowledge(start, finish, handle, rows_pulled, early)
            finally:
                if zero_late:  # answered (or failed, as without mapping)
                    self._grads.zero_()
            if want_params:
                self._adopt()
        if early is not None:
            early.run()  # a no-op if it ran while the servers worked
        return handle

    def _push_and_acknowledge(
        self,
        start: Callable[[_ShardConnection], _SentPush],
        finish: Callable[[_ShardConnection, _SentPush], PushStatus],
        handle: PushHandle,
        then: Callable[[], None] | None = None,
        early: _EarlyWork | None = None,
    ) -> None:
        """Send a push to every server; ``then`` runs before the handle is done.

        ``early`` runs while the servers work, if the exchange allows it (see
        :meth:`_exchange`).
        """
        try:
            statuses = self._exchange(start, finish, early)
            if then is not None:
                then()
        except BaseException as exc:
            handle._finish(exc, [])
            raise
        if PushStatus.STALE not in statuses:
            self._acknowledged += 1
        handle._finish(None, statuses)

    def push_empty(self, *, key: PushKey | None = None) -> list[PushStatus]:
        """Push no gradient, then pull: take part in the current sync step, and with
        ``key``, have every server hold its records (skipped ones: nothing to apply).

        Returns:
            Each server's answer (STALE: the caller pulls and pushes again).
        """
        self.flush()

        def start(c: _ShardConnection) -> _SentPush:
            return c.send_push(
                self.trainer_id, 0, self._step, empty=True, want_params=True, key=key
            )

        def finish(c: _ShardConnection, sent: _SentPush) -> PushStatus:
            c.finish_push(sent)
            return c.status

        statuses = self._exchange(start, finish)
        self._adopt()
        return statuses

    def _split_rows(
        self,
        rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        with_grads: bool,
    ) -> dict[int, _Rows]:
        """Cut ids (and gradient rows) by server: what each server gets, in table order.

        Raises:
            ConfigError: a table the client was not given.
            SparseTableError: an id out of a fixed table's range.
        """
        n = len(self.tables)
        parts: dict[
            int, tuple[np.ndarray, list[np.ndarray], list[np.ndarray | None], list[np.ndarray]]
        ] = {}
        no_ids = np.zeros(0, np.int64)
        for name, value in rows.items():
            t = self._table_index.get(name)
            if t is None:
                raise ConfigError(f"no sparse table named {name!r} on the parameter servers")
            ids_t, grads_t = value if isinstance(value, tuple) else (value, None)
            ids = np.ascontiguousarray(ids_t.detach().reshape(-1).to(torch.int64).numpy())
            grads = None
            if with_grads and grads_t is not None:
                grads = np.ascontiguousarray(
                    grads_t.detach().to(torch.float32).reshape(len(ids), -1).numpy()
                )
            for shard, pos in enumerate(self._table_split(t, name, ids)):
                if not len(pos):
                    continue
                counts, id_parts, row_parts, positions = parts.setdefault(
                    shard, (np.zeros(n, np.int64), [no_ids] * n, [None] * n, [no_ids] * n)
                )
                counts[t] = len(pos)
                id_parts[t] = ids[pos]
                positions[t] = pos
                if grads is not None:
                    row_parts[t] = grads[pos].reshape(-1)
        out = {}
        for shard, (counts, id_parts, row_parts, positions) in parts.items():
            flat_rows = None
            if with_grads:  # in table order, as the ids
                present = [r for r in row_parts if r is not None]
                flat_rows = np.concatenate(present) if present else np.zeros(0, np.float32)
            out[shard] = _Rows(counts, np.concatenate(id_parts), flat_rows, tuple(positions))
        return out

    def _table_split(self, t: int, name: str, ids: np.ndarray) -> list[np.ndarray]:
        """Positions of table ``t``'s ids going to each server (see ``Partitioner.split``).

        The last :data:`_RECENT_SPLITS` splits of each table are kept: a
        push's gradient rows are those of the ids its batch pulled
        (prefetched with an earlier push; with ``overlap_pull``, two pushes
        earlier, and other batches' ids were split since), so the push finds
        them split already, and range-checked.

        Raises:
            SparseTableError: an id out of a fixed table's range.
        """
        recent = self._last_split.get(t, ())
        for known, positions in recent:
            if np.array_equal(known, ids):
                return positions
        check_id_range(name, ids, self.tables[t].spec.num_embeddings)
        positions = self._partitioners[t].split(ids)
        # A copy: the caller's tensor may change later. One tuple: a reader
        # sees the whole list of splits or the one before.
        self._last_split[t] = ((ids.copy(), positions), *recent[: _RECENT_SPLITS - 1])
        return positions

    def pull_rows(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The current rows of some ids of sparse tables, from the servers that hold them.

        One ROW_PULL per server holding any of the ids, in parallel; a
        server that is lost is waited for, as for a pull.

        Args:
            ids: table name -> int64 ids (any shape; duplicates allowed but
                pulled twice).

        Returns:
            Table name -> float32 ``[k, dim]``, row ``i`` for the ``i``-th id.

        Raises:
            ConfigError: a table the client was not given.
            SparseTableError: an id out of a fixed table's range.
            RemoteError: a server refused.
            ServiceUnavailableError: a server did not come back in time.
        """
        self.flush()
        requests = self._split_rows(ids, with_grads=False)
        by_index = {c.layout.index: c for c in self._conns}
        targets = [by_index[s] for s in sorted(requests)]
        replies = self._fan_out(lambda c: c.pull_rows(requests[c.layout.index]), targets)
        return self._assemble_rows(
            ids, requests, {c.layout.index: r for c, r in zip(targets, replies, strict=True)}
        )

    def _assemble_rows(
        self,
        ids: Mapping[str, torch.Tensor],
        requests: Mapping[int, _Rows],
        replies: Mapping[int, np.ndarray],
    ) -> dict[str, torch.Tensor]:
        """Each table's rows, in its ids' order, from the servers' replies (by server index)."""
        outs: dict[int, np.ndarray] = {}
        for name, v in ids.items():
            t = self._table_index[name]
            outs[t] = np.empty((v.numel(), self.tables[t].spec.dim), dtype=np.float32)
        # Put each server's reply back at its ids' positions (found by the split).
        for index, flat in replies.items():
            request = requests[index]
            offset = 0
            for t, k in enumerate(request.counts.tolist()):
                if not k:
                    continue
                dim = self.tables[t].spec.dim
                outs[t][request.positions[t]] = flat[offset : offset + k * dim].reshape(k, dim)
                offset += k * dim
        return {name: torch.from_numpy(outs[self._table_index[name]]) for name in ids}

    def pull(self) -> None:
        """Receive every shard's parameters into the flat parameter buffer.

        Waits for the push in flight first, so the pull sees it applied.
        """
        self.flush()
        self._fan_out(lambda c: c.pull())
        self._adopt()

    def pull_consistent(self, timeout_s: float | None = None) -> None:
        """Pull until every shard is at one version and generation (sync mode).

        Shards are realigned by the master after a server restart; until
        then a pull may see a mixture, which must not be trained on.

        Args:
            timeout_s: longest wait, seconds; default ``reconnect_timeout_s``.

        Raises:
            ServiceUnavailableError: still inconsistent after ``timeout_s``.
        """
        if self.consistent:
            return
        wait_s = self._reconnect_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        delays = _backoff(0.005, 0.1)
        looks = 0
        while True:
            self.pull()
            if self.consistent:
                return
            looks += 1
            if looks % LAGGING_LOOKS == 0:
                self._join_lagging()
                continue
            if time.monotonic() >= deadline or self._stop.is_set():
                raise ServiceUnavailableError(
                    "the parameter servers did not agree on a model version within "
                    f"{wait_s:g} s: versions {self.versions}, generations {self.generations}"
                )
            self._stop.wait(next(delays))

    def _join_lagging(self) -> None:
        """Sync mode: take part, without a gradient, in the open step of shards one
        version behind the others (same generation).

        A trainer that joins while a step is open may be waited for by the
        step of one shard and not by that of another, which closed without it
        (each shard fixes whom a step waits for when the step opens, from its
        own view of etcd). Waiting for the shards to agree would then wait for
        ourselves: the lagging shard's step waits for our push. An empty push
        there completes that step with the gradients the other shard applied.
        It is harmless otherwise: a trainer here has no push in any open step,
        and a step that only empty pushes join moves no version.
        """
        if not self._sync or len(set(self.generations)) != 1:
            return
        versions = self.versions
        ahead = max(versions)
        if min(versions) != ahead - 1:
            return
        lagging = [c for c, v in zip(self._conns, versions, strict=True) if v != ahead]

        def send(c: _ShardConnection) -> None:
            c.finish_push(c.send_push(self.trainer_id, 0, self._step, empty=True, want_params=True))

        log.info(
            "shards at versions %s: joining the open step of those behind without a gradient",
            versions,
        )
        self._fan_out(send, lagging)

    def stats(self) -> list[dict[str, object]]:
        """Each server's ``stats`` control answer."""
        self.flush()
        return self._fan_out(lambda c: c.control("stats"))

    def close(self) -> None:
        """Wait for the push in flight (its errors are only logged), close every connection."""
        inflight, self._inflight = getattr(self, "_inflight", None), None
        if inflight is not None:
            try:
                inflight[0].result()
            except Exception as exc:
                log.warning("the last push was not acknowledged: %s", exc)
        for c in getattr(self, "_conns", []):
            c.release()
        for pool in (getattr(self, "_pool", None), getattr(self, "_background", None)):
            if pool is not None:
                pool.shutdown(wait=False)
