"""The tensor-plane server against real ParameterClients and raw sockets.

Each test runs fresh in-process ParameterServers on 127.0.0.1, port 0, each
serving in its own thread; a fixture finalizer stops them and closes every
client and socket the test opened.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.coord.store import PSSlot
from elasticps.errors import ConfigError, RemoteError, ServiceUnavailableError
from elasticps.netutil import LOOPBACK
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND, Placement, page_runs
from elasticps.pserver.checkpoint import ShardFiles
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.server import ParameterServer
from elasticps.snapshot import take_consistent_checkpoint
from elasticps.testing import wait_for
from elasticps.trainer import client as client_module
from elasticps.trainer.client import ParameterClient, parse_address
from elasticps.trainer.flat import FlatModel, bind_flat_buffers
from elasticps.wire.auth import client_handshake
from elasticps.wire.frame import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_JSON_BYTES,
    PROTO_VERSION,
    DType,
    Flags,
    FrameHeader,
    MsgType,
    PushStatus,
    local_host_id,
    recv_header,
    recv_json,
    send_frame,
    send_json,
    tensor_view,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# SGD with lr=1: an applied update changes the values by exactly -grad.
SGD_LR1 = OptimizerConfig(name="sgd", lr=1.0)
# Small enough that TinyModel's first weight (4 * width elements) is sliced
# over all servers, large enough that the other parameters go whole.
BIG_ARRAY_BOUND = 8
# Every wait on a socket or a thread ends after this many seconds.
DEADLINE_S = 10.0
INITIALIZER, SECOND, THIRD = 1, 2, 3
# Trainer id of the clients a test uses only to look at the shards.
OBSERVER = 9


class TinyModel(nn.Module):
    """4 -> width -> 2; with width 3: 12 + 3 + 6 + 2 parameters."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.head = nn.Linear(width, 2)


def dyadic_values(numel: int, offset: float) -> torch.Tensor:
    """Values with few mantissa bits, so sums, averages and differences are exact."""
    return torch.arange(numel, dtype=torch.float32) * 0.125 + offset


@dataclass
class Peer:
    """A trainer-side view: the model bound to flat buffers, and its client."""

    flat: FlatModel
    client: ParameterClient

    @property
    def params(self) -> torch.Tensor:
        return self.flat.params

    @property
    def grads(self) -> torch.Tensor:
        return self.flat.grads

    @property
    def placement(self) -> Placement:
        return self.flat.placement


class Cluster:
    """Parameter servers in threads, and the clients and raw sockets a test opens."""

    def __init__(self) -> None:
        self.servers: list[ParameterServer] = []
        self._threads: list[threading.Thread] = []
        self._clients: list[ParameterClient] = []
        self._socks: list[socket.socket] = []

    def start(self, num_servers: int, mode: UpdateMode, *, unix_dir: Path | None = None) -> None:
        for index in range(num_servers):
            server = ParameterServer(
                index,
                mode,
                SGD_LR1,
                host=LOOPBACK,
                port=0,
                init_timeout_s=DEADLINE_S,
                unix_path=None if unix_dir is None else unix_dir / f"ps-{index}.sock",
            )
            self.servers.append(server)
            thread = threading.Thread(target=server.serve_forever, name=f"ps-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def addresses(self) -> list[str]:
        return [server.address for server in self.servers]

    def peer(
        self,
        trainer_id: int,
        *,
        width: int = 3,
        values: torch.Tensor | None = None,
        big_array_bound: int = BIG_ARRAY_BOUND,
        **client_options: Any,
    ) -> Peer:
        """Bind a TinyModel to flat buffers and connect a client (no HELLO yet)."""
        flat = bind_flat_buffers(TinyModel(width), len(self.servers), big_array_bound)
        if values is not None:
            flat.params.copy_(values)
        client = ParameterClient(
            flat.placement,
            self.addresses,
            flat.params,
            flat.grads,
            trainer_id,
            timeout_s=DEADLINE_S,
            **client_options,
        )
        self._clients.append(client)
        return Peer(flat, client)

    def raw(self, index: int = 0) -> socket.socket:
        """A TCP connection to server ``index``, past the handshake, with a receive deadline."""
        sock = socket.create_connection(parse_address(self.addresses[index]), timeout=DEADLINE_S)
        client_handshake(sock, None, 0)
        sock.settimeout(DEADLINE_S)
        self._socks.append(sock)
        return sock

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        for client in self._clients:
            client.close()
        for server in self.servers:
            server.stop()
        for thread in self._threads:
            thread.join(timeout=DEADLINE_S)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"serve_forever did not return after stop(): {alive}"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def reference_placement(num_servers: int) -> Placement:
    """The placement of TinyModel() over ``num_servers`` servers."""
    return bind_flat_buffers(TinyModel(), num_servers, BIG_ARRAY_BOUND).placement


def initialized(cluster: Cluster, num_servers: int, mode: UpdateMode) -> torch.Tensor:
    """Start servers and initialize their shards from known values; return the values."""
    cluster.start(num_servers, mode)
    values = dyadic_values(reference_placement(num_servers).total_numel, -1.0)
    first = cluster.peer(INITIALIZER, values=values)
    first.client.hello(initialize=True)
    first.client.close()
    return values


def observer(cluster: Cluster) -> Peer:
    """A new client with the reference layout that has said HELLO (and so pulled)."""
    numel = reference_placement(len(cluster.servers)).total_numel
    peer = cluster.peer(OBSERVER, values=torch.full((numel,), 7.0))
    peer.client.hello(initialize=False)
    return peer


def shard_stats(peer: Peer) -> list[dict[str, int]]:
    """The ``stats`` counters of every server the peer is connected to."""
    return [answer["stats"] for answer in peer.client.stats()]  # type: ignore[misc]


def sliced_params(placement: Placement) -> list[str]:
    """Names of the parameters split over more than one shard."""
    shards_of: dict[str, set[int]] = {}
    for layout in placement.shards:
        for piece in layout.pieces:
            shards_of.setdefault(piece.name, set()).add(layout.index)
    return [name for name, shards in shards_of.items() if len(shards) > 1]


def assert_shard_untouched(cluster: Cluster, values: torch.Tensor) -> None:
    """A new client pulls ``values`` at version 0, and no push was ever counted."""
    fresh = observer(cluster)
    assert torch.equal(fresh.params, values)
    assert fresh.client.versions == [0] * len(cluster.servers)
    assert [s["pushes"] for s in shard_stats(fresh)] == [0] * len(cluster.servers)


# --- a trainer's view ---------------------------------------------------------


@pytest.mark.parametrize("num_servers", [1, 2])
def test_first_client_initializes_shards_and_second_client_receives_the_same_values(
    cluster: Cluster, num_servers: int
) -> None:
    cluster.start(num_servers, UpdateMode.ASYNC)
    first = cluster.peer(INITIALIZER)
    if num_servers > 1:
        assert sliced_params(first.placement) == ["embed.weight"]  # the layout under test
    values = dyadic_values(first.placement.total_numel, -1.0)
    first.params.copy_(values)

    first.client.hello(initialize=True)

    assert torch.equal(first.params, values)  # the pull after HELLO returned our own values
    second = cluster.peer(SECOND, values=torch.zeros(first.placement.total_numel))
    # initialize=False: the client raises if a server asks it for initial values.
    second.client.hello(initialize=False)
    assert torch.equal(second.params, values)
    assert second.client.versions == [0] * num_servers
    for answer in second.client.stats():
        assert answer["initialized"] is True
        assert answer["stats"]["version"] == 0  # type: ignore[index]


@pytest.mark.parametrize("num_servers", [1, 2])
def test_async_push_with_sgd_lr_one_changes_values_by_exactly_minus_grad(
    cluster: Cluster, num_servers: int
) -> None:
    values = initialized(cluster, num_servers, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=False)
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)

    peer.client.push(num_samples=4, want_params=True)

    assert torch.equal(peer.params, values - grad)
    assert peer.client.versions == [1] * num_servers
    fresh = observer(cluster)
    assert torch.equal(fresh.params, values - grad)
    assert fresh.client.versions == [1] * num_servers


