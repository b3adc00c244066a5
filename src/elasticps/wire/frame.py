"""Tensor-plane frames: a fixed 76-byte header followed by a raw body.

Why plain sockets
=================

The tensor plane is the product's hot path. Measured on the build machines with
100 MB of float32 split over 2 parameter servers (push, then pull): plain
sockets take 48-57 ms, gRPC raw-bytes streaming 153 ms and gRPC protobuf unary
755 ms; gRPC also refuses memoryviews and costs about 3x the CPU
(design.md, "Tensor plane"). So tensors travel as length-prefixed
frames over TCP (between hosts) or AF_UNIX (same host), with no pickle and no
per-message body buffers: bodies are sent straight from the tensors' memory
with ``sendmsg``/``sendall`` and received with ``recv_into`` into buffers the
caller allocated once. A TCP connection of a job with TLS on
(:mod:`elasticps.tls`) carries the same frames inside TLS 1.3; there small
views are joined before they are sent, and big ones are encrypted from where
they lie.

Frame layout
============

Every frame is a header of :data:`HEADER_SIZE` (76) bytes, packed
little-endian as ``struct.Struct("<4sBBBBIIqqQQQIIIIBBH")``, then
``body_nbytes`` bytes of body::

    offset  size  field          type  meaning
    ------  ----  -------------  ----  ------------------------------------------
         0     4  magic          4s    b"EPSF"
         4     1  proto_version  u8    PROTO_VERSION (2)
         5     1  msg_type       u8    MsgType
         6     1  dtype          u8    DType of the body elements (BYTES for JSON)
         7     1  flags          u8    Flags (only PUSH may set flags)
         8     4  sender         u32   trainer rank; 0 if not applicable
        12     4  num_samples    u32   samples the gradient was computed on
        16     8  model_version  i64   model version (>= 0)
        24     8  step           i64   training step (>= 0)
        32     8  body_nbytes    u64   body length in bytes
        40     8  epoch          u64   the PS slot epoch (see below)
        48     8  task_id        u64   push key: the task
        56     4  pass_id        u32   push key: the pass (epoch of training)
        60     4  key_lo         u32   push key: first record, from the task's start
        64     4  key_hi         u32   push key: end record (exclusive)
        68     4  generation     u32   sync group generation (see below)
        72     1  status         u8    PushStatus of a PUSH_OK or PARAMS reply
        73     1  reserved       u8    0
        74     2  reserved       u16   0
        76     -  body                 body_nbytes bytes

*Epoch.* Each claim of a parameter-server slot in etcd has an epoch that no
other claim of that slot has (the etcd revision that created the slot key).
A trainer sends the epoch it resolved with the server's address on every
request, and a server refuses requests for another epoch, so a trainer never
talks to a deposed server through a recycled address, and every reply names
the epoch of the server that sent it. 0 means "no slot" (a server run
without etcd, or a CONTROL request from a tool).

*Push key.* A PUSH of a gradient computed for records ``[key_lo, key_hi)``
of task ``task_id`` in pass ``pass_id`` carries them, so that a server
applies every key at most once (:mod:`elasticps.pserver.coverage`). A PUSH
without a key (``key_lo == key_hi == 0`` and ``task_id == pass_id == 0``,
e.g. from the KVStore API) is applied every time. An EMPTY PUSH with a key
has the server hold the key's records without applying anything: records
skipped as bad (``--bad-records skip``) are accounted for that way.

*Generation.* In sync mode the servers of a job share a generation, which
changes when the master realigns them after a server restart (every shard
rolled back to one version). A PUSH of another generation is stale; a
PARAMS reply names the generation, so a trainer can tell a consistent
model (same generation and version on every shard) from a mixture.

*Status.* A PUSH_OK or PARAMS reply to a PUSH says what became of it:
:class:`PushStatus` APPLIED (0; also the value on every other frame),
DUPLICATE (its key was held already: acknowledged, not applied again) or
STALE (computed on another model version or generation: not applied; the
trainer recomputes it on fresh parameters).

Bodies come in three kinds:

* JSON (HELLO, HELLO_OK, ERROR, CONTROL, CONTROL_OK): dtype BYTES, a UTF-8
  JSON object of 1..max_json_bytes bytes (default :data:`MAX_JSON_BYTES`).
* none (PUSH_OK, PULL): body_nbytes is 0; dtype is not interpreted.
* ids (ROW_PULL): dtype INT64, a multiple of 8 bytes (see "Sparse rows").
* tensor (INIT_VALUES, PARAMS, PUSH, ROWS, ROW_GRADS): dtype FLOAT32, FLOAT16 or BFLOAT16, the
  flat concatenation of a shard's tensors in the layout agreed in HELLO, in
  native (little-endian) byte order; body_nbytes is a multiple of the item size
  and at most the receiver's ``max_body_bytes``. A PUSH with Flags.EMPTY
  carries no gradient (body_nbytes 0): the sender only takes part in the sync
  barrier.

Sparse rows
===========

A model's sparse embedding tables (:mod:`elasticps.nn`) are partitioned
by row over the servers; the HELLO layout lists them (``tables``), so both
sides know their order ``t = 0..T-1`` and row widths ``dim_t``. Rows travel
in their own frames:

* ROW_PULL (dtype INT64): ``counts`` int64 ``[T]`` (ids wanted of each
  table), then the ids, int64 ``[sum(counts)]``, table by table. The reply
  ROWS (dtype FLOAT32) holds the rows in the same order, float32
  ``[sum_t counts_t * dim_t]``, and names the model version and generation
  they belong to.
  A client may send a ROW_PULL right behind a PUSH (and its ROW_GRADS)
  before reading the push's answer: a server answers the frames of a
  connection in order, so the rows are read after that push is handled.
* ROW_GRADS: sent right after a PUSH that set Flags.ROWS (dense part first,
  rows second, one push with one push key: both are applied together, or
  neither). Body: ``counts`` int64 ``[T]``, ids int64 ``[sum(counts)]``,
  then the gradient rows in the frame's float dtype, ``[sum_t counts_t *
  dim_t]``. Ids of one table are unique within a push.

The header check covers the sizes that do not depend on the tables (a
multiple of the item size, within ``max_body_bytes``); the server then reads
``counts`` and checks the rest of the body against them before reading it,
and the ids (range, uniqueness, which server owns them) before applying
anything. A bad body is answered ERROR ``bad_rows`` and changes nothing.

A receiver decodes and validates the whole header (:func:`decode_header`)
before it reads a single body byte, so a malformed or oversized frame never
makes it allocate or read. Any :class:`~elasticps.errors.FrameError` means the
stream can no longer be trusted: the receiver closes the connection.

Shared memory
=============

A trainer on the same host as a server (so over AF_UNIX) may hand the
connection a shared-memory file, so that dense gradients and parameters stop
being copied through the socket: a CONTROL ``{"op": "attach_shm", "numel":
N}`` (optionally with ``"params_at": P``, ``N <= P <= N + 1024``) is followed
at once by one byte (0) that carries a file descriptor (``SCM_RIGHTS``): a
memfd of at least ``4 * (P + N)`` bytes holding float32 ``[N]`` gradients at
offset 0 and float32 ``[N]`` parameters at offset ``4 * P`` (``P = N`` when
absent), where ``N`` is the shard's element count. (A trainer that maps the
memfd's pages into its own buffers puts the parameters on a page.) The
server answers CONTROL_OK ``{"shard": i, "attached": true}``, or ``false``
with a ``reason`` (it then
maps nothing, and the trainer keeps sending bodies). From then on a PUSH
with Flags.SHARED (dtype FLOAT32, no body) takes its gradient from the first
region, read after the header arrives; with WANT_PARAMS, the server writes
the shard's parameters into the second region before it sends the PARAMS
header, whose body is empty. A trainer writes the gradient region only
before sending a PUSH and reads the parameter region only after its reply,
so the two sides never touch a region at the same time. Nothing else moves
through the shared memory: HELLO, INIT_VALUES, PULL, rows and 16-bit
gradients travel in frame bodies. Measured in ``benchmarks/README.md``
("shared memory").

Requests and replies
====================

The client (trainer) sends one request and waits for its reply:

==============  =================================================
request         reply
==============  =================================================
HELLO           HELLO_OK | ERROR
INIT_VALUES     HELLO_OK | ERROR
PUSH            PUSH_OK | PARAMS (with Flags.WANT_PARAMS) | ERROR
PULL            PARAMS | ERROR
ROW_PULL        ROWS | ERROR
CONTROL         CONTROL_OK | ERROR
==============  =================================================

:data:`REPLY_TYPES` holds the same table. An ERROR body is the JSON object
``{"code": str, "message": str}``; :func:`decode_error` turns it into a
:class:`~elasticps.errors.RemoteError`.

Sockets are blocking (optionally with a timeout, whose ``TimeoutError``
propagates). On TCP, callers should set ``TCP_NODELAY``: a frame goes out as
one gather write, and Nagle's algorithm would only add latency to replies.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import mmap
import os
import socket
import ssl
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import torch

from elasticps.errors import FrameError, ProtocolError, RemoteError

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "ID_TYPES",
    "JSON_TYPES",
    "MAGIC",
    "MAX_JSON_BYTES",
    "NO_BODY_TYPES",
    "PROTO_VERSION",
    "REPLY_TYPES",
    "TENSOR_TYPES",
    "ConnectionClosedError",
    "DType",
    "Flags",
    "FrameHeader",
    "MsgType",
    "PushStatus",
    "decode_error",
    "decode_header",
    "decode_json_body",
    "discard_body",
    "dtype_from_torch",
    "encode_header",
    "encode_header_into",
    "local_host_id",
    "map_shared_region",
    "recv_body_into",
    "recv_exact_into",
    "recv_header",
    "recv_json",
    "send_error",
    "send_frame",
    "send_json",
    "shared_region_nbytes",
    "tensor_view",
]

HEADER: Final = struct.Struct("<4sBBBBIIqqQQQIIIIBBH")
HEADER_SIZE: Final[int] = 76
MAGIC: Final[bytes] = b"EPSF"
PROTO_VERSION: Final[int] = 2
MAX_JSON_BYTES: Final[int] = 1 << 20

assert HEADER.size == HEADER_SIZE

_U32_MAX: Final = (1 << 32) - 1
_I64_MAX: Final = (1 << 63) - 1
_U64_MAX: Final = (1 << 64) - 1


def _iov_max() -> int:
    """Most buffers one sendmsg/recvmsg call accepts (IOV_MAX; 1024 on Linux)."""
    try:
        return max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        return 16


_IOV_MAX: Final[int] = _iov_max()


class MsgType(enum.IntEnum):
    """The type of a frame; see the module docstring for request/reply pairs."""

    HELLO = 1
    """client -> PS, JSON body: the layout description of the shard."""
    HELLO_OK = 2
    """PS -> client, JSON body."""
    INIT_VALUES = 3
    """client -> PS, tensor body: initial parameter values."""
    PUSH = 4
    """client -> PS, tensor body (gradients), or empty body with Flags.EMPTY."""
    PUSH_OK = 5
    """PS -> client, no body."""
    PULL = 6
    """client -> PS, no body."""
    PARAMS = 7
    """PS -> client, tensor body: the shard's current parameter values."""
    ERROR = 8
    """either way, JSON body ``{"code": str, "message": str}``."""
    CONTROL = 9
    """client -> PS, JSON body, e.g. ``{"op": "shutdown"}`` or ``{"op": "stats"}``."""
    CONTROL_OK = 10
    """PS -> client, JSON body."""
    ROW_PULL = 11
    """client -> PS, INT64 body: the rows wanted of each sparse table (see "Sparse rows")."""
    ROWS = 12
    """PS -> client, FLOAT32 body: the rows a ROW_PULL asked for, in its order."""
    ROW_GRADS = 13
    """client -> PS, right after a PUSH with Flags.ROWS: ids and gradient rows per table."""


