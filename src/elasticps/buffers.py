"""Model buffers (BatchNorm statistics and the like) as state of the parameter servers.

A model's *persistent* buffers (``model.named_buffers()`` minus those
registered with ``persistent=False``, i.e. the buffers of ``state_dict()``)
travel with the parameters: they are placed on the parameter servers like
parameters (whole, by CRC-32 of the name; never sliced), pulled with them,
saved in every checkpoint and in ``model.safetensors``. They never receive a
gradient. This module is pure (no I/O): the encoding of buffers on the
float32 tensor plane, the trainer's bookkeeping of what its buffers did
since the last pull (:class:`BufferSync`), and the rules by which a
parameter server combines the trainers' contributions
(:class:`BufferLayout`, :class:`BufferRound`).

**Encoding.** Floating-point buffers (float32, and float16 or bfloat16,
whose values float32 holds exactly) travel as float32. Integer and bool
buffers travel as three float32 *limbs* per element, each a whole number in
``[-2**23, 2**23)``, so that every step, checkpoint and reassembly keeps
them exact (float32 holds every integer up to ``2**24``)::

    v = l0 + l1 * 2**24 + l2 * 2**48      (for any int64 v)

Small values (``|v| < 2**23``) are ``(v, 0, 0)``. The limbs are plain
numbers, not bit patterns reinterpreted as floats: no denormal or NaN
pattern can be flushed or quieted on the way. float64 and complex buffers
are refused (as float64 parameters are): float32 cannot carry them exactly.

**What a trainer sends**, in the gradient buffer's place for the buffers:
for integer buffers, their *increment* since the values it last pulled
(sums of its local updates); for floating-point buffers, the increment in
sync mode and the model's current values in async mode.
:class:`BufferSync` keeps that account across pulls, pushes and pushes
computed again after a STALE answer.

**How a server combines them** (``b`` is the server's value):

- async mode: floating-point buffers take each push's values as it
  arrives, ``b = v``: the server holds the running statistics of the
  trainer that pushed last, as PyTorch DDP keeps one replica's
  (``broadcast_buffers=True`` copies rank 0's buffers to every replica).
  Adding each trainer's increment instead, as TensorFlow's
  parameter-server training does with moving averages
  (``assign_moving_average`` on the servers' variables), is unstable when
  the increments are computed from values pulled several steps earlier:
  an exponential moving average with momentum ``m``, decayed by ``n``
  trainers from values ``d`` steps old, follows
  ``b[t+1] = b[t] - n * m * b[t-d]`` (towards a zero target), which
  oscillates once ``n * m > d**d / (d+1)**(d+1)`` (about ``1 / (e * (d+1))``)
  and diverges once ``n * m > 2 * cos(d * pi / (2*d + 1))`` (Levin and May,
  "A note on difference-delay equations", 1976): with BatchNorm's
  ``m = 0.1`` and two trainers, from ``d = 8``. A running variance near
  zero then goes negative and evaluation returns NaN. Taken values are
  always statistics some trainer's module computed.
  Integer increments are added, ``b += inc``: ``num_batches_tracked``
  counts every mini-batch of every trainer.
- sync mode: a step adds the **sample-weighted mean** of the floating-point
  increments of the round's trainers, and the **largest** of their integer
  increments. All of them started from the same pulled ``b``, so for
  floats this is the sample-weighted mean of the trainers' new values: the
  running mean moves once per step, toward the mean of the trainers'
  batch statistics, as Keras' BatchNormalization does under a synchronous
  strategy (its moving statistics are ``ON_READ`` variables with
  ``aggregation=MEAN``). PyTorch DDP instead broadcasts rank 0's buffers
  at every forward (``broadcast_buffers=True``), keeping one replica's
  statistics and dropping the others'. The counter ``num_batches_tracked``
  then counts steps (each trainer adds 1 per step), as in DDP and in a
  single process that trains on the step's global batch.

Pushes that are stale or duplicates carry their buffers away with them:
a server applies a push's buffers exactly when it applies its gradient,
so buffers follow the exactly-once rule of the records without being part
of it (the coverage of push keys knows nothing of them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from elasticps.errors import LayoutMismatchError, ModelContractError

__all__ = [
    "LIMBS_PER_INT",
    "NO_BUFFERS_ENV",
    "BufferLayout",
    "BufferRange",
    "BufferRound",
    "BufferSpec",
    "BufferSync",
    "buffer_specs",
    "decode",
    "decode_ints",
    "describe_buffers",
    "encode",
    "encode_ints",
    "model_buffers",
    "state_from_flat",
]

LIMBS_PER_INT = 3
"""float32 limbs per element of an integer or bool buffer."""

NO_BUFFERS_ENV = "ELASTICPS_BENCH_NO_BUFFERS"
"""Benchmark knob: set to ``1``, :func:`model_buffers` reports none, so buffers
stay on each trainer, as if elasticps did not carry them (the B side of what
carrying them costs, ``benchmarks/training.py``). A model with buffers then
cannot be evaluated (its saved model lacks them). Unset in normal runs."""

_LIMB = 1 << 24
_HALF_LIMB = 1 << 23

_FLOAT_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
_INT_DTYPES = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
}
_DTYPES_BY_NAME = {name: dtype for dtype, name in {**_FLOAT_DTYPES, **_INT_DTYPES}.items()}


def _kind_of(dtype_name: str) -> str:
    """``"float"`` or ``"int"``; KeyError for a dtype that is not carried."""
    if dtype_name in _FLOAT_DTYPES.values():
        return "float"
    if dtype_name in _INT_DTYPES.values():
        return "int"
    raise KeyError(dtype_name)


@dataclass(frozen=True)
class BufferSpec:
    """A persistent buffer of a model: name, shape and dtype.

    Attributes:
        name: its name in ``state_dict()`` (``"bn.running_mean"``).
        shape: its shape.
        dtype: its dtype's name: ``float32``, ``float16``, ``bfloat16``,
            ``bool``, ``uint8``, ``int8``, ``int16``, ``int32`` or ``int64``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def kind(self) -> str:
        """``"float"`` (carried as float32) or ``"int"`` (carried as limbs)."""
        return _kind_of(self.dtype)

    @property
    def numel(self) -> int:
        """Number of elements of the buffer."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def encoded_numel(self) -> int:
        """float32 elements it takes on the tensor plane."""
        return self.numel * (LIMBS_PER_INT if self.kind == "int" else 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The buffer's ``torch.dtype``."""
        return _DTYPES_BY_NAME[self.dtype]


