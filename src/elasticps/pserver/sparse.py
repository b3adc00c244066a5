"""Sparse embedding tables: rows of ``dim`` float32 values keyed by int64 ids (pure: no I/O).

A parameter server holds the dense parameters of a model in one flat buffer
(:mod:`elasticps.pserver.shard`); an embedding table too large for that, and
of which a mini-batch touches only a few rows, is held as a
:class:`SparseTable` instead: trainers pull the rows of the ids in their batch
(:meth:`SparseTable.lookup`) and push one gradient row per unique id
(:meth:`SparseTable.apply`), as MXNet's ``row_sparse`` pull/push and
ElasticDL's parameter-server ``EmbeddingTable`` do.

Tables
    A *fixed* table (``num_embeddings=n``) takes ids in ``[0, n)``, like
    ``torch.nn.Embedding``; a *hashed* table (``num_embeddings=None``) takes
    any int64 key and grows as keys arrive (Monolith's collisionless
    embedding table: every key gets its own row, no hashing into a fixed
    number of buckets; Liu et al. 2022, "Monolith: Real Time Recommendation
    System With Collisionless Embedding Table", section 2.1). Both are held
    the same way: an open-addressing id index (linear probing over numpy
    arrays, at most half full) maps an id to a *slot*, and slot ``s`` lives
    in row ``s % chunk_rows`` of chunk ``s // chunk_rows``. Storage grows by
    whole chunks, never by copying the table; only the id index, 16 bytes a
    slot, is rebuilt when it doubles.

Initial values
    A row is allocated at its first update; a lookup of an absent id returns
    the row's initial value without allocating it (and keeps it, up to 4 MiB
    of rows a table, so that the row's first update does not compute it
    again). The initial value is a
    pure function of ``(seed, table name, id)``, so every parameter server,
    every restart and every repartitioning agree on it, and no per-row RNG
    state is stored. Element ``j`` of row ``id`` is computed from outputs
    ``2j`` and ``2j + 1`` of a SplitMix64 generator (Steele, Lea and Flood
    2014, "Fast Splittable Pseudorandom Number Generators"; constants of
    Vigna's reference ``splitmix64.c``) seeded with ``mix(mix(seed ^
    name_hash) ^ id)``, where ``name_hash`` is the first 8 bytes of the
    BLAKE2b digest of the table name: ``normal`` turns the pair into one
    N(0, scale^2) value by the Box-Muller transform (scale 1 is
    ``torch.nn.Embedding``'s N(0, 1)), ``uniform`` maps the first output to
    U(-scale, scale), ``zeros`` gives 0. The arithmetic is float64 then
    rounded to float32, so values agree bit for bit on every machine with
    the same libm (``log``, ``cos``).

Optimizers (lazy: state only for the rows touched)
    :class:`SparseSGD` (with optional momentum), :class:`SparseAdagrad` and
    :class:`SparseAdam` keep their state per row, and update a row only when
    a push carries it, like ``torch.optim.SparseAdam``, TensorFlow's
    ``LazyAdamOptimizer`` and its ``SparseApply*`` kernels. On the rows it
    touches, plain SGD and AdaGrad compute exactly what the dense rules of
    :mod:`elasticps.pserver.rules` compute on a flat tensor whose other
    rows get a zero gradient (the same kernels: ``add_`` and
    ``torch._fused_adagrad_``), bit for bit (tested). Where lazy math
    differs from dense math it is said in each rule's docstring: weight
    decay and momentum act only on rows that are pushed, and Adam's moments
    and bias correction advance only with the row's own updates.

Eviction
    Each row keeps ``count`` (updates received), ``created_version`` and
    ``last_version`` (the table versions of its first and last update).
    :meth:`SparseTable.evict` removes rows not updated for ``expire_versions``
    versions, and rows updated fewer than ``min_count`` times within their
    first ``count_window_versions`` versions, as Monolith expires stale
    features and filters rare ones (section 2.2, "expirable embeddings and
    frequency filtering"). An evicted id that comes back starts again from
    its initial value with fresh optimizer state.

Partitioning and checkpoints
    :class:`Partitioner` maps ids to parameter servers by a hash of the id
    or by contiguous id range; :meth:`SparseTable.state_chunks` exports a
    table as :class:`RowChunk` s (never one giant tensor) with JSON metadata
    (:meth:`SparseTable.meta`); :func:`repartition` and :func:`select_shard`
    route checkpointed chunks of N shards to M shards, and
    :meth:`SparseTable.from_state` rebuilds a table from chunks.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from elasticps.errors import ConfigError, SparseTableError

IdArray: TypeAlias = npt.NDArray[np.int64]
FloatArray: TypeAlias = npt.NDArray[np.float32]

TABLE_FORMAT: Final = "elasticps-sparse/1"
"""Value of the ``format`` field of :meth:`SparseTable.meta`."""

INIT_KINDS: Final = ("normal", "uniform", "zeros")
"""Initialisers a :class:`TableSpec` can name."""

COUNTER_KEYS: Final = ("count", "created_version", "last_version")
"""The per-row int64 counters kept by every table and carried by every :class:`RowChunk`."""

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_GAMMA: Final = 0x9E3779B97F4A7C15
_MIX1: Final = 0xBF58476D1CE4E5B9
_MIX2: Final = 0x94D049BB133111EB
_PARTITION_SALT: Final = 0x5DEECE66D2B7E151
_MAX_LOAD: Final = 0.5
_SCALAR_PROBES: Final = 8  # _IdIndex.find: probe this few ids one by one
#: A fixed table of at most this many ids maps them to slots with an array
#: indexed by id (:class:`_DirectIndex`, 8 bytes an id up to the largest
#: allocated) instead of a hash index.
_DIRECT_MAX_IDS: Final = 1 << 20
_SCAN_SHARDS: Final = 8  # Partitioner.split: up to this many shards, scan once per shard
_INITIAL_CACHE_FLOATS: Final = 1 << 20  # SparseTable: initial values kept from lookups (4 MiB)


# --- hashing -------------------------------------------------------------------------------


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The SplitMix64 finaliser, element-wise (wrapping uint64 arithmetic).

    ``z = x + 0x9E3779B97F4A7C15``, then two xor-shift-multiply rounds
    (constants of Vigna's ``splitmix64.c``, after Steele, Lea and Flood 2014).
    A bijection of uint64, so distinct inputs give distinct outputs.

    Args:
        x: uint64 array of any shape.

    Returns:
        uint64 array of the same shape.
    """
    if x.ndim:
        # Array arithmetic wraps silently; only 0-d (scalar) arithmetic warns,
        # and entering errstate costs more than hashing a batch's ids.
        return _splitmix64(x)
    with np.errstate(over="ignore"):
        return _splitmix64(x)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = x + np.uint64(_GAMMA)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a table name: the first 8 bytes of BLAKE2b, little-endian."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def _as_u64(ids: IdArray) -> npt.NDArray[np.uint64]:
    return ids.view(np.uint64)


# --- table description -----------------------------------------------------------------------