class DType(enum.IntEnum):
    """The element type of a frame body."""

    BYTES = 0
    """UTF-8 JSON."""
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT64 = 4
    """Sparse-table ids (ROW_PULL bodies)."""

    @property
    def itemsize(self) -> int:
        """Size of one element in bytes (1 for BYTES)."""
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        """Whether this dtype is a float type (dense tensors and gradient rows)."""
        return self in (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16)

    def to_torch(self) -> torch.dtype:
        """Return the matching torch dtype.

        Raises:
            ValueError: for BYTES and INT64, which carry no tensor of floats.
        """
        if not self.is_float:
            raise ValueError(f"DType.{self.name} has no float torch dtype")
        return _TO_TORCH[self]


class Flags(enum.IntFlag):
    """Per-frame flag bits. Only PUSH may set any."""

    NONE = 0
    WANT_PARAMS = 1
    """On PUSH: reply with PARAMS (after the update) instead of PUSH_OK."""
    EMPTY = 2
    """On PUSH: no gradient; the sender only joins the sync barrier. Body must be empty."""
    ROWS = 4
    """On PUSH (not with EMPTY): a ROW_GRADS frame follows at once, part of the same push."""
    SHARED = 8
    """On PUSH (not with EMPTY): the gradient is in the connection's shared memory
    (see "Shared memory"), not in the body, which is empty; with WANT_PARAMS the
    reply's parameters are written there too, and its PARAMS body is empty."""


