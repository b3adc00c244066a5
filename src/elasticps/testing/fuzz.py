"""Mutation fuzzing of the parsers that read what arrives from the network or the disk.

Each :class:`Target` is a parser with a contract: on any input it returns a
value or raises one of its documented errors (``allowed``), never anything
else. :func:`fuzz` feeds it inputs made from valid examples (its ``seeds``)
by random mutations (bit flips, byte overwrites with boundary values,
insertions, deletions, truncations, duplications, splices of two seeds, and
now and then random bytes), as coverage-less mutation fuzzers such as
``radamsa`` do, and counts how each input ended. An exception outside the
contract is a *crash*: the input that caused it is kept.

The targets (:data:`TARGETS`):

- ``frame_header``: :func:`elasticps.wire.frame.decode_header`, the 76 bytes
  before any body (``FrameError``);
- ``json_body``: a JSON control body, decoded by
  :func:`elasticps.wire.frame.decode_json_body`, as ``recv_json`` does (``FrameError``);
- ``task_record``: one ``tasks/<id>`` ledger value, decoded and restored
  into a :class:`~elasticps.master.taskqueue.TaskQueue` (``InvalidRecordError``);
- ``kafka_record``: a Kafka message value, decoded by
  :func:`elasticps.data.kafka.decode_values` (``DataError``);
- ``shard_file``: the bytes of a parameter server's checkpoint file,
  decoded and verified by :func:`elasticps.pserver.checkpoint.decode_shard`,
  then loaded by ``ParameterShard.from_state`` (``DataError``, ``ValueError``);
- ``shard_metadata``: the same, with the mutations in the file's metadata
  and a CRC-32 that matches them, so that they reach the checks behind it;
- ``checkpoint_manifest``: the ``manifest.json`` of a consistent checkpoint,
  read and verified against its tensors by
  :func:`elasticps.checkpoint.load_checkpoint` (``DataError``).

Used by ``tests/unit/test_fuzz.py`` (a fixed budget per target) and
``benchmarks/fuzz.py`` (a million inputs each).
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

__all__ = ["TARGETS", "FuzzResult", "Target", "fuzz", "mutate"]

_BOUNDARY: Final = (0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF)
_MAX_KEPT_CRASHES: Final = 5


@dataclass(frozen=True)
class Target:
    """A parser under fuzzing.

    Attributes:
        name: the target's name.
        seeds: returns valid inputs to mutate.
        parse: the parser, on one input (bytes).
        allowed: the errors its contract allows.
    """

    name: str
    seeds: Callable[[], list[bytes]]
    parse: Callable[[bytes], object]
    allowed: tuple[type[BaseException], ...]


@dataclass
class FuzzResult:
    """How the inputs of one :func:`fuzz` run ended.

    Attributes:
        target: the target's name.
        inputs: inputs fed.
        accepted: inputs the parser accepted.
        rejected: allowed errors, by exception class name.
        crashes: errors outside the contract, as ``(repr of the error, input as hex)``
            (the first few).
        crash_count: all of them.
        slowest_s: the longest one mutated input took, seconds.
        wall_s: the whole run, seconds.
    """

    target: str
    inputs: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    crashes: list[tuple[str, str]] = field(default_factory=list)
    crash_count: int = 0
    slowest_s: float = 0.0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {
            "target": self.target,
            "inputs": self.inputs,
            "accepted": self.accepted,
            "rejected": dict(sorted(self.rejected.items())),
            "crashes": self.crash_count,
            "first_crashes": self.crashes,
            "slowest_input_s": round(self.slowest_s, 6),
            "wall_s": round(self.wall_s, 3),
        }


def mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    """One random mutation (or a few) of ``data``; ``seeds`` are spliced in now and then."""
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        kind = rng.randrange(9)
        n = len(out)
        if kind == 0 and n:  # flip a bit
            i = rng.randrange(n)
            out[i] ^= 1 << rng.randrange(8)
        elif kind == 1 and n:  # a boundary byte
            out[rng.randrange(n)] = rng.choice(_BOUNDARY)
        elif kind == 2 and n >= 8:  # a boundary 8-byte integer (lengths, counts)
            i = rng.randrange(n - 7)
            value = rng.choice((0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, n, n + 1))
            out[i : i + 8] = value.to_bytes(8, "little")
        elif kind == 3:  # insert random bytes
            i = rng.randrange(n + 1)
            out[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif kind == 4 and n:  # delete a range
            i = rng.randrange(n)
            del out[i : i + rng.randrange(1, 17)]
        elif kind == 5 and n:  # truncate
            del out[rng.randrange(n) :]
        elif kind == 6 and n:  # duplicate a range
            i = rng.randrange(n)
            j = min(n, i + rng.randrange(1, 33))
            out[j:j] = out[i:j]
        elif kind == 7 and seeds:  # splice with another seed
            other = rng.choice(seeds)
            i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            out = out[:i] + other[j:]
        elif kind == 8 and n:  # a random printable or structural character (JSON)
            out[rng.randrange(n)] = ord(rng.choice('{}[]",:0123456789.eE-+ntfalsrue\\u'))
    if rng.random() < 0.01:
        return rng.randbytes(rng.randrange(0, max(2, 2 * len(data))))
    return bytes(out)


def fuzz(target: Target, inputs: int, seed: int = 0) -> FuzzResult:
    """Feed ``target`` ``inputs`` mutated inputs (the seeds themselves first).

    Args:
        target: the parser.
        inputs: how many inputs, >= 0.
        seed: seed of the ``random.Random`` that draws the mutations.

    Returns:
        What happened to them.
    """
    rng = random.Random(seed)
    seeds = target.seeds()
    result = FuzzResult(target.name)
    started = time.perf_counter()
    for n in range(inputs):
        data = seeds[n] if n < len(seeds) else mutate(rng, rng.choice(seeds), seeds)
        timed = n >= len(seeds)  # a seed's first parse may import what the parser uses
        t0 = time.perf_counter()
        try:
            target.parse(data)
        except target.allowed as exc:
            name = type(exc).__name__
            result.rejected[name] = result.rejected.get(name, 0) + 1
        except Exception as exc:  # outside the contract: a crash
            result.crash_count += 1
            if len(result.crashes) < _MAX_KEPT_CRASHES:
                result.crashes.append((repr(exc)[:300], data[:512].hex()))
        else:
            result.accepted += 1
        if timed:
            result.slowest_s = max(result.slowest_s, time.perf_counter() - t0)
        result.inputs += 1
    result.wall_s = time.perf_counter() - started
    return result


# --- the targets ---------------------------------------------------------------------


def _frame_seeds() -> list[bytes]:
    from elasticps.errors import FrameError
    from elasticps.wire.frame import DType, FrameHeader, MsgType, encode_header

    seeds = []
    for msg_type in MsgType:
        for dtype, nbytes in ((DType.BYTES, 0), (DType.BYTES, 64), (DType.FLOAT32, 64),
                              (DType.INT64, 16)):  # fmt: skip
            header = FrameHeader(msg_type, dtype=dtype, body_nbytes=nbytes, epoch=7, sender=3)
            try:
                seeds.append(encode_header(header))
            except (FrameError, ValueError):
                continue
    return seeds


def _parse_frame(data: bytes) -> object:
    from elasticps.wire.frame import decode_header

    return decode_header(data, max_body_bytes=1 << 20)


def _json_seeds() -> list[bytes]:
    bodies = [
        {"op": "coverage", "pass": 3},
        {"op": "seal", "pass": 2, "if_version": 17},
        {"op": "hello", "trainer": 4, "epoch": 9, "layout": {"numel": 10, "shard": 0}},
        {"code": "stale", "message": "computed on version 3"},
    ]
    return [json.dumps(b).encode() for b in bodies]


def _parse_json(data: bytes) -> object:
    from elasticps.wire.frame import decode_json_body

    return decode_json_body(data, "JSON")


def _queue_parts() -> tuple[list[object], object]:
    from elasticps.master.taskqueue import DataRange, QueueConfig

    ranges = [DataRange("train.parquet", 10 * i, 10 * i + 10) for i in range(2)]
    return list(ranges), QueueConfig(task_timeout_s=10.0, max_task_timeouts=2, num_passes=3)


def _task_seeds() -> list[bytes]:
    from elasticps.master.ledger import encode
    from elasticps.master.taskqueue import Dispatch, TaskQueue

    ranges, config = _queue_parts()
    queue = TaskQueue(ranges, config)  # type: ignore[arg-type]
    seeds = [encode(queue.record(0)).encode()]
    first, _ = queue.get_task("t0", 0.0)
    assert isinstance(first, Dispatch)
    seeds.append(encode(queue.record(first.task_id)).encode())
    queue.report_progress(first.task_id, first.pass_id, first.attempt, 4, 1.0, skipped=1)
    seeds.append(encode(queue.record(first.task_id)).encode())
    queue.report_task(first.task_id, first.pass_id, first.attempt, success=True, now=2.0, skipped=1)
    seeds.append(encode(queue.record(first.task_id)).encode())
    return seeds


def _parse_task(data: bytes) -> object:
    from elasticps.master.ledger import decode_object
    from elasticps.master.taskqueue import TaskQueue

    ranges, config = _queue_parts()
    record = decode_object(data, "tasks/0")
    meta = TaskQueue(ranges, config).meta()  # type: ignore[arg-type]
    fresh = TaskQueue(ranges, config).record(1)  # type: ignore[arg-type]
    return TaskQueue.restore(ranges, config, meta, {0: record, 1: fresh}, 0.0)  # type: ignore[arg-type]


def _kafka_seeds() -> list[bytes]:
    rows = [{"label": 3, "pixels": [0.0, 0.5, 1.0]}, {"label": 7, "pixels": [1.0, 0.0, 0.25]}]
    return [json.dumps(r).encode() for r in rows]


def _parse_kafka(data: bytes) -> object:
    from elasticps.data.kafka import decode_values

    return decode_values([data, _kafka_seeds()[0]], ["label", "pixels"], "topic[0]", 0)


def _shard_seeds() -> list[bytes]:
    import torch

    from elasticps.config import OptimizerConfig, UpdateMode
    from elasticps.pserver.checkpoint import encode_shard
    from elasticps.pserver.shard import ParameterShard

    seeds = []
    for name in ("sgd", "adam"):
        shard = ParameterShard(
            {"shard": 0, "numel": 6}, "fp", OptimizerConfig(name=name, lr=0.1), UpdateMode.ASYNC
        )
        try:
            shard.push(0, torch.ones(6), 0, 1)
            seeds.append(encode_shard(*shard.state()))
        finally:
            shard.close()
    return seeds


def _parse_shard(data: bytes) -> object:
    from elasticps.config import OptimizerConfig, UpdateMode
    from elasticps.pserver.checkpoint import decode_shard
    from elasticps.pserver.shard import ParameterShard

    tensors, meta = decode_shard(data, "shard-fuzz.safetensors")
    shard = ParameterShard.from_state(
        tensors, meta, optimizer=OptimizerConfig(name="sgd", lr=0.1), mode=UpdateMode.ASYNC
    )
    shard.close()
    return shard


@functools.cache
def _shard_tensors() -> dict[str, torch.Tensor]:
    from elasticps.pserver.checkpoint import decode_shard

    tensors, _ = decode_shard(_shard_seeds()[0], "seed")
    return dict(tensors)


def _shard_meta_seeds() -> list[bytes]:
    from elasticps.pserver.checkpoint import decode_shard

    out = []
    for data in _shard_seeds():
        _, meta = decode_shard(data, "seed")
        out.append(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    return out


def _parse_shard_meta(data: bytes) -> object:
    """A shard file whose metadata is ``data`` (as Latin-1 text), with a valid CRC-32,
    so that the checks after the CRC see the mutations."""
    from safetensors.torch import save

    from elasticps.pserver.atomic import content_crc32

    tensors = _shard_tensors()
    meta_text = data.decode("latin-1")
    crc = content_crc32(meta_text, tensors)
    return _parse_shard(save(tensors, metadata={"elasticps": meta_text, "crc32": str(crc)}))


@functools.cache
def _checkpoint() -> tuple[Path, bytes]:
    """A consistent checkpoint in a temporary directory (removed when the process
    exits), and its ``manifest.json`` as written."""
    import atexit
    import shutil
    import tempfile

    import torch

    from elasticps.checkpoint import save_checkpoint

    path = Path(tempfile.mkdtemp(prefix="elasticps-fuzz-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    tensors = {"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}
    save_checkpoint(path, tensors, {"job": "fuzz", "version": 12})
    return path, (path / "manifest.json").read_bytes()


def _manifest_seeds() -> list[bytes]:
    return [_checkpoint()[1]]


def _parse_manifest(data: bytes) -> object:
    """The checkpoint with ``data`` as its manifest, loaded and verified."""
    from elasticps.checkpoint import load_checkpoint

    path, _ = _checkpoint()
    (path / "manifest.json").write_bytes(data)
    return load_checkpoint(path)


def _targets() -> dict[str, Target]:
    from elasticps.errors import DataError, FrameError, InvalidRecordError

    return {
        t.name: t
        for t in (
            Target("frame_header", _frame_seeds, _parse_frame, (FrameError,)),
            Target("json_body", _json_seeds, _parse_json, (FrameError,)),
            Target("task_record", _task_seeds, _parse_task, (InvalidRecordError,)),
            Target("kafka_record", _kafka_seeds, _parse_kafka, (DataError,)),
            Target("shard_file", _shard_seeds, _parse_shard, (DataError, ValueError)),
            Target("shard_metadata", _shard_meta_seeds, _parse_shard_meta, (DataError, ValueError)),
            Target("checkpoint_manifest", _manifest_seeds, _parse_manifest, (DataError,)),
        )
    }


TARGETS: Final = _targets()
"""The targets by name (see the module docstring)."""