def model_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The model's persistent buffers, ``(name, tensor)`` in ``state_dict()`` order.

    Buffers registered with ``persistent=False`` (not in ``state_dict()``)
    and ``None`` buffers are left out; a buffer shared by two modules appears
    once, under its first name. None at all under the benchmark knob
    :data:`NO_BUFFERS_ENV`.
    """
    if os.environ.get(NO_BUFFERS_ENV) == "1":
        return []
    out = []
    seen: set[int] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def buffer_specs(model: nn.Module, *, what: str = "model") -> list[BufferSpec]:
    """The :class:`BufferSpec` of each persistent buffer of ``model``.

    Args:
        model: the module.
        what: how to name it in errors.

    Raises:
        ModelContractError: a buffer is float64, complex or of another dtype
            the float32 tensor plane cannot carry exactly.
    """
    specs = []
    wrong = []
    for name, buf in model_buffers(model):
        dtype = _FLOAT_DTYPES.get(buf.dtype) or _INT_DTYPES.get(buf.dtype)
        if dtype is None:
            wrong.append(f"{name} ({str(buf.dtype).removeprefix('torch.')})")
            continue
        specs.append(BufferSpec(name, tuple(buf.shape), dtype))
    if wrong:
        shown = ", ".join(wrong[:5]) + (", ..." if len(wrong) > 5 else "")
        raise ModelContractError(
            f"{what}: buffers must be float32, float16, bfloat16, an integer type or bool "
            f"(the tensor plane carries float32); found {shown}"
        )
    return specs


# --- encoding ---------------------------------------------------------------------------


def encode_ints(values: Tensor) -> Tensor:
    """Integers as float32 limbs (see the module docstring).

    Args:
        values: any integer or bool tensor; read as int64.

    Returns:
        float32 ``[3 * values.numel()]``: ``(l0, l1, l2)`` per element, each
        a whole number in ``[-2**23, 2**23)``.
    """
    v = values.reshape(-1).to(torch.int64)
    l0 = torch.remainder(v + _HALF_LIMB, _LIMB) - _HALF_LIMB
    rest = torch.div(v - l0, _LIMB, rounding_mode="floor")
    l1 = torch.remainder(rest + _HALF_LIMB, _LIMB) - _HALF_LIMB
    l2 = torch.div(rest - l1, _LIMB, rounding_mode="floor")
    return torch.stack((l0, l1, l2), dim=1).reshape(-1).to(torch.float32)


def decode_ints(limbs: Tensor) -> Tensor:
    """The inverse of :func:`encode_ints`.

    Limbs are rounded to the nearest whole number first, so a mean of limbs
    that are all equal decodes exactly.

    Args:
        limbs: float32 ``[3 * n]``.

    Returns:
        int64 ``[n]``.

    Raises:
        LayoutMismatchError: the size is not a multiple of 3.
    """
    if limbs.numel() % LIMBS_PER_INT:
        raise LayoutMismatchError(f"{limbs.numel()} limbs are not whole integers of 3 limbs")
    parts = torch.round(limbs.reshape(-1, LIMBS_PER_INT).to(torch.float64)).to(torch.int64)
    return parts[:, 0] + parts[:, 1] * _LIMB + parts[:, 2] * (_LIMB * _LIMB)


def encode(value: Tensor, spec: BufferSpec) -> Tensor:
    """A buffer's value as it travels: float32 ``[spec.encoded_numel]``."""
    if spec.kind == "int":
        return encode_ints(value)
    return value.detach().reshape(-1).to(torch.float32)