class PushStatus(enum.IntEnum):
    """What a server did with a PUSH, carried in the ``status`` field of its reply."""

    APPLIED = 0
    """Applied (in sync mode: joined the step that was applied); also the value of
    every frame that is not a reply to a PUSH."""
    DUPLICATE = 1
    """Its push key was held already: acknowledged, not applied again."""
    STALE = 2
    """Computed on another model version or generation: not applied. The
    trainer pulls and computes the gradient again."""


_ITEMSIZE: Final[dict[DType, int]] = {
    DType.BYTES: 1,
    DType.FLOAT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.INT64: 8,
}
_TO_TORCH: Final[dict[DType, torch.dtype]] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}
_FROM_TORCH: Final[dict[torch.dtype, DType]] = {v: k for k, v in _TO_TORCH.items()}
# A plain int: ~ on an IntFlag member only complements within the known bits.
_KNOWN_FLAGS: Final[int] = int(Flags.WANT_PARAMS | Flags.EMPTY | Flags.ROWS | Flags.SHARED)

JSON_TYPES: Final[frozenset[MsgType]] = frozenset(
    {MsgType.HELLO, MsgType.HELLO_OK, MsgType.ERROR, MsgType.CONTROL, MsgType.CONTROL_OK}
)
"""Message types whose body is a UTF-8 JSON object."""
NO_BODY_TYPES: Final[frozenset[MsgType]] = frozenset({MsgType.PUSH_OK, MsgType.PULL})
"""Message types that never carry a body."""
TENSOR_TYPES: Final[frozenset[MsgType]] = frozenset(
    {MsgType.INIT_VALUES, MsgType.PUSH, MsgType.PARAMS, MsgType.ROWS, MsgType.ROW_GRADS}
)
"""Message types whose body is a flat float tensor (PUSH may be empty with Flags.EMPTY;
a ROW_GRADS body starts with int64 ids, see "Sparse rows")."""
ID_TYPES: Final[frozenset[MsgType]] = frozenset({MsgType.ROW_PULL})
"""Message types whose body is int64 (counts and ids of sparse-table rows)."""

_STATUS_TYPES: Final[frozenset[MsgType]] = frozenset({MsgType.PUSH_OK, MsgType.PARAMS})

# Wire value -> member, looked up instead of calling the enum (a header is
# decoded on every request; a lookup is several times cheaper than the call).
_MSG_TYPE_OF: Final[dict[int, MsgType]] = {int(m): m for m in MsgType}
_DTYPE_OF: Final[dict[int, DType]] = {int(d): d for d in DType}
_STATUS_OF: Final[dict[int, PushStatus]] = {int(s): s for s in PushStatus}
_FLAGS_OF: Final[dict[int, Flags]] = {
    v: Flags(v) for v in range(_KNOWN_FLAGS + 1) if not v & ~_KNOWN_FLAGS
}

REPLY_TYPES: Final[Mapping[MsgType, frozenset[MsgType]]] = {
    MsgType.HELLO: frozenset({MsgType.HELLO_OK, MsgType.ERROR}),
    MsgType.INIT_VALUES: frozenset({MsgType.HELLO_OK, MsgType.ERROR}),
    MsgType.PUSH: frozenset({MsgType.PUSH_OK, MsgType.PARAMS, MsgType.ERROR}),
    MsgType.PULL: frozenset({MsgType.PARAMS, MsgType.ERROR}),
    MsgType.CONTROL: frozenset({MsgType.CONTROL_OK, MsgType.ERROR}),
    MsgType.ROW_PULL: frozenset({MsgType.ROWS, MsgType.ERROR}),
}
"""For each request type, the message types a server may answer it with."""


