"""Sync mode: every shard at one model version, checkpointed together, realigned after a restart.

In sync-SGD a model version is a set of shards that went through the same
steps. Each shard restores from its own checkpoint after a restart, so a
restarted shard is behind the others, and a trainer that pulled from all of
them would train on a mixture of two models. The master prevents that
(:class:`SyncAligner`):

- *Aligned checkpoints.* Every ``checkpoint_every_s`` seconds it freezes
  every shard between two steps (a shard caught mid-step finishes it first,
  as for a consistent checkpoint), has each save its state at that one
  version, and thaws them. So every shard has checkpoints of the same
  versions on stable storage.
- *Realignment.* A shard restored from a checkpoint waits (it serves no
  trainer). When the master sees it, it freezes every shard, picks the newest
  version that every shard has (a checkpoint, or its current state), rolls
  each shard back to it, and lets them serve again under a new *generation*.
  Pushes computed before (another generation) are stale: their trainers pull
  the realigned model and compute them again. Records applied after that
  version are lost only in the ledger's view: the end-of-pass check
  (:mod:`elasticps.master.verify`) re-opens them, so each is applied once.

When no version is common (a shard restarted without any checkpoint), every
shard keeps its state, the shard that lost it is relabelled to the others'
version so that trainers see one version, and the loss is reported at the end
of the pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from elasticps.coord.store import JobStore, PSSlot
from elasticps.errors import ElasticPSError, RemoteError
from elasticps.master.shards import ShardController
from elasticps.snapshot import shards_mid_step

__all__ = ["SyncAligner", "common_version"]

log = logging.getLogger(__name__)

_CHECK_S = 0.5
"""How often the aligner looks for a shard that waits to be realigned, seconds."""

_FINISH_ROUND_S = 2.0
"""How long an aligned checkpoint waits for a shard to finish its open round, seconds."""

_SKEW_PATIENCE_S = _FINISH_ROUND_S
"""How long serving shards may stay a step apart at the same versions before they are
realigned anyway, seconds: a round that has not closed by then will not close (its
trainers wait for the shards to agree), and the job would stall until task timeouts."""


def common_version(states: Mapping[int, Mapping[str, object]]) -> int | None:
    """The newest version every initialized shard can be at (pure).

    A shard can be at its current version, or at any version it has a
    checkpoint of (``durable_versions``).

    Args:
        states: the ``checkpoints`` answers of the shards, by slot.

    Returns:
        The version, or None if there is none in common (or no shard holds
        parameters).
    """
    options: list[set[int]] = []
    for state in states.values():
        if not state.get("initialized"):
            continue
        have: set[int] = set()
        version = state.get("version")
        if isinstance(version, int):
            have.add(version)
        durable = state.get("durable_versions", [])
        if isinstance(durable, list):
            have.update(v for v in durable if isinstance(v, int))
        options.append(have)
    if not options:
        return None
    common = set.intersection(*options)
    return max(common) if common else None


def aligned(states: Mapping[int, Mapping[str, object]]) -> bool:
    """Whether every initialized shard serves, at one version and one generation (pure).

    Shards that do not run in sync mode are never realigned (True).
    """
    live = [s for s in states.values() if s.get("initialized")]
    if not live or any(s.get("mode") != "sync" for s in live):
        return True
    return (
        all(s.get("serving") for s in live)
        and len({(s.get("version"), s.get("generation")) for s in live}) == 1
    )


class SyncAligner:
    """Keeps the shards of a sync job aligned: aligned checkpoints and realignment.

    Args:
        store: the job's store.
        every_s: seconds between aligned checkpoints, > 0.
        stop: set when the master stops.
    """

    def __init__(self, store: JobStore, every_s: float, stop: threading.Event) -> None:
        self._store = store
        self._every_s = every_s
        self._stop = stop
        self._controller = ShardController(store)
        self._wake = threading.Event()
        # The versions of serving shards seen a step apart, and since when (monotonic s).
        self._skew: tuple[tuple[int, object], ...] | None = None
        self._skew_since = 0.0
        self._thread = threading.Thread(target=self._run, name="sync-aligner", daemon=True)
        self._watch = store.watch_ps_slots(self._on_slots)
        self._thread.start()

    def _on_slots(self, slots: dict[int, PSSlot]) -> None:
        self._controller.slots_changed(slots)
        self._wake.set()

    def close(self) -> None:
        """Stop watching; the thread ends with ``stop``."""
        self._watch.cancel()
        self._wake.set()
        self._controller.close()

    def _run(self) -> None:
        next_save = time.monotonic() + self._every_s
        while not self._stop.is_set():
            self._wake.wait(_CHECK_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._realign_if_needed()
                if time.monotonic() >= next_save:
                    self._save_aligned()
                    next_save = time.monotonic() + self._every_s
            except ElasticPSError as exc:
                log.warning("sync alignment: %s; retrying", exc)
                self._stop.wait(0.1)

    def _realign_if_needed(self) -> None:
        states = self._controller.request_all({"op": "checkpoints"})
        if aligned(states):
            self._skew = None
            return
        live = {i: s for i, s in states.items() if s.get("initialized")}
        frozen: list[int] = []
        try:
            freezes: dict[int, dict[str, object]] = {}
            for index in sorted(live):
                freezes[index] = self._controller.request_one(index, {"op": "freeze"})
                frozen.append(index)
            # Every shard serving, but at different versions: a step applied
            # by some shards and not yet by others is no misalignment. Let the
            # open rounds close, then look again. (A restarted shard does not
            # serve until realigned: no waiting then.)
            order = sorted(live)
            skew_only = all(s.get("serving") for s in live.values()) and (
                len({s.get("generation") for s in live.values()}) == 1
            )
            for position in shards_mid_step([freezes[i] for i in order]) if skew_only else []:
                try:
                    self._controller.request_one(
                        order[position],
                        {"op": "freeze", "finish_round": True, "timeout_s": _FINISH_ROUND_S},
                        timeout_s=_FINISH_ROUND_S + 10.0,
                    )
                except RemoteError as exc:
                    if exc.code != "freeze_timeout":
                        raise
            states = {i: self._controller.request_one(i, {"op": "checkpoints"}) for i in live}
            if aligned(states):
                self._skew = None
                return
            stuck = skew_only and self._skew_outlasted(states)
            if skew_only and not stuck:
                # Still a step apart (a round that did not close within
                # _FINISH_ROUND_S, e.g. a trainer being replaced): every shard
                # went through the same steps so far, so nothing is rolled
                # back; the next check looks again.
                log.debug("sync alignment: serving shards a step apart; looking again")
                return
            self._skew = None
            if stuck:
                # A finish-round freeze that timed out left its shard thawed:
                # freeze every shard again (between two steps) before rolling back.
                states = {}
                for index in sorted(live):
                    self._controller.request_one(index, {"op": "freeze"})
                    states[index] = self._controller.request_one(index, {"op": "checkpoints"})
            target = common_version(states)
            generation = 1 + max(
                (g for s in states.values() if isinstance(g := s.get("generation"), int)),
                default=0,
            )
            if target is None:
                versions = [v for s in states.values() if isinstance(v := s.get("version"), int)]
                relabel = max(versions, default=0)
                log.log(
                    logging.WARNING if stuck else logging.ERROR,
                    "sync alignment: no version in common (%s); every shard keeps its state "
                    "and is relabelled version %d; the end of the pass re-opens the records a "
                    "shard lacks, or reports them lost",
                    "a step some shards never applied" if stuck else "a shard lost its state",
                    relabel,
                )
                for index in sorted(live):
                    current = states[index]["version"]
                    self._controller.request_one(index, {"op": "rollback", "version": current})
                for index in sorted(live):
                    self._controller.request_one(
                        index, {"op": "serve", "generation": generation, "version": relabel}
                    )
                return
            for index in sorted(live):
                self._controller.request_one(index, {"op": "rollback", "version": target})
            for index in sorted(live):
                self._controller.request_one(index, {"op": "serve", "generation": generation})
            log.warning(
                "sync alignment: every shard rolled back to version %d and serves generation %d",
                target,
                generation,
            )
        finally:
            self._thaw(frozen)

    def _skew_outlasted(self, states: Mapping[int, Mapping[str, object]]) -> bool:
        """Whether serving shards have stood a step apart at these very versions for
        longer than ``_SKEW_PATIENCE_S``; starts the clock when the versions are new."""
        key = tuple(sorted((i, s.get("version")) for i, s in states.items()))
        now = time.monotonic()
        if key != self._skew:
            self._skew, self._skew_since = key, now
            return False
        if now - self._skew_since < _SKEW_PATIENCE_S:
            return False
        log.warning(
            "sync alignment: shards stood a step apart at versions %s for %.1f s (a round "
            "that cannot close); realigning them",
            {i: v for i, v in key},
            now - self._skew_since,
        )
        return True

    def _thaw(self, frozen: list[int]) -> None:
        for index in frozen:
            try:
                self._controller.request_one(index, {"op": "thaw"})
            except ElasticPSError as exc:
                log.info("thawing parameter server %d: %s", index, exc)

    def _save_aligned(self) -> None:
        states = self._controller.request_all({"op": "checkpoints"})
        live = sorted(i for i, s in states.items() if s.get("initialized"))
        if not live or not aligned(states):
            return
        frozen: list[int] = []
        try:
            freezes: dict[int, dict[str, object]] = {}
            for index in live:
                freezes[index] = self._controller.request_one(index, {"op": "freeze"})
                frozen.append(index)
            mid = shards_mid_step([freezes[i] for i in live])
            for position in mid:
                index = live[position]
                try:
                    freezes[index] = self._controller.request_one(
                        index,
                        {"op": "freeze", "finish_round": True, "timeout_s": _FINISH_ROUND_S},
                        timeout_s=_FINISH_ROUND_S + 10.0,
                    )
                except RemoteError as exc:
                    if exc.code != "freeze_timeout":
                        raise
                    # A round that does not close soon (a trainer being
                    # replaced): skip this checkpoint rather than hold the job.
                    log.info("aligned checkpoint skipped: %s", exc)
                    return
            versions = {f.get("version") for f in freezes.values()}
            if len(versions) != 1:
                log.info("aligned checkpoint skipped: shards at versions %s", versions)
                return
            for index in live:
                self._controller.request_one(index, {"op": "save"}, timeout_s=120.0)
            log.debug("aligned checkpoint of %d shards at version %s", len(live), versions)
        finally:
            self._thaw(frozen)
