"""Sparse rows on the tensor plane: ROW_PULL / ROWS / ROW_GRADS against real servers.

In-process ParameterServers on 127.0.0.1 (port 0), each in its own thread,
with a real ParameterClient and with raw sockets that send malformed
requests: every bad request gets an ERROR frame and changes nothing.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

import elasticps.nn as enn
from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import RemoteError, SparseTableError
from elasticps.netutil import LOOPBACK
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.server import ParameterServer
from elasticps.pserver.sparse import Partitioner
from elasticps.pserver.sparse_shard import TableEntry
from elasticps.trainer.client import ParameterClient, parse_address
from elasticps.trainer.flat import FlatModel, bind_flat_buffers
from elasticps.wire.auth import client_handshake
from elasticps.wire.frame import (
    HEADER_SIZE,
    DType,
    Flags,
    FrameHeader,
    MsgType,
    PushStatus,
    encode_header,
    recv_header,
    recv_json,
    send_frame,
    send_json,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROWS, DIM = 30, 4
SGD_LR1 = OptimizerConfig(name="sgd", lr=1.0)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = enn.Embedding(ROWS, DIM, name="emb", feature="ids", partition="range")
        self.head = nn.Linear(DIM, 1)


@pytest.fixture
def servers() -> Iterator[list[ParameterServer]]:
    made = [ParameterServer(i, UpdateMode.ASYNC, SGD_LR1, host=LOOPBACK) for i in range(2)]
    for s in made:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield made
    for s in made:
        s.stop()


@pytest.fixture
def trainer(servers: list[ParameterServer]) -> Iterator[tuple[FlatModel, ParameterClient]]:
    # Hash placement puts the whole dense part on server 0 (the tests rely on it).
    flat = bind_flat_buffers(Model(), 2, strategy="hash")
    entries = [TableEntry(s, "range", 2) for s in enn.table_specs(flat.model).values()]
    client = ParameterClient(
        flat.placement, [s.address for s in servers], flat.params, flat.grads, 1, tables=entries
    )
    client.hello()
    yield flat, client
    client.close()


def test_rows_are_pulled_from_and_pushed_to_the_server_holding_them_once_per_key(
    trainer: tuple[FlatModel, ParameterClient], servers: list[ParameterServer]
) -> None:
    flat, client = trainer
    ids = torch.tensor([2, 29, 2, 17])
    local = flat.model.emb.local.table  # type: ignore[union-attr]
    rows = client.pull_rows({"emb": ids})["emb"]
    assert torch.equal(rows, local.lookup(ids))  # initial values: a function of the id
    unique = torch.tensor([2, 17, 29])
    grads = torch.arange(3 * DIM, dtype=torch.float32).reshape(3, DIM)
    key = PushKey(0, 1, 0, 8)
    handle = client.push(8, want_params=True, key=key, rows={"emb": (unique, grads)})
    assert handle.statuses == [PushStatus.APPLIED, PushStatus.APPLIED]
    after = client.pull_rows({"emb": unique})["emb"]
    torch.testing.assert_close(after, local.lookup(unique) - grads)
    again = client.push(8, want_params=True, key=key, rows={"emb": (unique, grads)})
    assert again.statuses == [PushStatus.DUPLICATE, PushStatus.DUPLICATE]
    assert torch.equal(client.pull_rows({"emb": unique})["emb"], after)
    held = [s["sparse_rows"] for s in client.stats()]
    lo, hi = Partitioner("range", 2, ROWS).range_bounds()[0]
    assert held == [{"emb": 1}, {"emb": 2}] and lo <= 2 < hi <= 17
    assert all(s.shard is not None and s.shard.tables is not None for s in servers)


def test_a_push_pulls_rows_pipelined_behind_it_and_they_include_its_update(
    trainer: tuple[FlatModel, ParameterClient],
) -> None:
    flat, client = trainer
    local = flat.model.emb.local.table  # type: ignore[union-attr]
    unique = torch.tensor([2, 17, 29])
    grads = torch.ones(3, DIM)
    wanted = torch.tensor([29, 3, 2])  # any order, rows of both servers
    handle = client.push(8, want_params=True, key=PushKey(0, 1, 0, 8),
                         rows={"emb": (unique, grads)}, prefetch={"emb": wanted})  # fmt: skip
    assert handle.statuses == [PushStatus.APPLIED, PushStatus.APPLIED]
    assert handle.rows is not None
    expected = local.lookup(wanted) - torch.tensor([1.0, 0.0, 1.0])[:, None]  # 29, 2 updated
    torch.testing.assert_close(handle.rows["emb"], expected)
    assert torch.equal(handle.rows["emb"], client.pull_rows({"emb": wanted})["emb"])
    # A refused push (an id pushed twice): the rows pulled behind it are read
    # and dropped, and the connection stays usable.
    with pytest.raises(RemoteError, match="not unique"):
        client.push(8, want_params=True, key=PushKey(0, 2, 0, 8),
                    rows={"emb": (torch.tensor([2, 2]), torch.ones(2, DIM))},
                    prefetch={"emb": wanted})  # fmt: skip
    assert torch.equal(client.pull_rows({"emb": wanted})["emb"], expected)
    plain = client.push(8, want_params=False, key=PushKey(0, 3, 0, 8))
    assert plain.rows is None


def test_a_split_is_reused_only_for_the_same_ids_even_if_the_callers_tensor_changes(
    trainer: tuple[FlatModel, ParameterClient],
) -> None:
    # The client keeps each table's last split (a push's rows are the ids its
    # batch pulled); a tensor changed in place since must be split again.
    flat, client = trainer
    local = flat.model.emb.local.table  # type: ignore[union-attr]
    ids = torch.tensor([1, 2, 3])  # all on server 0
    assert torch.equal(client.pull_rows({"emb": ids})["emb"], local.lookup(ids))
    ids.copy_(torch.tensor([20, 25, 29]))  # all on server 1 now
    assert torch.equal(client.pull_rows({"emb": ids})["emb"], local.lookup(ids))
    client.push(
        8, want_params=True, key=PushKey(0, 1, 0, 8), rows={"emb": (ids, torch.ones(3, DIM))}
    )
    torch.testing.assert_close(client.pull_rows({"emb": ids})["emb"], local.lookup(ids) - 1.0)
    with pytest.raises(SparseTableError, match="out of range"):
        client.pull_rows({"emb": torch.tensor([20, ROWS])})


# --- overlap_pull: pushes that pull, in the background ----------------------------------


def _overlapped(servers: list[ParameterServer]) -> tuple[FlatModel, ParameterClient]:
    flat = bind_flat_buffers(Model(), 2, strategy="hash")
    entries = [TableEntry(s, "range", 2) for s in enn.table_specs(flat.model).values()]
    client = ParameterClient(
        flat.placement, [s.address for s in servers], flat.params, flat.grads, 1,
        tables=entries, overlap_pull=True,
    )  # fmt: skip
    client.hello()
    return flat, client


def test_with_overlap_pull_a_push_pulls_in_the_background_and_params_change_at_the_next_call(
    servers: list[ParameterServer],
) -> None:
    flat, client = _overlapped(servers)
    try:
        local = flat.model.emb.local.table  # type: ignore[union-attr]
        before = flat.params.clone()
        unique, wanted = torch.tensor([2, 17, 29]), torch.tensor([29, 3, 2])
        flat.grads.fill_(0.5)
        acked: list[str] = []
        handle = client.push(
            8, want_params=True, key=PushKey(0, 1, 0, 8),
            on_acknowledged=lambda: acked.append(threading.current_thread().name),
            rows={"emb": (unique, torch.ones(3, DIM))}, prefetch={"emb": wanted},
        )  # fmt: skip
        flat.grads.zero_()  # the push sent its staging copy: the caller may reuse grads
        handle.wait(10.0)
        assert handle.acknowledged and acked and acked[0].startswith("ps-push")
        assert handle.rows is not None  # read behind the push, so with its update
        expected = local.lookup(wanted) - torch.tensor([1.0, 0.0, 1.0])[:, None]
        torch.testing.assert_close(handle.rows["emb"], expected)
        # Answered, but the caller's parameters change only at its next call on the client.
        assert torch.equal(flat.params, before)
        assert client.versions == [0, 0]
        client.flush()
        torch.testing.assert_close(flat.params, before - 0.5)  # SGD, lr 1, dense part
        assert client.versions == [1, 1]
    finally:
        client.close()


@pytest.mark.parametrize(("bound", "applied"), [(0, False), (1, True)])
def test_an_overlapped_push_carries_the_version_it_was_computed_on(
    bound: int, applied: bool
) -> None:
    # Push 2 is computed while push 1 travels, on the parameters from before
    # push 1: one version behind once push 1 is applied.
    made = [
        ParameterServer(i, UpdateMode.ASYNC, SGD_LR1, host=LOOPBACK, max_staleness=bound)
        for i in range(2)
    ]
    for s in made:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    flat, client = _overlapped(made)
    try:
        for task in (1, 2):
            flat.grads.fill_(0.5)
            handle = client.push(8, want_params=True, key=PushKey(0, task, 0, 8),
                                 on_acknowledged=lambda: None)  # fmt: skip
        handle.wait(10.0)
        assert handle.stale is not applied
        assert handle.statuses == [PushStatus.APPLIED if applied else PushStatus.STALE] * 2
    finally:
        client.close()
        for s in made:
            s.stop()


# --- malformed requests on a raw socket ---------------------------------------------------


class Raw:
    """A raw connection to one server, after a HELLO with the trainer's layout."""

    def __init__(self, server: ParameterServer, client: ParameterClient, index: int) -> None:
        self.sock = socket.create_connection(parse_address(server.address), timeout=10)
        client_handshake(self.sock, None, 0)
        self.sock.settimeout(10)
        self.scratch = bytearray(HEADER_SIZE)
        conn = next(c for c in client._conns if c.layout.index == index)
        self.index = index
        send_json(self.sock, MsgType.HELLO, {"trainer_id": 7, "layout": conn.hello_layout,
                                             "fingerprint": conn.fingerprint})  # fmt: skip
        assert self.reply().msg_type is MsgType.HELLO_OK

    def reply(self) -> FrameHeader:
        header = recv_header(self.sock, self.scratch, max_body_bytes=1 << 20)
        if header.msg_type in (MsgType.HELLO_OK, MsgType.ERROR, MsgType.CONTROL_OK):
            self.last = recv_json(self.sock, header)
        elif header.body_nbytes:
            body = bytearray(header.body_nbytes)
            self.sock.recv_into(body, header.body_nbytes, socket.MSG_WAITALL)
            self.body = bytes(body)
        return header

    def row_pull(self, counts: list[int], ids: list[int]) -> None:
        body = np.array([*counts, *ids], dtype=np.int64)
        send_frame(
            self.sock,
            FrameHeader(MsgType.ROW_PULL, dtype=DType.INT64, body_nbytes=body.nbytes),
            [body.data.cast("B")],
        )

    def push_rows(
        self, ids: list[int], rows: np.ndarray, *, counts: list[int] | None = None
    ) -> None:
        send_frame(self.sock, FrameHeader(MsgType.PUSH, DType.FLOAT32, Flags.ROWS, num_samples=1,
                                          body_nbytes=0 if self.index else 4 * 5),
                   [] if self.index else [np.zeros(5, np.float32).data.cast("B")])  # fmt: skip
        head = np.array([*(counts or [len(ids)]), *ids], dtype=np.int64)
        body = [head.data.cast("B"), np.ascontiguousarray(rows, np.float32).data.cast("B")]
        send_frame(
            self.sock,
            FrameHeader(MsgType.ROW_GRADS, DType.FLOAT32, body_nbytes=sum(b.nbytes for b in body)),
            body,
        )

    def error(self) -> str:
        header = self.reply()
        assert header.msg_type is MsgType.ERROR, header
        return f"{self.last['code']}: {self.last['message']}"


