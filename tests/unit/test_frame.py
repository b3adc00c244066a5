"""Tests of the tensor-plane frame format and its socket helpers."""

from __future__ import annotations

import itertools
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import Buffer

from elasticps.errors import FrameError, ProtocolError, RemoteError
from elasticps.wire.frame import (
    HEADER,
    HEADER_SIZE,
    ID_TYPES,
    JSON_TYPES,
    MAGIC,
    MAX_JSON_BYTES,
    NO_BODY_TYPES,
    PROTO_VERSION,
    REPLY_TYPES,
    TENSOR_TYPES,
    ConnectionClosedError,
    DType,
    Flags,
    FrameHeader,
    MsgType,
    PushStatus,
    decode_error,
    decode_header,
    discard_body,
    dtype_from_torch,
    encode_header,
    encode_header_into,
    local_host_id,
    recv_body_into,
    recv_exact_into,
    recv_header,
    recv_json,
    send_error,
    send_frame,
    send_json,
    tensor_view,
)

LIMIT = 1 << 20  # max_body_bytes used by most tests

VALID_HEADERS: dict[MsgType, FrameHeader] = {
    MsgType.HELLO: FrameHeader(MsgType.HELLO, sender=3, body_nbytes=17),
    MsgType.HELLO_OK: FrameHeader(MsgType.HELLO_OK, model_version=9, body_nbytes=2),
    MsgType.INIT_VALUES: FrameHeader(MsgType.INIT_VALUES, DType.FLOAT32, body_nbytes=400),
    MsgType.PUSH: FrameHeader(
        MsgType.PUSH,
        DType.BFLOAT16,
        Flags.WANT_PARAMS,
        sender=7,
        num_samples=64,
        model_version=12,
        step=5,
        body_nbytes=1000,
    ),
    MsgType.PUSH_OK: FrameHeader(MsgType.PUSH_OK, model_version=13),
    MsgType.PULL: FrameHeader(MsgType.PULL, sender=2),
    MsgType.PARAMS: FrameHeader(MsgType.PARAMS, DType.FLOAT16, model_version=4, body_nbytes=64),
    MsgType.ERROR: FrameHeader(MsgType.ERROR, body_nbytes=40),
    MsgType.CONTROL: FrameHeader(MsgType.CONTROL, body_nbytes=17),
    MsgType.CONTROL_OK: FrameHeader(MsgType.CONTROL_OK, body_nbytes=MAX_JSON_BYTES),
    MsgType.ROW_PULL: FrameHeader(MsgType.ROW_PULL, DType.INT64, body_nbytes=48),
    MsgType.ROWS: FrameHeader(MsgType.ROWS, DType.FLOAT32, model_version=3, body_nbytes=64),
    MsgType.ROW_GRADS: FrameHeader(MsgType.ROW_GRADS, DType.FLOAT16, body_nbytes=40),
}