def test_async_push_without_want_params_leaves_local_values_until_the_next_pull(
    cluster: Cluster,
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=False)
    grad = dyadic_values(peer.placement.total_numel, 0.25)
    peer.grads.copy_(grad)

    peer.client.push(num_samples=1, want_params=False)
    assert torch.equal(peer.params, values)

    peer.client.pull()
    assert torch.equal(peer.params, values - grad)
    assert peer.client.versions == [1, 1]


@pytest.mark.parametrize("num_servers", [1, 2])
def test_sync_pushes_from_two_trainers_both_receive_the_sample_weighted_average_update(
    cluster: Cluster, num_servers: int
) -> None:
    values = initialized(cluster, num_servers, UpdateMode.SYNC)
    for server in cluster.servers:
        server.set_live_trainers({SECOND, THIRD})
    a, b = cluster.peer(SECOND), cluster.peer(THIRD)
    a.client.hello(initialize=False)
    b.client.hello(initialize=False)
    numel = a.placement.total_numel
    grad_a = dyadic_values(numel, 1.0)
    grad_b = -2.0 * dyadic_values(numel, 0.0)
    a.grads.copy_(grad_a)
    b.grads.copy_(grad_b)

    # Not a with-block: if a push hangs, the test fails at once and the
    # fixture's server.stop() releases the thread.
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        pushes = [
            pool.submit(a.client.push, 1, want_params=True),
            pool.submit(b.client.push, 3, want_params=True),
        ]
        for push in pushes:
            push.result(timeout=DEADLINE_S)
    finally:
        pool.shutdown(wait=False)

    expected = values - (grad_a * 1 + grad_b * 3) / 4
    assert torch.equal(a.params, expected)
    assert torch.equal(b.params, expected)
    assert a.client.versions == b.client.versions == [1] * num_servers


def test_consistent_checkpoint_of_a_round_that_closes_without_a_step_does_not_stall(
    cluster: Cluster, tmp_path: Path
) -> None:
    # The end of a job: THIRD, idle, has pushed an empty gradient into the open
    # round; SECOND leaves. The round closes without a step, so the version
    # never moves; the snapshot must not wait for it to (it used to wait out
    # its catch-up timeout and record an incomplete step).
    initialized(cluster, 2, UpdateMode.SYNC)
    for server in cluster.servers:
        server.set_live_trainers({SECOND, THIRD})
    idle = cluster.peer(THIRD)
    idle.client.hello(initialize=False)
    watcher = observer(cluster)
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        empty_push = pool.submit(idle.client.push_empty)
        wait_for(
            lambda: all(s["open_round"] == 1 for s in shard_stats(watcher)),
            "the empty push to open a round on every server",
        )
        # Frozen, the round stays open when SECOND leaves: the state the
        # snapshot finds when it freezes a server just before the departure.
        shards = [server.shard for server in cluster.servers]
        for shard in shards:
            assert shard is not None
            shard.freeze()
        for server in cluster.servers:
            server.set_live_trainers({THIRD})  # SECOND left
        assert all(s["open_round"] == 1 for s in shard_stats(watcher))
        snapshot = pool.submit(
            take_consistent_checkpoint,
            cluster.addresses,
            tmp_path / "snap",
            ledger_revision=None,
            extra={},
            catch_up_timeout_s=DEADLINE_S * 3,
        )

        manifest = snapshot.result(timeout=DEADLINE_S)
        empty_push.result(timeout=DEADLINE_S)
    finally:
        pool.shutdown(wait=False)

    assert manifest["complete_steps"] is True
    assert manifest["version"] == 0
    assert idle.client.versions == [0, 0]


def test_sync_push_waits_for_every_live_trainer_before_applying(cluster: Cluster) -> None:
    values = initialized(cluster, 1, UpdateMode.SYNC)
    cluster.servers[0].set_live_trainers({SECOND, THIRD})
    a, b = cluster.peer(SECOND), cluster.peer(THIRD)
    a.client.hello(initialize=False)
    b.client.hello(initialize=False)
    a.grads.copy_(dyadic_values(a.placement.total_numel, 1.0))

    watcher = observer(cluster)

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        waiting = pool.submit(a.client.push, 1, want_params=True)
        wait_for(lambda: shard_stats(watcher)[0]["pushes"] == 1, "the server to receive the push")
        # The step cannot complete while trainer THIRD has not taken part.
        assert shard_stats(watcher)[0]["version"] == 0
        assert not waiting.done()
        b.client.push_empty()
        waiting.result(timeout=DEADLINE_S)
    finally:
        pool.shutdown(wait=False)

    assert torch.equal(a.params, values - a.grads)
    assert torch.equal(b.params, a.params)


def test_pipelined_sync_steps_average_gradients_of_the_version_before(cluster: Cluster) -> None:
    """Sync mode with overlap_pull: a push returns at once and the caller computes
    on the parameters it has; its next push first adopts the step the last one
    joined, then joins the step after. So step k + 1 averages gradients computed
    on the parameters of step k, and every server moves in lock-step."""
    values = initialized(cluster, 2, UpdateMode.SYNC)
    for server in cluster.servers:
        server.set_live_trainers({SECOND, THIRD})
    a = cluster.peer(SECOND, overlap_pull=True, sync=True)
    b = cluster.peer(THIRD, overlap_pull=True, sync=True)
    a.client.hello(initialize=False)
    b.client.hello(initialize=False)
    g1 = dyadic_values(a.placement.total_numel, 0.5)
    g2 = dyadic_values(a.placement.total_numel, 0.25)
    acked: list[str] = []

    def note(name: str) -> Callable[[], None]:
        return lambda: acked.append(name)

    for peer, name in ((a, "a1"), (b, "b1")):
        peer.grads.copy_(g1)
        peer.client.push(1, want_params=True, on_acknowledged=note(name))
        peer.grads.zero_()
        # Returned at once; the parameters are those computed on until adopted.
        assert torch.equal(peer.params, values)
    for peer, name in ((a, "a2"), (b, "b2")):
        peer.grads.copy_(g2)  # "computed" on the step-0 parameters
        peer.client.push(1, want_params=True, on_acknowledged=note(name))
        # The push waited for step 1 (both first pushes) and adopted it.
        assert torch.equal(peer.params, values - g1)
        assert peer.client.versions == [1, 1] and peer.client.consistent
    for peer in (a, b):
        peer.client.flush()
        assert torch.equal(peer.params, values - g1 - g2)
        assert peer.client.versions == [2, 2]
    assert sorted(acked) == ["a1", "a2", "b1", "b2"]
    stats = shard_stats(observer(cluster))
    assert [s["steps"] for s in stats] == [2, 2] and [s["stale_pushes"] for s in stats] == [0, 0]