def test_bad_row_requests_get_an_error_change_nothing_and_keep_the_connection(
    trainer: tuple[FlatModel, ParameterClient], servers: list[ParameterServer]
) -> None:
    _, client = trainer
    numel = [c.layout.numel for c in sorted(client._conns, key=lambda c: c.layout.index)]
    assert numel[1] == 0  # the dense part is on server 0 (the test relies on it)
    raw = Raw(servers[1], client, 1)
    mine = [20, 25]  # the range of server 1
    before = client.pull_rows({"emb": torch.tensor(mine)})["emb"]

    raw.row_pull([1], [ROWS])
    assert "bad_rows" in raw.error() and "out of range" in raw.last["message"]
    raw.row_pull([1], [3])
    assert "belongs to parameter server 0" in raw.error()
    raw.row_pull([2], [20])  # the counts promise more ids than the body holds
    assert "bad_rows" in raw.error()
    raw.push_rows([20, 20], np.ones((2, DIM)))
    assert "not unique" in raw.error()
    raw.push_rows([3], np.ones((1, DIM)))
    assert "belongs to parameter server 0" in raw.error()
    raw.push_rows([20], np.ones((2, DIM)))  # more rows than ids
    assert "bad_rows" in raw.error()
    raw.row_pull([2], mine)  # still usable
    header = raw.reply()
    assert header.msg_type is MsgType.ROWS and header.body_nbytes == 2 * DIM * 4
    assert np.array_equal(np.frombuffer(raw.body, np.float32).reshape(2, DIM), before.numpy())
    assert torch.equal(client.pull_rows({"emb": torch.tensor(mine)})["emb"], before)
    stats = client.stats()[1]
    assert stats["sparse_rows"] == {"emb": 0} and stats["stats"]["version"] == 0


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset) the connection."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_malformed_row_frame_closes_the_connection(
    trainer: tuple[FlatModel, ParameterClient], servers: list[ParameterServer]
) -> None:
    _, client = trainer
    raw = Raw(servers[1], client, 1)
    # Ids must travel as int64: a header that says FLOAT32 (patched: encoders refuse it).
    header = bytearray(encode_header(FrameHeader(MsgType.ROW_PULL, DType.INT64, body_nbytes=16)))
    header[6] = int(DType.FLOAT32)
    raw.sock.sendall(bytes(header) + np.array([1, 20], np.int64).tobytes())
    assert "bad_frame" in raw.error()
    assert closed(raw.sock)
    other = Raw(servers[0], client, 0)
    send_frame(other.sock, FrameHeader(MsgType.PUSH, DType.FLOAT32, Flags.ROWS, num_samples=1,
                                       body_nbytes=4 * 5),
               [np.zeros(5, np.float32).data.cast("B")])  # fmt: skip
    send_frame(other.sock, FrameHeader(MsgType.PULL))  # not the ROW_GRADS a ROWS push promised
    assert "bad_frame" in other.error()
    assert closed(other.sock)
    with pytest.raises(SparseTableError, match="out of range"):
        client.pull_rows({"emb": torch.tensor([ROWS + 1])})