def raw_header(**fields: object) -> bytes:
    """Pack header fields without any validation (defaults: a valid PULL)."""
    values: dict[str, object] = {
        "magic": MAGIC,
        "version": PROTO_VERSION,
        "msg_type": int(MsgType.PULL),
        "dtype": int(DType.BYTES),
        "flags": 0,
        "sender": 0,
        "num_samples": 0,
        "model_version": 0,
        "step": 0,
        "body_nbytes": 0,
        "epoch": 0,
        "task_id": 0,
        "pass_id": 0,
        "key_lo": 0,
        "key_hi": 0,
        "generation": 0,
        "status": 0,
        "reserved8": 0,
        "reserved16": 0,
    }
    assert set(fields) <= set(values)
    values.update(fields)
    return HEADER.pack(*values.values())


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def run_in_thread(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


# --- header encoding ---------------------------------------------------------


def test_header_is_forty_bytes() -> None:
    assert HEADER_SIZE == HEADER.size == 76


def test_every_message_type_has_a_valid_example() -> None:
    assert set(VALID_HEADERS) == set(MsgType)
    assert set(MsgType) == JSON_TYPES | NO_BODY_TYPES | TENSOR_TYPES | ID_TYPES


@pytest.mark.parametrize("msg_type", list(MsgType))
def test_header_round_trips_for_every_message_type(msg_type: MsgType) -> None:
    header = VALID_HEADERS[msg_type]
    raw = encode_header(header)
    assert len(raw) == HEADER_SIZE
    assert raw[:4] == MAGIC
    assert decode_header(raw, max_body_bytes=LIMIT) == header
    assert decode_header(memoryview(bytearray(raw)), max_body_bytes=LIMIT) == header


def test_encode_header_into_writes_the_same_bytes_at_the_front() -> None:
    header = VALID_HEADERS[MsgType.PUSH]
    buf = bytearray(b"\xff" * (HEADER_SIZE + 8))
    encode_header_into(header, buf)
    assert bytes(buf[:HEADER_SIZE]) == encode_header(header)
    assert buf[HEADER_SIZE:] == b"\xff" * 8


def test_encode_header_into_rejects_short_or_readonly_buffer() -> None:
    header = VALID_HEADERS[MsgType.PULL]
    with pytest.raises(ValueError, match="76"):
        encode_header_into(header, bytearray(HEADER_SIZE - 1))
    with pytest.raises(ValueError):
        encode_header_into(header, memoryview(bytes(76)))


def test_empty_push_round_trips_with_any_flags() -> None:
    header = FrameHeader(MsgType.PUSH, DType.FLOAT32, Flags.EMPTY | Flags.WANT_PARAMS, step=3)
    assert decode_header(encode_header(header), max_body_bytes=0) == header


def test_plain_int_fields_are_encoded_like_enums() -> None:
    header = FrameHeader(MsgType.PARAMS, DType.FLOAT32, body_nbytes=8)
    loose = FrameHeader(7, 1, 0, body_nbytes=8)  # type: ignore[arg-type]
    assert encode_header(loose) == encode_header(header)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (FrameHeader(MsgType.PULL, sender=-1), "sender -1"),
        (FrameHeader(MsgType.PULL, sender=1 << 32), "sender"),
        (FrameHeader(MsgType.PULL, num_samples=1 << 32), "num_samples"),
        (FrameHeader(MsgType.PULL, model_version=-1), "model_version -1"),
        (FrameHeader(MsgType.PULL, step=1 << 63), "step"),
        (FrameHeader(MsgType.PARAMS, DType.FLOAT32, body_nbytes=1 << 64), "body_nbytes"),
        (FrameHeader(42), "msg_type 42"),  # type: ignore[arg-type]
        (FrameHeader(MsgType.PULL, dtype=9), "dtype 9"),  # type: ignore[arg-type]
        (FrameHeader(MsgType.PUSH, DType.FLOAT32, flags=16), "flags"),  # type: ignore[arg-type]
        (FrameHeader(MsgType.PULL, body_nbytes=4), "PULL frame must have no body"),
        (FrameHeader(MsgType.PULL, flags=Flags.WANT_PARAMS), "only on PUSH"),
        (FrameHeader(MsgType.HELLO), "JSON body"),
        (FrameHeader(MsgType.PUSH, DType.FLOAT32, body_nbytes=6), "multiple"),
    ],
)
def test_encode_header_rejects_invalid_fields(header: FrameHeader, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        encode_header(header)


# --- header decoding: each malformed field is rejected ----------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (raw_header(magic=b"EPSG"), "bad magic"),
        (raw_header(version=0), "unsupported protocol version 0"),
        (raw_header(version=1), "unsupported protocol version 1"),
        (raw_header(version=3), "unsupported protocol version 3"),
        (raw_header(msg_type=0), "unknown msg_type 0"),
        (raw_header(msg_type=99), "unknown msg_type 99"),
        (raw_header(dtype=9), "unknown dtype 9"),
        (raw_header(msg_type=int(MsgType.PUSH), dtype=1, flags=16), "unknown flags"),
        (raw_header(msg_type=int(MsgType.PUSH), dtype=1, flags=0x80), "unknown flags"),
        (raw_header(flags=int(Flags.WANT_PARAMS)), "only on PUSH"),
        (
            raw_header(msg_type=int(MsgType.ROW_PULL), dtype=1, body_nbytes=16),
            "must have dtype INT64",
        ),
        (raw_header(msg_type=int(MsgType.ROW_PULL), dtype=4, body_nbytes=12), "multiple of 8"),
        (raw_header(msg_type=int(MsgType.ROW_GRADS), dtype=4, body_nbytes=16), "float dtype"),
        (raw_header(msg_type=int(MsgType.ROWS), dtype=0, body_nbytes=16), "float dtype"),
        (
            raw_header(msg_type=int(MsgType.PUSH), dtype=1, flags=int(Flags.EMPTY | Flags.ROWS)),
            "EMPTY cannot carry ROWS",
        ),
        (raw_header(msg_type=int(MsgType.PULL), flags=int(Flags.ROWS)), "only on PUSH"),
        (raw_header(model_version=-1), "model_version -1 is negative"),
        (raw_header(step=-(1 << 63)), "step .* is negative"),
        (raw_header(msg_type=int(MsgType.PUSH_OK), body_nbytes=1), "PUSH_OK frame must have no"),
        (raw_header(msg_type=int(MsgType.PULL), body_nbytes=1 << 63), "PULL frame must have no"),
        (
            raw_header(msg_type=int(MsgType.PUSH), dtype=1, flags=2, body_nbytes=4),
            "EMPTY must have no body",
        ),
        (raw_header(msg_type=int(MsgType.PARAMS), dtype=1, body_nbytes=6), "not a multiple"),
        (raw_header(msg_type=int(MsgType.PUSH), dtype=3, body_nbytes=5), "not a multiple"),
        (raw_header(msg_type=int(MsgType.INIT_VALUES), dtype=0, body_nbytes=4), "float dtype"),
        (
            raw_header(msg_type=int(MsgType.PUSH), dtype=1, body_nbytes=LIMIT + 4),
            "exceeds max_body_bytes",
        ),
        (
            raw_header(msg_type=int(MsgType.PARAMS), dtype=1, body_nbytes=(1 << 64) - 4),
            "exceeds max_body_bytes",
        ),
        (raw_header(msg_type=int(MsgType.HELLO), body_nbytes=0), "must have a JSON body"),
        (raw_header(msg_type=int(MsgType.ERROR), dtype=1, body_nbytes=8), "dtype BYTES"),
        (
            raw_header(msg_type=int(MsgType.CONTROL), body_nbytes=MAX_JSON_BYTES + 1),
            "exceeds max_json_bytes",
        ),
    ],
)
def test_decode_header_rejects_malformed_field(raw: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_header(raw, max_body_bytes=LIMIT)


@pytest.mark.parametrize("length", [0, 39, 41, 80])
def test_decode_header_rejects_wrong_buffer_length(length: int) -> None:
    raw = (raw_header() * 2)[:length]
    with pytest.raises(FrameError, match=f"got {length}"):
        decode_header(raw, max_body_bytes=LIMIT)


def test_json_limit_is_the_callers_choice() -> None:
    raw = raw_header(msg_type=int(MsgType.HELLO), body_nbytes=101)
    assert decode_header(raw, max_body_bytes=0, max_json_bytes=101).body_nbytes == 101
    with pytest.raises(FrameError, match="exceeds max_json_bytes 100"):
        decode_header(raw, max_body_bytes=LIMIT, max_json_bytes=100)


def test_tensor_body_may_equal_the_limit_exactly() -> None:
    raw = raw_header(msg_type=int(MsgType.PARAMS), dtype=2, body_nbytes=LIMIT)
    assert decode_header(raw, max_body_bytes=LIMIT).body_nbytes == LIMIT


def test_decode_header_rejects_negative_limits() -> None:
    with pytest.raises(ValueError, match="limits"):
        decode_header(raw_header(), max_body_bytes=-1)


# --- header fuzzing ------------------------------------------------------------


# (in-range strategy, full wire-range strategy) for each header field, in wire order.
_FIELD_STRATEGIES: list[tuple[st.SearchStrategy[object], st.SearchStrategy[object]]] = [
    (st.just(MAGIC), st.binary(min_size=4, max_size=4)),
    (st.just(PROTO_VERSION), st.integers(0, 255)),
    (st.integers(1, 10), st.integers(0, 255)),
    (st.integers(0, 3), st.integers(0, 255)),
    (st.integers(0, 3), st.integers(0, 255)),
    (st.integers(0, 8), st.integers(0, (1 << 32) - 1)),
    (st.integers(0, 8), st.integers(0, (1 << 32) - 1)),
    (st.integers(0, 8), st.integers(-(1 << 63), (1 << 63) - 1)),
    (st.integers(0, 8), st.integers(-(1 << 63), (1 << 63) - 1)),
    (st.integers(0, 70), st.integers(0, (1 << 64) - 1)),
    (st.integers(0, 3), st.integers(0, (1 << 64) - 1)),  # epoch
    (st.just(0), st.integers(0, (1 << 64) - 1)),  # task_id
    (st.just(0), st.integers(0, (1 << 32) - 1)),  # pass_id
    (st.just(0), st.integers(0, (1 << 32) - 1)),  # key_lo
    (st.just(0), st.integers(0, (1 << 32) - 1)),  # key_hi
    (st.integers(0, 3), st.integers(0, (1 << 32) - 1)),  # generation
    (st.just(0), st.integers(0, 255)),  # status
    (st.just(0), st.integers(0, 255)),  # reserved
    (st.just(0), st.integers(0, (1 << 16) - 1)),  # reserved
]


@st.composite
def plausible_raw_headers(draw: st.DrawFn) -> bytes:
    """Header bytes with at most two fields drawn from their full wire range.

    Purely random bytes almost always fail on the magic; these reach every
    later check, and often decode.
    """
    wild = draw(st.sets(st.integers(0, len(_FIELD_STRATEGIES) - 1), max_size=2))
    values = [draw(full if i in wild else tame) for i, (tame, full) in enumerate(_FIELD_STRATEGIES)]
    return HEADER.pack(*values)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE) | plausible_raw_headers(),
    max_body_bytes=st.integers(0, 64) | st.integers(0, (1 << 64) - 1),
    max_json_bytes=st.integers(0, 64) | st.just(MAX_JSON_BYTES),
)
def test_decode_header_either_round_trips_or_raises_frame_error(
    raw: bytes, max_body_bytes: int, max_json_bytes: int
) -> None:
    try:
        header = decode_header(raw, max_body_bytes=max_body_bytes, max_json_bytes=max_json_bytes)
    except FrameError:
        return
    assert encode_header(header) == raw
    assert isinstance(header.msg_type, MsgType)
    assert isinstance(header.dtype, DType)
    assert isinstance(header.flags, Flags)