def test_a_trainer_waited_for_by_one_shard_only_joins_its_step_and_the_shards_agree(
    cluster: Cluster,
) -> None:
    """Shard 0 learned of trainer THIRD before its step opened, shard 1 did not:
    shard 1 steps without it and shard 0 waits for it. THIRD, waiting for the
    shards to agree, would wait for itself; it joins shard 0's step without a
    gradient, and both apply SECOND's gradient alone."""
    values = initialized(cluster, 2, UpdateMode.SYNC)
    cluster.servers[0].set_live_trainers({SECOND, THIRD})
    cluster.servers[1].set_live_trainers({SECOND})
    a, b = cluster.peer(SECOND), cluster.peer(THIRD, sync=True)
    a.client.hello(initialize=False)
    b.client.hello(initialize=False)
    a.grads.copy_(dyadic_values(a.placement.total_numel, 1.0))
    watcher = observer(cluster)

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        waiting = pool.submit(a.client.push, 1, want_params=True)
        wait_for(
            lambda: [s["version"] for s in shard_stats(watcher)] == [0, 1],
            "shard 1 to step without THIRD",
        )
        b.client.pull()
        assert b.client.versions == [0, 1] and not b.client.consistent
        b.client.pull_consistent(timeout_s=DEADLINE_S)
        waiting.result(timeout=DEADLINE_S)
    finally:
        pool.shutdown(wait=False)

    assert b.client.versions == a.client.versions == [1, 1]
    assert torch.equal(a.params, values - a.grads)
    assert torch.equal(b.params, a.params)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_client_with_a_different_layout_is_refused_and_the_shard_is_unchanged(
    cluster: Cluster, num_servers: int
) -> None:
    values = initialized(cluster, num_servers, UpdateMode.ASYNC)
    other = cluster.peer(SECOND, width=5)
    other.params.fill_(3.0)

    with pytest.raises(RemoteError) as refused:
        other.client.hello(initialize=True)

    assert refused.value.code == "layout_mismatch"
    assert_shard_untouched(cluster, values)


# --- raw frames -------------------------------------------------------------------


def raw_header(
    msg_type: int,
    *,
    body_nbytes: int = 0,
    dtype: int = DType.BYTES,
    flags: int = 0,
    magic: bytes = MAGIC,
    version: int = PROTO_VERSION,
) -> bytes:
    """A header packed without validation, so it can be malformed."""
    return HEADER.pack(
        magic, version, msg_type, dtype, flags, 0, 0, 0, 0, body_nbytes, 0, 0, 0, 0, 0, 0, 0, 0, 0
    )


def read_reply(sock: socket.socket) -> tuple[FrameHeader, dict[str, object] | None]:
    """Receive one frame; return its header and, for JSON frames, its body."""
    header = recv_header(sock, bytearray(HEADER_SIZE), max_body_bytes=1 << 20)
    body = recv_json(sock, header) if header.msg_type is not MsgType.PARAMS else None
    return header, body


def expect_error(sock: socket.socket, code: str) -> str:
    """Receive one ERROR frame with ``code``; return its message."""
    header, body = read_reply(sock)
    assert header.msg_type is MsgType.ERROR, header
    assert body is not None
    assert body["code"] == code, body
    return str(body["message"])


def assert_closed_by_server(sock: socket.socket) -> None:
    """The server closed the connection: EOF (or a reset) before the deadline."""
    try:
        data = sock.recv(1)
    except ConnectionResetError:
        return
    assert data == b"", f"expected the server to close the connection, got {data!r}"


def raw_hello(sock: socket.socket, cluster: Cluster, trainer_id: int = SECOND) -> int:
    """Say HELLO to shard 0 with the reference layout; return the shard's numel."""
    layout = reference_placement(len(cluster.servers)).shards[0]
    send_json(
        sock,
        MsgType.HELLO,
        {"trainer_id": trainer_id, "layout": layout.describe(), "fingerprint": layout.fingerprint},
    )
    header, body = read_reply(sock)
    assert header.msg_type is MsgType.HELLO_OK, body
    assert body is not None
    assert body["need_values"] is False
    return layout.numel


