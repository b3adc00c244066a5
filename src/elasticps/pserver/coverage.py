"""Which records' gradients a shard has applied: the ground truth of exactly-once.

Every gradient a trainer pushes for a task carries a *push key*
``(pass_id, task_id, lo, hi)``: the records ``[lo, hi)`` of the task (counted
from the task's first record) whose gradients it sums. A shard applies a key
at most once: a push whose key it already holds is acknowledged and dropped.
So a push can be re-sent safely, whoever sends it (a trainer that reconnects,
or the next attempt of a task whose trainer died after the acknowledgement
and before its progress reached the master).

:class:`Coverage` is the set of keys a shard has applied, kept inside the
shard's checkpointed state so that parameters and coverage always agree: a
shard restored from a checkpoint knows exactly which records it lacks, and the
master re-opens them at the end of the pass (see
:mod:`elasticps.master.verify`). The set is exact, not a summary, and it
shrinks back to nothing at every pass boundary: when a pass is *sealed* (every
shard holds every record of it, and has made that durable), its keys are
dropped and any later push for that pass is a duplicate by definition.

Push boundaries are aligned: every attempt of a task starts at a boundary of
an earlier push (the master's offset is always the end of an acknowledged
push), and trainers of one job push every ``batch_size * push_every``
records. So a key is either entirely new to a shard or entirely held;
:meth:`Coverage.status` reports a partial overlap, which the shard refuses
rather than apply half a gradient.

This module is pure: no I/O, no locks (the shard holds its own).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["Coverage", "KeyStatus", "PushKey"]

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class PushKey:
    """The records one pushed gradient covers.

    Attributes:
        pass_id: the pass (epoch) the records were trained in, 0-based.
        task_id: the task, 0-based.
        lo: first record, counted from the task's first record, inclusive.
        hi: last record, exclusive; ``lo < hi``.

    Raises:
        ValueError: ``lo >= hi`` or a field is out of its wire range
            (``pass_id``, ``lo``, ``hi`` < 2**32; ``task_id`` < 2**64).
    """

    pass_id: int
    task_id: int
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi <= _U32_MAX:
            raise ValueError(f"push key needs 0 <= lo < hi < 2**32, got [{self.lo}, {self.hi})")
        if not 0 <= self.pass_id <= _U32_MAX or not 0 <= self.task_id <= _U64_MAX:
            raise ValueError(f"push key pass {self.pass_id} / task {self.task_id} out of range")

    @property
    def records(self) -> int:
        """Number of records the key covers (``hi - lo``)."""
        return self.hi - self.lo


class KeyStatus(enum.Enum):
    """How a key relates to a :class:`Coverage`."""

    NEW = "new"
    """No record of the key is held: apply it."""
    HELD = "held"
    """Every record of the key is held (or its pass is sealed): a duplicate."""
    PARTIAL = "partial"
    """Some records are held and some are not: misaligned pushes (refused)."""


class Coverage:
    """The push keys a shard has applied, per (pass, task), as disjoint intervals.

    Intervals of one task are kept sorted and merged, so a task trained
    end to end is one interval whatever the number of pushes. Passes up to
    :attr:`sealed_through` count as wholly held.
    """

    def __init__(self) -> None:
        # (pass, task) -> sorted, disjoint, non-adjacent [lo, hi) intervals:
        # starts and ends in two parallel lists for bisect.
        self._tasks: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self._sealed_through = -1

    # --- queries -----------------------------------------------------------

    @property
    def sealed_through(self) -> int:
        """The last sealed pass (-1 if none): its pushes and earlier ones are duplicates."""
        return self._sealed_through

    def status(self, key: PushKey) -> KeyStatus:
        """Whether ``key`` is new, held, or partly held. O(log intervals)."""
        if key.pass_id <= self._sealed_through:
            return KeyStatus.HELD
        entry = self._tasks.get((key.pass_id, key.task_id))
        if entry is None:
            return KeyStatus.NEW
        starts, ends = entry
        # The interval that could contain key.lo: the last one starting at or before it.
        i = bisect.bisect_right(starts, key.lo) - 1
        if i >= 0 and ends[i] > key.lo:
            return KeyStatus.HELD if ends[i] >= key.hi else KeyStatus.PARTIAL
        # key.lo is in a gap; does the next interval start before key.hi?
        j = i + 1
        if j < len(starts) and starts[j] < key.hi:
            return KeyStatus.PARTIAL
        return KeyStatus.NEW

    def intervals(self, pass_id: int, task_id: int) -> list[tuple[int, int]]:
        """The held ``[lo, hi)`` intervals of one task in one pass, sorted."""
        entry = self._tasks.get((pass_id, task_id))
        return [] if entry is None else list(zip(entry[0], entry[1], strict=True))

    def prefix(self, pass_id: int, task_id: int) -> int:
        """Records held from the task's first record on without a gap (0 if none).

        For a sealed pass this is unbounded; callers check :attr:`sealed_through`.
        """
        entry = self._tasks.get((pass_id, task_id))
        if entry is None or entry[0][0] != 0:
            return 0
        return entry[1][0]

    def tasks(self, pass_id: int) -> Iterator[int]:
        """The tasks of ``pass_id`` with at least one held record, in no order."""
        for p, t in self._tasks:
            if p == pass_id:
                yield t

    def records(self, pass_id: int) -> int:
        """Records held in ``pass_id`` (0 for a sealed pass, whose keys were dropped)."""
        return sum(
            hi - lo
            for (p, _), (starts, ends) in self._tasks.items()
            if p == pass_id
            for lo, hi in zip(starts, ends, strict=True)
        )

    def __len__(self) -> int:
        """Number of intervals held (a measure of memory and checkpoint size)."""
        return sum(len(starts) for starts, _ in self._tasks.values())

    # --- mutations -----------------------------------------------------------

    def add(self, key: PushKey) -> None:
        """Record ``key`` as applied, merging with neighbouring intervals.

        Raises:
            ValueError: ``key`` overlaps held records (its status is not NEW).
        """
        if key.pass_id <= self._sealed_through:
            raise ValueError(f"pass {key.pass_id} is sealed; its keys are all held")
        starts, ends = self._tasks.setdefault((key.pass_id, key.task_id), ([], []))
        i = bisect.bisect_right(starts, key.lo)
        if (i > 0 and ends[i - 1] > key.lo) or (i < len(starts) and starts[i] < key.hi):
            raise ValueError(f"{key} overlaps records already held")
        lo, hi = key.lo, key.hi
        merge_left = i > 0 and ends[i - 1] == lo
        merge_right = i < len(starts) and starts[i] == hi
        if merge_left and merge_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif merge_left:
            ends[i - 1] = hi
        elif merge_right:
            starts[i] = lo
        else:
            starts.insert(i, lo)
            ends.insert(i, hi)

    def seal(self, pass_id: int) -> None:
        """Mark every pass up to ``pass_id`` as wholly held and drop their intervals.

        Idempotent; sealing an earlier pass than :attr:`sealed_through` does nothing.
        """
        if pass_id <= self._sealed_through:
            return
        self._sealed_through = pass_id
        for key in [k for k in self._tasks if k[0] <= pass_id]:
            del self._tasks[key]

    # --- persistence ---------------------------------------------------------

    def to_tensor(self) -> torch.Tensor:
        """The intervals as int64 ``[n, 4]`` rows ``(pass, task, lo, hi)``, sorted.

        Together with :attr:`sealed_through` this is the whole state (see
        :meth:`from_tensor`); checkpoints store it next to the parameters.
        """
        rows = sorted(
            (p, t, lo, hi)
            for (p, t), (starts, ends) in self._tasks.items()
            for lo, hi in zip(starts, ends, strict=True)
        )
        if not rows:
            return torch.zeros((0, 4), dtype=torch.int64)
        return torch.tensor(rows, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, rows: torch.Tensor, sealed_through: int) -> Coverage:
        """Rebuild a coverage from :meth:`to_tensor` rows and :attr:`sealed_through`.

        Raises:
            ValueError: ``rows`` is not int64 ``[n, 4]``, a row is not a valid
                key, or two rows overlap.
        """
        if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 4:
            raise ValueError(f"coverage must be int64 [n, 4], got {rows.dtype} {list(rows.shape)}")
        if sealed_through < -1:
            raise ValueError(f"sealed_through must be >= -1, got {sealed_through}")
        cov = cls()
        cov._sealed_through = sealed_through
        for p, t, lo, hi in rows.tolist():
            key = PushKey(p, t, lo, hi)
            if p <= sealed_through:
                raise ValueError(f"coverage row {key} belongs to a sealed pass")
            cov.add(key)
        return cov

    @classmethod
    def of(cls, keys: Iterable[PushKey]) -> Coverage:
        """A coverage holding ``keys`` (for tests and tools).

        Raises:
            ValueError: two keys overlap.
        """
        cov = cls()
        for key in keys:
            cov.add(key)
        return cov