@st.composite
def valid_tensor_headers(draw: st.DrawFn) -> FrameHeader:
    """Any header of a tensor frame that a sender may legitimately encode."""
    msg_type = draw(st.sampled_from(sorted(TENSOR_TYPES)))
    dtype = draw(st.sampled_from([DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16]))
    want_params = draw(st.booleans()) and msg_type is MsgType.PUSH
    return FrameHeader(
        msg_type=msg_type,
        dtype=dtype,
        flags=Flags.WANT_PARAMS if want_params else Flags.NONE,
        sender=draw(st.integers(0, (1 << 32) - 1)),
        num_samples=draw(st.integers(0, (1 << 32) - 1)),
        model_version=draw(st.integers(0, (1 << 63) - 1)),
        step=draw(st.integers(0, (1 << 63) - 1)),
        body_nbytes=draw(st.integers(0, 1 << 20)) * dtype.itemsize,
    )


@settings(max_examples=200, deadline=None)
@given(header=valid_tensor_headers())
def test_every_valid_tensor_header_round_trips(header: FrameHeader) -> None:
    decoded = decode_header(encode_header(header), max_body_bytes=header.body_nbytes)
    assert decoded == header


# --- dtypes and tensor views ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16])
def test_dtype_maps_to_torch_and_back(dtype: DType) -> None:
    tdtype = dtype.to_torch()
    assert dtype_from_torch(tdtype) is dtype
    assert torch.empty((), dtype=tdtype).element_size() == dtype.itemsize