@dataclass(frozen=True)
class TableSpec:
    """What a sparse table is: its name, row width, id space and initialiser.

    Attributes:
        name: the table's key, unique in a model: 1 to 128 characters among
            letters, digits and ``_ . : -``.
        dim: floats per row, >= 1.
        num_embeddings: ids in ``[0, num_embeddings)`` for a fixed table;
            None for a hashed table that takes any int64 key.
        init: ``normal`` (N(0, init_scale^2), ``torch.nn.Embedding``'s with
            scale 1), ``uniform`` (U(-init_scale, init_scale)) or ``zeros``.
        init_scale: standard deviation or bound of the initialiser, >= 0.
        seed: seed of the initial values (see the module docstring).

    Raises:
        ConfigError: a field out of range.
    """

    name: str
    dim: int
    num_embeddings: int | None = None
    init: str = "normal"
    init_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"sparse table name must be 1-128 letters, digits or '_.:-', got {self.name!r}"
            )
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise ConfigError(
                f"sparse table {self.name}: dim must be an int >= 1, got {self.dim!r}"
            )
        n = self.num_embeddings
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(
                f"sparse table {self.name}: num_embeddings must be an int >= 1 or None, got {n!r}"
            )
        if self.init not in INIT_KINDS:
            raise ConfigError(
                f"sparse table {self.name}: init must be one of {', '.join(INIT_KINDS)}, "
                f"got {self.init!r}"
            )
        if not (isinstance(self.init_scale, (int, float)) and self.init_scale >= 0):
            raise ConfigError(
                f"sparse table {self.name}: init_scale must be >= 0, got {self.init_scale!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"sparse table {self.name}: seed must be an int, got {self.seed!r}")

    @property
    def hashed(self) -> bool:
        """True for a hashed table (no fixed id range)."""
        return self.num_embeddings is None

    def describe(self) -> dict[str, Any]:
        """The spec as a JSON-ready dict (for HELLO frames and checkpoint metadata)."""
        return asdict(self)

    @classmethod
    def from_json(cls, value: object) -> TableSpec:
        """Rebuild a spec from :meth:`describe` output (validated: it may come from the network).

        Raises:
            ConfigError: not a dict of the spec's fields, or a field out of range.
        """
        if not isinstance(value, dict):
            raise ConfigError(f"a sparse table spec must be a JSON object, got {value!r:.80}")
        names = {f for f in cls.__dataclass_fields__}
        if not set(value) <= names or "name" not in value or "dim" not in value:
            raise ConfigError(f"sparse table spec has unexpected fields: {sorted(value)}")
        return cls(**value)


def check_id_range(name: str, ids: IdArray | Tensor, num_embeddings: int | None) -> None:
    """Refuse ids outside a fixed table's ``[0, num_embeddings)`` (None: any key).

    Args:
        name: the table, for the message.
        ids: int64 ids, 1-d (a numpy array or a tensor).
        num_embeddings: the fixed table's size, or None for a hashed table.

    Raises:
        SparseTableError: naming the first id out of range.
    """
    n = num_embeddings
    if n is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
        bad = ids[(ids < 0) | (ids >= n)][0]
        raise SparseTableError(f"sparse table {name}: id {int(bad)} is out of range [0, {n})")


def initial_rows(spec: TableSpec, ids: IdArray) -> FloatArray:
    """The initial values of rows ``ids`` (see the module docstring for the generator).

    Args:
        spec: the table.
        ids: int64 ``[k]``.

    Returns:
        float32 ``[k, spec.dim]``, a fresh array.
    """
    k, dim = len(ids), spec.dim
    if spec.init == "zeros" or k == 0 or spec.init_scale == 0:
        return np.zeros((k, dim), dtype=np.float32)
    table_key = splitmix64(np.array([(spec.seed & (2**64 - 1)) ^ name_hash(spec.name)], np.uint64))
    row_seed = splitmix64(_as_u64(np.ascontiguousarray(ids, dtype=np.int64)) ^ table_key[0])
    with np.errstate(over="ignore"):
        counters = (np.arange(1, 2 * dim + 1, dtype=np.uint64) * np.uint64(_GAMMA))[None, :]
        bits = splitmix64(row_seed[:, None] + counters)  # [k, 2 * dim]
    # 53 high bits -> [0, 1), as numpy's and Java's doubles from 64 random bits.
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
    u1, u2 = unit[:, 0::2], unit[:, 1::2]
    if spec.init == "uniform":
        values = (2.0 * u1 - 1.0) * spec.init_scale
    else:  # Box-Muller (1958): 1 - u1 is in (0, 1], so the log is finite.
        values = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2) * spec.init_scale
    return values.astype(np.float32)


# --- update rules --------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseSGD:
    """Lazy SGD: ``p -= lr * g`` on the rows pushed, with optional per-row momentum.

    The math of ``torch.optim.SGD`` (and :class:`~elasticps.pserver.rules.SGDRule`)
    applied to the rows pushed only: ``g = grad + weight_decay * p``; with
    momentum, ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` at
    the row's first update) and ``g = buf`` (or ``g + momentum * buf`` with
    Nesterov). Without momentum and weight decay this is bit-identical to the
    dense rule (an untouched row has a zero gradient, which leaves it as it
    is). With momentum it is TensorFlow's ``SparseApplyMomentum``: a row's
    buffer neither decays nor moves the row between its updates, whereas the
    dense rule keeps applying a decaying buffer at every step; weight decay,
    likewise, shrinks a row only when it is pushed.

    Raises:
        ConfigError: a hyper-parameter out of range.
    """

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError("sparse SGD momentum and weight decay must be >= 0")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("Nesterov momentum requires a momentum and zero dampening")

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Per-row float32 ``[dim]`` state tensors (``torch.optim`` names)."""
        return ("momentum_buffer",) if self.momentum else ()


@dataclass(frozen=True)
class SparseAdagrad:
    """Lazy AdaGrad (Duchi, Hazan and Singer 2011), per row.

    On a pushed row: ``g = grad + weight_decay * p``, ``sum += g * g``,
    ``p -= clr * g / (sqrt(sum) + eps)`` with ``clr = lr / (1 + (step - 1) *
    lr_decay)`` and ``step`` the row's own update count, through
    ``torch._fused_adagrad_`` as :class:`~elasticps.pserver.rules.AdagradRule`.
    With ``lr_decay = 0`` and ``weight_decay = 0`` the result is bit-identical
    to the dense rule on the rows pushed (a zero gradient leaves a dense row
    and its sum unchanged); with ``lr_decay`` the decay follows the row's own
    step, not the table's.

    Raises:
        ConfigError: a hyper-parameter out of range.
    """

    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        if min(self.lr_decay, self.weight_decay, self.initial_accumulator_value, self.eps) < 0:
            raise ConfigError(
                "sparse AdaGrad lr_decay, weight decay, initial_accumulator_value and eps "
                "must be >= 0"
            )

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Per-row float32 ``[dim]`` state tensors (``torch.optim`` names)."""
        return ("sum",)


@dataclass(frozen=True)
class SparseAdam:
    """Lazy Adam (Kingma and Ba 2015, algorithm 1), per row.

    On a pushed row, as ``torch.optim.Adam`` (single-tensor form):
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``, with
    ``g = grad + weight_decay * p`` (or, with ``decoupled_weight_decay``,
    AdamW's ``p *= 1 - lr * weight_decay``; Loshchilov and Hutter 2019).

    ``step_count`` chooses ``t``. ``"row"`` (default): the row's own update
    count, so a rare id's first update gets the full bias correction of a
    first step, as DeepRec's ``AdamAsyncOptimizer`` does for embedding
    variables. ``"table"``: the table's version (one per :meth:`SparseTable.apply`),
    as ``torch.optim.SparseAdam`` and TensorFlow's ``LazyAdamOptimizer`` do.
    How lazy Adam differs from dense Adam: the moments of a row decay only
    when it is pushed (dense Adam decays every row's moments at every step
    and keeps moving a row with its old momentum after its gradient stops),
    and with ``"row"`` the bias correction follows the row. When every row
    is pushed at every step both choices equal dense Adam up to float32
    rounding (this is not the fused kernel, so not bit for bit). Unlike
    ``SparseAdam`` and ``LazyAdamOptimizer``, which add ``eps`` to
    ``sqrt(v)`` before bias correction ("epsilon hat"), ``eps`` is added
    after it, as in ``torch.optim.Adam``.

    Raises:
        ConfigError: a hyper-parameter out of range.
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False
    step_count: Literal["row", "table"] = "row"

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"sparse Adam betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps < 0 or self.weight_decay < 0:
            raise ConfigError("sparse Adam eps and weight decay must be >= 0")
        if self.step_count not in ("row", "table"):
            raise ConfigError(
                f"sparse Adam step_count must be 'row' or 'table', got {self.step_count!r}"
            )

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Per-row float32 ``[dim]`` state tensors (``torch.optim`` names)."""
        return ("exp_avg", "exp_avg_sq")


SparseRule: TypeAlias = SparseSGD | SparseAdagrad | SparseAdam
"""A lazy update rule of a :class:`SparseTable`."""

_RULES: Final[dict[str, type[SparseSGD] | type[SparseAdagrad] | type[SparseAdam]]] = {
    "sgd": SparseSGD,
    "adagrad": SparseAdagrad,
    "adam": SparseAdam,
}