def decode(flat: Tensor, spec: BufferSpec) -> Tensor:
    """A buffer's value from what travels: ``spec.shape``, ``spec.dtype`` (a new tensor).

    Raises:
        LayoutMismatchError: ``flat`` does not have ``spec.encoded_numel`` elements.
    """
    if flat.numel() != spec.encoded_numel:
        raise LayoutMismatchError(
            f"buffer {spec.name} needs {spec.encoded_numel} float32 values, got {flat.numel()}"
        )
    if spec.kind == "int":
        return decode_ints(flat).to(spec.torch_dtype).reshape(spec.shape)
    return flat.detach().to(spec.torch_dtype).reshape(spec.shape).clone()


def state_from_flat(
    model: nn.Module, values: Mapping[str, Tensor], *, what: str = "the checkpoint"
) -> dict[str, Tensor]:
    """The model's ``state_dict`` tensors from flat values by name (as servers hold them).

    Args:
        model: the model (its parameters' shapes and buffers' dtypes are used).
        values: name -> float32 ``[numel]`` (a parameter flattened, a buffer
            encoded), e.g. :attr:`elasticps.snapshot.ConsistentCheckpoint.values`.
        what: how to name ``values`` in errors.

    Returns:
        name -> tensor shaped as in the model: parameters float32, buffers
        in their own dtype.

    Raises:
        LayoutMismatchError: a parameter or buffer is missing or has another size.
    """
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        flat = values.get(name)
        if flat is None or flat.numel() != param.numel():
            raise LayoutMismatchError(f"{what} lacks parameter {name!r} (or it has another size)")
        out[name] = flat.reshape(param.shape).contiguous()
    for spec in buffer_specs(model):
        flat = values.get(spec.name)
        if flat is None or flat.numel() != spec.encoded_numel:
            raise LayoutMismatchError(f"{what} lacks buffer {spec.name!r} (or it has another size)")
        out[spec.name] = decode(flat, spec)
    return out


# --- the trainer's side -------------------------------------------------------------------