def test_unsupported_dtypes_are_rejected() -> None:
    with pytest.raises(ValueError, match="int64"):
        dtype_from_torch(torch.int64)
    with pytest.raises(ValueError, match="BYTES"):
        DType.BYTES.to_torch()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_view_aliases_the_tensor_memory(dtype: torch.dtype) -> None:
    t = torch.zeros(2, 3, dtype=dtype, requires_grad=True)
    view = tensor_view(t)
    assert view.format == "B"
    assert view.nbytes == 6 * t.element_size()
    assert not view.readonly
    src = torch.arange(6, dtype=dtype).reshape(2, 3)
    view[:] = tensor_view(src)
    assert torch.equal(t.detach(), src)


def test_tensor_view_of_a_scalar_and_of_an_empty_tensor() -> None:
    assert tensor_view(torch.tensor(1.5)).tobytes() == struct.pack("<f", 1.5)
    assert tensor_view(torch.empty(0, 4)).nbytes == 0


def test_tensor_view_rejects_non_contiguous_tensors() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        tensor_view(torch.zeros(3, 4).t())


# --- sockets: frames end to end ------------------------------------------------------


def test_tensor_frame_scatters_into_several_views_exactly(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    # Larger than the socketpair buffers, so sends and receives are partial.
    src = torch.randn(300_007)
    header = FrameHeader(
        MsgType.PUSH, DType.FLOAT32, sender=1, num_samples=32, step=4, body_nbytes=src.numel() * 4
    )
    # Send as three views, receive into five of different boundaries (one empty).
    src_parts = [tensor_view(p) for p in torch.split(src, [1, 200_000, 100_006])]
    sender = run_in_thread(lambda: send_frame(a, header, src_parts))
    scratch = bytearray(HEADER_SIZE + 24)
    got = recv_header(b, scratch, max_body_bytes=header.body_nbytes)
    assert got == header
    dst = torch.empty(300_007)
    sizes = [3, 0, 150_000, 1, 150_003]
    recv_body_into(b, got, [tensor_view(p) for p in torch.split(dst, sizes)])
    sender.join(5)
    assert torch.equal(dst, src)


def test_body_of_many_small_views_round_trips(pair: tuple[socket.socket, socket.socket]) -> None:
    # More views than one sendmsg/recvmsg call accepts (IOV_MAX = 1024 on Linux).
    a, b = pair
    src = [torch.full((i % 7 + 1,), float(i), dtype=torch.bfloat16) for i in range(2500)]
    nbytes = sum(t.numel() * 2 for t in src)
    header = FrameHeader(MsgType.PARAMS, DType.BFLOAT16, model_version=3, body_nbytes=nbytes)
    sender = run_in_thread(lambda: send_frame(a, header, [tensor_view(t) for t in src]))
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=nbytes)
    dst = [torch.empty_like(t) for t in src]
    recv_body_into(b, got, [tensor_view(t) for t in dst])
    sender.join(5)
    assert all(torch.equal(x, y) for x, y in zip(src, dst, strict=True))