def rule_to_json(rule: SparseRule) -> dict[str, Any]:
    """``{"name": ..., "options": {...}}``, JSON-ready, for checkpoint metadata."""
    name = next(n for n, cls in _RULES.items() if isinstance(rule, cls))
    options = asdict(rule)
    if "betas" in options:
        options["betas"] = list(options["betas"])
    return {"name": name, "options": options}


def rule_from_json(value: object) -> SparseRule:
    """Rebuild a rule from :func:`rule_to_json` output (validated).

    Raises:
        ConfigError: an unknown rule name or options the rule does not take.
    """
    if not isinstance(value, dict) or value.get("name") not in _RULES:
        raise ConfigError(f"unknown sparse update rule {value!r:.80}")
    options = value.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError("sparse update rule options must be a JSON object")
    options = dict(options)
    if "betas" in options and isinstance(options["betas"], list):
        options["betas"] = tuple(options["betas"])
    try:
        return _RULES[value["name"]](**options)
    except TypeError as exc:
        raise ConfigError(f"sparse update rule {value['name']}: {exc}") from exc


def sparse_rule_from_config(
    name: str, options: Mapping[str, Any], weight_decay: float = 0.0, momentum: float = 0.0
) -> SparseRule:
    """The lazy rule matching a parameter server's dense optimizer.

    Args:
        name: ``sgd``, ``momentum``, ``adagrad`` or ``adam`` (``OptimizerConfig.name``).
        options: the ``--optimizer-options`` object; keys the lazy rule does
            not take (``amsgrad``) are refused.
        weight_decay: ``OptimizerConfig.weight_decay``.
        momentum: ``OptimizerConfig.momentum``, used by ``momentum`` only.

    Returns:
        A :class:`SparseSGD`, :class:`SparseAdagrad` or :class:`SparseAdam`.

    Raises:
        ConfigError: another optimizer, or options the lazy rule does not take.
    """
    opts = dict(options)
    try:
        if name == "sgd":
            return SparseSGD(weight_decay=weight_decay, **opts)
        if name == "momentum":
            return SparseSGD(momentum=momentum, weight_decay=weight_decay, **opts)
        if name == "adagrad":
            return SparseAdagrad(weight_decay=weight_decay, **opts)
        if name == "adam":
            if "betas" in opts:
                opts["betas"] = tuple(opts["betas"])
            return SparseAdam(weight_decay=weight_decay, **opts)
    except TypeError as exc:
        raise ConfigError(
            f"sparse tables cannot run optimizer {name!r} with these options: {exc}"
        ) from exc
    raise ConfigError(
        f"sparse tables support the optimizers sgd, momentum, adagrad and adam, not {name!r}"
    )


def _apply_rule(
    rule: SparseRule,
    rows: Tensor,
    *,
    grads: Tensor,
    state: dict[str, Tensor],
    steps: Tensor,
    lr: float,
) -> None:
    """One lazy update of gathered rows, in place.

    Args:
        rows: float32 ``[k, dim]``, contiguous.
        grads: float32 ``[k, dim]``.
        state: per-row state, float32 ``[k, dim]`` each, updated in place.
        steps: int64 ``[k]``, each row's update count *including* this one.
        lr: learning rate.
    """
    if isinstance(rule, SparseSGD):
        g = -grads if rule.maximize else grads
        if rule.weight_decay:
            g = g.add(rows, alpha=rule.weight_decay)
        if rule.momentum:
            buf = state["momentum_buffer"]
            first = steps == 1
            rest = ~first
            if bool(rest.any()):
                buf[rest] = buf[rest].mul_(rule.momentum).add_(g[rest], alpha=1 - rule.dampening)
            if bool(first.any()):
                buf[first] = g[first]
            g = g.add(buf, alpha=rule.momentum) if rule.nesterov else buf
        rows.add_(g, alpha=-lr)
        return
    if isinstance(rule, SparseAdagrad):
        groups: Iterable[tuple[Tensor | None, float]]
        if rule.lr_decay:
            values = np.unique(steps.numpy())
            groups = ((steps == int(v), float(v)) for v in values.tolist())
        else:
            groups = ((None, 1.0),)
        for mask, step in groups:
            p = rows if mask is None else rows[mask]
            s = state["sum"] if mask is None else state["sum"][mask]
            g = grads if mask is None else grads[mask]
            torch._fused_adagrad_(
                [p],
                [g],
                [s],
                [torch.tensor(step, dtype=torch.float32)],
                lr=lr,
                lr_decay=rule.lr_decay,
                weight_decay=rule.weight_decay,
                eps=rule.eps,
                maximize=rule.maximize,
                grad_scale=None,
                found_inf=None,
            )
            if mask is not None:
                rows[mask] = p
                state["sum"][mask] = s
        return


def combine_gradients(
    pushes: Sequence[tuple[Tensor, Tensor, float]], dim: int
) -> tuple[Tensor, Tensor]:
    """The weighted mean of several trainers' row gradients, for one sync step.

    As the dense shard averages gradients weighted by samples: a row pushed
    by some trainers only gets ``sum_t w_t g_t / sum_t w_t`` over *all*
    pushes, as if the others had pushed a zero row for it (which is what
    their dense gradient would hold).

    Args:
        pushes: ``(ids int64 [k_t] unique, grads float32 [k_t, dim], weight)``
            per trainer; weights (samples) >= 0, not all 0 unless empty.
        dim: row width.

    Returns:
        ``(ids, grads)``: int64 ``[k]`` unique ascending, float32 ``[k, dim]``.

    Raises:
        SparseTableError: shapes that do not match, or no positive weight.
    """
    if not pushes:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim)
    total = float(sum(w for _, _, w in pushes))
    if not total > 0 or any(w < 0 for _, _, w in pushes):
        raise SparseTableError("sparse pushes need weights >= 0 with a positive sum")
    for ids, grads, _ in pushes:
        if ids.dim() != 1 or tuple(grads.shape) != (len(ids), dim):
            raise SparseTableError(
                f"a sparse push has ids {list(ids.shape)} and grads {list(grads.shape)}, "
                f"expected [k] and [k, {dim}]"
            )
    all_ids = torch.cat([ids.to(torch.int64) for ids, _, _ in pushes])
    weighted = torch.cat([grads * (w / total) for _, grads, w in pushes])
    unique, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
    out = torch.zeros(len(unique), dim, dtype=torch.float32).index_add_(0, inverse, weighted)
    return unique, out


@dataclass(frozen=True)
class _Staged:
    """One table's pushed rows, gathered for an update step (see :func:`apply_tables`).

    ``rows``, ``state`` and ``grads`` are float32 ``[k, dim]``; ``count``
    int64 ``[k]``, each row's update count including this step.
    """

    table: SparseTable
    where: _Locator
    rows: FloatArray
    state: dict[str, FloatArray]
    count: IdArray
    grads: FloatArray


def apply_tables(
    pushes: Sequence[tuple[SparseTable, Tensor | IdArray, Tensor | FloatArray]],
    lr: float,
    *,
    checked: bool = False,
) -> None:
    """One optimizer step of several tables: :meth:`SparseTable.apply` of each push.

    Tables with the same rule and row width are stepped together: their
    gathered rows are concatenated and the rule runs once over them, which
    costs about what one table's step does (the rule's cost for a few
    hundred rows is mostly per call). The result is the same as applying
    each table alone.

    Args:
        pushes: ``(table, ids int64 [k] unique, grads float32 [k, dim])``
            (grads a tensor or a numpy array), at most one per table.
        lr: learning rate of this step, > 0.
        checked: as :meth:`SparseTable.apply`.

    Raises:
        SparseTableError: as :meth:`SparseTable.apply`; every push is
            checked before any table changes.
    """
    arrays = [table._check_push(ids, grads, checked=checked) for table, ids, grads in pushes]
    groups: dict[tuple[SparseRule, int], list[_Staged]] = {}
    for (table, _, grads), arr in zip(pushes, arrays, strict=True):
        staged = table._stage(arr, grads)
        if staged is not None:
            groups.setdefault((table.rule, table.spec.dim), []).append(staged)
    for (rule, _), members in groups.items():
        if len(members) == 1:
            one = members[0]
            _step_rows(rule, one.rows, one.grads, one.state, one.count, members, lr)
            one.table._commit(one, one.rows, one.state)
            continue
        rows = np.concatenate([m.rows for m in members])
        state = {k: np.concatenate([m.state[k] for m in members]) for k in rule.state_keys}
        count = np.concatenate([m.count for m in members])
        grads = np.concatenate([m.grads for m in members])
        _step_rows(rule, rows, grads, state, count, members, lr)
        start = 0
        for m in members:
            end = start + m.where.n
            m.table._commit(m, rows[start:end], {k: v[start:end] for k, v in state.items()})
            start = end


