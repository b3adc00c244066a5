"""End-of-pass verification: what the shards hold decides whether a pass is over.

The task ledger counts what trainers *reported*; exactly-once is about what
the parameter servers *applied*. Before a pass completes, the master asks
every shard which records of the pass it holds (the push keys it applied,
see :mod:`elasticps.pserver.coverage`) and compares them with the pass's
tasks:

- a done task that some shard does not hold in full is *re-opened* at the
  first record any shard lacks (:meth:`TaskQueue.rewind
  <elasticps.master.taskqueue.TaskQueue.rewind>`); its next attempt trains
  from there, and the shards that hold those records already drop the
  pushes as duplicates, so only the shards that lack them apply them;
- once every shard holds every record of every done task, the master
  *seals* the pass on every shard (each drops the pass's keys and saves a
  checkpoint), and only then completes the pass.

A shard restored from a checkpoint therefore loses nothing of the current
pass. A checkpoint older than an earlier pass's seal (the newer files were
damaged or deleted) still holds the shard's keys of that pass: the same
judgement over that pass's done tasks gives the *repairs* (see
:mod:`elasticps.master.repairs`). What no checkpoint can give back (a shard
with none readable, whose values came from a trainer) is *lost* on that
shard, and the pass summary says so (``records_lost``), never claiming
exactly-once.

This module is pure: it turns coverage reports into decisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["ShardCoverage", "Verdict", "judge_pass", "records_missing"]


@dataclass(frozen=True)
class ShardCoverage:
    """What one shard holds of one pass (the answer to the ``coverage`` control op).

    Attributes:
        shard: the shard's index.
        sealed: the whole pass is held (the shard sealed it).
        intervals: held ``(task, lo, hi)`` records, when not sealed.
        initialized: False for a shard that holds no parameters yet (nothing
            is held).
    """

    shard: int
    sealed: bool
    intervals: Sequence[tuple[int, int, int]] = ()
    initialized: bool = True

    def prefixes(self) -> dict[int, int]:
        """Per task, the records held from its first one without a gap."""
        out: dict[int, int] = {}
        for task, lo, hi in sorted(self.intervals):
            if task not in out:
                out[task] = hi if lo == 0 else 0
        return out

    def held(self, task: int) -> int:
        """Records of ``task`` held, wherever they are."""
        return sum(hi - lo for t, lo, hi in self.intervals if t == task)


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`judge_pass`.

    Attributes:
        rewinds: task -> the record to re-open it at (the shortest held
            prefix over every shard), for done tasks some shard lacks.
        missing: shard -> records of done tasks it lacks (before the rewinds).
    """

    rewinds: dict[int, int] = field(default_factory=dict)
    missing: dict[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether every shard holds every record of every done task."""
        return not self.rewinds


def judge_pass(
    task_records: Mapping[int, int],
    done: Sequence[int],
    reports: Sequence[ShardCoverage],
) -> Verdict:
    """Decide which done tasks must be re-opened so that every shard holds them.

    Args:
        task_records: task id -> number of records in the task.
        done: the tasks done in the pass (failed tasks are not checked: they
            were set aside, and their records are counted as such).
        reports: every shard's coverage of the pass.

    Returns:
        The rewinds, and the records each shard lacks.

    Raises:
        KeyError: a done task is not in ``task_records``.
    """
    rewinds: dict[int, int] = {}
    missing: dict[int, int] = {}
    prefixes = [(r, r.prefixes()) for r in reports if not r.sealed]
    for task in done:
        size = task_records[task]
        lowest = size
        for report, prefix in prefixes:
            held = prefix.get(task, 0) if report.initialized else 0
            if held < size:
                missing[report.shard] = (
                    missing.get(report.shard, 0) + size - min(size, report.held(task))
                )
                lowest = min(lowest, held)
        if lowest < size:
            rewinds[task] = lowest
    return Verdict(rewinds, missing)


def records_missing(
    task_records: Mapping[int, int], done: Sequence[int], report: ShardCoverage
) -> int:
    """Records of the done tasks of a pass that one shard does not hold.

    Used for passes already sealed by the master that a shard restored
    without (their records are lost on that shard).
    """
    if report.sealed:
        return 0
    return sum(task_records[t] - min(task_records[t], report.held(t)) for t in done)