class DribblingSocket(socket.socket):
    """A socket whose every send and receive moves at most ``limit`` bytes.

    Forces the partial-transfer paths that a real socket takes only under load.
    """

    limit = 1

    @staticmethod
    def _clip(buffers: Iterable[Buffer], limit: int) -> list[memoryview]:
        out: list[memoryview] = []
        for buf in buffers:
            view = memoryview(buf).cast("B")[:limit]
            out.append(view)
            limit -= view.nbytes
            if limit == 0:
                break
        return out

    def sendmsg(self, buffers: Iterable[Buffer], *args: Any) -> int:
        return super().sendmsg(self._clip(buffers, self.limit), *args)

    def recv_into(self, buffer: Buffer, nbytes: int = 0, flags: int = 0) -> int:
        return super().recv_into(self._clip([buffer], self.limit)[0], 0, flags)

    def recvmsg_into(self, buffers: Iterable[Buffer], *args: Any) -> Any:
        return super().recvmsg_into(self._clip(buffers, self.limit), *args)


@pytest.mark.parametrize("limit", [1, 7, 4093])
def test_frames_survive_partial_sends_and_receives(limit: int) -> None:
    a, b = socket.socketpair()
    with (
        DribblingSocket(a.family, a.type, fileno=a.detach()) as da,
        DribblingSocket(b.family, b.type, fileno=b.detach()) as db,
    ):
        da.limit = db.limit = limit
        da.settimeout(5.0)
        db.settimeout(5.0)
        src = [torch.randn(n) for n in (5, 0, 3000, 1)]
        nbytes = sum(t.numel() * 4 for t in src)
        header = FrameHeader(MsgType.PUSH, DType.FLOAT32, step=2, body_nbytes=nbytes)
        sender = run_in_thread(lambda: send_frame(da, header, [tensor_view(t) for t in src]))
        got = recv_header(db, bytearray(HEADER_SIZE), max_body_bytes=nbytes)
        assert got == header
        dst = torch.empty(sum(t.numel() for t in src))
        recv_body_into(db, got, [tensor_view(t) for t in torch.split(dst, [1, 2999, 6])])
        sender.join(5)
        assert torch.equal(dst, torch.cat(src))