def _table_steps(members: Sequence[_Staged]) -> npt.NDArray[np.float64]:
    """Each gathered row's table version (Adam's ``step_count="table"``), float64 ``[k]``."""
    return np.concatenate([np.full(m.where.n, float(m.table.version)) for m in members])


def _step_rows(  # noqa: PLR0917 (the arrays of one step)
    rule: SparseRule,
    rows: FloatArray,
    grads: FloatArray,
    state: dict[str, FloatArray],
    count: IdArray,
    members: Sequence[_Staged],
    lr: float,
) -> None:
    """One lazy update of gathered rows, in place: the concatenation of ``members``'
    arrays (as :class:`_Staged`'s)."""
    if isinstance(rule, SparseAdam):
        t = count.astype(np.float64) if rule.step_count == "row" else _table_steps(members)
        _adam_rows(rule, rows, grads, state, t, lr)
        return
    _apply_rule(
        rule,
        torch.from_numpy(rows),
        grads=torch.from_numpy(grads),
        state={k: torch.from_numpy(v) for k, v in state.items()},
        steps=torch.from_numpy(count),
        lr=lr,
    )


def _adam_rows(  # noqa: PLR0917 (the arrays of one step)
    rule: SparseAdam,
    rows: FloatArray,
    grads: FloatArray,
    state: dict[str, FloatArray],
    t: npt.NDArray[np.float64],
    lr: float,
) -> None:
    """:class:`SparseAdam` on gathered rows, in place, in numpy; ``t`` is each
    row's step number for the bias corrections, float64 ``[k]``.

    The operations of ``torch.optim.Adam``'s single-tensor step, in float32,
    with the per-row bias corrections computed in float64. numpy rather
    than torch because a step touches a few hundred rows, where each torch
    call's fixed cost (several microseconds) outweighs its arithmetic.
    Results match the torch operations to float32 rounding (``lerp`` uses a
    fused multiply-add there).
    """
    beta1, beta2 = rule.betas
    g = -grads if rule.maximize else grads
    if rule.weight_decay:
        if rule.decoupled_weight_decay:
            rows *= np.float32(1 - lr * rule.weight_decay)
        else:
            g = g + rows * np.float32(rule.weight_decay)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    delta = g - m
    delta *= np.float32(1 - beta1)
    m += delta  # m.lerp_(g, 1 - beta1)
    v *= np.float32(beta2)
    sq = g * np.float32(1 - beta2)
    sq *= g
    v += sq  # v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = (lr / (1.0 - np.power(beta1, t))).astype(np.float32)[:, None]
    bias2_sqrt = np.sqrt(1.0 - np.power(beta2, t)).astype(np.float32)[:, None]
    denom = np.sqrt(v)
    denom /= bias2_sqrt
    denom += np.float32(rule.eps)
    np.divide(m, denom, out=denom)
    denom *= step_size
    rows -= denom


# --- chunked storage -------------------------------------------------------------------------


class _Locator:
    """Where slots live: chunk and offset of each, grouped by chunk for gathers and scatters."""

    def __init__(self, slots: IdArray, chunk_rows: int, *, one_chunk: bool = False) -> None:
        """``one_chunk``: the caller knows every slot is below ``chunk_rows``."""
        self.n = len(slots)
        self.groups: list[tuple[int, IdArray | None]] = []
        if one_chunk:
            self.offset = slots
            if self.n:
                self.groups = [(0, None)]
            return
        chunk = slots // chunk_rows
        self.offset = slots % chunk_rows
        if not self.n:
            return
        if chunk[0] == chunk[-1] and (chunk == chunk[0]).all():
            self.groups = [(int(chunk[0]), None)]
            return
        order = np.argsort(chunk, kind="stable")
        sorted_chunk = chunk[order]
        bounds = np.flatnonzero(np.diff(sorted_chunk)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [self.n]))
        self.groups = [
            (int(sorted_chunk[s]), order[s:e]) for s, e in zip(starts, ends, strict=True)
        ]


class _Column:
    """One per-slot array stored in chunks of ``chunk_rows`` slots."""

    def __init__(self, dtype: type[np.generic], width: int | None, chunk_rows: int) -> None:
        self.dtype = dtype
        self.width = width
        self.chunk_rows = chunk_rows
        self.chunks: list[npt.NDArray[Any]] = []

    def _shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)

    def reserve(self, slots: int) -> None:
        while len(self.chunks) * self.chunk_rows < slots:
            self.chunks.append(np.zeros(self._shape(self.chunk_rows), dtype=self.dtype))

    def truncate(self, slots: int) -> None:
        keep = -(-slots // self.chunk_rows)
        del self.chunks[keep:]

    def gather(self, where: _Locator, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """The values of ``where``'s slots: a fresh array, or ``out`` filled."""
        if len(where.groups) == 1 and where.groups[0][1] is None:
            return np.take(self.chunks[where.groups[0][0]], where.offset, axis=0, out=out)
        if out is None:
            out = np.empty(self._shape(where.n), dtype=self.dtype)
        for chunk, idx in where.groups:
            assert idx is not None
            out[idx] = self.chunks[chunk][where.offset[idx]]
        return out

    def scatter(self, where: _Locator, values: npt.NDArray[Any]) -> None:
        if len(where.groups) == 1 and where.groups[0][1] is None:
            self.chunks[where.groups[0][0]][where.offset] = values
            return
        for chunk, idx in where.groups:
            assert idx is not None
            self.chunks[chunk][where.offset[idx]] = values[idx]

    def views(self, size: int) -> Iterator[npt.NDArray[Any]]:
        """The stored slots ``[0, size)``, chunk by chunk (views, not copies)."""
        for i, chunk in enumerate(self.chunks):
            start = i * self.chunk_rows
            if start >= size:
                return
            yield chunk[: min(self.chunk_rows, size - start)]


class _IdIndex:
    """An int64 -> slot map with linear probing over numpy arrays, at most half full.

    Vectorised: a batch of ids is probed together, one numpy pass per probe
    distance. Never deletes; eviction rebuilds it from the surviving ids.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._reset(capacity)

    def _reset(self, capacity: int) -> None:
        cap = 1 << max(4, (capacity - 1).bit_length())
        self._keys = np.zeros(cap, dtype=np.int64)
        self._slots = np.full(cap, -1, dtype=np.int64)
        self._mask = np.uint64(cap - 1)
        self.size = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the index arrays."""
        return int(self._keys.nbytes + self._slots.nbytes)

    def _home(self, ids: IdArray) -> IdArray:
        return (splitmix64(_as_u64(ids)) & self._mask).astype(np.int64)

    def find(self, ids: IdArray) -> IdArray:
        """Slots of ``ids`` (any order, duplicates allowed); -1 where absent."""
        out = np.full(len(ids), -1, dtype=np.int64)
        pos = self._home(ids)
        pending = np.arange(len(ids))
        mask = int(self._mask)
        while pending.size:
            if pending.size <= _SCALAR_PROBES:
                # The few ids left sit on long probe chains: a numpy pass per
                # probe costs more than walking them one by one.
                self._walk(ids, pos, pending, out)
                break
            p = pos[pending]
            slot = self._slots[p]
            empty = slot < 0
            hit = ~empty & (self._keys[p] == ids[pending])
            out[pending[hit]] = slot[hit]
            pending = pending[~(empty | hit)]
            pos[pending] = (pos[pending] + 1) & mask
        return out

    def _walk(self, ids: IdArray, pos: IdArray, pending: IdArray, out: IdArray) -> None:
        """:meth:`find` for ``ids[pending]`` from ``pos``, one id at a time."""
        keys, slots, mask = self._keys, self._slots, int(self._mask)
        for i in pending.tolist():
            p, key = int(pos[i]), int(ids[i])
            while (slot := int(slots[p])) >= 0:
                if int(keys[p]) == key:
                    out[i] = slot
                    break
                p = (p + 1) & mask

    def insert(self, ids: IdArray, slots: IdArray) -> None:
        """Add ``ids`` (unique, all absent) with their slots, growing the index if needed."""
        if (self.size + len(ids)) > _MAX_LOAD * len(self._keys):
            live = self._slots >= 0
            old_ids, old_slots = self._keys[live], self._slots[live]
            need = int((self.size + len(ids)) / _MAX_LOAD) + 1
            self._reset(max(need, 2 * len(self._keys)))
            self._place(old_ids, old_slots)
        self._place(ids, slots)

    def _place(self, ids: IdArray, slots: IdArray) -> None:
        pos = self._home(ids)
        pending = np.arange(len(ids))
        mask = int(self._mask)
        placed = np.zeros(len(ids), dtype=bool)
        while pending.size:
            p = pos[pending]
            free = self._slots[p] < 0
            if free.any():
                # Of the ids probing the same free position, the first takes it.
                positions, first = np.unique(p[free], return_index=True)
                winners = pending[free][first]
                self._keys[positions] = ids[winners]
                self._slots[positions] = slots[winners]
                placed[winners] = True
                pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + 1) & mask
        self.size += len(ids)


class _DirectIndex:
    """The id -> slot map of a fixed table with few ids: an array indexed by id.

    One gather per lookup instead of hashing and probing. The array covers
    the ids up to the largest inserted (grown by doubling, at most
    ``num_ids``); -1 marks an absent id. Ids outside ``[0, num_ids)`` are
    refused before they get here (fixed tables check their range).
    """

    def __init__(self, num_ids: int) -> None:
        self._num_ids = num_ids
        self._slots = np.zeros(0, dtype=np.int64)
        self.size = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the index array."""
        return int(self._slots.nbytes)

    def find(self, ids: IdArray) -> IdArray:
        """Slots of ``ids`` (any order, duplicates allowed); -1 where absent."""
        slots = self._slots
        if len(slots) == self._num_ids:  # grown to every id, and ids are in range
            every: IdArray = slots[ids]
            return every
        if len(ids) and int(ids.min()) >= 0 and int(ids.max()) < len(slots):
            found: IdArray = slots[ids]
            return found
        out = np.full(len(ids), -1, dtype=np.int64)
        known = (ids >= 0) & (ids < len(slots))
        out[known] = slots[ids[known]]
        return out

    def insert(self, ids: IdArray, slots: IdArray) -> None:
        """Add ``ids`` (unique, all absent, in ``[0, num_ids)``) with their slots."""
        if not len(ids):
            return
        need = int(ids.max()) + 1
        if need > len(self._slots):
            grown = np.full(
                min(self._num_ids, max(need, 2 * len(self._slots), 1024)), -1, dtype=np.int64
            )
            grown[: len(self._slots)] = self._slots
            self._slots = grown
        self._slots[ids] = slots
        self.size += len(ids)


def _new_index(spec: TableSpec, capacity: int = 1024) -> _IdIndex | _DirectIndex:
    """An empty id index for a table: direct for a fixed table of few ids, else hashed."""
    n = spec.num_embeddings
    if n is not None and n <= _DIRECT_MAX_IDS:
        return _DirectIndex(n)
    return _IdIndex(capacity)


# --- row chunks (checkpoints, repartitioning) -------------------------------------------------


@dataclass(frozen=True)
class RowChunk:
    """A run of rows of one table with their optimizer state and counters.

    The unit of checkpoints and repartitioning: a table is exported, stored,
    routed and loaded as chunks of at most ``chunk_rows`` rows, never as one
    tensor.

    Attributes:
        ids: int64 ``[r]``, unique within a table.
        rows: float32 ``[r, dim]``.
        state: per-row optimizer state by ``torch.optim`` name, float32 ``[r, dim]`` each.
        counters: ``count``, ``created_version``, ``last_version``: int64 ``[r]`` each.
    """

    ids: IdArray
    rows: FloatArray
    state: Mapping[str, FloatArray] = field(default_factory=dict)
    counters: Mapping[str, IdArray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, positions: IdArray) -> RowChunk:
        """The rows at ``positions`` (int64 ``[r']``), as a new chunk (copies)."""
        return RowChunk(
            self.ids[positions],
            self.rows[positions],
            {k: v[positions] for k, v in self.state.items()},
            {k: v[positions] for k, v in self.counters.items()},
        )

    def tensors(self, prefix: str) -> dict[str, Tensor]:
        """The chunk as named CPU tensors for a safetensors file (zero-copy where contiguous).

        Names: ``<prefix>ids``, ``<prefix>rows``, ``<prefix>optim.<key>``,
        ``<prefix><counter>``.
        """
        out = {f"{prefix}ids": self.ids, f"{prefix}rows": self.rows}
        out.update({f"{prefix}optim.{k}": v for k, v in self.state.items()})
        out.update({f"{prefix}{k}": v for k, v in self.counters.items()})
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], prefix: str, dim: int) -> RowChunk:
        """Rebuild a chunk written by :meth:`tensors` (validated: it comes from a file).

        Raises:
            SparseTableError: a tensor is missing, of the wrong dtype or shape.
        """

        def get(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> npt.NDArray[Any]:
            t = tensors.get(prefix + name)
            if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                got = None if t is None else (t.dtype, tuple(t.shape))
                raise SparseTableError(
                    f"sparse chunk {prefix}: tensor {name!r} must be {dtype} {list(shape)}, "
                    f"got {got}"
                )
            return t.numpy()

        ids_t = tensors.get(prefix + "ids")
        if ids_t is None or ids_t.dim() != 1:
            raise SparseTableError(f"sparse chunk {prefix}: no 1-d 'ids' tensor")
        r = ids_t.shape[0]
        state_keys = sorted(
            k[len(prefix) + len("optim.") :] for k in tensors if k.startswith(prefix + "optim.")
        )
        return cls(
            get("ids", torch.int64, (r,)),
            get("rows", torch.float32, (r, dim)),
            {k: get(f"optim.{k}", torch.float32, (r, dim)) for k in state_keys},
            {k: get(k, torch.int64, (r,)) for k in COUNTER_KEYS},
        )


# --- partitioning --------------------------------------------------------------------------


@dataclass(frozen=True)
class Partitioner:
    """Maps ids to parameter servers (pure).

    ``hash``: shard ``splitmix64(id ^ salt) % num_shards``, for any table;
    the mixing spreads consecutive and strided ids evenly, which ``id %
    num_shards`` would not. ``range``: contiguous id ranges, split as evenly
    as :func:`elasticps.placement.even_split` splits a big dense parameter;
    fixed tables only. Range keeps neighbouring ids together (cheap range
    scans, checkpoints of one shard cover one range) but sends a popular
    range to one server; hash balances skewed (Zipf) ids.

    Attributes:
        kind: ``hash`` or ``range``.
        num_shards: parameter servers, >= 1.
        num_embeddings: the fixed table's size (``range`` only).

    Raises:
        ConfigError: an unknown kind, ``num_shards < 1``, or ``range``
            without ``num_embeddings``.
    """

    kind: Literal["hash", "range"]
    num_shards: int
    num_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("hash", "range"):
            raise ConfigError(f"partition kind must be 'hash' or 'range', got {self.kind!r}")
        if self.num_shards < 1:
            raise ConfigError(f"number of shards must be >= 1, got {self.num_shards}")
        if self.kind == "range" and (self.num_embeddings is None or self.num_embeddings < 1):
            raise ConfigError("range partitioning needs a fixed table (num_embeddings >= 1)")

    def range_bounds(self) -> list[tuple[int, int]]:
        """``[(start, end))`` of each shard for ``range`` (empty list for ``hash``)."""
        if self.kind != "range" or self.num_embeddings is None:
            return []
        from elasticps.placement import even_split

        return even_split(self.num_embeddings, self.num_shards)

    def shard_of(self, ids: IdArray) -> IdArray:
        """The shard of each id.

        Args:
            ids: int64 ``[k]``; within ``[0, num_embeddings)`` for ``range``.

        Returns:
            int64 ``[k]`` in ``[0, num_shards)``.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if self.num_shards == 1:
            return np.zeros(len(ids), dtype=np.int64)
        if self.kind == "hash":
            mixed = splitmix64(_as_u64(ids) ^ np.uint64(_PARTITION_SALT))
            return (mixed % np.uint64(self.num_shards)).astype(np.int64)
        ends = np.array([end for _, end in self.range_bounds()], dtype=np.int64)
        return np.searchsorted(ends, ids, side="right").astype(np.int64)

    def split(self, ids: IdArray) -> list[IdArray]:
        """Positions of ``ids`` going to each shard: ``out[s]`` is int64 ``[k_s]``, ascending.

        A trainer sends ``ids[out[s]]`` to shard ``s`` and writes the rows it
        gets back to ``rows[out[s]]``.
        """
        if self.num_shards == 1:
            return [np.arange(len(ids), dtype=np.int64)]
        shard = self.shard_of(ids)
        if self.num_shards <= _SCAN_SHARDS:  # one pass per shard beats a sort
            return [np.flatnonzero(shard == s) for s in range(self.num_shards)]
        order = np.argsort(shard, kind="stable")
        counts = np.bincount(shard, minlength=self.num_shards)
        return list(np.split(order.astype(np.int64), np.cumsum(counts)[:-1]))

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (for checkpoint metadata)."""
        return asdict(self)


def select_shard(
    chunks: Iterable[RowChunk], partitioner: Partitioner, shard: int
) -> Iterator[RowChunk]:
    """The rows of ``chunks`` that belong to ``shard`` under ``partitioner``.

    What a parameter server restoring onto a new number of servers does: read
    every old shard's chunks and keep its own rows. Streaming: one output
    chunk (possibly empty chunks skipped) per input chunk.

    Raises:
        ConfigError: ``shard`` is not in ``[0, partitioner.num_shards)``.
    """
    if not 0 <= shard < partitioner.num_shards:
        raise ConfigError(f"shard {shard} is not in [0, {partitioner.num_shards})")
    for chunk in chunks:
        mine = np.flatnonzero(partitioner.shard_of(chunk.ids) == shard)
        if len(mine) == len(chunk):
            yield chunk
        elif len(mine):
            yield chunk.take(mine)


def repartition(
    chunks: Iterable[RowChunk], partitioner: Partitioner, chunk_rows: int
) -> list[list[RowChunk]]:
    """Route the chunks of N old shards to ``partitioner.num_shards`` new ones.

    Args:
        chunks: every chunk of every old shard, in any order.
        partitioner: the new partitioning.
        chunk_rows: rows per output chunk, >= 1 (the last of a shard may be shorter).

    Returns:
        One list of chunks per new shard; every input row lands in exactly
        one of them, in input order.

    Raises:
        ConfigError: ``chunk_rows < 1``.
    """
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
    pending: list[list[RowChunk]] = [[] for _ in range(partitioner.num_shards)]
    pending_rows = [0] * partitioner.num_shards
    out: list[list[RowChunk]] = [[] for _ in range(partitioner.num_shards)]

    def flush(s: int, final: bool) -> None:
        while pending_rows[s] >= chunk_rows or (final and pending_rows[s]):
            merged = concat_chunks(pending[s])
            take = min(chunk_rows, len(merged))
            out[s].append(merged.take(np.arange(take)))
            rest = merged.take(np.arange(take, len(merged)))
            pending[s] = [rest] if len(rest) else []
            pending_rows[s] = len(rest)

    for chunk in chunks:
        for s, positions in enumerate(partitioner.split(chunk.ids)):
            if len(positions):
                pending[s].append(chunk.take(positions))
                pending_rows[s] += len(positions)
                flush(s, final=False)
    for s in range(partitioner.num_shards):
        flush(s, final=True)
    return out


def concat_chunks(chunks: Sequence[RowChunk]) -> RowChunk:
    """One chunk holding the rows of ``chunks`` in order (at least one chunk).

    Raises:
        SparseTableError: the chunks carry different state or counter keys.
    """
    if len(chunks) == 1:
        return chunks[0]
    keys = {tuple(sorted(c.state)) for c in chunks}
    if len(keys) != 1:
        raise SparseTableError(f"chunks carry different optimizer state: {sorted(keys)}")
    return RowChunk(
        np.concatenate([c.ids for c in chunks]),
        np.concatenate([c.rows for c in chunks]),
        {k: np.concatenate([c.state[k] for c in chunks]) for k in chunks[0].state},
        {k: np.concatenate([c.counters[k] for c in chunks]) for k in chunks[0].counters},
    )


# --- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EvictionPolicy:
    """Which rows :meth:`SparseTable.evict` removes (Monolith's expiry and frequency filter).

    Attributes:
        expire_versions: remove rows whose last update is at least this many
            versions old; 0 disables.
        min_count: remove rows updated fewer than this many times ...
        count_window_versions: ... once their first update is at least this
            many versions old (so a new row has a window to prove itself);
            >= 1 when ``min_count`` > 0.

    Versions are the table's (:attr:`SparseTable.version`, one per apply);
    a row's ``created_version`` and ``last_version`` are the versions its
    first and last updates produced.

    Raises:
        ConfigError: a negative value, or ``min_count`` without a window.
    """

    expire_versions: int = 0
    min_count: int = 0
    count_window_versions: int = 0

    def __post_init__(self) -> None:
        if min(self.expire_versions, self.min_count, self.count_window_versions) < 0:
            raise ConfigError("eviction versions and counts must be >= 0")
        if self.min_count > 0 and self.count_window_versions < 1:
            raise ConfigError("eviction by min_count needs count_window_versions >= 1")


def default_chunk_rows(dim: int) -> int:
    """Rows per storage chunk: about 4 MiB of float32 rows, a power of two in [256, 65536]."""
    rows = max(256, min(65536, (1 << 20) // dim))
    return 1 << (rows.bit_length() - 1)


class SparseTable:
    """One sparse embedding table (or one parameter server's part of it) with a lazy optimizer.

    Not thread-safe: the parameter server serialises calls, as it does for a
    :class:`~elasticps.pserver.shard.ParameterShard`.

    Args:
        spec: the table.
        rule: the lazy update rule; fixed for the table's life because the
            per-row state depends on it (see :meth:`set_rule`).
        chunk_rows: slots per storage chunk (default :func:`default_chunk_rows`).

    Raises:
        ConfigError: ``chunk_rows < 1``.
    """

    def __init__(
        self, spec: TableSpec, rule: SparseRule | None = None, *, chunk_rows: int | None = None
    ) -> None:
        self.spec = spec
        self.rule: SparseRule = rule if rule is not None else SparseSGD()
        self.chunk_rows = chunk_rows if chunk_rows is not None else default_chunk_rows(spec.dim)
        if self.chunk_rows < 1:
            raise ConfigError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        self.version = 0
        self._size = 0
        self._index = _new_index(spec)
        self._columns: dict[str, _Column] = {}
        self._make_columns()
        # Initial values a lookup computed for absent ids (ascending ids, their
        # rows): the first update of those ids takes them from here instead of
        # computing them again. Not state: the values are a function of the id.
        self._initial: tuple[IdArray, FloatArray] | None = None

    def _make_columns(self) -> None:
        c = self.chunk_rows
        self._columns = {
            "ids": _Column(np.int64, None, c),
            "rows": _Column(np.float32, self.spec.dim, c),
            **{f"optim.{k}": _Column(np.float32, self.spec.dim, c) for k in self.rule.state_keys},
            **{k: _Column(np.int64, None, c) for k in COUNTER_KEYS},
        }

    # -- introspection

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes of storage allocated (chunks and id index), not only the rows in use."""
        chunks = sum(ch.nbytes for col in self._columns.values() for ch in col.chunks)
        return chunks + self._index.nbytes

    def set_rule(self, rule: SparseRule) -> None:
        """Replace the update rule while the table holds no rows.

        Raises:
            SparseTableError: the table already holds rows (their state
                belongs to the old rule).
        """
        if self._size:
            raise SparseTableError(
                f"sparse table {self.spec.name}: cannot change the update rule of a table "
                f"that holds {self._size} rows"
            )
        self.rule = rule
        self._make_columns()

    def _check_ids(self, ids: object, what: str) -> IdArray:
        if isinstance(ids, Tensor):
            if ids.dtype not in (torch.int64, torch.int32):
                raise SparseTableError(f"sparse table {self.spec.name}: {what} must be int64")
            arr = ids.detach().to(torch.int64).cpu().numpy()
        else:
            arr = np.asarray(ids)
            if arr.dtype.kind not in "iu":
                raise SparseTableError(f"sparse table {self.spec.name}: {what} must be int64")
            arr = arr.astype(np.int64, copy=False)
        if arr.ndim != 1:
            raise SparseTableError(
                f"sparse table {self.spec.name}: {what} must be 1-d, got shape {list(arr.shape)}"
            )
        check_id_range(self.spec.name, arr, self.spec.num_embeddings)
        return np.ascontiguousarray(arr)

    def contains(self, ids: Tensor | IdArray) -> Tensor:
        """Whether each id has a row allocated: bool ``[k]``.

        Raises:
            SparseTableError: ids not int64 1-d, or out of a fixed table's range.
        """
        arr = self._check_ids(ids, "ids")
        return torch.from_numpy(self._index.find(arr) >= 0)

    def ids(self) -> Tensor:
        """The ids of the rows allocated, in slot order: int64 ``[len(self)]``."""
        parts = list(self._columns["ids"].views(self._size))
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def counters(self, ids: Tensor | IdArray) -> dict[str, Tensor]:
        """The per-row counters of ``ids`` (0 for absent rows): int64 ``[k]`` each.

        Raises:
            SparseTableError: ids not int64 1-d, or out of a fixed table's range.
        """
        arr = self._check_ids(ids, "ids")
        slots = self._index.find(arr)
        present = slots >= 0
        out = {}
        where = _Locator(slots[present], self.chunk_rows)
        for key in COUNTER_KEYS:
            values = np.zeros(len(arr), dtype=np.int64)
            if present.any():
                values[present] = self._columns[key].gather(where)
            out[key] = torch.from_numpy(values)
        return out

    # -- pull and push

    def lookup(self, ids: Tensor | IdArray) -> Tensor:
        """The rows of ``ids``; absent rows read as their initial value and are not allocated.

        Args:
            ids: int64 ``[k]``, any order, duplicates allowed.

        Returns:
            float32 ``[k, dim]``, a fresh tensor.

        Raises:
            SparseTableError: ids not int64 1-d, or out of a fixed table's range.
        """
        arr = self._check_ids(ids, "ids")
        out = np.empty((len(arr), self.spec.dim), dtype=np.float32)
        self.lookup_into(arr, out)
        return torch.from_numpy(out)

    def lookup_into(self, ids: IdArray, out: FloatArray) -> None:
        """:meth:`lookup` of checked ids, written into ``out``.

        Args:
            ids: int64 ``[k]``, 1-d, in a fixed table's range (as a parameter
                server checks a pull's ids on receipt); duplicates allowed.
            out: float32 ``[k, dim]``, C-contiguous.
        """
        if not len(ids):
            return
        slots = self._index.find(ids)
        present = slots >= 0
        if present.all():
            self._columns["rows"].gather(self._locate(slots), out=out)
            return
        if present.any():
            out[present] = self._columns["rows"].gather(self._locate(slots[present]))
        absent = ~present
        initial = initial_rows(self.spec, ids[absent])
        out[absent] = initial
        self._remember_initial(ids[absent], initial)

    def _locate(self, slots: IdArray) -> _Locator:
        """Where ``slots`` (allocated ones) live."""
        return _Locator(slots, self.chunk_rows, one_chunk=self._size <= self.chunk_rows)

    def _remember_initial(self, ids: IdArray, rows: FloatArray) -> None:
        """Keep the initial rows of ``ids`` (absent at a lookup) for their first update.

        At most :data:`_INITIAL_CACHE_FLOATS` floats are kept: past that, only
        the newest lookup's rows.
        """
        old = self._initial
        if old is not None and (len(old[0]) + len(ids)) * self.spec.dim <= _INITIAL_CACHE_FLOATS:
            ids = np.concatenate([old[0], ids])
            rows = np.concatenate([old[1], rows])
        elif len(ids) * self.spec.dim > _INITIAL_CACHE_FLOATS:
            return
        ids, first = np.unique(ids, return_index=True)  # ascending, once each
        self._initial = (ids, rows[first])

    def _initial_rows(self, ids: IdArray) -> FloatArray:
        """:func:`initial_rows` of ``ids``, taken from the lookups' cache where it has them."""
        cache = self._initial
        if cache is None or not len(cache[0]):
            return initial_rows(self.spec, ids)
        known, rows = cache
        pos = np.searchsorted(known, ids).clip(max=len(known) - 1)
        hit = known[pos] == ids
        if hit.all():
            hits: FloatArray = rows[pos]
            return hits
        out = np.empty((len(ids), self.spec.dim), dtype=np.float32)
        out[hit] = rows[pos[hit]]
        miss = ~hit
        out[miss] = initial_rows(self.spec, ids[miss])
        return out

    def apply(
        self, ids: Tensor | IdArray, grads: Tensor, lr: float, *, checked: bool = False
    ) -> None:
        """One optimizer step: update rows ``ids`` with ``grads``, and bump :attr:`version`.

        :func:`apply_tables` does the same for several tables at once.

        Rows absent so far are allocated at their initial value first. An
        empty push still bumps the version (a step in which no trainer used
        the table), which ages rows for eviction and advances Adam's
        ``"table"`` step count.

        Args:
            ids: int64 ``[k]``, unique.
            grads: float32 ``[k, dim]``: the gradient of each row.
            lr: learning rate of this step, > 0.
            checked: the caller has already checked that ``ids`` are a 1-d
                int64 array, unique and in range (a parameter server checks
                a push's ids as it receives them): only the shapes are checked
                again.

        Raises:
            SparseTableError: ids not int64 1-d or not unique, out of a fixed
                table's range, or grads of the wrong dtype or shape.
        """
        apply_tables([(self, ids, grads)], lr, checked=checked)

    def _check_push(
        self, ids: Tensor | IdArray, grads: Tensor | FloatArray, *, checked: bool
    ) -> IdArray:
        """The ids of a push as an int64 array, once the push is checked.

        Raises:
            SparseTableError: as :meth:`apply`.
        """
        if checked and isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1:
            arr = ids
        else:
            arr = self._check_ids(ids, "ids")
            checked = False
        if not (
            (isinstance(grads, Tensor) and grads.dtype == torch.float32)
            or (isinstance(grads, np.ndarray) and grads.dtype == np.float32)
        ):
            raise SparseTableError(f"sparse table {self.spec.name}: grads must be float32")
        if tuple(grads.shape) != (len(arr), self.spec.dim):
            raise SparseTableError(
                f"sparse table {self.spec.name}: grads must be [{len(arr)}, {self.spec.dim}], "
                f"got {list(grads.shape)}"
            )
        if not checked and len(arr) > 1 and len(np.unique(arr)) != len(arr):
            raise SparseTableError(f"sparse table {self.spec.name}: pushed ids are not unique")
        return arr

    def _stage(self, arr: IdArray, grads: Tensor | FloatArray) -> _Staged | None:
        """Bump :attr:`version`, allocate the absent rows of ``arr`` (checked by
        :meth:`_check_push`) and gather their values, state and counts (None: no rows)."""
        self.version += 1
        if not len(arr):
            return None
        slots = self._allocate(arr)
        where = self._locate(slots)
        cols = self._columns
        return _Staged(
            self,
            where,
            np.ascontiguousarray(cols["rows"].gather(where)),
            {
                k: np.ascontiguousarray(cols[f"optim.{k}"].gather(where))
                for k in self.rule.state_keys
            },
            cols["count"].gather(where) + 1,
            np.ascontiguousarray(grads)
            if isinstance(grads, np.ndarray)
            else grads.detach().cpu().contiguous().numpy(),
        )

    def _commit(self, staged: _Staged, rows: FloatArray, state: Mapping[str, FloatArray]) -> None:
        """Write back the rows and state a step computed for :meth:`_stage`'s rows."""
        where, cols = staged.where, self._columns
        cols["rows"].scatter(where, rows)
        for k, v in state.items():
            cols[f"optim.{k}"].scatter(where, v)
        cols["count"].scatter(where, staged.count)
        cols["last_version"].scatter(where, np.full(where.n, self.version, np.int64))

    def _allocate(self, ids: IdArray) -> IdArray:
        """Slots of ``ids`` (unique), allocating and initialising the absent ones."""
        slots = self._index.find(ids)
        new = slots < 0
        n_new = int(new.sum())
        if not n_new:
            return slots
        new_ids = ids[new]
        new_slots = np.arange(self._size, self._size + n_new, dtype=np.int64)
        for col in self._columns.values():
            col.reserve(self._size + n_new)
        where = _Locator(new_slots, self.chunk_rows)
        cols = self._columns
        cols["ids"].scatter(where, new_ids)
        cols["rows"].scatter(where, self._initial_rows(new_ids))
        for key in self.rule.state_keys:
            fill = (
                self.rule.initial_accumulator_value
                if isinstance(self.rule, SparseAdagrad) and key == "sum"
                else 0.0
            )
            cols[f"optim.{key}"].scatter(
                where, np.full((n_new, self.spec.dim), fill, dtype=np.float32)
            )
        cols["count"].scatter(where, np.zeros(n_new, np.int64))
        cols["created_version"].scatter(where, np.full(n_new, self.version, np.int64))
        cols["last_version"].scatter(where, np.full(n_new, self.version, np.int64))
        self._index.insert(new_ids, new_slots)
        self._size += n_new
        slots[new] = new_slots
        return slots

    # -- eviction

    def evict(self, policy: EvictionPolicy) -> Tensor:
        """Remove the rows ``policy`` selects at the current :attr:`version`.

        Rows left are compacted into the freed slots (at most one move per
        evicted row), trailing chunks are released, and the id index is
        rebuilt.

        Returns:
            The evicted ids: int64 ``[e]``.
        """
        if not self._size or (policy.expire_versions == 0 and policy.min_count == 0):
            return torch.zeros(0, dtype=torch.int64)
        cols = self._columns
        size = self._size
        drop = np.zeros(size, dtype=bool)
        last = np.concatenate(list(cols["last_version"].views(size)))
        if policy.expire_versions:
            drop |= self.version - last >= policy.expire_versions
        if policy.min_count:
            created = np.concatenate(list(cols["created_version"].views(size)))
            count = np.concatenate(list(cols["count"].views(size)))
            drop |= (self.version - created >= policy.count_window_versions) & (
                count < policy.min_count
            )
        all_ids = np.concatenate(list(cols["ids"].views(size)))
        evicted = all_ids[drop]
        if not len(evicted):
            return torch.zeros(0, dtype=torch.int64)
        keep = size - len(evicted)
        holes = np.flatnonzero(drop[:keep])  # freed slots below the new size
        movers = np.flatnonzero(~drop[keep:]) + keep  # surviving slots above it
        if len(holes):
            src, dst = _Locator(movers, self.chunk_rows), _Locator(holes, self.chunk_rows)
            for col in cols.values():
                col.scatter(dst, col.gather(src))
        for col in cols.values():
            col.truncate(keep)
        self._size = keep
        self._rebuild_index()
        return torch.from_numpy(evicted)

    def _rebuild_index(self) -> None:
        parts = list(self._columns["ids"].views(self._size))
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self._index = _new_index(self.spec, max(1024, int(len(ids) / _MAX_LOAD) + 1))
        self._index.insert(ids, np.arange(len(ids), dtype=np.int64))

    # -- checkpoints

    def meta(self) -> dict[str, Any]:
        """The table's JSON-ready metadata: format, spec, rule, version, rows, chunk rows."""
        return {
            "format": TABLE_FORMAT,
            "spec": self.spec.describe(),
            "rule": rule_to_json(self.rule),
            "version": self.version,
            "rows": self._size,
            "chunk_rows": self.chunk_rows,
            "state_keys": list(self.rule.state_keys),
        }

    def state_chunks(self) -> Iterator[RowChunk]:
        """The table's rows, optimizer state and counters, one :class:`RowChunk` per storage chunk.

        The chunks are views of the live storage: write or copy them before
        the next :meth:`apply` or :meth:`evict`.
        """
        cols = self._columns
        names = list(cols)
        for parts in zip(*(cols[n].views(self._size) for n in names), strict=True):
            by = dict(zip(names, parts, strict=True))
            yield RowChunk(
                by["ids"],
                by["rows"],
                {k: by[f"optim.{k}"] for k in self.rule.state_keys},
                {k: by[k] for k in COUNTER_KEYS},
            )

    def load_chunk(self, chunk: RowChunk) -> None:
        """Insert the rows of a chunk with their state and counters (on restore).

        Raises:
            SparseTableError: the chunk's shapes or state keys do not fit the
                table, its ids are out of range, or some are already present.
        """
        ids = self._check_ids(chunk.ids, "chunk ids")
        r = len(ids)
        if chunk.rows.shape != (r, self.spec.dim) or set(chunk.state) != set(self.rule.state_keys):
            raise SparseTableError(
                f"sparse table {self.spec.name}: chunk of {r} rows with state "
                f"{sorted(chunk.state)} does not fit rows [{r}, {self.spec.dim}] and state "
                f"{sorted(self.rule.state_keys)}"
            )
        for k in self.rule.state_keys:
            if chunk.state[k].shape != (r, self.spec.dim):
                raise SparseTableError(
                    f"sparse table {self.spec.name}: chunk state {k} has a wrong shape"
                )
        for k in COUNTER_KEYS:
            if k not in chunk.counters or chunk.counters[k].shape != (r,):
                raise SparseTableError(f"sparse table {self.spec.name}: chunk lacks counter {k}")
        if len(np.unique(ids)) != r or (self._index.find(ids) >= 0).any():
            raise SparseTableError(f"sparse table {self.spec.name}: chunk ids are duplicated")
        if not r:
            return
        slots = np.arange(self._size, self._size + r, dtype=np.int64)
        for col in self._columns.values():
            col.reserve(self._size + r)
        where = _Locator(slots, self.chunk_rows)
        cols = self._columns
        cols["ids"].scatter(where, ids)
        cols["rows"].scatter(where, np.asarray(chunk.rows, dtype=np.float32))
        for k in self.rule.state_keys:
            cols[f"optim.{k}"].scatter(where, np.asarray(chunk.state[k], dtype=np.float32))
        for k in COUNTER_KEYS:
            cols[k].scatter(where, np.asarray(chunk.counters[k], dtype=np.int64))
        self._index.insert(ids, slots)
        self._size += r

    @classmethod
    def from_state(
        cls, meta: Mapping[str, Any], chunks: Iterable[RowChunk], *, chunk_rows: int | None = None
    ) -> SparseTable:
        """Rebuild a table from :meth:`meta` and chunks (of this or of other shards).

        Args:
            meta: as :meth:`meta` returns it (validated: it comes from a file).
            chunks: the rows to load, e.g. :func:`select_shard` of every old
                shard's chunks.
            chunk_rows: storage chunk size of the new table (default: the
                saved one).

        Returns:
            The table, at the saved version.

        Raises:
            SparseTableError: the metadata is malformed or of another format,
                or a chunk does not fit (see :meth:`load_chunk`).
            ConfigError: the spec or rule in the metadata is invalid.
        """
        if meta.get("format") != TABLE_FORMAT:
            raise SparseTableError(
                f"sparse table metadata has format {meta.get('format')!r}, "
                f"expected {TABLE_FORMAT!r}"
            )
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise SparseTableError(f"sparse table metadata has an invalid version {version!r}")
        saved_rows = meta.get("chunk_rows")
        rows = chunk_rows if chunk_rows is not None else saved_rows
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise SparseTableError(f"sparse table metadata has an invalid chunk_rows {rows!r}")
        table = cls(
            TableSpec.from_json(meta.get("spec")), rule_from_json(meta.get("rule")), chunk_rows=rows
        )
        table.version = version
        for chunk in chunks:
            table.load_chunk(chunk)
        return table


def meta_json(table: SparseTable) -> str:
    """:meth:`SparseTable.meta` as compact, key-sorted JSON text."""
    return json.dumps(table.meta(), sort_keys=True, separators=(",", ":"))