def dtype_from_torch(dtype: torch.dtype) -> DType:
    """Return the wire dtype of a torch dtype.

    Args:
        dtype: torch.float32, torch.float16 or torch.bfloat16.

    Returns:
        The matching :class:`DType`.

    Raises:
        ValueError: if the dtype cannot travel on the tensor plane.
    """
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise ValueError(
            f"torch dtype {dtype} cannot travel on the tensor plane "
            "(use float32, float16 or bfloat16)"
        ) from None


class ConnectionClosedError(ProtocolError):
    """The peer closed (or reset) the connection between frames or mid-frame.

    Attributes:
        clean: True if the peer closed between two frames (an orderly
            disconnect), False if a frame was cut short or a send failed.
    """

    def __init__(self, message: str, *, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded frame header. See the module docstring for field meanings.

    Constructing one does not validate it; :func:`encode_header` and
    :func:`decode_header` do.

    Attributes:
        msg_type: the message type.
        dtype: element type of the body (BYTES for JSON and bodiless frames).
        flags: flag bits (only PUSH may set any).
        sender: trainer rank, 0..2**32-1; 0 if not applicable.
        num_samples: samples the gradient was computed on, 0..2**32-1.
        model_version: model version, 0..2**63-1.
        step: training step, 0..2**63-1.
        body_nbytes: body length in bytes, 0..2**64-1.
        epoch: the parameter-server slot epoch, 0..2**64-1; 0: none.
        task_id: push key task, 0..2**64-1.
        pass_id: push key pass, 0..2**32-1.
        key_lo: push key first record, 0..2**32-1.
        key_hi: push key end record, 0..2**32-1; ``key_hi > key_lo`` on a
            keyed PUSH, all four key fields 0 otherwise.
        generation: sync group generation, 0..2**32-1.
        status: :class:`PushStatus` of a reply to a PUSH; APPLIED otherwise.
    """

    msg_type: MsgType
    dtype: DType = DType.BYTES
    flags: Flags = Flags.NONE
    sender: int = 0
    num_samples: int = 0
    model_version: int = 0
    step: int = 0
    body_nbytes: int = 0
    epoch: int = 0
    task_id: int = 0
    pass_id: int = 0
    key_lo: int = 0
    key_hi: int = 0
    generation: int = 0
    status: PushStatus = PushStatus.APPLIED

    @property
    def keyed(self) -> bool:
        """Whether this PUSH carries a push key."""
        return self.key_hi > self.key_lo


# --- header encoding and validation -----------------------------------------


def _check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise FrameError(f"{name} {value} out of range [{lo}, {hi}]")


def _check_consistency(h: FrameHeader) -> None:
    """Check the rules that do not depend on the receiver's size limits."""
    mt = h.msg_type
    if h.flags and mt is not MsgType.PUSH:
        raise FrameError(f"flags {int(h.flags):#04x} not allowed on {mt.name} (only on PUSH)")
    if h.status is not PushStatus.APPLIED and mt not in _STATUS_TYPES:
        raise FrameError(f"status {h.status.name} not allowed on {mt.name}")
    if h.key_hi > h.key_lo:
        if mt is not MsgType.PUSH:
            raise FrameError(f"a push key is allowed on a PUSH only, not {mt.name}")
    elif h.key_lo or h.key_hi or h.task_id or h.pass_id:
        raise FrameError(
            f"malformed push key: task {h.task_id} pass {h.pass_id} "
            f"records [{h.key_lo}, {h.key_hi})"
        )
    if mt in JSON_TYPES:
        if h.dtype is not DType.BYTES:
            raise FrameError(f"{mt.name} frame must have dtype BYTES, got {h.dtype.name}")
        if h.body_nbytes == 0:
            raise FrameError(f"{mt.name} frame must have a JSON body, got body_nbytes 0")
    elif mt in NO_BODY_TYPES:
        if h.body_nbytes != 0:
            raise FrameError(f"{mt.name} frame must have no body, got body_nbytes {h.body_nbytes}")
    elif mt is MsgType.PUSH and h.flags & Flags.EMPTY:
        if h.body_nbytes != 0:
            raise FrameError(
                f"PUSH with flag EMPTY must have no body, got body_nbytes {h.body_nbytes}"
            )
        if h.flags & Flags.ROWS:
            raise FrameError("PUSH with flag EMPTY cannot carry ROWS")
        if h.flags & Flags.SHARED:
            raise FrameError("PUSH with flag EMPTY cannot be SHARED")
    elif mt is MsgType.PUSH and h.flags & Flags.SHARED:
        if h.body_nbytes != 0 or h.dtype is not DType.FLOAT32:
            raise FrameError(
                "PUSH with flag SHARED must have dtype FLOAT32 and no body, got "
                f"{h.body_nbytes} bytes of {h.dtype.name}"
            )
    elif mt in ID_TYPES:
        if h.dtype is not DType.INT64:
            raise FrameError(f"{mt.name} frame must have dtype INT64, got {h.dtype.name}")
        if h.body_nbytes % 8:
            raise FrameError(f"body_nbytes {h.body_nbytes} of {mt.name} is not a multiple of 8")
    else:  # tensor body
        if not h.dtype.is_float:
            raise FrameError(f"{mt.name} frame must have a float dtype, got {h.dtype.name}")
        if h.body_nbytes % h.dtype.itemsize:
            raise FrameError(
                f"body_nbytes {h.body_nbytes} of {mt.name} is not a multiple of the "
                f"{h.dtype.name} item size ({h.dtype.itemsize} bytes)"
            )


_E = TypeVar("_E", MsgType, DType, PushStatus)


def _member(table: Mapping[int, _E], value: int, field: str) -> _E:
    """The enum member of a header field's value (see ``_MSG_TYPE_OF``).

    Raises:
        FrameError: the value is not one of the field's members.
    """
    member = table.get(value)
    if member is None:
        raise FrameError(f"unknown {field} {value!r}")
    return member


def _validated_fields(h: FrameHeader) -> tuple[object, ...]:
    """Check ``h`` for encoding and return the values to pack into :data:`HEADER`."""
    mt = _member(_MSG_TYPE_OF, h.msg_type, "msg_type")
    dt = _member(_DTYPE_OF, h.dtype, "dtype")
    st = _member(_STATUS_OF, h.status, "status")
    fl = _FLAGS_OF.get(h.flags)
    if fl is None:
        raise FrameError(f"unknown flags bits in {int(h.flags):#x}")
    _check_range("sender", h.sender, 0, _U32_MAX)
    _check_range("num_samples", h.num_samples, 0, _U32_MAX)
    _check_range("model_version", h.model_version, 0, _I64_MAX)
    _check_range("step", h.step, 0, _I64_MAX)
    _check_range("body_nbytes", h.body_nbytes, 0, _U64_MAX)
    _check_range("epoch", h.epoch, 0, _U64_MAX)
    _check_range("task_id", h.task_id, 0, _U64_MAX)
    _check_range("pass_id", h.pass_id, 0, _U32_MAX)
    _check_range("key_lo", h.key_lo, 0, _U32_MAX)
    _check_range("key_hi", h.key_hi, 0, _U32_MAX)
    _check_range("generation", h.generation, 0, _U32_MAX)
    if mt is h.msg_type and dt is h.dtype and fl is h.flags and st is h.status:
        _check_consistency(h)
    else:
        # Callers may pass plain ints; the consistency rules compare enum members.
        _check_consistency(dataclasses.replace(h, msg_type=mt, dtype=dt, flags=fl, status=st))
    return (
        MAGIC,
        PROTO_VERSION,
        int(mt),
        int(dt),
        int(fl),
        h.sender,
        h.num_samples,
        h.model_version,
        h.step,
        h.body_nbytes,
        h.epoch,
        h.task_id,
        h.pass_id,
        h.key_lo,
        h.key_hi,
        h.generation,
        int(st),
        0,
        0,
    )


def encode_header(h: FrameHeader) -> bytes:
    """Validate a header and pack it into its 76-byte wire form.

    Checks every field range and the type rules of :func:`decode_header`
    except the receiver's size limits (``max_body_bytes``, ``max_json_bytes``).

    Args:
        h: the header to encode.

    Returns:
        :data:`HEADER_SIZE` (76) bytes.

    Raises:
        FrameError: if a field is unknown or out of range, or the fields
            contradict each other (e.g. a PULL with a body).
    """
    return HEADER.pack(*_validated_fields(h))


def encode_header_into(h: FrameHeader, buf: bytearray | memoryview) -> None:
    """Validate a header and pack it into the first 76 bytes of ``buf``.

    The allocation-free variant of :func:`encode_header`.

    Args:
        h: the header to encode.
        buf: a writable buffer of at least :data:`HEADER_SIZE` (76) bytes.

    Raises:
        FrameError: as :func:`encode_header`.
        ValueError: if ``buf`` is shorter than 76 bytes or read-only.
    """
    mv = memoryview(buf)
    if mv.readonly or mv.nbytes < HEADER_SIZE:
        raise ValueError(f"need a writable buffer of >= {HEADER_SIZE} bytes, got {mv.nbytes}")
    HEADER.pack_into(buf, 0, *_validated_fields(h))


def decode_header(
    buf: bytes | bytearray | memoryview,
    *,
    max_body_bytes: int,
    max_json_bytes: int = MAX_JSON_BYTES,
) -> FrameHeader:
    """Decode and fully validate a 76-byte frame header.

    Args:
        buf: exactly :data:`HEADER_SIZE` (76) bytes.
        max_body_bytes: largest tensor body the receiver accepts, in bytes
            (a server passes its shard size).
        max_json_bytes: largest JSON body the receiver accepts, in bytes.

    Returns:
        The header; every field is a known enum member or in range, and the
        body length is consistent with the type and within the limits.

    Raises:
        FrameError: on a wrong buffer length, bad magic, unsupported protocol
            version, unknown msg_type/dtype/flag bits, negative model_version
            or step, a body length that does not fit the message type, or an
            oversized body. The message names the field and its value.
        ValueError: if a limit is negative.
    """
    if max_body_bytes < 0 or max_json_bytes < 0:
        raise ValueError(
            f"limits must be >= 0, got max_body_bytes={max_body_bytes}, "
            f"max_json_bytes={max_json_bytes}"
        )
    mv = memoryview(buf)
    if mv.nbytes != HEADER_SIZE:
        raise FrameError(f"a frame header is {HEADER_SIZE} bytes, got {mv.nbytes}")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    (
        magic, version, mt_raw, dt_raw, fl_raw, sender, samples, mversion, step, nbytes,
        epoch, task_id, pass_id, key_lo, key_hi, generation, st_raw, pad8, pad16,
    ) = HEADER.unpack(mv)  # fmt: skip
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != PROTO_VERSION:
        raise FrameError(
            f"unsupported protocol version {version} (this side speaks {PROTO_VERSION})"
        )
    msg_type = _member(_MSG_TYPE_OF, mt_raw, "msg_type")
    dtype = _member(_DTYPE_OF, dt_raw, "dtype")
    status = _member(_STATUS_OF, st_raw, "status")
    flags = _FLAGS_OF.get(fl_raw)
    if flags is None:
        raise FrameError(f"unknown flags bits in {fl_raw:#04x}")
    if mversion < 0:
        raise FrameError(f"model_version {mversion} is negative")
    if step < 0:
        raise FrameError(f"step {step} is negative")
    if pad8 or pad16:
        raise FrameError("reserved header bytes must be 0")
    header = FrameHeader(
        msg_type=msg_type,
        dtype=dtype,
        flags=flags,
        sender=sender,
        num_samples=samples,
        model_version=mversion,
        step=step,
        body_nbytes=nbytes,
        epoch=epoch,
        task_id=task_id,
        pass_id=pass_id,
        key_lo=key_lo,
        key_hi=key_hi,
        generation=generation,
        status=status,
    )
    _check_consistency(header)
    if msg_type in JSON_TYPES:
        if nbytes > max_json_bytes:
            raise FrameError(
                f"body_nbytes {nbytes} of {msg_type.name} exceeds max_json_bytes {max_json_bytes}"
            )
    elif nbytes > max_body_bytes:
        raise FrameError(
            f"body_nbytes {nbytes} of {msg_type.name} exceeds max_body_bytes {max_body_bytes}"
        )
    return header


def decode_error(payload: Mapping[str, object]) -> RemoteError:
    """Turn the JSON body of an ERROR frame into a :class:`RemoteError`.

    Args:
        payload: the object returned by :func:`recv_json` for an ERROR frame.

    Returns:
        A RemoteError carrying the server's code and message (to be raised).

    Raises:
        FrameError: if ``code`` or ``message`` is missing or not a string.
    """
    code = payload.get("code")
    message = payload.get("message")
    if not isinstance(code, str) or not isinstance(message, str):
        raise FrameError(
            f"ERROR body needs string 'code' and 'message', got {dict(payload)!r:.200}"
        )
    return RemoteError(code, message)


# --- buffers -------------------------------------------------------------------


def _byte_view(buf: memoryview, *, writable: bool) -> memoryview:
    """Return ``buf`` as a flat 'B' view, checking contiguity (and writability)."""
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise ValueError("receive buffer is read-only")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise ValueError(f"buffer must be C-contiguous (shape {mv.shape}, strides {mv.strides})")
    return mv.cast("B")


def tensor_view(t: torch.Tensor) -> memoryview:
    """Return a writable byte view of a contiguous CPU tensor's memory.

    The view aliases the tensor (no copy) and keeps its storage alive, so it
    can be passed to :func:`send_frame` or filled by :func:`recv_body_into`.
    Works for any dtype, bfloat16 included (via a uint8 view of the tensor).

    Args:
        t: a dense, C-contiguous tensor on the CPU, of ``t.numel() *
            t.element_size()`` bytes. ``requires_grad`` is ignored.

    Returns:
        A 1-D memoryview of format 'B' and ``t.numel() * t.element_size()`` bytes.

    Raises:
        ValueError: if ``t`` is not on the CPU, not strided, or not contiguous.
    """
    if t.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU, got device {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"tensor must be dense (strided), got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(
            f"tensor must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}"
        )
    # reshape(-1) of a contiguous tensor is a view; uint8 view avoids numpy's lack of bfloat16.
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


# --- socket helpers ------------------------------------------------------------


_TLS_JOIN_BYTES: Final = 64 * 1024
"""Views smaller than this are joined before a TLS socket sends them (one record for a
header and a small body); bigger ones are sent as they are."""


def _send_views_tls(sock: ssl.SSLSocket, pending: list[memoryview]) -> None:
    """``_send_views`` for a TLS socket, which has no ``sendmsg``."""
    batch: list[memoryview] = []
    size = 0
    for view in pending:
        if view.nbytes >= _TLS_JOIN_BYTES:
            if batch:
                sock.sendall(b"".join(batch))
                batch, size = [], 0
            sock.sendall(view)
            continue
        batch.append(view)
        size += view.nbytes
        if size >= _TLS_JOIN_BYTES:
            sock.sendall(b"".join(batch))
            batch, size = [], 0
    if batch:
        sock.sendall(b"".join(batch))


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Gather-write every byte of ``views`` (flat 'B' views) in as few syscalls as possible."""
    pending = [v for v in views if v.nbytes]
    i = 0
    try:
        if isinstance(sock, ssl.SSLSocket):
            _send_views_tls(sock, pending)
            return
        if not hasattr(sock, "sendmsg"):  # pragma: no cover - non-POSIX
            for v in pending:
                sock.sendall(v)
            return
        while i < len(pending):
            batch = pending[i : i + _IOV_MAX]
            sent = sock.sendmsg(batch)
            for v in batch:
                if sent < v.nbytes:
                    break
                sent -= v.nbytes
                i += 1
            if sent:
                pending[i] = pending[i][sent:]
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise ConnectionClosedError(f"peer closed the connection while sending: {exc}") from exc


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-read until every view is full (flat, writable 'B' views)."""
    pending = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in pending)
    got = 0
    i = 0
    scatter = hasattr(sock, "recvmsg_into") and not isinstance(sock, ssl.SSLSocket)
    try:
        while i < len(pending):
            if len(pending) - i == 1 or not scatter:
                n = sock.recv_into(pending[i])
            else:
                n = sock.recvmsg_into(pending[i : i + _IOV_MAX])[0]
            if n == 0:
                raise ConnectionClosedError(
                    f"peer closed the connection with {total - got} of {total} bytes missing"
                )
            got += n
            while n and n >= pending[i].nbytes:
                n -= pending[i].nbytes
                i += 1
            if n:
                pending[i] = pending[i][n:]
    except ConnectionResetError as exc:
        raise ConnectionClosedError(
            f"connection reset with {total - got} of {total} bytes missing"
        ) from exc


