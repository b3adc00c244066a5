"""The trainer's side of the tensor plane: push gradients, pull parameters.

The trainer keeps every parameter in one flat float32 buffer and every
gradient in another (see :mod:`elasticps.placement`); the model's parameters
and their ``.grad`` are views into them. A push sends, for each parameter
server at once, the ranges of the gradient buffer that server owns, with
``sendall(memoryview)``; a pull receives each server's reply with
``recv_into`` straight into the parameter buffer. Nothing is copied or
allocated per step.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from elasticps.errors import ElasticPSError, ProtocolError, RemoteError, ServiceUnavailableError
from elasticps.placement import Placement, ShardLayout
from elasticps.wire.frame import (
    HEADER_SIZE,
    ConnectionClosedError,
    DType,
    Flags,
    FrameHeader,
    MsgType,
    recv_body_into,
    recv_header,
    recv_json,
    send_frame,
    send_json,
    tensor_view,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


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


class _ShardConnection:
    """One TCP connection to one parameter server, with its views of the flat buffers."""

    def __init__(
        self,
        layout: ShardLayout,
        address: str,
        params: torch.Tensor,
        grads: torch.Tensor,
        timeout_s: float,
    ) -> None:
        self.layout = layout
        self.address = address
        self.version = 0
        self.scratch = bytearray(HEADER_SIZE)
        self.param_views = [tensor_view(params[lo:hi]) for lo, hi in layout.ranges]
        self.grad_views = [tensor_view(grads[lo:hi]) for lo, hi in layout.ranges]
        self.body_nbytes = layout.numel * 4
        self.sock = self._connect(address, timeout_s)

    def _connect(self, address: str, timeout_s: float) -> socket.socket:
        try:
            sock = socket.create_connection(parse_address(address), timeout=timeout_s)
        except OSError as exc:
            raise ServiceUnavailableError(
                f"cannot connect to parameter server {self.layout.index} at {address}: {exc}"
            ) from exc
        # Blocking from here on: a sync push waits for the slowest trainer.
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def reconnect(self, address: str, timeout_s: float) -> None:
        """Replace a broken connection with one to ``address``."""
        self.close()
        self.sock = self._connect(address, timeout_s)
        self.address = address

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _reply(self) -> FrameHeader:
        header = recv_header(self.sock, self.scratch, max_body_bytes=self.body_nbytes)
        if header.msg_type is MsgType.ERROR:
            body = recv_json(self.sock, header)
            raise RemoteError(str(body.get("code", "error")), str(body.get("message", "")))
        return header

    def _expect(self, header: FrameHeader, kind: MsgType) -> None:
        if header.msg_type is not kind:
            raise ProtocolError(
                f"parameter server {self.layout.index} answered {header.msg_type.name}, "
                f"expected {kind.name}"
            )

    def hello(self, trainer_id: int, initial_values: bool) -> None:
        send_json(
            self.sock,
            MsgType.HELLO,
            {
                "trainer_id": trainer_id,
                "layout": self.layout.describe(),
                "fingerprint": self.layout.fingerprint,
            },
        )
        header = self._reply()
        self._expect(header, MsgType.HELLO_OK)
        answer = recv_json(self.sock, header)
        if answer.get("need_values"):
            if not initial_values:
                raise ProtocolError(f"parameter server {self.layout.index} holds no parameters yet")
            send_frame(
                self.sock,
                FrameHeader(MsgType.INIT_VALUES, dtype=DType.FLOAT32, body_nbytes=self.body_nbytes),
                self.param_views,
            )
            header = self._reply()
            self._expect(header, MsgType.HELLO_OK)
            answer = recv_json(self.sock, header)
        version = answer.get("version")
        self.version = version if isinstance(version, int) else 0

    def push(
        self, trainer_id: int, num_samples: int, step: int, *, empty: bool, want_params: bool
    ) -> None:
        flags = (Flags.EMPTY if empty else Flags.NONE) | (
            Flags.WANT_PARAMS if want_params else Flags.NONE
        )
        send_frame(
            self.sock,
            FrameHeader(
                MsgType.PUSH,
                dtype=DType.FLOAT32,
                flags=flags,
                sender=trainer_id,
                num_samples=num_samples,
                model_version=self.version,
                step=step,
                body_nbytes=0 if empty else self.body_nbytes,
            ),
            () if empty else self.grad_views,
        )
        header = self._reply()
        if want_params:
            self._receive_params(header)
        else:
            self._expect(header, MsgType.PUSH_OK)
            # Async: our copy stays at the version we last pulled; the server
            # tells us how far it has moved, which we keep only for staleness.

    def pull(self) -> None:
        send_frame(self.sock, FrameHeader(MsgType.PULL))
        self._receive_params(self._reply())

    def _receive_params(self, header: FrameHeader) -> None:
        self._expect(header, MsgType.PARAMS)
        recv_body_into(self.sock, header, self.param_views)
        self.version = header.model_version

    def control(self, op: str) -> dict[str, object]:
        send_json(self.sock, MsgType.CONTROL, {"op": op})
        header = self._reply()
        self._expect(header, MsgType.CONTROL_OK)
        return recv_json(self.sock, header)


class ParameterClient:
    """Pushes gradients to and pulls parameters from every parameter server.

    When a parameter server goes away (its connection breaks), the client
    asks ``resolve`` for the address of the server that took over its index,
    reconnects, says hello again (initializing the shard from our parameters
    if it came back empty), pulls, and repeats the interrupted request: a
    pending push is re-sent, computed-on version set to the restored one, so
    it is neither dropped nor lost. This waits at most ``reconnect_timeout_s``
    seconds, then raises :class:`~elasticps.errors.ServiceUnavailableError`.

    Args:
        placement: where each parameter lives.
        addresses: ``host:port`` of parameter server ``i`` at index ``i``.
        params: the flat parameter buffer, float32 ``[placement.total_numel]``.
        grads: the flat gradient buffer, float32 ``[placement.total_numel]``.
        trainer_id: this trainer's id, sent with every push.
        timeout_s: connect timeout, seconds.
        resolve: given a shard index, the current ``host:port`` of its
            server (trainers read ``/ps/<index>`` in etcd); ``None`` disables
            reconnection. It may raise ElasticPSError while there is none.
        reconnect_timeout_s: how long to wait for a lost server, seconds.
        stop: when set, reconnection gives up at once.

    Raises:
        ServiceUnavailableError: a parameter server cannot be reached.
    """

    def __init__(
        self,
        placement: Placement,
        addresses: Sequence[str],
        params: torch.Tensor,
        grads: torch.Tensor,
        trainer_id: int,
        *,
        timeout_s: float = 30.0,
        resolve: Callable[[int], str] | None = None,
        reconnect_timeout_s: float = 60.0,
        stop: threading.Event | None = None,
    ) -> None:
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
        self.reconnects = 0
        self._conns: list[_ShardConnection] = []
        try:
            for layout in placement.shards:
                if layout.numel == 0:
                    continue  # a shard that holds nothing (hash placement left it empty)
                self._conns.append(
                    _ShardConnection(layout, addresses[layout.index], params, grads, timeout_s)
                )
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self._conns)), thread_name_prefix="ps-fanout"
        )

    @property
    def versions(self) -> list[int]:
        """Model version of each connected shard, as last pulled."""
        return [c.version for c in self._conns]

    def _fan_out(self, fn: Callable[[_ShardConnection], T]) -> list[T]:
        if len(self._conns) == 1:
            return [self._robust(fn, self._conns[0])]
        futures = [self._pool.submit(self._robust, fn, c) for c in self._conns]
        return [f.result() for f in futures]

    def _robust(self, fn: Callable[[_ShardConnection], T], conn: _ShardConnection) -> T:
        deadline: float | None = None
        while True:
            try:
                return fn(conn)
            except (ConnectionClosedError, OSError) as exc:
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

    def _reconnect(self, conn: _ShardConnection, deadline: float) -> None:
        """Reconnect ``conn`` to whichever server now holds its index, or raise."""
        assert self._resolve is not None
        delays = _backoff()
        while True:
            try:
                address = self._resolve(conn.layout.index)
                conn.reconnect(address, self._timeout_s)
                conn.hello(self.trainer_id, initial_values=True)
                conn.pull()
                self.reconnects += 1
                log.info(
                    "reconnected to parameter server %d at %s (version %d)",
                    conn.layout.index, address, conn.version,
                )  # fmt: skip
                return
            except (ElasticPSError, OSError) as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    raise ServiceUnavailableError(
                        f"parameter server {conn.layout.index} did not come back within "
                        f"{self._reconnect_timeout_s:.0f} s: {exc}"
                    ) from exc
                self._stop.wait(min(next(delays), remaining))

    def hello(self, *, initialize: bool = True) -> None:
        """Introduce ourselves to every PS, initializing empty shards from ``params``.

        Then pulls, so that ``params`` holds the servers' current values.

        Raises:
            RemoteError: a server refused (for example a layout mismatch).
        """
        self._fan_out(lambda c: c.hello(self.trainer_id, initialize))
        self.pull()

    def push(self, num_samples: int, *, want_params: bool) -> None:
        """Push the gradient buffer (the mean gradient over ``num_samples`` samples).

        Args:
            num_samples: samples behind the gradient, weighting it in sync mode.
            want_params: receive the updated parameters in the reply (in sync
                mode, after the step is applied).
        """
        self._step += 1
        self._fan_out(
            lambda c: c.push(
                self.trainer_id, num_samples, self._step, empty=False, want_params=want_params
            )
        )

    def push_empty(self) -> None:
        """Take part in the current sync step without a gradient, then pull."""
        self._fan_out(
            lambda c: c.push(self.trainer_id, 0, self._step, empty=True, want_params=True)
        )

    def pull(self) -> None:
        """Receive every shard's parameters into the flat parameter buffer."""
        self._fan_out(lambda c: c.pull())

    def stats(self) -> list[dict[str, object]]:
        """Each server's ``stats`` control answer."""
        return self._fan_out(lambda c: c.control("stats"))

    def close(self) -> None:
        """Close every connection."""
        for c in self._conns:
            c.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