@pytest.mark.parametrize(
    ("name", "header", "mentions"),
    [
        ("bad magic", lambda numel: raw_header(MsgType.PULL, magic=b"JUNK"), "magic"),
        ("bad version", lambda numel: raw_header(MsgType.PULL, version=99), "version"),
        (
            "oversized push body",
            lambda numel: raw_header(MsgType.PUSH, dtype=DType.FLOAT32, body_nbytes=numel * 4 + 4),
            "exceeds",
        ),
        (
            "oversized json body",
            lambda numel: raw_header(MsgType.CONTROL, body_nbytes=MAX_JSON_BYTES + 1),
            "exceeds",
        ),
        ("unknown msg_type", lambda numel: raw_header(200), "msg_type"),
    ],
)
def test_malformed_header_gets_an_error_frame_and_the_connection_is_closed(
    cluster: Cluster, name: str, header: Callable[[int], bytes], mentions: str
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    sock = cluster.raw(0)
    numel = raw_hello(sock, cluster)

    sock.sendall(header(numel))

    assert mentions in expect_error(sock, "bad_frame")
    assert_closed_by_server(sock)
    assert_shard_untouched(cluster, values)


@pytest.mark.parametrize("cut_in", ["header", "body"])
def test_truncated_push_closes_the_connection_and_applies_nothing(
    cluster: Cluster, cut_in: str
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    sock = cluster.raw(0)
    numel = raw_hello(sock, cluster)
    header = raw_header(MsgType.PUSH, dtype=DType.FLOAT32, body_nbytes=numel * 4)
    grad = torch.ones(numel, dtype=torch.float32)

    if cut_in == "header":
        sock.sendall(header[: HEADER_SIZE // 2])
    else:
        sock.sendall(header)
        sock.sendall(tensor_view(grad)[: numel * 2])
    sock.shutdown(socket.SHUT_WR)  # the frame ends half-way

    assert_closed_by_server(sock)
    assert_shard_untouched(cluster, values)


@pytest.mark.parametrize("request_kind", ["push", "empty push", "pull"])
def test_request_before_hello_gets_no_hello_and_the_connection_stays_usable(
    cluster: Cluster, request_kind: str
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    numel = reference_placement(2).shards[0].numel
    sock = cluster.raw(0)

    if request_kind == "push":
        grad = torch.ones(numel, dtype=torch.float32)
        send_frame(
            sock,
            FrameHeader(MsgType.PUSH, dtype=DType.FLOAT32, body_nbytes=numel * 4),
            [tensor_view(grad)],
        )
    elif request_kind == "empty push":
        send_frame(sock, FrameHeader(MsgType.PUSH, dtype=DType.FLOAT32, flags=Flags.EMPTY))
    else:
        send_frame(sock, FrameHeader(MsgType.PULL))
    expect_error(sock, "no_hello")

    # The same connection can still say HELLO and pull.
    raw_hello(sock, cluster)
    send_frame(sock, FrameHeader(MsgType.PULL))
    header = recv_header(sock, bytearray(HEADER_SIZE), max_body_bytes=numel * 4)
    assert header.msg_type is MsgType.PARAMS
    assert header.body_nbytes == numel * 4
    assert_shard_untouched(cluster, values)


def test_stats_control_op_answers_before_and_after_initialization(cluster: Cluster) -> None:
    cluster.start(1, UpdateMode.ASYNC)
    sock = cluster.raw(0)

    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header, body = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK
    assert body == {"shard": 0, "initialized": False, "stats": None, "auth_refused": {}}

    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=True)
    peer.grads.fill_(1.0)
    peer.client.push(num_samples=2, want_params=True)

    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header, body = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK
    assert body is not None
    assert body["initialized"] is True
    expected = {"version": 1, "pushes": 1, "stale_pushes": 0, "steps": 1, "live_trainers": 0}
    stats = body["stats"]
    assert isinstance(stats, dict)
    assert {key: stats.get(key) for key in expected} == expected


def test_unknown_control_op_gets_an_error_and_the_connection_stays_usable(
    cluster: Cluster,
) -> None:
    cluster.start(1, UpdateMode.ASYNC)
    sock = cluster.raw(0)

    send_json(sock, MsgType.CONTROL, {"op": "explode"})
    assert "explode" in expect_error(sock, "bad_control")

    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header, _ = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK


# --- transports: the AF_UNIX fast path ---------------------------------------------


@pytest.mark.parametrize(("transport", "expected"), [("auto", "unix"), ("tcp", "tcp")])
def test_client_on_the_same_host_uses_the_unix_socket_unless_told_tcp(
    cluster: Cluster, tmp_path: Path, transport: str, expected: str
) -> None:
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    values = dyadic_values(reference_placement(2).total_numel, -1.0)
    peer = cluster.peer(INITIALIZER, values=values, transport=transport)
    peer.client.hello(initialize=True)
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)

    peer.client.push(num_samples=1, want_params=True)

    assert peer.client.transports == [expected, expected]
    assert torch.equal(peer.params, values - grad)
    fresh = cluster.peer(OBSERVER, transport="tcp")
    fresh.client.hello(initialize=False)
    assert torch.equal(fresh.params, values - grad)


@pytest.mark.parametrize("mode", [UpdateMode.ASYNC, UpdateMode.SYNC])
def test_pushes_over_shared_memory_give_what_bodies_give(
    cluster: Cluster, tmp_path: Path, mode: UpdateMode
) -> None:
    cluster.start(2, mode, unix_dir=tmp_path)
    values = dyadic_values(reference_placement(2).total_numel, -1.0)
    shared = cluster.peer(INITIALIZER, values=values)
    shared.client.hello(initialize=True)
    assert [c.shared for c in shared.client._conns] == [True, True]
    grad = dyadic_values(shared.placement.total_numel, 0.5)

    for step in range(1, 4):  # the second and later pushes reuse the shared memory
        shared.grads.copy_(grad)
        shared.client.push(num_samples=1, want_params=True, key=PushKey(0, 0, step - 1, step))
        assert torch.equal(shared.params, values - step * grad)
    assert [s["pushes"] for s in shard_stats(shared)] == [3, 3]

    # A client without shared memory sees the same shards, and its pushes mix in.
    bodies = cluster.peer(SECOND, shared_memory=False)
    bodies.client.hello(initialize=False)
    assert [c.shared for c in bodies.client._conns] == [False, False]
    assert torch.equal(bodies.params, values - 3 * grad)
    if mode is UpdateMode.ASYNC:
        bodies.grads.copy_(grad)
        bodies.client.push(num_samples=1, want_params=True)
        shared.client.pull()
        assert torch.equal(shared.params, values - 4 * grad)


def connection_dropper() -> tuple[list[bool], Callable[[], None]]:
    """A server gate that drops the connection of the first request it sees (before
    applying it), and the list that records it."""
    dropped: list[bool] = []

    def drop_first() -> None:
        if not dropped:
            dropped.append(True)
            raise ConnectionResetError("dropped by the test")

    return dropped, drop_first


def shared_memory_peer(cluster: Cluster) -> tuple[Peer, torch.Tensor, ThreadPoolExecutor]:
    """A peer of 2 started servers, said hello, with shared memory on both connections;
    its initial values; its fan-out pool."""
    values = dyadic_values(reference_placement(2).total_numel, -1.0)
    peer = cluster.peer(INITIALIZER, values=values)
    peer.client.hello(initialize=True)
    assert [c.shared for c in peer.client._conns] == [True, True]
    pool = peer.client._pool
    assert pool is not None
    return peer, values, pool


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_a_shared_memory_push_reaches_every_server_at_once_from_the_calling_thread(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_threads: int
) -> None:
    # Both servers must hold the push at the same time (a barrier in each), and
    # the client's thread pool is not used: the calling thread sends to every
    # server, then reads the answers. With more than one torch thread the
    # copies into and out of shared memory go through numpy.
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    both = threading.Barrier(2, timeout=DEADLINE_S)
    for server in cluster.servers:
        server._gate = both.wait  # type: ignore[assignment]
    peer, values, pool = shared_memory_peer(cluster)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a shared-memory push used the thread pool")

    pool.submit = refuse  # type: ignore[method-assign,assignment]
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    for step in range(1, 3):
        peer.grads.copy_(grad)
        handle = peer.client.push(num_samples=1, want_params=True)
        assert handle.acknowledged
        assert torch.equal(peer.params, values - step * grad)
    assert not both.broken


def test_a_big_model_s_shared_memory_push_uses_a_thread_per_server(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Above the bound the copies into and out of shared memory run in parallel.
    monkeypatch.setattr(client_module, "SERIAL_EXCHANGE_MAX_BYTES", 0)
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    peer, values, pool = shared_memory_peer(cluster)
    submitted: list[object] = []
    real_submit = pool.submit

    def recording(fn: Callable[..., object], *args: object) -> object:
        submitted.append(fn)
        return real_submit(fn, *args)

    pool.submit = recording  # type: ignore[method-assign,assignment]
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)
    peer.client.push(num_samples=1, want_params=True)
    assert len(submitted) == 1  # one server on the pool, the other on this thread
    assert torch.equal(peer.params, values - grad)


@pytest.mark.parametrize("zero_grad", [False, True])
def test_a_server_lost_in_a_shared_memory_push_is_sent_the_push_again_after_the_others(
    cluster: Cluster, tmp_path: Path, zero_grad: bool
) -> None:
    # Server 1 drops the connection on the first push, before applying it:
    # server 0's answer is read, then the client reconnects to server 1 and
    # sends the push again. Each server applies it once. With zero_grad the
    # gradient buffer was zeroed while the servers worked: the retry must
    # carry the gradient (from the connection's shared memory), not zeros.
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    dropped, drop_first = connection_dropper()

    values = dyadic_values(reference_placement(2).total_numel, -1.0)
    peer = cluster.peer(
        INITIALIZER,
        values=values,
        resolve=lambda index: cluster.addresses[index],
        reconnect_timeout_s=DEADLINE_S,
    )
    peer.client.hello(initialize=True)
    cluster.servers[1]._gate = drop_first  # after the hello's pull, which passes it too
    assert [c.shared for c in peer.client._conns] == [True, True]
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)
    calls: list[int] = []

    handle = peer.client.push(
        num_samples=1,
        want_params=True,
        key=PushKey(0, 0, 0, 1),
        zero_grad=zero_grad,
        while_waiting=lambda: calls.append(1),
    )

    assert handle.acknowledged and dropped == [True] and calls == [1]
    assert peer.client.reconnects == 1
    assert torch.equal(peer.params, values - grad)
    assert torch.equal(peer.grads, torch.zeros_like(grad) if zero_grad else grad)
    assert [s["pushes"] for s in shard_stats(peer)] == [1, 1]


@pytest.mark.parametrize("mapped", [False, True])
def test_a_shared_memory_push_runs_the_caller_s_work_while_servers_work(
    cluster: Cluster, tmp_path: Path, mapped: bool
) -> None:
    # Both servers hold the push until the caller's work runs: it must run
    # once every request is out and before any answer is read. A copying
    # client has zeroed the gradient by then (the push copied it); a mapped
    # one zeroes it only once the servers answered (they read it in place).
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    released = threading.Event()

    def hold() -> None:
        assert released.wait(DEADLINE_S), "the caller's work did not run while the servers held"

    peer = mapped_peer(cluster) if mapped else shared_memory_peer(cluster)[0]
    values = peer.params.clone()
    for server in cluster.servers:
        server._gate = hold
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)
    seen: list[bool] = []

    def work() -> None:
        seen.append(torch.equal(peer.grads, grad if mapped else torch.zeros_like(grad)))
        released.set()

    handle = peer.client.push(num_samples=1, want_params=True, zero_grad=True, while_waiting=work)

    assert handle.acknowledged and seen == [True]
    assert not peer.grads.any()
    assert_shard_ranges_equal(peer, values - grad)


@pytest.mark.parametrize("options", [{"overlap_push": True}, {"overlap_pull": True}])
def test_background_pushes_go_through_shared_memory_and_a_reconnected_server_gets_bodies(
    cluster: Cluster, tmp_path: Path, options: dict[str, bool]
) -> None:
    # The caller writes a background push's gradient into the shared memory;
    # a connection replaced meanwhile has new, empty memory: it gets the
    # staged copy in a body instead.
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    values = dyadic_values(reference_placement(2).total_numel, -1.0)
    peer = cluster.peer(INITIALIZER, values=values, **options)
    peer.client.hello(initialize=True)
    assert [c.shared for c in peer.client._conns] == [True, True]
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    want = "overlap_pull" in options
    sent: list[tuple[socket.socket, bool]] = []  # (connection, through shared memory)
    real_send = client_module.send_frame

    def recording(sock: socket.socket, header: FrameHeader, body: Any = ()) -> None:
        if header.msg_type is MsgType.PUSH:
            sent.append((sock, bool(header.flags & Flags.SHARED)))
        real_send(sock, header, body)

    client_module.send_frame = recording  # type: ignore[assignment]
    try:
        peer.grads.copy_(grad)
        handle = peer.client.push(num_samples=1, want_params=want, on_acknowledged=lambda: None)
        peer.grads.zero_()  # the caller may reuse grads at once
        handle.wait(DEADLINE_S)
        assert handle.acknowledged
        peer.client.flush()
        # The next push waits behind a blocked sender while server 0's
        # connection is replaced: written into the old memory, it must
        # reach the new connection in a body.
        release = threading.Event()
        assert peer.client._background is not None
        peer.client._background.submit(release.wait, DEADLINE_S)
        peer.grads.copy_(grad)
        handle = peer.client.push(num_samples=1, want_params=want, on_acknowledged=lambda: None)
        peer.grads.zero_()
        conn = peer.client._conns[0]
        conn.connect(PSSlot(0, cluster.addresses[0], 0), DEADLINE_S)
        conn.hello(INITIALIZER, None)
        assert conn.shared
        release.set()
        handle.wait(DEADLINE_S)
        assert handle.acknowledged
    finally:
        client_module.send_frame = real_send  # type: ignore[assignment]
    replaced = peer.client._conns[0].sock
    assert [shm for sock, shm in sent if sock is replaced] == [False]
    assert [shm for sock, shm in sent if sock is not replaced] == [True, True, True]
    peer.client.pull()
    assert torch.equal(peer.params, values - 2 * grad)


def test_a_new_connection_gets_new_shared_memory(cluster: Cluster, tmp_path: Path) -> None:
    # A server still handling a request of a connection the trainer gave up may
    # write into that connection's memory later: it must not be the memory the
    # trainer reads the answers of its new connection from.
    cluster.start(1, UpdateMode.ASYNC, unix_dir=tmp_path)
    values = dyadic_values(reference_placement(1).total_numel, -1.0)
    peer = cluster.peer(INITIALIZER, values=values)
    peer.client.hello(initialize=True)
    conn = peer.client._conns[0]
    before = conn._shared
    assert conn.shared and before is not None

    conn.connect(PSSlot(0, cluster.addresses[0], 0), DEADLINE_S)
    conn.hello(INITIALIZER, None)

    assert conn.shared and conn._shared is not None and conn._shared is not before
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)
    peer.client.push(num_samples=1, want_params=True)
    assert torch.equal(peer.params, values - grad)