def test_json_frame_round_trips_with_header_fields(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    obj = {"op": "stats", "names": ["w", "b"], "note": "π ≈ 3.14"}
    send_json(a, MsgType.CONTROL, obj, sender=4, step=2)
    header = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=0)
    assert (header.msg_type, header.sender, header.step) == (MsgType.CONTROL, 4, 2)
    assert recv_json(b, header) == obj


def test_send_json_rejects_non_json_types_and_unknown_fields(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, _ = pair
    with pytest.raises(ValueError, match="JSON"):
        send_json(a, MsgType.PULL, {})
    with pytest.raises(ValueError, match="body_nbytes"):
        send_json(a, MsgType.CONTROL, {}, body_nbytes=3)


def test_error_frame_becomes_remote_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    send_error(a, "stale_gradient", "version 3 < 5")
    header = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=0)
    assert header.msg_type is MsgType.ERROR
    err = decode_error(recv_json(b, header))
    assert isinstance(err, RemoteError)
    assert err.code == "stale_gradient"
    assert "version 3 < 5" in str(err)


def test_decode_error_rejects_bodies_without_string_code() -> None:
    with pytest.raises(FrameError, match="code"):
        decode_error({"code": 3, "message": "x"})


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"[1, 2]", "JSON object, got list"),
        (b'"hello"', "JSON object, got str"),
        (b"null", "JSON object, got NoneType"),
        (b"{not json", "not valid JSON"),
        (b'{"a": 1} trailing', "not valid JSON"),
        (b'{"a": "\xff\xfe"}', "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON|JSON object"),
    ],
)
def test_recv_json_rejects_bodies_that_are_not_a_json_object(
    pair: tuple[socket.socket, socket.socket], body: bytes, match: str
) -> None:
    a, b = pair
    header = FrameHeader(MsgType.HELLO_OK, body_nbytes=len(body))
    sender = run_in_thread(lambda: send_frame(a, header, [memoryview(body)]))
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=0)
    with pytest.raises(FrameError, match=match):
        recv_json(b, got)
    sender.join(5)


def test_recv_json_refuses_a_tensor_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    with pytest.raises(FrameError, match="expected a JSON frame"):
        recv_json(b, VALID_HEADERS[MsgType.PARAMS])


def test_send_frame_refuses_mismatched_body_and_sends_nothing(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    header = FrameHeader(MsgType.PUSH, DType.FLOAT32, body_nbytes=16)
    with pytest.raises(ValueError, match=r"12 bytes but header\.body_nbytes is 16"):
        send_frame(a, header, [tensor_view(torch.zeros(3))])
    with pytest.raises(FrameError):
        send_frame(a, FrameHeader(MsgType.PULL, body_nbytes=4), [memoryview(b"abcd")])
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)


def test_recv_body_into_refuses_mismatched_views_without_reading(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    src = torch.arange(4, dtype=torch.float32)
    header = FrameHeader(MsgType.PARAMS, DType.FLOAT32, body_nbytes=16)
    send_frame(a, header, [tensor_view(src)])
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=16)
    with pytest.raises(FrameError, match="16 bytes, expected 12"):
        recv_body_into(b, got, [tensor_view(torch.empty(3))])
    dst = torch.empty(4)
    recv_body_into(b, got, [tensor_view(dst)])  # the body is still there, unread
    assert torch.equal(dst, src)