def send_frame(sock: socket.socket, header: FrameHeader, body: Sequence[memoryview] = ()) -> None:
    """Send one frame: the header, then the body views in order, without copying them.

    Args:
        sock: a connected blocking stream socket.
        header: the frame header; ``header.body_nbytes`` must equal the total
            size of ``body``.
        body: C-contiguous buffers (e.g. from :func:`tensor_view`) whose bytes,
            concatenated, form the body.

    Raises:
        ValueError: if the body size differs from ``header.body_nbytes`` or a
            view is not C-contiguous. Nothing is sent.
        FrameError: if the header is invalid (see :func:`encode_header`).
            Nothing is sent.
        ConnectionClosedError: if the peer closed or reset the connection.
        OSError: on other socket errors, including ``TimeoutError``.
    """
    views = [_byte_view(v, writable=False) for v in body]
    nbytes = sum(v.nbytes for v in views)
    if nbytes != header.body_nbytes:
        raise ValueError(f"body is {nbytes} bytes but header.body_nbytes is {header.body_nbytes}")
    raw = encode_header(header)
    _send_views(sock, [memoryview(raw), *views])


_JSON_HEADER_FIELDS: Final = frozenset(
    {"sender", "num_samples", "model_version", "step", "epoch", "generation"}
)


def send_json(
    sock: socket.socket, msg_type: MsgType, obj: Mapping[str, object], **header_fields: int
) -> None:
    """Send a frame whose body is ``obj`` encoded as UTF-8 JSON.

    Args:
        sock: a connected blocking stream socket.
        msg_type: one of :data:`JSON_TYPES`.
        obj: a JSON-serialisable mapping.
        **header_fields: optional ``sender``, ``num_samples``,
            ``model_version``, ``step``, ``epoch`` and ``generation`` header values.

    Raises:
        ValueError: if ``msg_type`` is not a JSON type, a header field name is
            unknown, or the encoded body exceeds :data:`MAX_JSON_BYTES`.
        TypeError: if ``obj`` is not JSON-serialisable.
        FrameError: if a header field is out of range.
        ConnectionClosedError: if the peer closed or reset the connection.
        OSError: on other socket errors.
    """
    if msg_type not in JSON_TYPES:
        raise ValueError(f"{msg_type!r} does not carry a JSON body")
    unknown = set(header_fields) - _JSON_HEADER_FIELDS
    if unknown:
        raise ValueError(f"unknown header fields {sorted(unknown)}")
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(body) > MAX_JSON_BYTES:
        raise ValueError(f"JSON body is {len(body)} bytes, more than {MAX_JSON_BYTES}")
    header = FrameHeader(
        msg_type=msg_type,
        sender=header_fields.get("sender", 0),
        num_samples=header_fields.get("num_samples", 0),
        model_version=header_fields.get("model_version", 0),
        step=header_fields.get("step", 0),
        body_nbytes=len(body),
        epoch=header_fields.get("epoch", 0),
        generation=header_fields.get("generation", 0),
    )
    send_frame(sock, header, (memoryview(body),))