def test_shared_memory_that_could_shrink_is_refused_and_bodies_are_used(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.start(1, UpdateMode.ASYNC, unix_dir=tmp_path)
    values = dyadic_values(reference_placement(1).total_numel, -1.0)
    # A memfd without the seal against shrinking: a server mapping it could be
    # killed by SIGBUS, so it must refuse it.
    monkeypatch.setattr(client_module, "_SEALS", fcntl.F_SEAL_GROW)
    peer = cluster.peer(INITIALIZER, values=values)
    peer.client.hello(initialize=True)
    assert [c.shared for c in peer.client._conns] == [False]
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)
    peer.client.push(num_samples=1, want_params=True)
    assert torch.equal(peer.params, values - grad)


def test_a_shared_push_without_shared_memory_is_refused_and_the_connection_stays_usable(
    cluster: Cluster,
) -> None:
    values = initialized(cluster, 1, UpdateMode.ASYNC)
    sock = cluster.raw(0)
    raw_hello(sock, cluster)
    send_frame(sock, FrameHeader(MsgType.PUSH, DType.FLOAT32, flags=Flags.SHARED, sender=SECOND))
    assert "attach_shm" in expect_error(sock, "bad_push")
    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header, _ = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK
    assert_shard_untouched(cluster, values)


def test_attach_shm_over_tcp_closes_the_connection(cluster: Cluster) -> None:
    initialized(cluster, 1, UpdateMode.ASYNC)
    sock = cluster.raw(0)
    raw_hello(sock, cluster)
    send_json(sock, MsgType.CONTROL, {"op": "attach_shm", "numel": 1})
    assert "AF_UNIX" in expect_error(sock, "bad_frame")
    assert_closed_by_server(sock)