def test_discard_body_keeps_the_stream_aligned(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    push = FrameHeader(MsgType.PUSH, DType.FLOAT32, step=1, body_nbytes=4000)

    def send_two_frames() -> None:
        send_frame(a, push, [tensor_view(torch.ones(1000))])
        send_frame(a, FrameHeader(MsgType.PULL, sender=9))

    sender = run_in_thread(send_two_frames)
    scratch = bytearray(256)
    got = recv_header(b, scratch, max_body_bytes=4000)
    discard_body(b, got, scratch)
    nxt = recv_header(b, scratch, max_body_bytes=0)
    assert (nxt.msg_type, nxt.sender) == (MsgType.PULL, 9)
    sender.join(5)


def test_recv_header_rejects_an_invalid_header_before_reading_the_body(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(raw_header(msg_type=int(MsgType.PUSH), dtype=1, body_nbytes=1 << 40) + b"xyz")
    with pytest.raises(FrameError, match="exceeds max_body_bytes"):
        recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=LIMIT)
    assert b.recv(16) == b"xyz"


# --- sockets: truncation and closed peers ------------------------------------------


def test_close_between_frames_is_a_clean_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.close()
    with pytest.raises(ConnectionClosedError, match="between frames") as info:
        recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=LIMIT)
    assert info.value.clean
    assert isinstance(info.value, ProtocolError)


def test_close_mid_header_is_an_unclean_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(encode_header(VALID_HEADERS[MsgType.PULL])[:25])
    a.close()
    missing = HEADER_SIZE - 25
    with pytest.raises(
        ConnectionClosedError, match=rf"header cut short.*{missing} of {missing}"
    ) as info:
        recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=LIMIT)
    assert not info.value.clean


def test_close_mid_body_raises_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    header = FrameHeader(MsgType.PARAMS, DType.FLOAT32, body_nbytes=400)
    a.sendall(encode_header(header) + bytes(150))
    a.close()
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=400)
    dst = torch.empty(100)
    with pytest.raises(ConnectionClosedError, match="250 of 400 bytes missing"):
        recv_body_into(b, got, [tensor_view(dst)])


def test_close_mid_json_body_raises_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    body = json.dumps({"op": "shutdown"}).encode()
    a.sendall(encode_header(FrameHeader(MsgType.CONTROL, body_nbytes=len(body))) + body[:5])
    a.close()
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=0)
    with pytest.raises(ConnectionClosedError, match="missing"):
        recv_json(b, got)


def test_close_mid_discarded_body_raises_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    header = FrameHeader(MsgType.INIT_VALUES, DType.FLOAT16, body_nbytes=1000)
    a.sendall(encode_header(header) + bytes(300))
    a.close()
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=1000)
    with pytest.raises(ConnectionClosedError, match="of 1000 body bytes missing"):
        discard_body(b, got, bytearray(128))


def test_recv_exact_into_reports_missing_bytes(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"abc")
    a.close()
    buf = bytearray(10)
    with pytest.raises(ConnectionClosedError, match="7 of 10 bytes missing"):
        recv_exact_into(b, memoryview(buf))
    assert buf[:3] == b"abc"


def test_sending_to_a_closed_peer_raises_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.close()
    header = FrameHeader(MsgType.PUSH, DType.FLOAT32, body_nbytes=4 << 20)
    with pytest.raises(ConnectionClosedError):
        send_frame(a, header, [tensor_view(torch.zeros(1 << 20))])


# --- request/reply table ------------------------------------------------------------


def test_every_request_may_be_answered_with_an_error() -> None:
    assert set(REPLY_TYPES) == {
        MsgType.HELLO,
        MsgType.INIT_VALUES,
        MsgType.PUSH,
        MsgType.PULL,
        MsgType.CONTROL,
        MsgType.ROW_PULL,
    }
    assert all(MsgType.ERROR in replies for replies in REPLY_TYPES.values())
    assert MsgType.PARAMS in REPLY_TYPES[MsgType.PUSH]


# --- 16-bit gradients and both transports --------------------------------------------