def send_error(sock: socket.socket, code: str, message: str) -> None:
    """Send an ERROR frame with body ``{"code": code, "message": message}``.

    Args:
        sock: a connected blocking stream socket.
        code: a short machine-readable code, e.g. ``"layout_mismatch"``.
        message: a human-readable explanation.

    Raises:
        ConnectionClosedError: if the peer closed or reset the connection.
        OSError: on other socket errors.
    """
    send_json(sock, MsgType.ERROR, {"code": code, "message": message})


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Receive exactly ``view.nbytes`` bytes into ``view``.

    Args:
        sock: a connected blocking stream socket.
        view: a writable C-contiguous buffer to fill completely.

    Raises:
        ConnectionClosedError: if the peer closes before the view is full; the
            message says how many bytes were missing.
        ValueError: if ``view`` is read-only or not C-contiguous.
        OSError: on other socket errors, including ``TimeoutError``.
    """
    _recv_views(sock, [_byte_view(view, writable=True)])


def recv_header(
    sock: socket.socket,
    scratch: bytearray,
    *,
    max_body_bytes: int,
    max_json_bytes: int = MAX_JSON_BYTES,
) -> FrameHeader:
    """Receive and validate one frame header, before any of its body.

    Args:
        sock: a connected blocking stream socket.
        scratch: a reusable buffer of at least :data:`HEADER_SIZE` (76) bytes;
            its first 76 bytes are overwritten.
        max_body_bytes: largest tensor body accepted, in bytes.
        max_json_bytes: largest JSON body accepted, in bytes.

    Returns:
        The validated header.

    Raises:
        ConnectionClosedError: if the peer closed before the first header byte
            (``clean`` is True) or in the middle of the header (``clean`` is False).
        FrameError: if the header is invalid (see :func:`decode_header`).
        ValueError: if ``scratch`` is shorter than 76 bytes.
        OSError: on other socket errors, including ``TimeoutError``.
    """
    if len(scratch) < HEADER_SIZE:
        raise ValueError(f"scratch must hold >= {HEADER_SIZE} bytes, got {len(scratch)}")
    view = memoryview(scratch)[:HEADER_SIZE]
    try:
        n = sock.recv_into(view)
    except ConnectionResetError as exc:
        raise ConnectionClosedError(f"connection reset between frames: {exc}") from exc
    if n == 0:
        raise ConnectionClosedError("peer closed the connection between frames", clean=True)
    if n < HEADER_SIZE:
        try:
            _recv_views(sock, [view[n:]])
        except ConnectionClosedError as exc:
            raise ConnectionClosedError(f"frame header cut short: {exc}") from exc
    return decode_header(view, max_body_bytes=max_body_bytes, max_json_bytes=max_json_bytes)


def recv_body_into(sock: socket.socket, header: FrameHeader, views: Sequence[memoryview]) -> None:
    """Receive a frame body, scattering it over ``views`` in order.

    Args:
        sock: a connected blocking stream socket, positioned after ``header``.
        header: the frame's validated header.
        views: writable C-contiguous buffers (e.g. from :func:`tensor_view`)
            whose total size is ``header.body_nbytes``.

    Raises:
        FrameError: if the views' total size differs from
            ``header.body_nbytes``; nothing is read.
        ConnectionClosedError: if the peer closes before the body is complete.
        ValueError: if a view is read-only or not C-contiguous.
        OSError: on other socket errors, including ``TimeoutError``.
    """
    flat = [_byte_view(v, writable=True) for v in views]
    nbytes = sum(v.nbytes for v in flat)
    if nbytes != header.body_nbytes:
        raise FrameError(
            f"{header.msg_type.name} body is {header.body_nbytes} bytes, expected {nbytes}"
        )
    _recv_views(sock, flat)


def recv_json(
    sock: socket.socket, header: FrameHeader, *, max_json_bytes: int = MAX_JSON_BYTES
) -> dict[str, object]:
    """Receive a JSON frame body and decode it.

    Args:
        sock: a connected blocking stream socket, positioned after ``header``.
        header: the frame's validated header, of one of :data:`JSON_TYPES`.
        max_json_bytes: largest body accepted, in bytes (a second guard; the
            header was checked against it by :func:`recv_header`).

    Returns:
        The decoded JSON object.

    Raises:
        FrameError: if the frame is not a JSON frame, too large, not UTF-8,
            not valid JSON, or not a JSON object.
        ConnectionClosedError: if the peer closes before the body is complete.
        OSError: on other socket errors, including ``TimeoutError``.
    """
    if header.msg_type not in JSON_TYPES:
        raise FrameError(f"expected a JSON frame, got {header.msg_type!r}")
    if header.body_nbytes > max_json_bytes:
        raise FrameError(f"JSON body_nbytes {header.body_nbytes} exceeds {max_json_bytes}")
    body = bytearray(header.body_nbytes)
    recv_exact_into(sock, memoryview(body))
    return decode_json_body(body, header.msg_type.name)


def decode_json_body(body: bytes | bytearray, what: str) -> dict[str, object]:
    """Decode a JSON frame body (as :func:`recv_json` does, once it is received).

    Args:
        body: the body's bytes.
        what: names the frame in error messages (its message type).

    Returns:
        The decoded JSON object.

    Raises:
        FrameError: the body is not UTF-8, not valid JSON, or not a JSON object.
    """
    try:
        obj = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FrameError(f"{what} body is not valid UTF-8: {exc}") from exc
    except (ValueError, RecursionError) as exc:
        raise FrameError(f"{what} body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError(f"{what} body must be a JSON object, got {type(obj).__name__}")
    return obj


def discard_body(sock: socket.socket, header: FrameHeader, scratch: bytearray) -> None:
    """Read and drop a frame's body, keeping the stream aligned on frame boundaries.

    Used after rejecting a frame whose header is valid (e.g. replying ERROR
    to a stale PUSH).

    Args:
        sock: a connected blocking stream socket, positioned after ``header``.
        header: the frame's validated header.
        scratch: a reusable buffer; the body is read through it in chunks of
            ``len(scratch)`` bytes.

    Raises:
        ValueError: if ``scratch`` is empty and the body is not.
        ConnectionClosedError: if the peer closes before the body is complete.
        OSError: on other socket errors, including ``TimeoutError``.
    """
    remaining = header.body_nbytes
    if remaining and not scratch:
        raise ValueError("scratch buffer is empty")
    view = memoryview(scratch)
    while remaining:
        chunk = min(remaining, len(view))
        try:
            recv_exact_into(sock, view[:chunk])
        except ConnectionClosedError as exc:
            raise ConnectionClosedError(
                f"peer closed the connection with at most {remaining} of "
                f"{header.body_nbytes} body bytes missing"
            ) from exc
        remaining -= chunk


def shared_region_nbytes(numel: int, params_at: int | None = None) -> int:
    """Bytes of a connection's shared memory for a shard of ``numel`` elements
    (see "Shared memory"): float32 gradients, then float32 parameters from
    element ``params_at`` (default ``numel``)."""
    return 4 * ((numel if params_at is None else params_at) + numel)


def map_shared_region(
    fd: int, numel: int, params_at: int | None = None
) -> tuple[mmap.mmap, torch.Tensor, torch.Tensor]:
    """Map a connection's shared memory (see "Shared memory") for reading and writing.

    Returns:
        The mapping, its gradient region (float32 ``[numel]``, at offset 0) and
        its parameter region (float32 ``[numel]``, at offset ``4 * params_at``,
        default ``4 * numel``); both tensors are views of the mapping.

    Raises:
        OSError / ValueError: ``fd`` cannot be mapped for
            :func:`shared_region_nbytes` bytes.
    """
    at = numel if params_at is None else params_at
    region = mmap.mmap(fd, shared_region_nbytes(numel, at))  # MAP_SHARED, read and write
    grads = torch.frombuffer(region, dtype=torch.float32, count=numel)
    params = torch.frombuffer(region, dtype=torch.float32, count=numel, offset=4 * at)
    return region, grads, params


def local_host_id() -> str:
    """Identify this host's kernel, to tell whether a peer can reach our Unix sockets.

    Two processes that report the same id run on the same machine (same
    hostname and same boot, from ``/proc/sys/kernel/random/boot_id``), so an
    AF_UNIX path one of them listens on is reachable by the other if the
    file system is shared too (the caller still falls back to TCP when the
    connect fails).

    Returns:
        ``"<hostname>/<boot id>"``; the boot id is empty where ``/proc`` lacks it.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"
