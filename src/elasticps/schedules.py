"""Learning-rate schedules: pure multipliers of an updater's ``lr``, by model version.

Learning-rate schedules are applied **on the parameter server, by model
version** (the number of updates the shard has applied): before each step
the server sets ``param_group["lr"] = lr * schedule.factor(version)``. A
schedule is a pure function of the version, so every shard, a restarted
shard and a checkpoint resume all agree on it. Schedules are multipliers of
the updater's ``lr``:

- :class:`Constant`: 1.
- :class:`StepDecay`: ``gamma ** (version // every_versions)`` (PyTorch
  ``StepLR``, counted in versions instead of epochs).
- :class:`ExponentialDecay`: ``gamma ** (version / every_versions)``
  (TensorFlow ``ExponentialDecay`` with ``staircase=False``).
- :class:`Warmup`: linear warm-up ``(version + 1) / versions`` for the first
  ``versions`` versions, then ``then`` (Goyal et al. 2017, "Accurate, Large
  Minibatch SGD", section 2.2).
- :class:`Piecewise`: a table of factors by version boundaries (TensorFlow
  ``PiecewiseConstantDecay``).

They travel to the servers as JSON (:meth:`Schedule.to_json`,
:func:`schedule_from_json`). Users reach them as ``elasticps.updater.StepDecay``
and so on; they live here, apart from the updaters, so that
:class:`~elasticps.config.OptimizerConfig` can validate a schedule without
importing the updaters (which import the config, and torch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from elasticps.errors import ConfigError

__all__ = [
    "Constant",
    "ExponentialDecay",
    "JSONValue",
    "Piecewise",
    "Schedule",
    "StepDecay",
    "Warmup",
    "schedule_from_json",
]

JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None


# --- schedules ----------------------------------------------------------------------


class Schedule(Protocol):
    """A learning-rate schedule: a pure multiplier of the base lr, by model version."""

    def factor(self, version: int) -> float:
        """The multiplier of the base learning rate at ``version`` (>= 0)."""
        ...

    def to_json(self) -> dict[str, JSONValue]:
        """The schedule as a JSON object (see :func:`schedule_from_json`)."""
        ...


def _check_version(version: int) -> None:
    if version < 0:
        raise ValueError(f"model version must be >= 0, got {version}")


@dataclass(frozen=True)
class Constant:
    """The learning rate never changes: factor 1."""

    def factor(self, version: int) -> float:
        """Always 1.0."""
        _check_version(version)
        return 1.0

    def to_json(self) -> dict[str, JSONValue]:
        """``{"kind": "constant"}``."""
        return {"kind": "constant"}


@dataclass(frozen=True)
class StepDecay:
    """Multiply the learning rate by ``gamma`` every ``every_versions`` versions.

    ``factor(v) = gamma ** (v // every_versions)``; PyTorch's ``StepLR``, in versions.

    Attributes:
        every_versions: versions between two decays, >= 1.
        gamma: decay factor, in (0, 1].

    Raises:
        ConfigError: out-of-range attributes.
    """

    every_versions: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.every_versions < 1:
            raise ConfigError(f"StepDecay every_versions must be >= 1, got {self.every_versions}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"StepDecay gamma must be in (0, 1], got {self.gamma}")

    def factor(self, version: int) -> float:
        """``gamma ** (version // every_versions)``."""
        _check_version(version)
        return float(self.gamma ** (version // self.every_versions))

    def to_json(self) -> dict[str, JSONValue]:
        """``{"kind": "step", "every_versions": n, "gamma": g}``."""
        return {"kind": "step", "every_versions": self.every_versions, "gamma": self.gamma}


@dataclass(frozen=True)
class ExponentialDecay:
    """Smooth exponential decay: ``factor(v) = gamma ** (v / every_versions)``.

    Attributes:
        gamma: factor per ``every_versions`` versions, in (0, 1].
        every_versions: versions over which the rate is multiplied by ``gamma``, >= 1.

    Raises:
        ConfigError: out-of-range attributes.
    """

    gamma: float
    every_versions: int = 1

    def __post_init__(self) -> None:
        if self.every_versions < 1:
            raise ConfigError(
                f"ExponentialDecay every_versions must be >= 1, got {self.every_versions}"
            )
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"ExponentialDecay gamma must be in (0, 1], got {self.gamma}")

    def factor(self, version: int) -> float:
        """``gamma ** (version / every_versions)``."""
        _check_version(version)
        return float(self.gamma ** (version / self.every_versions))

    def to_json(self) -> dict[str, JSONValue]:
        """``{"kind": "exponential", "gamma": g, "every_versions": n}``."""
        return {"kind": "exponential", "gamma": self.gamma, "every_versions": self.every_versions}


@dataclass(frozen=True)
class Warmup:
    """Linear warm-up over the first ``versions`` versions, then ``then``.

    ``factor(v) = (v + 1) / versions`` for ``v < versions`` (so the first
    step already moves), then ``then.factor(v)`` (version not shifted). From
    Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in
    1 Hour", section 2.2 (gradual warm-up).

    Attributes:
        versions: length of the warm-up, >= 1.
        then: the schedule after the warm-up; :class:`Constant` by default.

    Raises:
        ConfigError: ``versions`` < 1.
    """

    versions: int
    then: Schedule = Constant()

    def __post_init__(self) -> None:
        if self.versions < 1:
            raise ConfigError(f"Warmup versions must be >= 1, got {self.versions}")

    def factor(self, version: int) -> float:
        """``(version + 1) / versions`` during the warm-up, then ``then.factor(version)``."""
        _check_version(version)
        if version < self.versions:
            return (version + 1) / self.versions
        return self.then.factor(version)

    def to_json(self) -> dict[str, JSONValue]:
        """``{"kind": "warmup", "versions": n, "then": {...}}``."""
        return {"kind": "warmup", "versions": self.versions, "then": self.then.to_json()}


@dataclass(frozen=True)
class Piecewise:
    """A table of factors: ``factors[i]`` from ``boundaries[i - 1]`` up to ``boundaries[i]``.

    ``Piecewise(boundaries=(1000, 5000), factors=(1.0, 0.1, 0.01))`` is 1.0
    for versions 0..999, 0.1 for 1000..4999 and 0.01 from 5000 on
    (TensorFlow's ``PiecewiseConstantDecay``).

    Attributes:
        boundaries: strictly increasing versions, each >= 1.
        factors: ``len(boundaries) + 1`` factors, each > 0.

    Raises:
        ConfigError: lengths do not match, boundaries not increasing, or a factor <= 0.
    """

    boundaries: tuple[int, ...]
    factors: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.factors) != len(self.boundaries) + 1:
            raise ConfigError(
                f"Piecewise needs len(boundaries) + 1 factors, got {len(self.boundaries)} "
                f"boundaries and {len(self.factors)} factors"
            )
        if any(b < 1 for b in self.boundaries) or any(
            a >= b for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)
        ):
            raise ConfigError(
                f"Piecewise boundaries must be increasing versions >= 1, got {self.boundaries}"
            )
        if not all(f > 0 and math.isfinite(f) for f in self.factors):
            raise ConfigError(f"Piecewise factors must be finite and > 0, got {self.factors}")

    def factor(self, version: int) -> float:
        """The factor of the table entry ``version`` falls in."""
        _check_version(version)
        for boundary, f in zip(self.boundaries, self.factors, strict=False):
            if version < boundary:
                return float(f)
        return float(self.factors[-1])

    def to_json(self) -> dict[str, JSONValue]:
        """``{"kind": "piecewise", "boundaries": [...], "factors": [...]}``."""
        return {
            "kind": "piecewise",
            "boundaries": list(self.boundaries),
            "factors": list(self.factors),
        }


def schedule_from_json(obj: object) -> Schedule:
    """Build a schedule from its JSON object (as :meth:`Schedule.to_json` writes it).

    Args:
        obj: a decoded JSON object, or a JSON text of one; ``""``/``None`` is
            :class:`Constant`.

    Raises:
        ConfigError: not a known schedule, or invalid fields. Input may come
            from the command line or the environment, so everything is checked.
    """
    if obj is None or obj == "":
        return Constant()
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"learning-rate schedule is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"learning-rate schedule must be a JSON object, got {obj!r:.80}")
    kind = obj.get("kind")
    fields = {k: v for k, v in obj.items() if k != "kind"}
    try:
        if kind == "constant" and not fields:
            return Constant()
        if kind == "step":
            return StepDecay(
                every_versions=_int(fields, "every_versions"),
                gamma=_float(fields, "gamma", 0.1),
            )
        if kind == "exponential":
            return ExponentialDecay(
                gamma=_float(fields, "gamma"),
                every_versions=_int(fields, "every_versions", 1),
            )
        if kind == "warmup":
            return Warmup(
                versions=_int(fields, "versions"), then=schedule_from_json(fields.get("then"))
            )
        if kind == "piecewise":
            boundaries = fields.get("boundaries")
            factors = fields.get("factors")
            if not isinstance(boundaries, list) or not isinstance(factors, list):
                raise ConfigError("piecewise schedule needs 'boundaries' and 'factors' lists")
            return Piecewise(
                boundaries=tuple(_as_int(b, "boundaries") for b in boundaries),
                factors=tuple(_as_float(f, "factors") for f in factors),
            )
    except TypeError as exc:
        raise ConfigError(f"learning-rate schedule {obj!r:.120}: {exc}") from exc
    raise ConfigError(
        f"unknown learning-rate schedule {obj!r:.120}; kinds: constant, step, exponential, "
        "warmup, piecewise"
    )


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"schedule field {name!r} must be an integer, got {value!r}")
    return value


def _as_float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"schedule field {name!r} must be a number, got {value!r}")
    return float(value)


def _int(fields: dict[str, Any], name: str, default: int | None = None) -> int:
    if name not in fields:
        if default is None:
            raise ConfigError(f"schedule field {name!r} is required")
        return default
    return _as_int(fields[name], name)


def _float(fields: dict[str, Any], name: str, default: float | None = None) -> float:
    if name not in fields:
        if default is None:
            raise ConfigError(f"schedule field {name!r} is required")
        return default
    return _as_float(fields[name], name)