def test_endpoints_control_op_names_the_unix_path_and_the_host(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(1, UpdateMode.ASYNC, unix_dir=tmp_path)
    sock = cluster.raw(0)

    send_json(sock, MsgType.CONTROL, {"op": "endpoints"})
    header, body = read_reply(sock)

    assert header.msg_type is MsgType.CONTROL_OK
    assert body == {
        "shard": 0,
        "unix": str(tmp_path / "ps-0.sock"),
        "host_id": local_host_id(),
        "shm": True,
    }
    cluster.close()
    assert not (tmp_path / "ps-0.sock").exists()  # stop() removes the socket file


def test_client_falls_back_to_tcp_for_another_host_or_a_tcp_only_server(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.start(1, UpdateMode.ASYNC)  # TCP only
    tcp_only = cluster.peer(INITIALIZER)
    tcp_only.client.hello(initialize=True)
    assert tcp_only.client.transports == ["tcp"]
    with pytest.raises(ServiceUnavailableError, match="does not listen on a Unix socket"):
        cluster.peer(SECOND, transport="unix")

    other = Cluster()
    try:
        other.start(1, UpdateMode.ASYNC, unix_dir=tmp_path)
        monkeypatch.setattr(client_module, "local_host_id", lambda: "elsewhere/boot")
        remote = other.peer(INITIALIZER)
        remote.client.hello(initialize=True)
        assert remote.client.transports == ["tcp"]
        with pytest.raises(ServiceUnavailableError, match="another host"):
            other.peer(SECOND, transport="unix")
    finally:
        other.close()


def test_a_stale_socket_file_is_replaced(cluster: Cluster, tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "ps-0.sock"))
    stale.close()  # the file stays behind, as after a crash

    cluster.start(1, UpdateMode.ASYNC, unix_dir=tmp_path)
    peer = cluster.peer(INITIALIZER, transport="unix")
    peer.client.hello(initialize=True)

    assert peer.client.transports == ["unix"]


# --- 16-bit gradient compression ------------------------------------------------------


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_push_is_widened_to_float32_on_the_server(
    cluster: Cluster, compression: str
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND, grad_compression=compression)
    peer.client.hello(initialize=False)
    # Dyadic values with few mantissa bits: exact in float16 and bfloat16 too.
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)

    peer.client.push(num_samples=1, want_params=True)

    assert torch.equal(peer.params, values - grad)
    assert peer.params.dtype == torch.float32
    fresh = observer(cluster)
    assert torch.equal(fresh.params, values - grad)


def test_compression_rounds_like_a_cast_to_the_wire_dtype(cluster: Cluster) -> None:
    values = initialized(cluster, 1, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND, grad_compression="bf16")
    peer.client.hello(initialize=False)
    grad = torch.linspace(-3.0, 3.0, peer.placement.total_numel) / 7.0  # not exact in bf16
    peer.grads.copy_(grad)

    peer.client.push(num_samples=1, want_params=True)

    assert torch.equal(peer.params, values - grad.to(torch.bfloat16).to(torch.float32))


@pytest.mark.parametrize(
    ("dtype", "itemsize_bytes", "why"),
    [
        (DType.FLOAT16, 4, "float16 with float32's byte count"),
        (DType.BFLOAT16, 1, "bfloat16 with too few bytes"),
        (DType.FLOAT32, 2, "float32 with float16's byte count"),
    ],
)
def test_push_whose_dtype_and_size_disagree_is_refused_and_applies_nothing(
    cluster: Cluster, dtype: DType, itemsize_bytes: int, why: str
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    sock = cluster.raw(0)
    numel = raw_hello(sock, cluster)
    body = torch.ones(numel * itemsize_bytes, dtype=torch.uint8)

    send_frame(
        sock, FrameHeader(MsgType.PUSH, dtype, body_nbytes=body.numel()), [tensor_view(body)]
    )

    assert "float16 or bfloat16" in expect_error(sock, "bad_push"), why
    send_json(sock, MsgType.CONTROL, {"op": "stats"})  # the connection is still usable
    header, _ = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK
    assert_shard_untouched(cluster, values)


def test_unknown_compression_or_transport_is_a_config_error(cluster: Cluster) -> None:
    cluster.start(1, UpdateMode.ASYNC)
    with pytest.raises(ConfigError, match="grad_compression"):
        cluster.peer(SECOND, grad_compression="int8")
    with pytest.raises(ConfigError, match="transport"):
        cluster.peer(SECOND, transport="rdma")


# --- pushes overlapped with compute ----------------------------------------------------


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_background_push_runs_its_callback_on_the_sender_once_acknowledged(
    cluster: Cluster, compression: str
) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND, overlap_push=True, grad_compression=compression)
    peer.client.hello(initialize=False)
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    acked: list[tuple[int, str]] = []

    total = torch.zeros_like(grad)
    for k in range(3):
        peer.grads.copy_(grad * (k + 1))
        total += grad * (k + 1)
        handle = peer.client.push(
            num_samples=1,
            want_params=False,
            on_acknowledged=lambda k=k: acked.append((k, threading.current_thread().name)),
        )
        peer.grads.zero_()  # the push sends its staging copy: the caller may reuse grads
        handle.wait(DEADLINE_S)
        assert handle.acknowledged
        assert handle.index == k + 1

    assert peer.client.acknowledged_pushes == 3
    assert [k for k, _ in acked] == [0, 1, 2]
    assert all(name.startswith("ps-push") for _, name in acked), acked  # in the background
    peer.client.pull()
    assert torch.equal(peer.params, values - total)


def test_pull_waits_for_the_push_in_flight(cluster: Cluster) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND, overlap_push=True)
    peer.client.hello(initialize=False)
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)

    peer.client.push(num_samples=1, want_params=False, on_acknowledged=lambda: None)
    peer.client.pull()  # no wait in between: the pull must see the push applied

    assert torch.equal(peer.params, values - grad)
    assert peer.client.acknowledged_pushes == 1
    assert peer.client.versions == [1, 1]


def test_a_failed_background_push_is_never_acknowledged_and_surfaces_on_the_next_call(
    cluster: Cluster,
) -> None:
    initialized(cluster, 1, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND, overlap_push=True)  # no resolve: no reconnection
    peer.client.hello(initialize=False)
    peer.client.push(num_samples=1, want_params=False, on_acknowledged=lambda: None).wait(
        DEADLINE_S
    )
    cluster.servers[0].stop()
    acked: list[str] = []

    handle = peer.client.push(
        num_samples=1, want_params=False, on_acknowledged=lambda: acked.append("push")
    )
    peer.client.when_acknowledged(lambda: acked.append("when"))

    with pytest.raises(ServiceUnavailableError):
        handle.wait(DEADLINE_S)
    assert not handle.acknowledged
    assert peer.client.acknowledged_pushes == 1
    assert acked == []
    with pytest.raises(ServiceUnavailableError):
        peer.client.pull()