def _slot(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


class BufferSync:
    """A trainer's account of its model's buffers against the flat buffers.

    The model's buffers are not views into the flat buffers (integer buffers
    cannot be): they are updated by the model as it trains, read back into
    the gradient buffer's place for them at each push (see :meth:`write_push`),
    and written from the parameter buffer's place for them when new values were
    pulled. Buffers are looked up by name each time, so a module that
    reassigns one (``self.count = self.count + 1``) is followed.

    The account, per buffer: ``base`` (the values last pulled or pushed
    from), ``pending`` (increments not pushed yet, kept across a pull).

    Args:
        model: the model.
        specs: its buffers (:func:`buffer_specs`).
        offsets: buffer name -> element offset in the flat buffers.
    """

    def __init__(
        self, model: nn.Module, specs: Sequence[BufferSpec], offsets: Mapping[str, int]
    ) -> None:
        self.specs = tuple(specs)
        self._model = model
        self._slots = [_slot(model, s.name) for s in self.specs]
        self._ranges = [(offsets[s.name], offsets[s.name] + s.encoded_numel) for s in self.specs]
        lo = min((r[0] for r in self._ranges), default=0)
        hi = max((r[1] for r in self._ranges), default=0)
        self._region = (lo, hi)
        self._base = [self._wide(t) for t in self._current()]
        self._pending = [torch.zeros_like(b) for b in self._base]
        self._last: Tensor | None = None

    def _current(self) -> list[Tensor]:
        out = []
        for (module, attr), spec in zip(self._slots, self.specs, strict=True):
            buf = module._buffers.get(attr)
            if buf is None:
                raise ModelContractError(f"buffer {spec.name} was removed from the model")
            out.append(buf)
        return out

    @staticmethod
    def _wide(t: Tensor) -> Tensor:
        """A copy in the type increments are counted in: float32, or int64."""
        if t.dtype.is_floating_point:
            return t.detach().to(torch.float32, copy=True)
        return t.detach().to(torch.int64, copy=True)

    def encode_into(self, flat: Tensor) -> None:
        """Write the model's current buffer values into ``flat`` (the initial values)."""
        for spec, t, (lo, hi) in zip(self.specs, self._current(), self._ranges, strict=True):
            flat[lo:hi] = encode(t, spec)

    def adopt(self, params: Tensor, *, force: bool = False) -> bool:
        """Take pulled buffer values from ``params`` into the model, if they changed.

        What the model's buffers did since the last pull or push is kept as
        pending increments (sent with the next push). Without ``force``,
        nothing happens while the buffers' part of ``params`` is the one last
        adopted (no pull brought new values).

        Args:
            params: the flat parameter buffer, float32.
            force: adopt even if the values did not change (after a pull that
                follows a STALE answer: the model's buffers may have run the
                mini-batches that are computed again).

        Returns:
            Whether values were adopted.
        """
        lo, hi = self._region
        region = params[lo:hi]
        if not force and self._last is not None and torch.equal(region, self._last):
            return False
        with torch.no_grad():
            for i, (spec, t, (a, b)) in enumerate(
                zip(self.specs, self._current(), self._ranges, strict=True)
            ):
                self._pending[i] += self._wide(t) - self._base[i]
                pulled = decode(params[a:b], spec)
                t.copy_(pulled)
                self._base[i] = self._wide(pulled)
        self._last = region.clone()
        return True

    def write_push(self, grads: Tensor, *, float_values: bool = False) -> None:
        """Put what the next push carries for the buffers into ``grads``' place for them.

        Called right before a push; the account starts again from the
        model's current values.

        Args:
            grads: the flat gradient buffer, float32.
            float_values: floating-point buffers carry the model's current
                values instead of their increment (async mode, see the module
                docstring); integer buffers always carry their increment.
        """
        with torch.no_grad():
            for i, (spec, t, (a, b)) in enumerate(
                zip(self.specs, self._current(), self._ranges, strict=True)
            ):
                now = self._wide(t)
                if spec.kind == "int":
                    grads[a:b] = encode_ints(self._pending[i] + (now - self._base[i]))
                elif float_values:
                    grads[a:b] = now.reshape(-1)
                else:
                    grads[a:b] = (self._pending[i] + (now - self._base[i])).reshape(-1)
                self._base[i] = now
                self._pending[i].zero_()


# --- the server's side -------------------------------------------------------------------


@dataclass(frozen=True)
class BufferRange:
    """Where one buffer lies in a shard's flat values.

    Attributes:
        name: the buffer's name.
        start: first element in the shard's flat values.
        end: one past the last.
        kind: ``"float"`` or ``"int"`` (limbs).
    """

    name: str
    start: int
    end: int
    kind: str


class BufferLayout:
    """The buffers of one shard, from its HELLO layout, and how to apply increments.

    Args:
        ranges: the buffers' ranges in the shard's flat values.
    """

    def __init__(self, ranges: Sequence[BufferRange]) -> None:
        self.ranges = tuple(ranges)

    @classmethod
    def from_layout(cls, layout: Mapping[str, object]) -> BufferLayout | None:
        """The layout's buffers (``layout["buffers"]``: name -> dtype name), or None.

        Raises:
            LayoutMismatchError: ``buffers`` is malformed, names a buffer that
                is not a whole piece, or an integer buffer's size is not a
                multiple of 3 (it arrives over the network).
        """
        declared = layout.get("buffers")
        if not declared:
            return None
        pieces = layout.get("pieces")
        if not isinstance(declared, Mapping) or not isinstance(pieces, list):
            raise LayoutMismatchError("layout 'buffers' must map buffer names to dtypes")
        kinds: dict[str, str] = {}
        for name, dtype in declared.items():
            try:
                kinds[str(name)] = _kind_of(str(dtype))
            except KeyError:
                raise LayoutMismatchError(
                    f"buffer {name!r} has an unknown dtype {dtype!r}"
                ) from None
        ranges = []
        offset = 0
        for piece in pieces:
            if not isinstance(piece, list) or len(piece) != 3:
                raise LayoutMismatchError(f"layout piece {piece!r:.80} is not [name, start, end]")
            name, lo, hi = piece
            if not isinstance(lo, int) or not isinstance(hi, int) or not 0 <= lo <= hi:
                raise LayoutMismatchError(f"layout piece {piece!r:.80} is not [name, start, end]")
            kind = kinds.pop(name, None) if isinstance(name, str) else None
            if kind is not None:
                if lo != 0 or (kind == "int" and hi % LIMBS_PER_INT):
                    raise LayoutMismatchError(f"buffer {name!r} is not a whole piece")
                ranges.append(BufferRange(name, offset, offset + hi, kind))
            offset += hi - lo
        if kinds:
            raise LayoutMismatchError(f"layout buffers {sorted(kinds)[:5]} have no piece")
        return cls(ranges)

    @property
    def names(self) -> frozenset[str]:
        """The buffers' names."""
        return frozenset(r.name for r in self.ranges)

    def take(self, flat: Tensor) -> list[Tensor]:
        """Copies of each buffer's part of ``flat``."""
        return [flat[r.start : r.end].clone() for r in self.ranges]

    def put(self, flat: Tensor, parts: Sequence[Tensor]) -> None:
        """Write ``parts`` (as :meth:`take` returns) back into ``flat``."""
        for r, part in zip(self.ranges, parts, strict=True):
            flat[r.start : r.end] = part

    def zero(self, flat: Tensor) -> None:
        """Zero each buffer's part of ``flat`` (no gradient reaches the optimizer there)."""
        for r in self.ranges:
            flat[r.start : r.end] = 0.0

    def apply(
        self,
        values: Tensor,
        before: Sequence[Tensor],
        pushed: Sequence[Tensor],
        *,
        float_values: bool = False,
    ) -> None:
        """Write the buffers' new values into ``values``.

        Integers become ``before + pushed`` (added exactly); floats become
        ``before + pushed``, or ``pushed`` itself with ``float_values``.

        Args:
            values: the shard's flat values, float32.
            before: each buffer's encoded values before the step (:meth:`take`).
            pushed: each buffer's encoded increment, or for floats with
                ``float_values`` its new value.
            float_values: ``pushed`` holds floats' values (an async push).
        """
        for r, old, new in zip(self.ranges, before, pushed, strict=True):
            if r.kind == "int":
                values[r.start : r.end] = encode_ints(decode_ints(old) + decode_ints(new))
            elif float_values:
                values[r.start : r.end] = new
            else:
                values[r.start : r.end] = old + new


class BufferRound:
    """The increments of one sync round: sample-weighted mean (floats), largest (integers).

    Args:
        layout: the shard's buffers.
    """

    def __init__(self, layout: BufferLayout) -> None:
        self.layout = layout
        self._sums: list[Tensor | None] = [None] * len(layout.ranges)
        self._weight = 0.0

    def join(self, grad: Tensor, num_samples: int) -> None:
        """Count one applied push's increments (``grad``: its flat body, float32)."""
        weight = float(num_samples)
        for i, r in enumerate(self.layout.ranges):
            part = grad[r.start : r.end]
            old = self._sums[i]
            if r.kind == "int":
                ints = decode_ints(part)
                self._sums[i] = ints if old is None else torch.maximum(old, ints)
            else:
                self._sums[i] = part * weight if old is None else old.add_(part, alpha=weight)
        self._weight += weight

    @property
    def joined(self) -> bool:
        """Whether any push joined the round."""
        return self._weight > 0

    def increments(self) -> list[Tensor]:
        """Each buffer's encoded increment for the step (zeros if no push joined)."""
        out = []
        for r, total in zip(self.layout.ranges, self._sums, strict=True):
            if total is None:
                out.append(torch.zeros(r.end - r.start, dtype=torch.float32))
            elif r.kind == "int":
                out.append(encode_ints(total))
            else:
                out.append(total / self._weight)
        return out

    def reset(self) -> None:
        """Forget the round's increments."""
        self._sums = [None] * len(self.layout.ranges)
        self._weight = 0.0


def describe_buffers(specs: Iterable[BufferSpec]) -> dict[str, str]:
    """``name -> dtype`` of buffers, as a HELLO layout's ``buffers`` carries them."""
    return {s.name: s.dtype for s in specs}
