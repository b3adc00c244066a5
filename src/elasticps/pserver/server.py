"""The tensor-plane server of a parameter server.

One thread per connection. Each connection owns a preallocated gradient
buffer, so a push is received with ``recv_into`` straight into it and a pull
is answered with ``sendall`` straight from the shard's parameter tensor: no
per-message allocation and no copy on the PS side.

Protocol (see :mod:`elasticps.wire.frame` for the frame layout):

- Every request except CONTROL must carry the server's slot epoch in its
  header (0 for a server run without etcd), and every reply carries it: a
  request for another epoch gets ERROR ``wrong_epoch`` (the trainer resolved
  a server that has been replaced; it resolves again). A CONTROL request may
  carry 0 (tools, read-only ops) or the epoch.
- ``HELLO`` (JSON: shard layout, fingerprint, trainer id) -> ``HELLO_OK``
  (JSON: ``need_values``, ``version``, ``generation``). The first trainer to say hello to an
  empty shard is asked for the initial values and sends ``INIT_VALUES``;
  the others wait until the shard is initialized. A shard restored from the
  server's own checkpoint, or built from a consistent checkpoint to resume
  from (:meth:`ParameterServer.resume_from`), never asks for values: the
  HELLO only checks the layout fingerprint.
- ``PUSH`` (gradient, or ``EMPTY``) -> ``PUSH_OK``, or ``PARAMS`` if the push
  has ``WANT_PARAMS``. In sync mode the reply is sent once the step the
  gradient joined has been applied. The reply's ``status`` says whether the
  push was applied, a duplicate of a held push key, or stale (see
  :mod:`elasticps.pserver.shard`). A push whose key overlaps held records
  partly gets ERROR ``misaligned_push`` and nothing is applied.
- ``PULL`` -> ``PARAMS``. Parameters are sent under the shard's read lock,
  so a reply never carries half a step.
- Sparse tables (a layout with ``tables``): ``ROW_PULL`` (ids per table) ->
  ``ROWS`` (the rows, under the same read lock, with the version they
  belong to); a ``PUSH`` with ``Flags.ROWS`` is followed by a ``ROW_GRADS``
  frame, and both are one push (one key, one step). The counts, ids and
  row dtype are checked before anything is read into a table or applied:
  an id out of range, of another server, or repeated in a push gets ERROR
  ``bad_rows`` (non-zero rows of a frozen table ``frozen_parameter``) and
  changes nothing; the connection stays usable.
- ``CONTROL`` (JSON ``{"op": ...}``) -> ``CONTROL_OK``, with ops:

  - ``stats``: the shard's counters, and ``auth_refused``: the connections
    the handshake refused, by reason.
  - ``endpoints``: ``{"shard", "unix", "host_id"}``: the AF_UNIX path the
    server also listens on (None if it does not) and
    :func:`~elasticps.wire.frame.local_host_id`, so that a client on the same
    host can switch to the Unix socket (allowed before HELLO).
  - ``shutdown``: ask the server process to stop.
  - ``freeze`` (optional ``version`` or ``finish_round``, ``timeout_s``): stop
    the shard between two steps (pushes wait) and answer ``{"shard",
    "initialized", "version", "mode", "open_round"}``. With ``version``, first
    let the shard run until that version and freeze right after it; with
    ``"finish_round": true``, until its open sync round completes (with or
    without a step). Either only if no other connection holds a freeze, else
    ERROR ``busy``. The freeze belongs to the connection: ``thaw``, or
    the connection closing, releases it; the shard thaws when no
    connection holds one.
  - ``snapshot`` (``dir``: an absolute path; only while this connection
    holds a freeze): write ``dir/shard-<index>.safetensors`` and answer
    ``{"shard", "file", "crc32", "bytes", "version", "layout", "mode",
    "optimizer"}``.
  - ``thaw``: release this connection's freeze; answers ``{"shard", "version"}``.
  - ``coverage`` (``pass``): the records the shard holds in that pass:
    ``{"shard", "epoch", "pass", "sealed", "intervals": [[task, lo, hi], ...],
    "version", "sealed_through", "opaque"}`` (``opaque``: the values came
    from a trainer since the last seal, see ``ParameterShard.opaque``).
  - ``seal`` (``pass``, optional ``if_version``): drop the pass's push keys
    (every shard holds them all; the master checked), save a checkpoint if
    the server keeps them, and answer ``{"shard", "epoch", "version",
    "durable"}``. With ``if_version``, only if the shard is still at that
    version (else ERROR ``changed``: it was restored or rolled back since).
  - ``save``: (while this connection holds a freeze) copy the shard's state
    at the frozen version and write it as a checkpoint in the background;
    answers ``{"shard", "version", "writing"}`` at once (``checkpoints``
    lists the version once it is written). ERROR ``busy`` while the previous
    one is still being written.
  - ``checkpoints``: the versions of the checkpoints on stable storage:
    ``{"shard", "epoch", "version", "durable_versions": [...], "serving"}``.
  - ``rollback`` (``version``; while this connection holds a freeze): load
    this server's own checkpoint at that version; the open round is dropped
    (its pushes answered stale) and the server stops serving until ``serve``.
  - ``serve`` (``generation``, optional ``version``): set the sync
    generation and serve again; with ``version``, relabel the shard's version
    first (a shard that lost its state, so that every shard's version counts
    the same steps).
  - ``freeze``, ``snapshot`` and every op from ``coverage`` on answer ERROR
    ``fenced`` when the server does not certainly still hold its slot (its
    lease is not known to be valid, checked before the op and again before
    the answer), and ``seal`` also when its checkpoint could not be written
    for that reason: a successor may hold the slot, so the caller resolves
    the slot again instead of trusting this server's shard.

  A consistent checkpoint of every server is taken by
  :func:`elasticps.snapshot.take_consistent_checkpoint`. A client that
  passed the handshake is trusted: ``snapshot`` writes where it says.

Authentication: every connection, TCP or AF_UNIX, first passes the
handshake of :mod:`elasticps.wire.auth` on the job secret (with ``secret``
set; over AF_UNIX also the peer's uid), before any frame is read; a
connection that fails it is closed and counted (``stats``: ``auth_refused``).

Any malformed frame gets an ``ERROR`` reply and the connection is closed; a
well-formed request that cannot be served (wrong layout, push before hello)
gets an ``ERROR`` and the connection stays usable. Nothing is applied from a
rejected frame.

Transports: the server always listens on TCP, and also on an AF_UNIX stream
socket when given ``unix_path``; both carry the same protocol and are served
by the same code. On this 2-core machine a 100 MB round trip over Unix
sockets takes about 0.7x the time of loopback TCP (benchmarks/README.md).

Gradient compression: a PUSH may carry its gradient as FLOAT16 or BFLOAT16
(``numel * 2`` bytes) instead of FLOAT32. The server checks the dtype and the
byte count against the shard before reading the body, receives it into a
per-connection 16-bit buffer and widens it into the connection's float32
gradient buffer (one ``copy_``), so the shard always sees float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elasticps import metrics
from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import (
    AuthenticationError,
    DataError,
    ElasticPSError,
    FrameError,
    FrozenParameterError,
    LayoutMismatchError,
    ProtocolError,
    SparseTableError,
)
from elasticps.placement import PAGE_NUMEL
from elasticps.pserver.checkpoint import ShardFiles, save_shard, tables_dir_of
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.shard import (
    SPARSE_STATE_KEY,
    FreezeTimeoutError,
    MisalignedPushError,
    ParameterShard,
    ShardClosedError,
)
from elasticps.pserver.sparse import EvictionPolicy
from elasticps.pserver.sparse_checkpoint import load_tables_state
from elasticps.pserver.sparse_shard import RowGrads, ShardTables, split_counts
from elasticps.security import JobSecret, Refusals
from elasticps.snapshot import ConsistentCheckpoint, shard_file_name, shard_state_for_layout
from elasticps.storage import Location, is_url
from elasticps.tls import JobTLS
from elasticps.wire.auth import HANDSHAKE_TIMEOUT_S, check_peer_uid, server_handshake
from elasticps.wire.frame import (
    HEADER_SIZE,
    ConnectionClosedError,
    DType,
    Flags,
    FrameHeader,
    MsgType,
    PushStatus,
    discard_body,
    local_host_id,
    map_shared_region,
    recv_body_into,
    recv_exact_into,
    recv_header,
    recv_json,
    send_error,
    send_frame,
    send_json,
    shared_region_nbytes,
    tensor_view,
)

log = logging.getLogger(__name__)

# Upper bound for a shard announced in a HELLO: 16 GiB of float32.
MAX_SHARD_NUMEL = 4 << 30
# Default and upper bound of a freeze op's "timeout_s", seconds.
FREEZE_TIMEOUT_S = 60.0
MAX_FREEZE_TIMEOUT_S = 3600.0
# Gradient dtypes a PUSH may carry; 16-bit ones are widened to float32 on arrival.
PUSH_DTYPES = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})
# Largest ROW_PULL or ROW_GRADS body, bytes (ids and rows of one request).
MAX_ROW_BODY_BYTES = 1 << 30


class ParameterServer:
    """Serves one shard over TCP, and over an AF_UNIX socket if ``unix_path`` is given.

    Args:
        shard_index: the index this server claimed in etcd (``/ps/<index>``).
        mode: sync-SGD or async-SGD.
        optimizer: optimizer configuration.
        host: interface to bind.
        port: TCP port; 0 picks a free one.
        init_timeout_s: seconds a HELLO waits for another trainer to finish
            initializing the shard.
        on_shutdown: called (from a connection thread) when a client sends
            the ``shutdown`` control command.
        frozen: glob patterns of frozen parameters (see ``ParameterShard``).
        max_staleness: async staleness bound (see ``ParameterShard``).
        reduction: sync reduction, ``"mean"`` or ``"sum"`` (see ``ParameterShard``).
        unix_path: also listen on this AF_UNIX path (at most 107 bytes; a
            stale socket file there is replaced; removed by :meth:`stop`).
            None: TCP only.
        gate: called before a push or pull is served; it blocks while the
            server may not act (its etcd lease is not known to be valid: a
            successor may hold the slot) and raises
            :class:`~elasticps.pserver.shard.ShardClosedError` once it never
            may again. None: always may.
        holds_slot: whether this server certainly still holds its slot now
            (its etcd lease is known to be valid), checked without blocking
            before and after every recovery or snapshot control op (see
            ``_RECOVERY_OPS``): a server that was paused past its lease
            answers them with ERROR ``fenced``, never with what it held,
            because a successor may hold the slot by then. None: always holds.
        eviction: which rows of sparse tables to evict, or None.
        secret: the job secret every connection must prove before its first
            frame (:mod:`elasticps.wire.auth`); None serves any client.
        tls: the TLS setup every TCP connection must complete first
            (:mod:`elasticps.tls`); None: plain TCP.

    Attributes:
        epoch: the slot epoch this server holds (set after its claim; 0
            without etcd). Requests must carry it.
        files: this server's own checkpoint files (set after its claim), for
            the ``seal``, ``save``, ``checkpoints`` and ``rollback`` ops; None
            if it keeps no checkpoints.

    Raises:
        OSError: a listener cannot be bound.
    """

    def __init__(
        self,
        shard_index: int,
        mode: UpdateMode,
        optimizer: OptimizerConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        init_timeout_s: float = 60.0,
        on_shutdown: Callable[[], None] | None = None,
        unix_path: str | os.PathLike[str] | None = None,
        frozen: tuple[str, ...] = (),
        max_staleness: int | None = None,
        gate: Callable[[], None] | None = None,
        holds_slot: Callable[[], bool] | None = None,
        reduction: str = "mean",
        eviction: EvictionPolicy | None = None,
        secret: JobSecret | None = None,
        tls: JobTLS | None = None,
    ) -> None:
        self._auth_key = None if secret is None else secret.tensor_plane_key()
        self._tls = tls
        self._shard_metrics: _ShardMetrics | None = None
        # Connections refused by the handshake (CONTROL "stats": auth_refused).
        self._refusals = Refusals()
        self._shard_options: dict[str, Any] = {
            "frozen": frozen,
            "max_staleness": max_staleness,
            "reduction": reduction,
            "eviction": eviction,
        }
        self.shard_index = shard_index
        self.epoch = 0
        self.files: ShardFiles | None = None
        self._gate = gate
        self._holds_slot = holds_slot
        self.mode = mode
        self._optimizer = optimizer
        self._init_timeout_s = init_timeout_s
        self._on_shutdown = on_shutdown
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._unix_path = None if unix_path is None else str(unix_path)
        self._unix_listener: socket.socket | None = None
        if self._unix_path is not None:
            try:
                self._unix_listener = _unix_listener(self._unix_path)
            except OSError:
                self._listener.close()
                raise
        self._host_id = local_host_id()
        self._cond = threading.Condition()
        self._shard: ParameterShard | None = None
        self._initializing: socket.socket | None = None
        self._pending_shard: ParameterShard | None = None
        self._live: set[int] = set()
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        # Connections holding a freeze (CONTROL "freeze"); the shard is frozen
        # while this is not empty.
        self._updated_any = False
        self._freezers: set[socket.socket] = set()
        self._resume: ConsistentCheckpoint | None = None
        self._resume_dir: Location | None = None
        self._save_thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` the server listens on."""
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    @property
    def unix_path(self) -> str | None:
        """The AF_UNIX path the server also listens on, or None."""
        return self._unix_path

    @property
    def shard(self) -> ParameterShard | None:
        """The shard, once a trainer has initialized it."""
        with self._cond:
            return self._shard

    def install_shard(self, shard: ParameterShard) -> None:
        """Serve ``shard`` (restored from a checkpoint) instead of waiting for a trainer.

        Call before :meth:`serve_forever`.

        Raises:
            LayoutMismatchError: the shard's layout is for another index.
        """
        if shard.layout.get("shard") != self.shard_index:
            raise LayoutMismatchError(
                f"the shard's layout is for parameter server {shard.layout.get('shard')!r}, "
                f"this is {self.shard_index}"
            )
        with self._cond:
            self._install(shard)

    def resume_from(
        self, checkpoint: ConsistentCheckpoint | None, directory: Path | Location | None = None
    ) -> None:
        """Fill the shard from ``checkpoint`` when the first trainer says hello.

        The first HELLO's layout picks the pieces (by parameter name) and the
        trainer is not asked for values. The checkpoint is dropped once used.
        ``directory`` is where it was read from: sparse tables are read from
        there, keeping the rows this server holds under the layout's
        partitioning (any number of servers).
        """
        with self._cond:
            self._resume = checkpoint
            self._resume_dir = None if directory is None else Location.of(directory)

    def _install(self, shard: ParameterShard) -> None:
        # Caller holds self._cond.
        shard.set_live_trainers(self._live)
        if self._freezers:
            shard.freeze()
        self._shard = shard
        self._cond.notify_all()

    def set_live_trainers(self, trainer_ids: set[int]) -> None:
        """Forward etcd membership to the shard's sync barrier."""
        with self._cond:
            self._live = set(trainer_ids)
            shard = self._shard
        if shard is not None:
            shard.set_live_trainers(trainer_ids)

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`; one daemon thread per connection.

        The Unix listener, if any, is served by a second daemon thread.
        """
        if self._unix_listener is not None:
            threading.Thread(
                target=self._accept_loop,
                args=(self._unix_listener, False),
                name="ps-accept-unix",
                daemon=True,
            ).start()
        self._accept_loop(self._listener, True)

    def _accept_loop(self, listener: socket.socket, tcp: bool) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            if tcp:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._conns.add(conn)
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()

    def stop(self) -> None:
        """Stop accepting, release waiting pushes, close every connection."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._unix_listener is not None:
            with contextlib.suppress(OSError):
                self._unix_listener.shutdown(socket.SHUT_RDWR)
            self._unix_listener.close()
            assert self._unix_path is not None
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)
        with self._cond:
            shard, conns = self._shard, list(self._conns)
        if shard is not None:
            shard.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # --- one connection -----------------------------------------------------

    def _metrics(self) -> _ShardMetrics:
        """This server's metrics, labelled with the shard it holds now."""
        current = self._shard_metrics
        if current is None or current.shard != self.shard_index:
            current = self._shard_metrics = _ShardMetrics(self.shard_index)
        return current

    def _refused(self, exc: AuthenticationError) -> None:
        refused = self._refusals.add(exc.reason)
        if refused is not None:
            log.warning(
                "ps %d: refused an unauthenticated connection (%s: %s); %d refused so far",
                self.shard_index, exc.reason, exc, refused,
            )  # fmt: skip

    def _secure(self, conn: socket.socket) -> socket.socket | None:
        """Run TLS on a new TCP connection if the job uses it (:mod:`elasticps.tls`).

        Returns:
            The connection to serve (the TLS one, which replaces ``conn`` in the
            set :meth:`stop` closes), or None if the handshake failed (counted).
        """
        if self._tls is None or conn.family == socket.AF_UNIX:
            return conn
        try:
            secure = self._tls.wrap_server(conn, HANDSHAKE_TIMEOUT_S)
        except AuthenticationError as exc:
            self._refused(exc)
            return None
        with self._cond:
            self._conns.discard(conn)
            if self._stopping.is_set():
                secure.close()
                return None
            self._conns.add(secure)
        return secure

    def _authenticate(self, conn: socket.socket) -> bool:
        """Run the handshake on a new connection; count and log a refusal."""
        try:
            if conn.family == socket.AF_UNIX:
                check_peer_uid(conn)
            server_handshake(conn, self._auth_key, self.epoch)
        except AuthenticationError as exc:
            self._refused(exc)
            return False
        return True

    def _serve_connection(self, accepted: socket.socket) -> None:
        conn = self._secure(accepted)
        if conn is None:
            with self._cond:
                self._conns.discard(accepted)
            accepted.close()
            return
        state = _Connection(conn)
        try:
            if not self._authenticate(conn):
                return
            while True:
                max_body = self._max_body_bytes(state)
                header = recv_header(conn, state.scratch, max_body_bytes=max_body)
                try:
                    self._dispatch(state, header)
                except (LayoutMismatchError, _RequestError) as exc:
                    code = getattr(exc, "code", "layout_mismatch")
                    self._metrics().refused(code)
                    send_error(conn, code, str(exc))
                except FrozenParameterError as exc:
                    # The gradient was read in full and not applied: the
                    # connection stays usable.
                    send_error(conn, "frozen_parameter", str(exc))
                except MisalignedPushError as exc:
                    log.error("ps %d: %s", self.shard_index, exc)
                    send_error(conn, "misaligned_push", str(exc))
                except SparseTableError as exc:
                    # The frames were read in full and nothing was applied.
                    send_error(conn, "bad_rows", str(exc))
        except ConnectionClosedError:
            pass
        except FrameError as exc:
            log.warning("ps %d: closing connection after a bad frame: %s", self.shard_index, exc)
            with contextlib.suppress(OSError):
                send_error(conn, "bad_frame", str(exc))
        except ShardClosedError:
            pass
        except (OSError, ProtocolError) as exc:
            if not self._stopping.is_set():
                log.info("ps %d: connection ended: %s", self.shard_index, exc)
        finally:
            self._release_freeze(conn)
            with self._cond:
                self._conns.discard(conn)
                if self._initializing is conn:
                    # The initializer died mid-way: let another trainer initialize.
                    self._initializing = None
                    self._pending_shard = None
                    self._cond.notify_all()
            conn.close()

    def _max_body_bytes(self, state: _Connection) -> int:
        with self._cond:
            if self._initializing is state.conn and self._pending_shard is not None:
                return self._pending_shard.numel * 4
            if self._shard is not None:
                # Also before HELLO: a full-size PUSH sent too early is well-formed,
                # so it is discarded and answered "no_hello" on a usable connection.
                rows = MAX_ROW_BODY_BYTES if self._shard.tables is not None else 0
                return max(self._shard.numel * 4, rows)
        return 0

    def _dispatch(self, state: _Connection, header: FrameHeader) -> None:
        kind = header.msg_type
        if kind is not MsgType.CONTROL and header.epoch != self.epoch:
            discard_body(state.conn, header, state.scratch)
            raise _RequestError(
                "wrong_epoch",
                f"this parameter server holds slot {self.shard_index} at epoch {self.epoch}, "
                f"the request is for epoch {header.epoch}: resolve the slot again",
            )
        if kind is MsgType.HELLO:
            self._on_hello(state, recv_json(state.conn, header))
        elif kind is MsgType.INIT_VALUES:
            self._on_init_values(state, header)
        elif kind is MsgType.PUSH:
            self._on_push(state, header)
        elif kind is MsgType.PULL:
            started = time.perf_counter()
            shard = self._require_shard(state)
            self._pass_gate(shard)
            self._send_params(state.conn, shard)
            self._metrics().pull_seconds.observe(time.perf_counter() - started)
        elif kind is MsgType.ROW_PULL:
            self._on_row_pull(state, header)
        elif kind is MsgType.CONTROL:
            if header.epoch not in (0, self.epoch):
                discard_body(state.conn, header, state.scratch)
                raise _RequestError(
                    "wrong_epoch",
                    f"parameter server {self.shard_index} is at epoch {self.epoch}, "
                    f"the control request is for epoch {header.epoch}",
                )
            self._on_control(state, recv_json(state.conn, header))
        else:
            discard_body(state.conn, header, state.scratch)
            raise _RequestError("unexpected_message", f"{kind.name} is not a request")

    def _pass_gate(self, shard: ParameterShard) -> None:
        """Block until this server may serve (lease valid, shard serving)."""
        if self._gate is not None:
            self._gate()
        shard.wait_serving()

    def _require_shard(self, state: _Connection) -> ParameterShard:
        with self._cond:
            shard = self._shard
        if shard is None or not state.hello_done:
            raise _RequestError("no_hello", "send HELLO before PUSH or PULL")
        return shard

    def _on_hello(self, state: _Connection, msg: dict[str, object]) -> None:
        layout = msg.get("layout")
        fingerprint = msg.get("fingerprint")
        trainer_id = msg.get("trainer_id")
        if not isinstance(layout, dict) or not isinstance(fingerprint, str):
            raise _RequestError("bad_hello", "HELLO needs a 'layout' object and a 'fingerprint'")
        if not isinstance(trainer_id, int) or trainer_id < 0:
            raise _RequestError("bad_hello", "HELLO needs a non-negative integer 'trainer_id'")
        if layout.get("shard") != self.shard_index:
            raise _RequestError(
                "wrong_shard",
                f"this is parameter server {self.shard_index}, the layout is for "
                f"{layout.get('shard')!r}",
            )
        numel = layout.get("numel")
        if not isinstance(numel, int) or not 0 <= numel <= MAX_SHARD_NUMEL:
            raise _RequestError("bad_hello", f"layout numel must be in 0..{MAX_SHARD_NUMEL}")
        state.trainer_id = trainer_id
        with self._cond:
            deadline_ok = self._cond.wait_for(
                lambda: self._shard is not None or self._initializing is None,
                timeout=self._init_timeout_s,
            )
            if not deadline_ok:
                raise _RequestError("init_timeout", "another trainer is still initializing")
            if self._shard is None and self._resume is not None:
                self._install(self._shard_from_resume(layout, fingerprint))
            if self._shard is not None:
                self._shard.check_fingerprint(fingerprint)
                state.hello_done = True
                version = self._shard.version
                need_values = False
            else:
                self._pending_shard = ParameterShard(
                    layout, fingerprint, self._optimizer, self.mode, **self._shard_options
                )
                self._initializing = state.conn
                version = 0
                need_values = True
        send_json(
            state.conn,
            MsgType.HELLO_OK,
            {
                "need_values": need_values,
                "version": version,
                "shard": self.shard_index,
                "generation": 0 if need_values or self._shard is None else self._shard.generation,
            },
            epoch=self.epoch,
        )

    def _on_init_values(self, state: _Connection, header: FrameHeader) -> None:
        with self._cond:
            pending = self._pending_shard if self._initializing is state.conn else None
        if pending is None:
            discard_body(state.conn, header, state.scratch)
            raise _RequestError("not_initializer", "INIT_VALUES without a HELLO that asked for it")
        if header.dtype is not DType.FLOAT32 or header.body_nbytes != pending.numel * 4:
            discard_body(state.conn, header, state.scratch)
            raise _RequestError("bad_init", f"INIT_VALUES must be {pending.numel} float32 values")
        recv_body_into(state.conn, header, [tensor_view(pending.values)])
        pending.mark_opaque()
        with self._cond:
            self._install(pending)
            self._pending_shard = None
            self._initializing = None
            state.hello_done = True
        log.info("ps %d: initialized %d parameters", self.shard_index, pending.numel)
        send_json(
            state.conn,
            MsgType.HELLO_OK,
            {"need_values": False, "version": 0, "shard": self.shard_index, "generation": 0},
            epoch=self.epoch,
        )

    def _on_push(self, state: _Connection, header: FrameHeader) -> None:
        started = time.perf_counter()
        try:
            shard = self._require_shard(state)
        except _RequestError:
            discard_body(state.conn, header, state.scratch)
            self._skip_rows_frame(state, header)
            raise
        assert state.trainer_id is not None  # set by HELLO
        grad: torch.Tensor | None = None
        # With SHARED, the parameters of a WANT_PARAMS reply go to shared memory.
        params_into: torch.Tensor | None = None
        if header.flags & Flags.SHARED:
            shared = state.shared
            if shared is None or shared.numel != shard.numel:
                self._skip_rows_frame(state, header)
                raise _RequestError(
                    "bad_push",
                    "a PUSH with flag SHARED needs shared memory attached to the connection "
                    "(CONTROL attach_shm) for this shard",
                )
            grad, params_into = shared.grads, shared.params
        elif not header.flags & Flags.EMPTY:
            dtype = header.dtype
            if dtype not in PUSH_DTYPES or header.body_nbytes != shard.numel * dtype.itemsize:
                discard_body(state.conn, header, state.scratch)
                self._skip_rows_frame(state, header)
                raise _RequestError(
                    "bad_push",
                    f"PUSH must carry {shard.numel} float32, float16 or bfloat16 values, "
                    f"got {header.body_nbytes} bytes of {dtype.name}",
                )
            if state.grad_buffer is None or state.grad_buffer.numel() != shard.numel:
                state.grad_buffer = torch.empty(shard.numel, dtype=torch.float32)
            if dtype is DType.FLOAT32:
                recv_body_into(state.conn, header, [tensor_view(state.grad_buffer)])
            else:
                wire = state.wire_buffer(shard.numel, dtype.to_torch())
                recv_body_into(state.conn, header, [tensor_view(wire)])
                state.grad_buffer.copy_(wire)  # widened to float32
            grad = state.grad_buffer
        rows = self._recv_push_rows(state, header, shard) if header.flags & Flags.ROWS else None
        key = (
            PushKey(header.pass_id, header.task_id, header.key_lo, header.key_hi)
            if header.keyed
            else None
        )
        if self._gate is not None:
            self._gate()
        staleness = max(0, shard.version - header.model_version)
        result = shard.push(
            state.trainer_id,
            grad,
            header.model_version,
            header.num_samples,
            key=key,
            generation=header.generation if self.mode is UpdateMode.SYNC else None,
            rows=rows,
        )
        if result.accepted and not self._updated_any:
            # Marks the end of a recovery in logs (benchmarks/recovery.py reads it).
            self._updated_any = True
            log.info("ps %d: first gradient accepted by this server", self.shard_index)
        if header.flags & Flags.WANT_PARAMS:
            self._send_params(state.conn, shard, result.status, into=params_into)
        else:
            send_frame(
                state.conn,
                FrameHeader(
                    MsgType.PUSH_OK,
                    model_version=result.version,
                    epoch=self.epoch,
                    generation=shard.generation,
                    status=result.status,
                ),
            )
        m = self._metrics()
        m.push_seconds.observe(time.perf_counter() - started)
        m.push_bytes.inc(shard.numel * 4 if header.flags & Flags.SHARED else header.body_nbytes)
        m.pushes[result.status].inc()
        m.version.set(result.version)
        if self.mode is not UpdateMode.SYNC:
            m.staleness.observe(staleness)
        else:
            m.sync_wait.observe(result.waited_s)

    # --- sparse rows ------------------------------------------------------------

    def _skip_rows_frame(self, state: _Connection, header: FrameHeader) -> None:
        """Read and drop the ROW_GRADS frame that follows a PUSH with ROWS (a refused push).

        Raises:
            FrameError: the next frame is not ROW_GRADS (the stream cannot be trusted).
        """
        if not header.flags & Flags.ROWS:
            return
        rows_header = recv_header(
            state.conn, state.scratch, max_body_bytes=max(MAX_ROW_BODY_BYTES, header.body_nbytes)
        )
        if rows_header.msg_type is not MsgType.ROW_GRADS:
            raise FrameError(
                f"a PUSH with ROWS must be followed by ROW_GRADS, not {rows_header.msg_type.name}"
            )
        discard_body(state.conn, rows_header, state.scratch)

    def _recv_counts_and_ids(
        self, state: _Connection, header: FrameHeader, tables: ShardTables, row_itemsize: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Receive a row frame's counts and ids; the rest of the body (rows) stays unread.

        Raises:
            SparseTableError: the counts do not fit the body (the body is then
                read to its end, so the connection stays usable).
        """
        head = 8 * len(tables)
        if header.body_nbytes < head:
            discard_body(state.conn, header, state.scratch)
            raise SparseTableError(
                f"a {header.msg_type.name} body needs {len(tables)} counts, got "
                f"{header.body_nbytes} bytes"
            )
        counts = np.empty(len(tables), dtype=np.int64)
        recv_exact_into(state.conn, counts.data.cast("B"))
        try:
            total = split_counts(counts, tables.dims, header.body_nbytes, row_itemsize)
        except SparseTableError:
            rest = dataclasses.replace(header, body_nbytes=header.body_nbytes - head)
            discard_body(state.conn, rest, state.scratch)
            raise
        ids = np.empty(total, dtype=np.int64)
        recv_exact_into(state.conn, ids.data.cast("B"))
        return counts, ids

    def _recv_push_rows(
        self, state: _Connection, header: FrameHeader, shard: ParameterShard
    ) -> RowGrads:
        """Receive and check the ROW_GRADS frame of a PUSH with ROWS.

        Raises:
            FrameError: the next frame is not ROW_GRADS.
            SparseTableError / FrozenParameterError: the rows are refused
                (read to their end; nothing applied).
        """
        rows_header = recv_header(
            state.conn, state.scratch, max_body_bytes=self._max_body_bytes(state)
        )
        if rows_header.msg_type is not MsgType.ROW_GRADS:
            raise FrameError(
                f"a PUSH with ROWS must be followed by ROW_GRADS, not {rows_header.msg_type.name}"
            )
        tables = shard.tables
        if tables is None or rows_header.dtype not in PUSH_DTYPES:
            discard_body(state.conn, rows_header, state.scratch)
            raise SparseTableError(
                "this parameter server holds no sparse tables"
                if tables is None
                else f"gradient rows must be float32, float16 or bfloat16, not "
                f"{rows_header.dtype.name}"
            )
        counts, ids = self._recv_counts_and_ids(
            state, rows_header, tables, rows_header.dtype.itemsize
        )
        elements = int(sum(int(c) * d for c, d in zip(counts.tolist(), tables.dims, strict=True)))
        wire = torch.empty(elements, dtype=rows_header.dtype.to_torch())
        recv_exact_into(state.conn, tensor_view(wire))
        flat = wire.to(torch.float32).numpy()
        per_table = tables.split_ids(counts, ids, unique=True)
        return tables.split_rows(per_table, flat)

    def _on_row_pull(self, state: _Connection, header: FrameHeader) -> None:
        try:
            shard = self._require_shard(state)
        except _RequestError:
            discard_body(state.conn, header, state.scratch)
            raise
        tables = shard.tables
        if tables is None:
            discard_body(state.conn, header, state.scratch)
            raise SparseTableError("this parameter server holds no sparse tables")
        counts, ids = self._recv_counts_and_ids(state, header, tables, 0)
        per_table = tables.split_ids(counts, ids, unique=False)
        self._pass_gate(shard)
        generation = shard.generation
        with shard.reading() as version:
            # Under the read lock: no step (nor a restore) changes a table meanwhile.
            rows = tables.lookup(per_table)
        send_frame(
            state.conn,
            FrameHeader(
                MsgType.ROWS,
                dtype=DType.FLOAT32,
                model_version=version,
                body_nbytes=rows.nbytes,
                epoch=self.epoch,
                generation=generation,
            ),
            [rows.data.cast("B")],
        )

    def _send_params(
        self,
        conn: socket.socket,
        shard: ParameterShard,
        status: PushStatus = PushStatus.APPLIED,
        *,
        into: torch.Tensor | None = None,
    ) -> None:
        """Send the shard's parameters: in the body, or written into ``into`` (the
        connection's shared memory, float32 ``[numel]``) with an empty body."""
        values = shard.values
        generation = shard.generation
        with shard.reading() as version:
            if into is not None:
                into.copy_(values)
            send_frame(
                conn,
                FrameHeader(
                    MsgType.PARAMS,
                    dtype=DType.FLOAT32,
                    model_version=version,
                    body_nbytes=0 if into is not None else values.numel() * 4,
                    epoch=self.epoch,
                    generation=generation,
                    status=status,
                ),
                () if into is not None else [tensor_view(values)],
            )

    def _on_control(self, state: _Connection, msg: dict[str, object]) -> None:
        op = msg.get("op")
        shard = self.shard
        if op == "stats":
            stats = shard.stats() if shard is not None else None
            body: dict[str, object] = {
                "shard": self.shard_index,
                "initialized": shard is not None,
                "stats": None if stats is None else stats.__dict__,
            }
            body["auth_refused"] = self._refusals.counts()
            if shard is not None and shard.tables is not None:
                with shard.reading():
                    body["sparse_rows"] = shard.tables.rows_held()
                body["sparse_evicted"] = shard.tables.evicted
            send_json(state.conn, MsgType.CONTROL_OK, body, epoch=self.epoch)
        elif op == "endpoints":
            send_json(
                state.conn,
                MsgType.CONTROL_OK,
                {
                    "shard": self.shard_index,
                    "unix": self._unix_path,
                    "host_id": self._host_id,
                    "shm": True,  # CONTROL attach_shm is understood
                },
                epoch=self.epoch,
            )
        elif op == "attach_shm":
            send_json(
                state.conn, MsgType.CONTROL_OK, self._attach_shm(state, msg), epoch=self.epoch
            )
        elif op == "shutdown":
            send_json(state.conn, MsgType.CONTROL_OK, {"shard": self.shard_index}, epoch=self.epoch)
            if self._on_shutdown is not None:
                self._on_shutdown()
        elif op == "freeze":
            reply = self._holding_slot(
                lambda: self._freeze(state.conn, msg),
                undo=lambda: self._release_freeze(state.conn),
            )
            send_json(state.conn, MsgType.CONTROL_OK, reply, epoch=self.epoch)
        elif op == "snapshot":
            reply = self._holding_slot(lambda: self._snapshot(state.conn, msg))
            send_json(state.conn, MsgType.CONTROL_OK, reply, epoch=self.epoch)
        elif op == "thaw":
            self._release_freeze(state.conn)
            shard = self.shard
            version = None if shard is None else shard.version
            send_json(
                state.conn,
                MsgType.CONTROL_OK,
                {"shard": self.shard_index, "version": version},
                epoch=self.epoch,
            )
        elif op in _RECOVERY_OPS:
            reply = self._holding_slot(lambda: getattr(self, f"_op_{op}")(state.conn, msg))
            send_json(
                state.conn,
                MsgType.CONTROL_OK,
                {"shard": self.shard_index, **reply},
                epoch=self.epoch,
            )
            if op == "seal":
                # The next pass waits for the seal's answer, not for this.
                self._prune_checkpoints()
        else:
            raise _RequestError("bad_control", f"unknown control op {json.dumps(op)}")

    def _attach_shm(self, state: _Connection, msg: dict[str, object]) -> dict[str, object]:
        """Map the shared memory a trainer hands over (see :mod:`elasticps.wire.frame`,
        "Shared memory"); the answer says whether it is used, and if not, why.

        Raises:
            FrameError: the connection is not AF_UNIX (no descriptor can follow),
                or the byte carrying the descriptor is missing.
        """
        if state.conn.family != socket.AF_UNIX:
            raise FrameError("attach_shm is only possible over AF_UNIX")
        # The descriptor rides on the one byte right behind the request: read it
        # first, whatever the answer, so the stream stays in step.
        data, fds, _, _ = socket.recv_fds(state.conn, 1, 1)
        if data != b"\0":
            for fd in fds:
                os.close(fd)
            raise FrameError("attach_shm must be followed by one 0 byte carrying a descriptor")
        reason = ""
        try:
            with self._cond:
                shard = self._shard
            numel = msg.get("numel")
            params_at = msg.get("params_at", numel)
            if shard is None or not state.hello_done:
                reason = "send HELLO first"
            elif len(fds) != 1:
                reason = f"{len(fds)} descriptors came with the request, not 1"
            elif not isinstance(numel, int) or numel != shard.numel or numel == 0:
                reason = f"numel must be this shard's ({shard.numel}), got {numel!r}"
            elif (
                not isinstance(params_at, int)
                or isinstance(params_at, bool)
                or not numel <= params_at <= numel + PARAMS_AT_MAX_PAD
            ):
                top = numel + PARAMS_AT_MAX_PAD
                reason = f"params_at must be {numel}..{top}, got {params_at!r}"
            else:
                reason = _check_shared_file(fds[0], shared_region_nbytes(numel, params_at))
                if not reason:
                    state.shared = _SharedRegion(fds[0], numel, params_at)
        finally:
            for fd in fds:
                os.close(fd)
        if reason:
            log.info("ps %d: shared memory not attached: %s", self.shard_index, reason)
            return {"shard": self.shard_index, "attached": False, "reason": reason}
        return {"shard": self.shard_index, "attached": True}

    # --- exactly-once and realignment (driven by the master) -------------------------

    def _holding_slot(
        self,
        work: Callable[[], dict[str, object]],
        undo: Callable[[], None] | None = None,
    ) -> dict[str, object]:
        """Do ``work`` (a control op) only while this server holds its slot; its answer.

        Checked before the work and again after it: the server may have been
        paused in it past its lease, and a successor restored from an older
        file meanwhile. ``undo`` reverts the work when the second check fails.

        Raises:
            _RequestError: ``fenced``, or what ``work`` raised.
        """
        self._check_holds_slot()
        reply = work()
        try:
            self._check_holds_slot()
        except _RequestError:
            if undo is not None:
                undo()
            raise
        return reply

    def _check_holds_slot(self) -> None:
        """Raise ERROR ``fenced`` unless this server certainly still holds its slot.

        Raises:
            _RequestError: the lease is not known to be valid now.
        """
        if self._holds_slot is not None and not self._holds_slot():
            raise _RequestError(
                "fenced",
                f"parameter server {self.shard_index} (epoch {self.epoch}) may no longer hold "
                "its slot (its lease is not known to be valid): resolve the slot again",
            )

    def _initialized(self) -> ParameterShard:
        shard = self.shard
        if shard is None:
            raise _RequestError("not_initialized", "the shard holds no parameters yet")
        return shard

    def _op_coverage(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        pass_id = _int_field(msg, "pass")
        shard = self._initialized()
        sealed, intervals = shard.coverage_of(pass_id)
        return {
            "epoch": self.epoch,
            "pass": pass_id,
            "sealed": sealed,
            "intervals": [list(iv) for iv in intervals],
            "version": shard.version,
            "sealed_through": shard.stats().sealed_through,
            "opaque": shard.opaque,
        }

    def _op_seal(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        pass_id = _int_field(msg, "pass")
        shard = self._initialized()
        if "if_version" in msg and _int_field(msg, "if_version") != shard.version:
            # Restored or rolled back since the master checked its coverage.
            raise _RequestError(
                "changed", f"the shard is at version {shard.version}, not {msg['if_version']}"
            )
        shard.seal(pass_id)
        durable = False
        if self.files is not None:
            try:
                saved = self.files.save(*shard.state(), prune=False)
            except OSError as exc:
                raise _RequestError(
                    "checkpoint_failed", f"cannot save the sealed shard: {exc}"
                ) from exc
            durable = saved is not None
            if not durable:
                # Writing is refused only when the lease is not known to be
                # valid: a successor may already serve an older file.
                raise _RequestError(
                    "fenced",
                    f"parameter server {self.shard_index} (epoch {self.epoch}) may no longer "
                    "hold its slot; the sealed shard was not saved",
                )
        log.info(
            "ps %d: sealed pass %d at version %d%s",
            self.shard_index, pass_id, shard.version, "" if durable else " (not saved)",
        )  # fmt: skip
        return {"epoch": self.epoch, "version": shard.version, "durable": durable}

    def _prune_checkpoints(self) -> None:
        """Remove the checkpoint files beyond the newest few (after a seal's answer)."""
        if self.files is None:
            return
        try:
            self.files.prune()
        except OSError as exc:
            log.warning("ps %d: cannot prune old checkpoints: %s", self.shard_index, exc)

    def _op_save(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        shard = self._initialized()
        with self._cond:
            held = conn in self._freezers
        if not held or not shard.frozen:
            raise _RequestError("not_frozen", "send freeze on this connection before save")
        if self.files is None:
            return {"epoch": self.epoch, "version": shard.version, "durable": False}
        # Copied now, while frozen (a memory copy); written by a background
        # thread after the reply, so the freeze lasts no longer than the copy.
        # The file counts once written (``checkpoints`` lists it then).
        tensors, meta = shard.state()
        files = self.files
        version = shard.version

        def write() -> None:
            try:
                files.save(tensors, meta)
            except (OSError, TypeError, ValueError) as exc:
                log.error(
                    "CHECKPOINT FAILED: ps %d could not save version %d: %s",
                    self.shard_index, version, exc,
                )  # fmt: skip

        with self._cond:
            previous = self._save_thread
            if previous is not None and previous.is_alive():
                raise _RequestError("busy", "the previous checkpoint is still being written")
            self._save_thread = threading.Thread(target=write, name="ps-save", daemon=True)
            self._save_thread.start()
        return {"epoch": self.epoch, "version": version, "durable": False, "writing": True}

    def _op_checkpoints(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        shard = self.shard
        return {
            "epoch": self.epoch,
            "initialized": shard is not None,
            "version": None if shard is None else shard.version,
            "generation": None if shard is None else shard.generation,
            "serving": None if shard is None else shard.serving,
            "mode": self.mode.value,
            "durable_versions": [] if self.files is None else self.files.durable_versions(),
        }

    def _op_rollback(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        version = _int_field(msg, "version")
        shard = self._initialized()
        with self._cond:
            held = conn in self._freezers
        if not held or not shard.frozen:
            raise _RequestError("not_frozen", "send freeze on this connection before rollback")
        shard.set_serving(False)
        if shard.version != version:
            if self.files is None:
                raise _RequestError("no_checkpoint", "this server keeps no checkpoints")
            try:
                tensors, meta = self.files.load_version(version)
            except DataError as exc:
                raise _RequestError("no_checkpoint", str(exc)) from exc
            shard.load_state(tensors, meta)
            log.warning(
                "ps %d: rolled back to version %d from %s",
                self.shard_index, version, self.files.path_of(version),
            )  # fmt: skip
        else:
            dropped = shard.discard_round()
            if dropped:
                log.info("ps %d: dropped the open round (%d pushes)", self.shard_index, dropped)
        return {"epoch": self.epoch, "version": shard.version}

    def _op_serve(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        generation = _int_field(msg, "generation")
        shard = self._initialized()
        if "version" in msg:
            shard.relabel_version(_int_field(msg, "version"))
        shard.set_generation(generation)
        shard.set_serving(True)
        log.info(
            "ps %d: serving generation %d at version %d",
            self.shard_index, generation, shard.version,
        )  # fmt: skip
        return {"epoch": self.epoch, "version": shard.version, "generation": generation}

    # --- consistent snapshots -------------------------------------------------

    def _freeze(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        at_version = msg.get("version")
        if at_version is not None and (
            not isinstance(at_version, int) or isinstance(at_version, bool) or at_version < 0
        ):
            raise _RequestError("bad_control", "freeze 'version' must be a non-negative integer")
        finish_round = msg.get("finish_round", False)
        if not isinstance(finish_round, bool) or (finish_round and at_version is not None):
            raise _RequestError(
                "bad_control", "freeze 'finish_round' must be a boolean, and not with 'version'"
            )
        waits = at_version is not None or finish_round
        timeout_s = msg.get("timeout_s", FREEZE_TIMEOUT_S)
        if (
            not isinstance(timeout_s, int | float)
            or isinstance(timeout_s, bool)
            or not 0 < timeout_s <= MAX_FREEZE_TIMEOUT_S
        ):
            raise _RequestError(
                "bad_control", f"freeze 'timeout_s' must be in (0, {MAX_FREEZE_TIMEOUT_S:g}]"
            )
        version: int | None = None
        # A plain freeze (or thaw) changes the shard under self._cond, so that
        # the set of freezers and the shard's state never disagree. A freeze
        # at a later version waits outside it; "busy" keeps others out meanwhile.
        with self._cond:
            if waits and self._freezers - {conn}:
                raise _RequestError("busy", "another client holds a freeze of this shard")
            self._freezers.add(conn)
            shard = self._shard
            if shard is not None and not waits:
                version = shard.freeze()
        if shard is not None and waits:
            try:
                version = shard.freeze(
                    at_version=at_version, finish_round=finish_round, timeout_s=float(timeout_s)
                )
            except FreezeTimeoutError as exc:
                raise _RequestError("freeze_timeout", str(exc)) from exc
        if version is not None:
            log.info("ps %d: frozen at version %d", self.shard_index, version)
        return {
            "shard": self.shard_index,
            "initialized": shard is not None,
            "version": version,
            "mode": self.mode.value,
            "open_round": 0 if shard is None else shard.stats().open_round,
        }

    def _release_freeze(self, conn: socket.socket) -> None:
        with self._cond:
            if conn not in self._freezers:
                return
            self._freezers.discard(conn)
            if self._freezers or self._shard is None:
                return
            self._shard.thaw()
        log.info("ps %d: thawed", self.shard_index)

    def _snapshot(self, conn: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        directory = msg.get("dir")
        if not isinstance(directory, str) or not (os.path.isabs(directory) or is_url(directory)):
            raise _RequestError("bad_control", "snapshot needs 'dir', an absolute path or a URL")
        with self._cond:
            held = conn in self._freezers
            shard = self._shard
        if shard is None:
            raise _RequestError("not_initialized", "the shard holds no parameters yet")
        if not held or not shard.frozen:
            raise _RequestError("not_frozen", "send freeze on this connection before snapshot")
        tensors, meta = shard.state()
        version = meta.get("version")
        name = shard_file_name(
            self.shard_index,
            # Remote snapshots never overwrite a file the previous manifest lists.
            version if is_url(directory) and isinstance(version, int) else None,
        )
        try:
            saved = save_shard(Location.of(directory) / name, tensors, meta)

        except OSError as exc:
            raise _RequestError(
                "snapshot_failed", f"cannot write {directory}/{name}: {exc}"
            ) from exc
        return {
            "shard": self.shard_index,
            "file": name,
            "crc32": saved.crc32,
            "bytes": saved.nbytes,
            "version": saved.version,
            "layout": shard.layout,
            "mode": self.mode.value,
            "optimizer": asdict(self._optimizer),
            "sparse_tables": meta.get("sparse_tables"),
        }

    def _shard_from_resume(self, layout: dict[str, object], fingerprint: str) -> ParameterShard:
        # Caller holds self._cond and has checked that self._resume is set.
        assert self._resume is not None
        shard = ParameterShard(
            layout, fingerprint, self._optimizer, self.mode, **self._shard_options
        )
        try:
            tensors, meta = shard_state_for_layout(layout, self._resume)
            if shard.tables is not None and self._resume_dir is not None:
                meta[SPARSE_STATE_KEY] = self._resume_tables(shard.tables)
            with_optimizer = shard.load_state(tensors, meta)
        except (DataError, ValueError) as exc:
            log.error("ps %d: cannot resume from the checkpoint: %s", self.shard_index, exc)
            raise _RequestError("resume_mismatch", f"cannot resume: {exc}") from exc
        self._resume = None  # free the memory; the shard holds what it needs
        log.info(
            "ps %d: resumed %d parameters at version %d from a consistent checkpoint%s",
            self.shard_index, shard.numel, shard.version,
            "" if with_optimizer else " (values only: it was saved for another optimizer)",
        )  # fmt: skip
        return shard

    def _resume_tables(self, tables: ShardTables) -> object:
        """This server's rows of every table, read from every shard of the resume checkpoint.

        Raises:
            DataError: a table's files are corrupt.
        """
        assert self._resume is not None and self._resume_dir is not None
        if not self._resume_dir.is_local:
            raise DataError(
                f"sparse tables cannot be resumed from {self._resume_dir}: copy the checkpoint "
                "to a local or mounted directory"
            )
        resume_dir = self._resume_dir.local_path
        entries = self._resume.meta.get("shards")
        dirs = [
            tables_dir_of(resume_dir / str(e["file"]))
            for e in (entries if isinstance(entries, list) else [])
            if isinstance(e, dict) and e.get("initialized") and isinstance(e.get("file"), str)
        ]
        state = load_tables_state(
            dirs,
            tables.names,
            partitioners={e.spec.name: e.partitioner for e in tables.entries},
            shard=self.shard_index,
        )
        log.info(
            "ps %d: resumed sparse tables %s (rows held here)",
            self.shard_index, state.rows(),
        )  # fmt: skip
        return state


_RECOVERY_OPS = frozenset({"coverage", "seal", "save", "checkpoints", "rollback", "serve"})


def _int_field(msg: dict[str, object], name: str) -> int:
    value = msg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _RequestError("bad_control", f"'{name}' must be a non-negative integer")
    return value


class _RequestError(ElasticPSError):
    """A well-formed request that cannot be served; answered with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


PARAMS_AT_MAX_PAD = PAGE_NUMEL
"""Most elements between the end of the gradients and the parameters in a
connection's shared memory (``attach_shm``'s ``params_at``): up to a page."""


def _check_shared_file(fd: int, nbytes: int) -> str:
    """Why the shared-memory file ``fd`` cannot be mapped for ``nbytes`` bytes ("" if it can).

    It must be at least that long and sealed against shrinking (``F_SEAL_SHRINK``):
    a file that shrank under the mapping would kill this server with SIGBUS.
    """
    try:
        size = os.fstat(fd).st_size
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        return f"not a sealable shared-memory file: {exc}"
    if size < nbytes:
        return f"the file holds {size} bytes, {nbytes} are needed"
    if not seals & fcntl.F_SEAL_SHRINK:
        return "the file is not sealed against shrinking (F_SEAL_SHRINK)"
    return ""


class _SharedRegion:
    """A trainer's shared memory for one connection: float32 gradients ``[numel]``,
    then float32 parameters ``[numel]`` from element ``params_at``."""

    def __init__(self, fd: int, numel: int, params_at: int) -> None:
        self.numel = numel
        self._map, self.grads, self.params = map_shared_region(fd, numel, params_at)


class _ShardMetrics:
    """The children of :mod:`elasticps.metrics`' PS metrics for one shard label."""

    def __init__(self, shard: int) -> None:
        label = str(shard)
        self.shard = shard
        self.push_seconds = metrics.PS_PUSH_SECONDS.labels(label)
        self.pull_seconds = metrics.PS_PULL_SECONDS.labels(label)
        self.push_bytes = metrics.PS_PUSH_BYTES.labels(label)
        self.pushes = {s: metrics.PS_PUSHES.labels(label, s.name.lower()) for s in PushStatus}
        self.staleness = metrics.PS_STALENESS.labels(label)
        self.version = metrics.PS_MODEL_VERSION.labels(label)
        self.sync_wait = metrics.PS_SYNC_WAIT_SECONDS.labels(label)
        self._label = label

    def refused(self, code: str) -> None:
        metrics.PS_REFUSED.labels(self._label, code).inc()


class _Connection:
    """Per-connection state: reusable header scratch and gradient buffer."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.scratch = bytearray(max(HEADER_SIZE, 64 * 1024))
        self.trainer_id: int | None = None
        self.hello_done = False
        self.grad_buffer: torch.Tensor | None = None
        self.shared: _SharedRegion | None = None
        self._wire: torch.Tensor | None = None

    def wire_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer of ``numel`` elements of ``dtype`` for 16-bit gradients."""
        if self._wire is None or self._wire.numel() != numel or self._wire.dtype != dtype:
            self._wire = torch.empty(numel, dtype=dtype)
        return self._wire


def _unix_listener(path: str) -> socket.socket:
    """Bind and listen on an AF_UNIX stream socket at ``path``, replacing a stale one.

    Raises:
        OSError: the path is too long, its directory is missing, or it is
            taken by something that is not a socket.
    """
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener
