"""One parameter-server shard: parameters, optimizer state and update rules.

This module does no I/O: the tensor-plane server (:mod:`elasticps.pserver.server`)
receives gradients into buffers and calls into a :class:`ParameterShard`.
Unit tests drive it directly.

The shard keeps its parameters as one flat float32 tensor, laid out as the
:class:`~elasticps.placement.ShardLayout` says, and updates it with an
:class:`~elasticps.pserver.rules.UpdateRule`. The optimizers offered
(SGD, momentum, Adam, AdaGrad, element-wise ``torch.optim`` classes) are
element-wise, so one step over the flat tensor equals one step per parameter,
at the cost of a single kernel launch. For the same reason the optimizer
state is a few flat tensors of the shard's size (Adam's ``exp_avg``...) plus
scalars (Adam's ``step``), which :meth:`ParameterShard.state` exports for
checkpoints and :meth:`ParameterShard.load_state` restores bit for bit.

Sync barrier under churn: the trainers a sync step waits for are fixed when
its round opens (at the round's first push): the live trainers at that
moment. A trainer that leaves is dropped from the open round at once; one
that joins is waited for from the next round on (a push it makes in the open
round, on the current version, still counts).

Consistent snapshots: :meth:`ParameterShard.freeze` stops the shard between
two steps; pushes then wait (they are not refused) until
:meth:`ParameterShard.thaw`, so values and version stay put while a snapshot
of every shard is written.

Learning-rate schedules: before every step the shard sets each param
group's ``lr`` to :func:`elasticps.updater.lr_at` of its config at the
version the step starts from, so the schedule is a pure function of the
model version (restarts and resumes agree on it).

Exactly-once: a push may carry a :class:`~elasticps.pserver.coverage.PushKey`
(the records its gradient sums). The shard applies every key at most once and
keeps the keys it applied in a :class:`~elasticps.pserver.coverage.Coverage`
that belongs to its checkpointed state; a push whose key is held is a
duplicate: acknowledged, not applied. In sync mode a duplicate joins its step
like an empty push. Sealing a pass (:meth:`ParameterShard.seal`) drops the
pass's keys once the master has checked that every shard holds all of them.

Torn reads: the parameters are written in place by a step, and replies send
them from the shard's memory without a copy. A step therefore takes the
write side of a reader-writer lock and every reply the read side
(:meth:`ParameterShard.reading`), so no reply carries half a step.

Sync generations: in sync mode the shards of a job share a generation, set
by the master when it realigns them (:meth:`ParameterShard.set_generation`,
after rolling every shard back to one checkpointed version). A push of
another generation is stale.

Sparse tables: a layout may declare sparse embedding tables
(:mod:`elasticps.pserver.sparse_shard`); the shard then holds its rows of
each (:attr:`ParameterShard.tables`). A push may carry row gradients with its
dense gradient: both are one push under one push key (applied together, or
found duplicate together), summed in a sync round with the same weights, and
applied in one step. Row lookups read under the same read lock as replies.

Frozen parameters: parameters whose names match the shard's ``frozen`` glob
patterns are pulled like any other but never change. A push whose gradient
is non-zero anywhere in a frozen range is refused with
:class:`~elasticps.errors.FrozenParameterError` before it touches any state
(nothing is applied, the sync round does not count it). Zero gradients are
accepted, but optimizers with state or weight decay (momentum, Adam) may
still move a value whose gradient is zero, so the frozen ranges are copied
before each step and written back after it: frozen values stay bit-identical.

Buffers: a layout may name some pieces as the model's buffers (BatchNorm
statistics; ``layout["buffers"]``, see :mod:`elasticps.buffers`). A push
carries them where a gradient would be; a step keeps them away from the
optimizer and writes them (async: each push's floating-point values replace
the shard's and its integer increments are added; sync: the round's
sample-weighted mean increment is added, or the largest for integers,
:class:`~elasticps.buffers.BufferRound`).
Frozen patterns never match buffers.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from elasticps.buffers import BufferLayout, BufferRound
from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import (
    ConfigError,
    ElasticPSError,
    FrozenParameterError,
    LayoutMismatchError,
    SparseTableError,
)
from elasticps.pserver.coverage import Coverage, KeyStatus, PushKey
from elasticps.pserver.rules import StateValue, make_update_rule
from elasticps.pserver.sparse import EvictionPolicy, sparse_rule_from_config
from elasticps.pserver.sparse_shard import RowGrads, ShardTables, TablesState, parse_tables
from elasticps.updater import schedule_from_json
from elasticps.wire.frame import PushStatus

VALUES_KEY = "values"
"""Name of the parameter tensor in :meth:`ParameterShard.state`."""

COVERAGE_KEY = "coverage"
"""Name of the coverage tensor (int64 ``[n, 4]``) in :meth:`ParameterShard.state`."""

SPARSE_STATE_KEY = "sparse_state"
"""Key of the sparse tables' copy (a :class:`~elasticps.pserver.sparse_shard.TablesState`)
in the ``meta`` of :meth:`ParameterShard.state`. It lives in memory only: checkpoint
writers take it out and store the tables as row-chunked part files."""

OPTIM_PREFIX = "optim."
"""Prefix of the element-wise optimizer-state tensors in :meth:`ParameterShard.state`
(``optim.exp_avg``, ``optim.exp_avg_sq``, ``optim.momentum_buffer``, ``optim.sum``)."""


def frozen_pieces(
    layout: Mapping[str, object], patterns: Sequence[str]
) -> tuple[tuple[str, int, int], ...]:
    """The element ranges of a shard that hold frozen parameters.

    Pure. The shard buffer is the concatenation of the layout's pieces in
    order (see :mod:`elasticps.placement`), so a piece's offset is the sum of
    the sizes before it.

    Args:
        layout: ``ShardLayout.describe()``: ``pieces`` is a list of
            ``[name, param_start, param_end]``.
        patterns: ``fnmatch`` glob patterns over parameter names (``"D.*"``).

    Returns:
        ``(name, start, end)`` element ranges of the shard buffer, in order,
        one per frozen piece (adjacent pieces are not merged, so that errors
        can name the parameter). Buffers (``layout["buffers"]``) are never
        frozen.

    Raises:
        LayoutMismatchError: the layout's pieces are malformed or do not add
            up to its ``numel`` (it arrives over the network).
    """
    pieces = layout.get("pieces")
    numel = layout.get("numel")
    if not isinstance(pieces, list):
        raise LayoutMismatchError("layout has no 'pieces' list; cannot locate frozen parameters")
    buffers = layout.get("buffers")
    skip = set(buffers) if isinstance(buffers, Mapping) else set()
    out: list[tuple[str, int, int]] = []
    offset = 0
    for piece in pieces:
        if (
            not isinstance(piece, list)
            or len(piece) != 3
            or not isinstance(piece[0], str)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in piece[1:])
            or not 0 <= piece[1] <= piece[2]
        ):
            raise LayoutMismatchError(f"layout piece {piece!r:.80} is not [name, start, end]")
        name, lo, hi = piece[0], piece[1], piece[2]
        size = hi - lo
        if size and name not in skip and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            out.append((name, offset, offset + size))
        offset += size
    if offset != numel:
        raise LayoutMismatchError(f"layout pieces add up to {offset} elements, numel is {numel}")
    return tuple(out)


class ShardClosedError(ElasticPSError):
    """The shard is shutting down; a waiting push was released without an update."""


class FreezeTimeoutError(ElasticPSError):
    """The shard did not reach the version a freeze waited for in time."""


class MisalignedPushError(ElasticPSError):
    """A push key overlaps records the shard holds without being one of its pushes.

    Push boundaries of one job are aligned (see :mod:`elasticps.pserver.coverage`),
    so this means trainers with different ``batch_size`` or ``push_every``;
    nothing was applied.
    """


class _RWLock:
    """A writer-preferring reader-writer lock (readers: replies; writer: a step)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass(frozen=True)
class PushResult:
    """Outcome of one push.

    Attributes:
        accepted: the gradient counted towards an update; False if it was
            empty, stale (computed on another model version) or a duplicate.
        version: the shard's model version after the push was handled (in
            sync mode, after the step it joined was applied).
        status: APPLIED (also for empty pushes), DUPLICATE (its key was held:
            acknowledged, not applied) or STALE (not applied: compute again).
        waited_s: in sync-SGD, how long the push waited at the step's barrier
            for the other trainers' pushes, seconds (0.0 in async-SGD).
    """

    accepted: bool
    version: int
    status: PushStatus = PushStatus.APPLIED
    waited_s: float = field(default=0.0, compare=False)

    @property
    def acknowledged(self) -> bool:
        """Whether the push's records are now held by the shard (APPLIED or DUPLICATE)."""
        return self.status is not PushStatus.STALE


@dataclass(frozen=True)
class ShardStats:
    """Counters of a shard, for logs and the ``stats`` control command."""

    version: int
    pushes: int
    stale_pushes: int
    steps: int
    live_trainers: int
    frozen: bool = False
    # Trainers that have pushed into the sync step not yet applied.
    open_round: int = 0
    duplicate_pushes: int = 0
    generation: int = 0
    serving: bool = True
    sealed_through: int = -1


class ParameterShard:
    """Parameters and optimizer state of one shard, and the sync/async update rules.

    Thread-safe: the tensor-plane server calls it from one thread per
    connection. Every update is applied under one lock, so a reader holding
    it (:meth:`state`, :meth:`freeze`) never sees half a step.

    Args:
        layout: the shard layout as described by the first trainer's HELLO
            (``ShardLayout.describe()``), kept for checkpoints and checks.
        fingerprint: SHA-256 of the layout; later HELLOs must match it.
        optimizer: optimizer configuration (with its lr schedule).
        mode: sync-SGD or async-SGD.
        frozen: ``fnmatch`` glob patterns over parameter names; matching
            parameters never change (see the module docstring).
        max_staleness: async only: default bound for :meth:`push` (drop
            gradients more than this many versions behind); None accepts any.
        reduction: sync only: ``"mean"`` applies the trainers' gradients
            averaged by samples, ``"sum"`` their sum.
        eviction: which rows of sparse tables to evict (checked every
            ``max(1, window // 8)`` steps), or None.

    Raises:
        LayoutMismatchError: the layout is malformed, or declares sparse
            tables the optimizer cannot train.
        ConfigError: the optimizer config does not build.
    """

    def __init__(
        self,
        layout: dict[str, object],
        fingerprint: str,
        optimizer: OptimizerConfig,
        mode: UpdateMode,
        *,
        frozen: Sequence[str] = (),
        max_staleness: int | None = None,
        reduction: str = "mean",
        eviction: EvictionPolicy | None = None,
    ) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be mean or sum, got {reduction!r}")
        self.reduction = reduction
        numel = layout.get("numel")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise LayoutMismatchError(f"layout has an invalid numel: {numel!r}")
        self.layout = layout
        self.fingerprint = fingerprint
        self.numel = numel
        self.mode = mode
        self.optimizer_config = optimizer
        self.frozen_patterns = tuple(frozen)
        self.max_staleness = max_staleness
        self._frozen_pieces = frozen_pieces(layout, self.frozen_patterns) if frozen else ()
        self._buffers = BufferLayout.from_layout(layout)
        self._buffer_round = BufferRound(self._buffers) if self._buffers is not None else None
        self._schedule = schedule_from_json(optimizer.schedule)
        self._values = torch.zeros(numel, dtype=torch.float32)
        self._rule = make_update_rule(self._values, optimizer)
        self.eviction = eviction
        self.tables: ShardTables | None = _make_tables(
            layout, optimizer, self.frozen_patterns, eviction
        )
        self._acc = torch.zeros(numel, dtype=torch.float32)
        self._acc_samples = 0
        self._cond = threading.Condition()
        # Steps write the values under the write side; replies read under the read side.
        self._values_lock = _RWLock()
        self._version = 0
        self._round = 0
        self._contributors: set[int] = set()
        # Who the open round waits for; fixed when it opens (see set_live_trainers).
        self._expected: set[int] = set()
        self._live: set[int] = set()
        # etcd's last membership, and the trainers it dropped since (ids are not
        # reused): a push of a departed trainer, sent before it died and taken
        # after etcd said so, must not make it a live trainer again.
        self._members: set[int] = set()
        self._departed: set[int] = set()
        self._closed = False
        self._frozen = False
        self._serving = True
        self._generation = 0
        # A pending freeze: at this version, or once this round number is reached.
        self._freeze_at: int | None = None
        self._freeze_at_round: int | None = None
        self._pushes = 0
        self._stale = 0
        self._duplicates = 0
        self._steps = 0
        self._coverage = Coverage()
        # Initialized from a trainer's values (INIT_VALUES), not from a checkpoint,
        # and not sealed since: the values may hold records the coverage does not
        # name, so sealed passes cannot be trained again onto it (see ``opaque``).
        self._opaque = False
        # Keys joined to the open sync round (applied with it), and whether a
        # gradient (applied or duplicate) joined it: such a round moves the version.
        self._round_keys: list[PushKey] = []
        self._round_cov = Coverage()
        self._round_has_gradient = False
        # Rounds dropped unapplied (discard_round): their pushes are answered STALE.
        self._discarded: set[int] = set()

    # --- state -------------------------------------------------------------

    @property
    def values(self) -> torch.Tensor:
        """The parameters: float32 ``[numel]``. Written in place by updates.

        Read them under :meth:`reading` to see whole steps only.
        """
        return self._values

    @contextlib.contextmanager
    def reading(self) -> Iterator[int]:
        """Hold off steps while the caller reads :attr:`values`; yields the version read.

        Replies send the parameters from the shard's own memory while other
        trainers' pushes arrive; without this a reply could carry half a step.
        """
        with self._values_lock.read():
            yield self._version

    @property
    def frozen_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(name, start, end)`` element ranges of frozen parameters in :attr:`values`."""
        return self._frozen_pieces

    @property
    def version(self) -> int:
        """Model version: the number of updates applied so far."""
        with self._cond:
            return self._version

    @property
    def generation(self) -> int:
        """The sync generation this shard serves (0 until the master sets one)."""
        with self._cond:
            return self._generation

    @property
    def frozen(self) -> bool:
        """True between :meth:`freeze` and :meth:`thaw`."""
        with self._cond:
            return self._frozen

    @property
    def serving(self) -> bool:
        """False while the shard waits to be realigned (pushes and pulls wait)."""
        with self._cond:
            return self._serving

    def stats(self) -> ShardStats:
        """A snapshot of the shard's counters."""
        with self._cond:
            return ShardStats(
                self._version,
                self._pushes,
                self._stale,
                self._steps,
                len(self._live),
                self._frozen,
                len(self._contributors),
                self._duplicates,
                self._generation,
                self._serving,
                self._coverage.sealed_through,
            )

    def check_fingerprint(self, fingerprint: str) -> None:
        """Raise LayoutMismatchError if a trainer's layout differs from the shard's."""
        if fingerprint != self.fingerprint:
            raise LayoutMismatchError(
                "the trainer's parameter layout differs from the one this parameter server "
                "holds (different model, --ps count or --big-array-bound?)"
            )

    # --- coverage --------------------------------------------------------------

    def coverage_of(self, pass_id: int) -> tuple[bool, list[tuple[int, int, int]]]:
        """The records this shard holds in one pass.

        Returns:
            ``(sealed, intervals)``: whether the pass is sealed (every record
            held, intervals empty), else the held ``(task, lo, hi)`` intervals,
            sorted.
        """
        with self._cond:
            cov = self._coverage
            if pass_id <= cov.sealed_through:
                return True, []
            out = [
                (task, lo, hi)
                for task in sorted(cov.tasks(pass_id))
                for lo, hi in cov.intervals(pass_id, task)
            ]
            return False, out

    @property
    def opaque(self) -> bool:
        """Whether the values came from a trainer (INIT_VALUES) since the last seal.

        Such values may already hold gradients of records that the coverage
        does not name (the trainer had pulled them from a predecessor), so
        the master does not train sealed passes again onto this shard: what
        it lacks of them is reported lost. A seal clears it; checkpoints keep it.
        """
        with self._cond:
            return self._opaque

    def mark_opaque(self) -> None:
        """Record that the values were just set from a trainer's (see :attr:`opaque`)."""
        with self._cond:
            self._opaque = True

    def seal(self, pass_id: int) -> None:
        """Drop the keys of every pass up to ``pass_id``: all their pushes are duplicates now.

        The master calls it once every shard holds every record of the pass.
        Idempotent.
        """
        with self._cond:
            self._coverage.seal(pass_id)
            self._round_cov.seal(pass_id)
            self._opaque = False

    def relabel_version(self, version: int) -> None:
        """Set the version number without changing the parameters (a shard that lost
        its state is brought to the count of the others; the loss is reported)."""
        with self._cond, self._values_lock.write():
            self._version = version

    def set_generation(self, generation: int) -> None:
        """Set the sync generation (the master's realignment); pushes of others are stale."""
        with self._cond:
            self._generation = generation

    def set_serving(self, serving: bool) -> None:
        """Hold (False) or release (True) every push and pull; see :meth:`wait_serving`."""
        with self._cond:
            self._serving = serving
            if serving:
                self._maybe_complete_round()
            self._cond.notify_all()

    def wait_serving(self, timeout_s: float | None = None) -> bool:
        """Block while the shard is not serving; return whether it serves now.

        Raises:
            ShardClosedError: the shard closed while waiting.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: self._serving or self._closed, timeout_s)
            if self._closed:
                raise ShardClosedError("parameter server is shutting down")
            return ok

    def discard_round(self) -> int:
        """Drop the open sync round unapplied; its pushes are answered STALE.

        Used when the master realigns the shards (rollback): a gradient that
        joined the round was computed on a model that no longer exists.

        Returns:
            How many pushes were waiting in the round.
        """
        with self._cond:
            waiting = len(self._contributors)
            if waiting:
                self._discarded.add(self._round)
                self._reset_round()
                self._round += 1
                self._cond.notify_all()
            return waiting

    # --- checkpoint state ----------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """Copy the shard's values, optimizer state and version, as of one instant.

        The copy is taken under the shard's lock (between two steps) and owns
        its memory, so the caller may write it out while training goes on.

        Returns:
            ``(tensors, meta)``. ``tensors`` maps :data:`VALUES_KEY` to the
            values and ``optim.<key>`` to each element-wise optimizer-state
            tensor (Adam ``exp_avg``/``exp_avg_sq``, momentum
            ``momentum_buffer``, AdaGrad ``sum``), all float32 ``[numel]``,
            and :data:`COVERAGE_KEY` to the applied push keys, int64
            ``[n, 4]`` (see :meth:`Coverage.to_tensor`).
            ``meta`` is JSON-ready: ``layout``, ``fingerprint``, ``version``,
            ``mode``, ``optimizer`` (the config), ``optimizer_scalars``
            (``{key: {"value": number, "dtype": "float32" | None}}``, e.g.
            Adam's ``step``; dtype None for a plain Python number) and
            ``sealed_through`` (the last sealed pass, -1 if none) and
            ``opaque`` (see :attr:`opaque`). With
            sparse tables, ``sparse_tables`` (rows held per table) and, in
            memory only, :data:`SPARSE_STATE_KEY`: a copy of every table.

        Raises:
            ValueError: the optimizer holds state of another shape (not one
                of the optimizers this module builds).
        """
        with self._cond:
            tensors: dict[str, torch.Tensor] = {
                VALUES_KEY: self._values.clone(),
                COVERAGE_KEY: self._coverage.to_tensor(),
            }
            scalars: dict[str, object] = {}
            for key, value in self._rule.state().items():
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    scalars[key] = {"value": value.item(), "dtype": _dtype_name(value.dtype)}
                elif isinstance(value, torch.Tensor) and tuple(value.shape) == (self.numel,):
                    tensors[OPTIM_PREFIX + key] = value.detach().to(torch.float32).clone()
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    scalars[key] = {"value": value, "dtype": None}
                else:
                    raise ValueError(f"cannot checkpoint optimizer state {key!r}: {value!r:.80}")
            meta: dict[str, object] = {
                "layout": self.layout,
                "fingerprint": self.fingerprint,
                "version": self._version,
                "mode": self.mode.value,
                "optimizer": asdict(self.optimizer_config),
                "optimizer_scalars": scalars,
                "sealed_through": self._coverage.sealed_through,
                "opaque": self._opaque,
            }
            if self.tables is not None:
                # A copy taken between two steps, with the dense values.
                with self._values_lock.read():
                    tables = self.tables.state()
                meta["sparse_tables"] = tables.rows()
                meta[SPARSE_STATE_KEY] = tables
        return tensors, meta

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> bool:
        """Restore values, optimizer state and version from :meth:`state`'s output.

        Only the values, the optimizer state, the coverage and the version
        are read; the layout is this shard's own. The optimizer's
        hyper-parameters (such as ``lr``) stay those of this shard's config,
        so a restart may change them. The open sync round, if any, is dropped
        (its pushes are answered STALE). A state without coverage (an older
        checkpoint, or a consistent checkpoint to resume from) restores an
        empty coverage: no push key applied yet.

        Sparse tables are restored from ``meta[SPARSE_STATE_KEY]`` (rows of
        other servers dropped); without it they restart empty (every row at
        its initial value).

        Args:
            tensors: as returned by :meth:`state`; values float32 ``[numel]``.
            meta: needs ``version``; ``optimizer`` and ``optimizer_scalars``
                for the optimizer state; ``sealed_through`` with coverage.

        Returns:
            True if the optimizer state was restored too; False if it was
            saved for another optimizer (``meta["optimizer"]["name"]`` or
            ``["torch_class"]`` differs), in which case the optimizer starts fresh.

        Raises:
            LayoutMismatchError: a tensor does not have ``numel`` elements.
            ValueError: ``version``, the optimizer scalars or the optimizer
                state's keys are malformed; nothing was changed.
        """
        values = tensors.get(VALUES_KEY)
        if values is None or values.numel() != self.numel:
            got = None if values is None else values.numel()
            raise LayoutMismatchError(f"saved values have {got} elements, shard has {self.numel}")
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"saved version must be a non-negative integer, got {version!r}")
        sealed = meta.get("sealed_through", -1)
        if not isinstance(sealed, int) or isinstance(sealed, bool):
            raise ValueError(f"saved sealed_through must be an integer, got {sealed!r}")
        opaque = meta.get("opaque", False)
        if not isinstance(opaque, bool):
            raise ValueError(f"saved opaque must be true or false, got {opaque!r}")
        rows = tensors.get(COVERAGE_KEY)
        coverage = (
            Coverage.from_tensor(rows, sealed)
            if rows is not None
            else Coverage.from_tensor(torch.zeros((0, 4), dtype=torch.int64), sealed)
        )
        saved_opt = meta.get("optimizer")
        same_optimizer = (
            isinstance(saved_opt, Mapping)
            and saved_opt.get("name") == self.optimizer_config.name
            and saved_opt.get("torch_class", "") == self.optimizer_config.torch_class
        )
        restored: dict[str, StateValue] = {}
        if same_optimizer:
            for name, tensor in tensors.items():
                if not name.startswith(OPTIM_PREFIX):
                    continue
                if tensor.numel() != self.numel:
                    raise LayoutMismatchError(
                        f"saved optimizer state {name!r} has {tensor.numel()} elements, "
                        f"shard has {self.numel}"
                    )
                restored[name.removeprefix(OPTIM_PREFIX)] = (
                    tensor.detach().reshape(-1).to(torch.float32).clone()
                )
            scalars = meta.get("optimizer_scalars", {})
            if not isinstance(scalars, Mapping):
                raise ValueError("saved optimizer_scalars must be an object")
            for key, entry in scalars.items():
                restored[str(key)] = _scalar_from_json(str(key), entry)
        tables = None
        if self.tables is not None:
            saved = meta.get(SPARSE_STATE_KEY)
            try:
                tables = self.tables.check_state(
                    saved if isinstance(saved, TablesState) else TablesState({}, {})
                )
            except (SparseTableError, ConfigError) as exc:
                raise ValueError(f"saved sparse tables do not fit: {exc}") from exc
        with self._cond, self._values_lock.write():
            if self.tables is not None and tables is not None:
                self.tables.install(tables)
            self._rule.load_state(restored)
            self._values.copy_(values.detach().reshape(-1))
            self._version = version
            self._coverage = coverage
            self._opaque = opaque
            if self._contributors:
                self._discarded.add(self._round)
                self._round += 1
            self._reset_round()
            self._cond.notify_all()
        return same_optimizer

    @classmethod
    def from_state(
        cls,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, object],
        *,
        optimizer: OptimizerConfig,
        mode: UpdateMode,
        frozen: Sequence[str] = (),
        max_staleness: int | None = None,
        reduction: str = "mean",
        eviction: EvictionPolicy | None = None,
    ) -> ParameterShard:
        """A shard rebuilt from :meth:`state`'s output, layout and fingerprint included.

        Args:
            tensors: as returned by :meth:`state`.
            meta: as returned by :meth:`state`; needs ``layout`` (an object)
                and ``fingerprint`` (a string).
            optimizer: the optimizer to run from now on (see :meth:`load_state`).
            mode: the update mode to run from now on.
            frozen: frozen-parameter patterns to run with from now on.
            max_staleness: async staleness bound from now on.
            reduction: sync reduction from now on.
            eviction: sparse-row eviction from now on.

        Raises:
            LayoutMismatchError: the layout or a tensor size is invalid.
            ValueError: the metadata is malformed.
        """
        layout = meta.get("layout")
        fingerprint = meta.get("fingerprint")
        if not isinstance(layout, dict) or not isinstance(fingerprint, str):
            raise ValueError("saved shard state needs a 'layout' object and a 'fingerprint'")
        shard = cls(
            layout,
            fingerprint,
            optimizer,
            mode,
            frozen=frozen,
            max_staleness=max_staleness,
            reduction=reduction,
            eviction=eviction,
        )
        shard.load_state(tensors, meta)
        return shard

    # --- membership (sync barrier) ------------------------------------------

    def set_live_trainers(self, trainer_ids: set[int]) -> None:
        """Set the trainers alive in etcd, whom sync rounds wait for.

        A trainer that left no longer holds up the open round; one that
        joined is waited for from the next round on. A push of a trainer that
        left (and has not come back) is stale: it would make a dead trainer
        one that every later round waits for.
        """
        with self._cond:
            self._departed |= self._members - trainer_ids
            self._departed -= trainer_ids
            self._members = set(trainer_ids)
            self._live = set(trainer_ids)
            self._expected &= self._live
            self._maybe_complete_round()

    def close(self) -> None:
        """Release every waiting push (and freeze) with :class:`ShardClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- consistent snapshots ----------------------------------------------------

    def freeze(
        self,
        *,
        at_version: int | None = None,
        finish_round: bool = False,
        timeout_s: float | None = None,
    ) -> int:
        """Stop applying updates; pushes wait (they are not refused) until :meth:`thaw`.

        Steps are applied under the shard's lock, so once this returns no step
        is half applied, and values and version stay as they are until
        :meth:`thaw`. A sync round that would complete meanwhile (a trainer
        left) completes after the thaw. Idempotent.

        Args:
            at_version: freeze right after the step that brings the shard to
                this version, letting updates go on until then (a frozen
                shard is thawed for that); used to bring every shard of a
                sync job to the same version. A shard already at or past it
                freezes at once.
            finish_round: sync mode: freeze right after the open round
                completes, whether it applies a step or closes without one
                (when only empty pushes joined it); at once if no round is
                open. This is how a snapshot lets a shard caught mid-step
                finish it (see :func:`elasticps.snapshot.shards_mid_step`).
            timeout_s: how long to wait for ``at_version`` or the round; None
                waits forever.

        Returns:
            The version the shard is frozen at.

        Raises:
            FreezeTimeoutError: ``at_version`` or the end of the round was not
                reached in time; the shard is then left thawed.
            ShardClosedError: the shard closed while waiting.
        """
        with self._cond:
            round_open = finish_round and bool(self._contributors)
            if not round_open and (at_version is None or self._version >= at_version):
                self._frozen = True
                self._freeze_at = self._freeze_at_round = None
                return self._version
            if round_open:
                self._freeze_at_round = self._round + 1
            else:
                self._freeze_at = at_version
            if self._frozen:
                self._frozen = False
                self._maybe_complete_round()
                self._cond.notify_all()
            reached = self._cond.wait_for(lambda: self._frozen or self._closed, timeout_s)
            if self._closed and not self._frozen:
                raise ShardClosedError("parameter server is shutting down")
            if not reached:
                self._freeze_at = self._freeze_at_round = None
                goal = "the end of its open round" if round_open else f"version {at_version}"
                raise FreezeTimeoutError(
                    f"shard did not reach {goal} within {timeout_s:g} s "
                    f"(it is at version {self._version})"
                )
            return self._version

    def thaw(self) -> None:
        """Let waiting and new pushes through again. Idempotent."""
        with self._cond:
            self._frozen = False
            self._freeze_at = self._freeze_at_round = None
            self._maybe_complete_round()
            self._cond.notify_all()

    def _wait_while_frozen(self) -> None:
        # Caller holds self._cond.
        while (self._frozen or not self._serving) and not self._closed:
            self._cond.wait()
        if self._closed:
            raise ShardClosedError("parameter server is shutting down")

    def _after_step(self) -> None:
        # Caller holds self._cond, right after the version moved or a round closed.
        if (self._freeze_at is not None and self._version >= self._freeze_at) or (
            self._freeze_at_round is not None and self._round >= self._freeze_at_round
        ):
            self._frozen = True
            self._freeze_at = self._freeze_at_round = None
        self._cond.notify_all()

    # --- updates -------------------------------------------------------------

    def push(
        self,
        trainer_id: int,
        grad: torch.Tensor | None,
        model_version: int,
        num_samples: int,
        *,
        max_staleness: int | None = None,
        key: PushKey | None = None,
        generation: int | None = None,
        rows: RowGrads | None = None,
    ) -> PushResult:
        """Apply, or join the sync step with, one gradient.

        Args:
            trainer_id: the pushing trainer.
            grad: float32 ``[numel]``, the mean gradient over ``num_samples``
                samples; ``None`` for an empty push, by which an idle trainer
                takes part in a sync step without a gradient.
            model_version: the shard version the gradient was computed on.
            num_samples: samples behind the gradient; weights it in sync mode.
            max_staleness: async only: drop gradients more than this many
                versions behind; ``None`` uses the shard's ``max_staleness``.
            key: the records the gradient sums; a key the shard holds
                already makes the push a duplicate (acknowledged, not
                applied). None: applied every time.
            generation: sync only: the generation the gradient was computed
                in; another than the shard's makes the push stale. None: not
                checked.
            rows: row gradients of the shard's sparse tables, checked by
                :meth:`ShardTables.split_rows
                <elasticps.pserver.sparse_shard.ShardTables.split_rows>`;
                part of the same push (same key, same weight). Needs a
                gradient (not an empty push).

        Returns:
            What became of the push, and the version after it.

        Raises:
            ShardClosedError: the shard is closed, or closed while the push waited.
            FrozenParameterError: the gradient is non-zero for a frozen
                parameter; nothing was applied.
            LayoutMismatchError: the gradient has the wrong size.
            MisalignedPushError: the key overlaps held records partly;
                nothing was applied.
        """
        if grad is not None and grad.numel() != self.numel:
            raise LayoutMismatchError(
                f"gradient has {grad.numel()} elements, shard has {self.numel}"
            )
        if grad is not None and self._frozen_pieces:
            self._check_frozen(grad)
        if rows is not None and (self.tables is None or grad is None):
            raise SparseTableError(
                "a push carries sparse rows, but "
                + ("this shard holds no sparse tables" if grad is not None else "no gradient")
            )
        if max_staleness is None:
            max_staleness = self.max_staleness
        if self.mode is UpdateMode.ASYNC:
            return self._push_async(grad, model_version, max_staleness, key, rows)
        return self._push_sync(trainer_id, grad, model_version, num_samples, key, generation, rows)

    def _check_frozen(self, grad: torch.Tensor) -> None:
        touched = sorted({name for name, lo, hi in self._frozen_pieces if grad[lo:hi].any()})
        if touched:
            shown = ", ".join(touched[:5]) + (
                f" and {len(touched) - 5} more" if len(touched) > 5 else ""
            )
            raise FrozenParameterError(
                f"push refused: non-zero gradient for frozen parameter(s) {shown} (patterns "
                f"{', '.join(self.frozen_patterns)}); nothing was applied. Zero their "
                "gradients on the trainer (pass the same frozen patterns to it)."
            )

    def _key_status(self, key: PushKey) -> KeyStatus:
        """New, held (applied, or joined to the open round) or partly held. Caller holds _cond."""
        status = self._coverage.status(key)
        if status is KeyStatus.NEW:
            status = self._round_cov.status(key)
        if status is KeyStatus.PARTIAL:
            raise MisalignedPushError(
                f"push for records [{key.lo}, {key.hi}) of task {key.task_id} (pass "
                f"{key.pass_id}) overlaps records this shard holds, without matching "
                "their pushes; trainers of one job must use the same --batch-size and "
                "--push-every. Nothing was applied."
            )
        return status

    def _step(
        self,
        grad: torch.Tensor,
        rows: RowGrads | None = None,
        buffer_increments: list[torch.Tensor] | None = None,
        *,
        round_rows: bool = False,
    ) -> None:
        """One optimizer step with ``grad``, at the scheduled lr; frozen values kept.

        With sparse tables, every table takes the same step: with ``rows``
        (async), or with the sync round's rows (``round_rows``, divided as
        the dense accumulator was).

        Buffers (if the layout has any) get ``buffer_increments`` added (a sync
        round's), or, if None, what ``grad`` carries in their place (an async
        push's: floats' values, integers' increments); the optimizer sees
        zeros there. ``grad`` is left as it was.

        Caller holds self._cond; the version is bumped by the caller afterwards.
        """
        lr = self.optimizer_config.lr * self._schedule.factor(self._version)
        values = self._values
        kept = [values[lo:hi].clone() for _, lo, hi in self._frozen_pieces]
        buffers = self._buffers
        if buffers is not None:
            carried = buffers.take(grad)
            increments = carried if buffer_increments is None else buffer_increments
            before = buffers.take(values)
            buffers.zero(grad)
        with self._values_lock.write():
            try:
                self._rule.step(grad, lr)
            finally:
                for (_, lo, hi), old in zip(self._frozen_pieces, kept, strict=True):
                    values[lo:hi].copy_(old)
                if buffers is not None:
                    buffers.apply(
                        values, before, increments, float_values=buffer_increments is None
                    )
                    buffers.put(grad, carried)
            if self.tables is not None:
                if round_rows:
                    divisor = float(self._acc_samples) if self.reduction == "mean" else 1.0
                    self.tables.apply_round(lr, max(divisor, 1.0))
                else:
                    self.tables.apply(rows, lr)
            self._version += 1
            self._steps += 1

    def _push_async(
        self,
        grad: torch.Tensor | None,
        model_version: int,
        max_staleness: int | None,
        key: PushKey | None,
        rows: RowGrads | None = None,
    ) -> PushResult:
        with self._cond:
            self._wait_while_frozen()
            self._pushes += 1
            if grad is None:
                # An empty push with a key: hold its records (skipped: no gradient).
                if key is not None:
                    if self._key_status(key) is KeyStatus.HELD:
                        self._duplicates += 1
                        return PushResult(False, self._version, PushStatus.DUPLICATE)
                    self._coverage.add(key)
                return PushResult(False, self._version)
            if max_staleness is not None and self._version - model_version > max_staleness:
                self._stale += 1
                return PushResult(False, self._version, PushStatus.STALE)
            if key is not None:
                if self._key_status(key) is KeyStatus.HELD:
                    self._duplicates += 1
                    return PushResult(False, self._version, PushStatus.DUPLICATE)
                self._step(grad, rows)
                self._coverage.add(key)
            else:
                self._step(grad, rows)
            self._after_step()
            return PushResult(True, self._version)

    def _push_sync(  # noqa: PLR0917 (private; called from push only)
        self,
        trainer_id: int,
        grad: torch.Tensor | None,
        model_version: int,
        num_samples: int,
        key: PushKey | None,
        generation: int | None,
        rows: RowGrads | None = None,
    ) -> PushResult:
        with self._cond:
            self._wait_while_frozen()
            self._pushes += 1
            if (
                model_version != self._version
                or trainer_id in self._contributors
                or trainer_id in self._departed
                or (generation is not None and generation != self._generation)
            ):
                # Computed on another version (the step went on without this
                # trainer, or the shards were realigned), a second push in one
                # step, or the push of a trainer that left: not applied; the
                # trainer computes it again (if it still runs).
                self._stale += 1
                return PushResult(False, self._version, PushStatus.STALE)
            status = PushStatus.APPLIED
            if key is not None and self._key_status(key) is KeyStatus.HELD:
                # Held already: joins the step like an empty push.
                self._duplicates += 1
                status = PushStatus.DUPLICATE
            # A trainer that pushes is alive, even if etcd's watch has not told
            # us yet: it is waited for from the next round on. The next etcd
            # membership update replaces the live set, so it is forgotten then
            # if etcd does not know it.
            self._live.add(trainer_id)
            if not self._contributors:
                # The round opens: it waits for the trainers alive now; those
                # that join later are waited for from the next round on.
                self._expected = set(self._live)
            if grad is not None:
                self._round_has_gradient = True
            applies = status is PushStatus.APPLIED and grad is not None and num_samples > 0
            if applies:
                assert grad is not None
                weight = float(num_samples) if self.reduction == "mean" else 1.0
                self._acc.add_(grad, alpha=weight)
                self._acc_samples += num_samples
                if rows is not None and self.tables is not None:
                    self.tables.accumulate(rows, weight)
                if self._buffer_round is not None:
                    self._buffer_round.join(grad, num_samples)
            if key is not None and status is PushStatus.APPLIED:
                # Held once the round completes (an empty push's key too: its
                # records were skipped, there is nothing to apply).
                self._round_keys.append(key)
                self._round_cov.add(key)
            self._contributors.add(trainer_id)
            my_round = self._round
            self._maybe_complete_round()
            barrier = time.monotonic()
            while self._round == my_round:
                if self._closed:
                    raise ShardClosedError("parameter server is shutting down")
                self._cond.wait()
            waited = time.monotonic() - barrier
            if my_round in self._discarded:
                self._stale += 1
                return PushResult(False, self._version, PushStatus.STALE, waited)
            return PushResult(applies, self._version, status, waited)

    def _maybe_complete_round(self) -> None:
        # Caller holds self._cond.
        if (
            self._frozen
            or not self._serving
            or not self._contributors
            or not self._expected <= self._contributors
        ):
            return
        if self._acc_samples > 0:
            if self.reduction == "mean":
                self._acc.div_(float(self._acc_samples))
            rnd = self._buffer_round
            self._step(
                self._acc,
                buffer_increments=rnd.increments() if rnd is not None else None,
                round_rows=True,
            )
        elif self._round_has_gradient:
            # Every gradient of the round was a duplicate here (another shard
            # applies it): the version moves as on the shards that apply, so
            # that the shards of a sync job stay at the same versions.
            with self._values_lock.write():
                if self.tables is not None:
                    self.tables.apply(None, 1.0)  # every table ages one step too
                self._version += 1
        for key in self._round_keys:
            self._coverage.add(key)
        self._reset_round()
        self._round += 1
        self._after_step()

    def _reset_round(self) -> None:
        # Caller holds self._cond.
        self._acc.zero_()
        self._acc_samples = 0
        if self.tables is not None:
            self.tables.clear_round()
        if self._buffer_round is not None:
            self._buffer_round.reset()
        self._contributors.clear()
        self._expected = set()
        self._round_keys = []
        self._round_cov = Coverage()
        self._round_cov.seal(self._coverage.sealed_through)
        self._round_has_gradient = False


def _make_tables(
    layout: Mapping[str, object],
    optimizer: OptimizerConfig,
    frozen: Sequence[str],
    eviction: EvictionPolicy | None,
) -> ShardTables | None:
    """The shard's sparse tables, if the layout declares any.

    Raises:
        LayoutMismatchError: the tables are malformed, or the optimizer has
            no lazy counterpart (only sgd, momentum, adagrad and adam do).
    """
    entries = parse_tables(layout)
    if not entries:
        return None
    shard = layout.get("shard")
    if not isinstance(shard, int) or isinstance(shard, bool):
        raise LayoutMismatchError("a layout with sparse tables needs an integer 'shard'")
    try:
        options = json.loads(optimizer.options) if optimizer.options else {}
        rule = sparse_rule_from_config(
            optimizer.name, options, optimizer.weight_decay, optimizer.momentum
        )
    except (ConfigError, ValueError) as exc:
        raise LayoutMismatchError(f"the model's sparse tables cannot be trained: {exc}") from exc
    window = 0
    if eviction is not None:
        window = min(
            v for v in (eviction.expire_versions, eviction.count_window_versions, 1 << 30) if v
        )
    return ShardTables(
        entries, shard, rule, frozen=frozen, eviction=eviction, evict_every=max(1, window // 8)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scalar_from_json(key: str, entry: object) -> StateValue:
    """Turn an ``optimizer_scalars`` entry back into a 0-d tensor or a number."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"saved optimizer scalar {key!r} must be an object")
    value = entry.get("value")
    dtype = entry.get("dtype")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"saved optimizer scalar {key!r} has no numeric value")
    if dtype is None:
        return value
    torch_dtype = getattr(torch, str(dtype), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"saved optimizer scalar {key!r} has an unknown dtype {dtype!r}")
    return torch.tensor(value, dtype=torch_dtype)