@pytest.fixture(params=["unix", "tcp"])
def transport_pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair over AF_UNIX (socketpair) or loopback TCP."""
    if request.param == "unix":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            a = socket.create_connection(listener.getsockname()[:2])
            b, _ = listener.accept()
        a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    a.settimeout(5.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_16_bit_push_round_trips_every_bit_pattern_on_both_transports(
    transport_pair: tuple[socket.socket, socket.socket], dtype: DType
) -> None:
    a, b = transport_pair
    # Every 16-bit pattern (NaNs, infinities, subnormals included), split over 3 views.
    sent = (
        torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype.to_torch())
    )
    header = FrameHeader(MsgType.PUSH, dtype, sender=1, step=2, body_nbytes=sent.numel() * 2)
    received = torch.empty_like(sent)
    cut = [0, 1, 40_000, sent.numel()]
    views = [tensor_view(received[lo:hi]) for lo, hi in itertools.pairwise(cut)]

    writer = run_in_thread(lambda: send_frame(a, header, [tensor_view(sent)]))
    got = recv_header(b, bytearray(HEADER_SIZE), max_body_bytes=sent.numel() * 4)
    recv_body_into(b, got, views)
    writer.join(5.0)

    assert got == header
    assert torch.equal(received.view(torch.int16), sent.view(torch.int16))


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([DType.FLOAT16, DType.BFLOAT16]),
    numel=st.integers(0, 1 << 20),
    extra=st.sampled_from([0, 1]),
    msg_type=st.sampled_from(sorted(TENSOR_TYPES)),
)
def test_16_bit_bodies_must_be_whole_elements_and_within_the_limit(
    dtype: DType, numel: int, extra: int, msg_type: MsgType
) -> None:
    nbytes = numel * 2 + extra
    raw = HEADER.pack(
        MAGIC, PROTO_VERSION, msg_type, dtype, 0, 0, 0, 0, 0, nbytes, 0, 0, 0, 0, 0, 0, 0, 0, 0
    )
    limit = numel * 4  # what a PS allows: its shard in float32
    if extra:
        with pytest.raises(FrameError, match="not a multiple"):
            decode_header(raw, max_body_bytes=limit)
    else:
        assert decode_header(raw, max_body_bytes=limit).body_nbytes == nbytes
    if nbytes:
        with pytest.raises(FrameError):
            decode_header(raw, max_body_bytes=nbytes - 1)


def test_local_host_id_is_hostname_and_boot_id_and_stable() -> None:
    host_id = local_host_id()

    hostname, _, boot_id = host_id.partition("/")
    assert hostname == socket.gethostname()
    assert host_id == local_host_id()
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        assert boot_id == f.read().strip()


# --- protocol 2: epochs, push keys, generations, statuses ---------------------------


def test_keyed_push_round_trips() -> None:
    header = FrameHeader(
        MsgType.PUSH,
        DType.FLOAT32,
        body_nbytes=16,
        epoch=123456789,
        task_id=(1 << 40) + 5,
        pass_id=3,
        key_lo=64,
        key_hi=128,
        generation=2,
    )
    got = decode_header(encode_header(header), max_body_bytes=16)
    assert got == header
    assert got.keyed


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (FrameHeader(MsgType.PULL, key_lo=0, key_hi=5), "push key is allowed on a PUSH only"),
        (FrameHeader(MsgType.PUSH, DType.FLOAT32, task_id=3), "malformed push key"),
        (FrameHeader(MsgType.PUSH, DType.FLOAT32, key_lo=9, key_hi=5), "malformed push key"),
        (FrameHeader(MsgType.PULL, status=PushStatus.STALE), "status STALE not allowed"),
    ],
)
def test_keys_and_statuses_are_checked(header: FrameHeader, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        encode_header(header)


def test_an_empty_push_may_carry_a_key() -> None:
    header = FrameHeader(MsgType.PUSH, DType.FLOAT32, Flags.EMPTY, key_lo=3, key_hi=5)
    assert decode_header(encode_header(header), max_body_bytes=0) == header


def test_a_reply_carries_its_status() -> None:
    for status in PushStatus:
        header = FrameHeader(MsgType.PUSH_OK, model_version=4, epoch=9, status=status)
        assert decode_header(encode_header(header), max_body_bytes=0).status is status


def test_nonzero_reserved_bytes_are_refused() -> None:
    with pytest.raises(FrameError, match="reserved"):
        decode_header(raw_header(reserved16=1), max_body_bytes=0)
    with pytest.raises(FrameError, match="unknown status"):
        decode_header(raw_header(status=7), max_body_bytes=0)