@pytest.mark.parametrize(
    ("want_params", "callback"),
    [(True, True), (False, False)],
    ids=["wants params", "no callback"],
)
def test_push_without_a_callback_or_wanting_params_is_acknowledged_when_it_returns(
    cluster: Cluster, want_params: bool, callback: bool
) -> None:
    initialized(cluster, 1, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND, overlap_push=True)
    peer.client.hello(initialize=False)
    acked: list[str] = []

    handle = peer.client.push(
        num_samples=1,
        want_params=want_params,
        on_acknowledged=(lambda: acked.append(threading.current_thread().name))
        if callback
        else None,
    )
    peer.client.when_acknowledged(lambda: acked.append("when"))

    assert handle.acknowledged  # sent in the foreground: reporting progress now is right
    assert acked == ([threading.current_thread().name] if callback else []) + ["when"]
    assert peer.client.acknowledged_pushes == 1


def test_background_push_interrupted_by_a_lost_server_is_resent_once_to_its_successor(
    cluster: Cluster,
) -> None:
    cluster.start(1, UpdateMode.ASYNC)
    current = {0: cluster.addresses[0]}
    values = dyadic_values(reference_placement(1).total_numel, -1.0)
    peer = cluster.peer(
        INITIALIZER,
        values=values,
        overlap_push=True,
        resolve=lambda index: current[index],
        reconnect_timeout_s=DEADLINE_S,
    )
    peer.client.hello(initialize=True)
    cluster.servers[0].stop()
    cluster.start(1, UpdateMode.ASYNC)  # the successor: empty, same index
    current[0] = cluster.servers[1].address
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)

    handle = peer.client.push(num_samples=1, want_params=False, on_acknowledged=lambda: None)
    handle.wait(DEADLINE_S)

    assert peer.client.reconnects == 1
    assert peer.client.acknowledged_pushes == 1
    peer.client.pull()
    assert torch.equal(peer.params, values - grad)  # applied once, on the successor
    assert [s["pushes"] for s in shard_stats(peer)] == [1]


# --- torn reads, epochs and push keys over the wire ---------------------------------


class WideModel(nn.Module):
    """One big parameter: a step over it takes long enough to overlap a pull."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))


def test_concurrent_pulls_never_see_half_a_step(cluster: Cluster) -> None:
    """Every push of a gradient of ones moves every value by exactly -1 (SGD, lr 1),
    so the values are equal everywhere between two steps. A pull that overlapped a
    step without the shard's read lock would see two versions mixed."""
    cluster.start(1, UpdateMode.ASYNC)
    numel = 1 << 21  # 8 MiB of float32
    pusher_flat = bind_flat_buffers(WideModel(numel), 1, numel + 1)
    puller_flat = bind_flat_buffers(WideModel(numel), 1, numel + 1)
    pusher = ParameterClient(
        pusher_flat.placement, cluster.addresses, pusher_flat.params, pusher_flat.grads, 1
    )
    puller = ParameterClient(
        puller_flat.placement, cluster.addresses, puller_flat.params, puller_flat.grads, 2
    )
    try:
        pusher.hello(initialize=True)
        puller.hello(initialize=False)
        pusher_flat.grads.fill_(1.0)
        stop = threading.Event()

        def push_forever() -> None:
            while not stop.is_set():
                pusher.push(1, want_params=False)

        thread = threading.Thread(target=push_forever, daemon=True)
        thread.start()
        try:
            torn = 0
            for _ in range(60):
                puller.pull()
                values = puller_flat.params
                if not torch.equal(values, values[:1].expand_as(values)):
                    torn += 1
        finally:
            stop.set()
            thread.join(DEADLINE_S)
        assert torn == 0, f"{torn} of 60 pulls saw a half-applied step"
        assert puller.versions[0] > 0
    finally:
        pusher.close()
        puller.close()


def test_requests_for_another_epoch_are_refused(cluster: Cluster) -> None:
    cluster.start(1, UpdateMode.ASYNC)
    cluster.servers[0].epoch = 41
    sock = cluster.raw()
    send_frame(sock, FrameHeader(MsgType.PULL, epoch=40))
    header = recv_header(sock, bytearray(HEADER_SIZE), max_body_bytes=0)
    assert header.msg_type is MsgType.ERROR
    assert recv_json(sock, header)["code"] == "wrong_epoch"
    # The connection stays usable, and a control request may carry no epoch.
    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header = recv_header(sock, bytearray(HEADER_SIZE), max_body_bytes=0)
    assert header.msg_type is MsgType.CONTROL_OK


def test_a_keyed_push_sent_twice_is_applied_once(cluster: Cluster) -> None:
    values = initialized(cluster, 2, UpdateMode.ASYNC)
    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=False)
    peer.grads.fill_(1.0)
    key = PushKey(0, 5, 0, 32)
    first = peer.client.push(32, want_params=True, key=key)
    again = peer.client.push(32, want_params=True, key=key)
    assert first.statuses == [PushStatus.APPLIED] * 2
    assert again.statuses == [PushStatus.DUPLICATE] * 2 and again.acknowledged
    assert torch.equal(peer.params, values - 1.0)
    coverage = [s.shard.coverage_of(0) for s in cluster.servers if s.shard is not None]
    assert coverage == [(False, [(5, 0, 32)])] * 2


def test_a_server_that_may_have_lost_its_slot_answers_recovery_ops_with_fenced(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A server paused past its lease must not vouch for its shard: a successor may
    serve an older checkpoint by now, and the master would seal a pass on its word."""
    cluster.start(1, UpdateMode.ASYNC)
    server = cluster.servers[0]
    held = threading.Event()
    held.set()
    server._holds_slot = held.is_set  # what run_ps wires to the lease
    server.files = ShardFiles(tmp_path, 0, server.epoch, may_write=held.is_set)
    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=True)
    peer.grads.fill_(1.0)
    peer.client.push(num_samples=2, want_params=True)
    sock = cluster.raw(0)

    held.clear()
    for body in (
        {"op": "coverage", "pass": 0},
        {"op": "seal", "pass": 0},
        {"op": "checkpoints"},
        {"op": "freeze"},
    ):
        send_json(sock, MsgType.CONTROL, body)
        assert "may no longer hold" in expect_error(sock, "fenced")
    # Nothing was sealed, saved or frozen; read-only ops still answer.
    assert server.files.durable_versions() == []
    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header, _ = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK

    held.set()
    send_json(sock, MsgType.CONTROL, {"op": "seal", "pass": 0})
    header, body = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK
    assert body is not None and body["durable"] is True


def test_a_seal_whose_checkpoint_may_not_be_written_is_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The lease lapsing between the op's checks shows as a refused write: not a seal."""
    cluster.start(1, UpdateMode.ASYNC)
    server = cluster.servers[0]
    server.files = ShardFiles(tmp_path, 0, server.epoch, may_write=lambda: False)
    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=True)
    sock = cluster.raw(0)
    send_json(sock, MsgType.CONTROL, {"op": "seal", "pass": 0})
    assert "not saved" in expect_error(sock, "fenced")
    assert server.files.durable_versions() == []


