"""What a job does when its parameter servers cannot write checkpoints.

Each PS publishes the state of its shard checkpoints under
``/elasticps/<job>/health/ps-<index>`` (see
:class:`elasticps.pserver.checkpoint.CheckpointHealth`): ``ok``,
``failing_since_unix_s``, ``error``, ``failures`` and ``saved_version``.
:class:`CheckpointHealthWatch` is the launcher's pure policy over those
records (no I/O, time is an argument):

- the first failed write of a PS is a warning, said once per failure spell;
- a PS whose writes have failed for ``fatal_after_s`` seconds without a
  success in between makes the job stop (a job that trains on while nothing
  can be saved would lose everything at its next crash);
- a PS whose writes succeed again clears its spell.

Its :meth:`~CheckpointHealthWatch.summary` is the ``checkpoint_health``
field of ``run.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticps.errors import ConfigError

__all__ = ["DEFAULT_FATAL_AFTER_S", "CheckpointHealthWatch", "HealthVerdict"]

DEFAULT_FATAL_AFTER_S = 300.0
"""Default grace period, seconds: ten failed checkpoints at the default 30 s
cadence of sync mode, thirty at async mode's 10 s."""


@dataclass(frozen=True)
class HealthVerdict:
    """What to do after reading the health records once.

    Attributes:
        warnings: new failure spells, one line each, to be logged loudly.
        recovered: PS that wrote a checkpoint again after a failure spell.
        fatal: None, or the one-line reason the job must stop.
    """

    warnings: tuple[str, ...] = ()
    recovered: tuple[str, ...] = ()
    fatal: str | None = None


@dataclass
class _Spell:
    since_unix_s: float
    error: str
    failures: int


@dataclass
class CheckpointHealthWatch:
    """The failure spells of the job's checkpoint writes.

    Args:
        fatal_after_s: seconds a PS's writes may fail before the job stops, > 0.

    Raises:
        ConfigError: ``fatal_after_s`` is not > 0.
    """

    fatal_after_s: float = DEFAULT_FATAL_AFTER_S
    _spells: dict[str, _Spell] = field(default_factory=dict)
    _history: list[dict[str, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.fatal_after_s > 0:
            raise ConfigError(
                f"--checkpoint-failures-fatal-after-s must be > 0, got {self.fatal_after_s}"
            )

    def update(self, records: Mapping[str, object], now_unix_s: float) -> HealthVerdict:
        """Read every PS's health record.

        Args:
            records: ``"ps-<index>"`` -> the JSON object it published. Records
                that are not objects, or lack the fields, are ignored (a PS of
                an older version, or a half-written record).
            now_unix_s: the current time, Unix seconds.

        Returns:
            The new warnings, recoveries and, past the grace period, the reason
            to stop.
        """
        warnings: list[str] = []
        recovered: list[str] = []
        fatal: str | None = None
        for name in sorted(records):
            record = records[name]
            if not isinstance(record, dict):
                continue
            ok = record.get("ok")
            if ok is True:
                if self._spells.pop(name, None) is not None:
                    recovered.append(name)
                    self._history.append(
                        {"ps": name, "event": "recovered", "unix_s": round(now_unix_s, 3)}
                    )
                continue
            since = record.get("failing_since_unix_s")
            if ok is not False or not isinstance(since, (int, float)):
                continue
            error = str(record.get("error", ""))
            failures = record.get("failures")
            spell = self._spells.get(name)
            if spell is None or spell.since_unix_s != float(since):
                spell = _Spell(float(since), error, 0)
                self._spells[name] = spell
                warnings.append(f"{name} cannot write its checkpoint: {error}")
                self._history.append(
                    {
                        "ps": name,
                        "event": "failing",
                        "since_unix_s": round(float(since), 3),
                        "error": error,
                    }
                )
            spell.error = error
            spell.failures = failures if isinstance(failures, int) else spell.failures
            failing_s = now_unix_s - spell.since_unix_s
            if fatal is None and failing_s >= self.fatal_after_s:
                fatal = (
                    f"{name} has failed to write checkpoints for {failing_s:.0f} s "
                    f"({spell.failures} attempts; the last: {error}); "
                    f"--checkpoint-failures-fatal-after-s is {self.fatal_after_s:g}"
                )
        return HealthVerdict(tuple(warnings), tuple(recovered), fatal)

    @property
    def failing(self) -> bool:
        """Whether some PS cannot write its checkpoints now."""
        return bool(self._spells)

    def summary(self) -> dict[str, object]:
        """The ``checkpoint_health`` field of ``run.json``.

        Returns:
            ``{"ok": bool, "failing": [{"ps", "since_unix_s", "error",
            "failures"}], "events": [...]}``; ``events`` lists every failure
            spell's start and end in order.
        """
        return {
            "ok": not self._spells,
            "failing": [
                {
                    "ps": name,
                    "since_unix_s": round(spell.since_unix_s, 3),
                    "error": spell.error,
                    "failures": spell.failures,
                }
                for name, spell in sorted(self._spells.items())
            ],
            "events": list(self._history),
        }