def test_sealing_keeps_only_the_newest_checkpoints(cluster: Cluster, tmp_path: Path) -> None:
    """Old files are pruned after a seal's answer, before the connection's next request."""
    cluster.start(1, UpdateMode.ASYNC)
    server = cluster.servers[0]
    server.files = ShardFiles(tmp_path, 0, server.epoch, keep=2)
    peer = cluster.peer(SECOND)
    peer.client.hello(initialize=True)
    sock = cluster.raw(0)
    for pass_id in range(4):
        peer.grads.fill_(1.0)
        peer.client.push(num_samples=2, want_params=True)
        send_json(sock, MsgType.CONTROL, {"op": "seal", "pass": pass_id})
        header, body = read_reply(sock)
        assert header.msg_type is MsgType.CONTROL_OK
        assert body is not None and body["durable"] is True
    send_json(sock, MsgType.CONTROL, {"op": "stats"})
    header, _ = read_reply(sock)
    assert header.msg_type is MsgType.CONTROL_OK
    assert server.files.durable_versions() == [4, 3]


# --- shared memory mapped into the flat buffers -----------------------------------------

# A TinyModel this wide has a paged layout on 2 servers (its embed.weight sliced
# in 16-page slices): the client may map the shared memory into its buffers.
MAPPED_WIDTH = 8192


def assert_shard_ranges_equal(peer: Peer, expected: torch.Tensor) -> None:
    """The peer's parameters equal ``expected`` wherever a shard's element is (not
    in the padding of a paged layout, which no server holds)."""
    for shard in peer.placement.shards:
        for lo, hi in shard.ranges:
            assert torch.equal(peer.params[lo:hi], expected[lo:hi])


def wide_peer(cluster: Cluster, trainer_id: int = INITIALIZER, **options: Any) -> Peer:
    """A peer of a TinyModel(MAPPED_WIDTH) that may map its buffers (no HELLO yet)."""
    numel = bind_flat_buffers(TinyModel(MAPPED_WIDTH), len(cluster.servers)).placement.total_numel
    return cluster.peer(
        trainer_id,
        width=MAPPED_WIDTH,
        values=dyadic_values(numel, -1.0),
        big_array_bound=DEFAULT_BIG_ARRAY_BOUND,
        map_buffers=True,
        **options,
    )


def mapped_peer(cluster: Cluster, trainer_id: int = INITIALIZER, **options: Any) -> Peer:
    """A peer of the started servers whose buffers are mapped shared memory, said hello."""
    peer = wide_peer(cluster, trainer_id, **options)
    assert page_runs(peer.placement) is not None  # precondition: a paged layout
    peer.client.hello(initialize=True)
    assert [c.mapped for c in peer.client._conns] == [True] * len(cluster.servers)
    return peer


def refuse_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any gather into or scatter out of shared memory fail the test."""

    def refuse(*args: object) -> None:
        raise AssertionError("a mapped push copied through the shared memory")

    monkeypatch.setattr(client_module._SharedMemory, "write_grads", refuse)
    monkeypatch.setattr(client_module._SharedMemory, "read_params", refuse)


@pytest.mark.parametrize("mode", [UpdateMode.ASYNC, UpdateMode.SYNC])
def test_mapped_pushes_copy_nothing_and_give_what_bodies_give(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: UpdateMode
) -> None:
    cluster.start(2, mode, unix_dir=tmp_path)
    peer = mapped_peer(cluster)
    values = peer.params.clone()
    refuse_copies(monkeypatch)
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    for step in range(1, 4):
        peer.grads.copy_(grad)
        handle = peer.client.push(num_samples=1, want_params=True, zero_grad=True)
        assert handle.acknowledged
        assert not peer.grads.any()
        assert_shard_ranges_equal(peer, values - step * grad)
    # A client that copies pulls the same values.
    monkeypatch.undo()
    other = cluster.peer(OBSERVER, width=MAPPED_WIDTH, big_array_bound=DEFAULT_BIG_ARRAY_BOUND)
    other.client.hello(initialize=False)
    assert not any(c.mapped for c in other.client._conns)
    assert_shard_ranges_equal(other, peer.params)


def test_a_server_lost_in_a_mapped_push_gets_it_again_and_its_old_memory_is_cut_off(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Server 1 drops the connection before applying the push; the client
    # reconnects (new shared memory, mapped anew) and sends it again. The
    # old memory no longer reaches the flat buffers: a server that outlived
    # its connection cannot change the trainer's parameters.
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    dropped, drop_first = connection_dropper()

    peer = mapped_peer(
        cluster, resolve=lambda index: cluster.addresses[index], reconnect_timeout_s=DEADLINE_S
    )
    values = peer.params.clone()
    conn = peer.client._conns[1]
    old = conn._shared
    assert old is not None
    old_fd = os.dup(old.fd)  # what a server that outlives the connection holds
    cluster.servers[1]._gate = drop_first
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)

    handle = peer.client.push(
        num_samples=1, want_params=True, key=PushKey(0, 0, 0, 1), zero_grad=True
    )

    assert handle.acknowledged and dropped == [True] and peer.client.reconnects == 1
    assert conn.mapped and conn._shared is not old
    assert_shard_ranges_equal(peer, values - grad)
    assert [s["pushes"] for s in shard_stats(peer)] == [1, 1]
    # Whatever the old memory holds now, the flat buffers do not see it.
    before = peer.params.clone()
    try:
        os.pwrite(old_fd, b"\xff" * (8 * old.params_at), 0)
    finally:
        os.close(old_fd)
    assert torch.equal(peer.params, before)


def test_closing_a_mapped_client_keeps_its_values_in_private_memory(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    peer = mapped_peer(cluster)
    memories = [c._shared for c in peer.client._conns if c._shared is not None]
    fds = [(os.dup(m.fd), 8 * m.params_at) for m in memories]
    values, grads = peer.params.clone(), peer.grads.clone()

    peer.client.close()

    assert not any(c.mapped for c in peer.client._conns)
    assert torch.equal(peer.params, values)
    for fd, nbytes in fds:
        try:
            os.pwrite(fd, b"\xff" * nbytes, 0)  # what a late server write would do
        finally:
            os.close(fd)
    assert torch.equal(peer.params, values) and torch.equal(peer.grads, grads)


def test_a_copying_client_option_turns_mapping_off(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    peer = wide_peer(cluster, overlap_push=True)
    peer.client.hello(initialize=True)
    assert [c.shared for c in peer.client._conns] == [True, True]
    assert not any(c.mapped for c in peer.client._conns)


def test_a_big_mapped_model_is_still_exchanged_by_the_calling_thread(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Above the bound a copying client spreads its copies over a thread per
    # server; a mapped one has nothing to copy and keeps to one thread.
    monkeypatch.setattr(client_module, "SERIAL_EXCHANGE_MAX_BYTES", 0)
    cluster.start(2, UpdateMode.ASYNC, unix_dir=tmp_path)
    peer = mapped_peer(cluster)
    values = peer.params.clone()
    pool = peer.client._pool
    assert pool is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a mapped push used the thread pool")

    pool.submit = refuse  # type: ignore[method-assign,assignment]
    grad = dyadic_values(peer.placement.total_numel, 0.5)
    peer.grads.copy_(grad)
    assert peer.client.push(num_samples=1, want_params=True).acknowledged
    assert_shard_ranges_equal(peer, values - grad)
