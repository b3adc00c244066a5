"""Updaters (optimizers run on the parameter servers) and learning-rate schedules.

An updater describes the optimizer every parameter server runs on its shard
with ``torch.optim`` (the trainers only compute gradients). It is a small
frozen value that turns into an :class:`~elasticps.config.OptimizerConfig`,
which travels to the servers as CLI flags or ``ELASTICPS_*`` environment
variables: everything in it is JSON, never pickle.

>>> from elasticps import updater
>>> u = updater.Momentum(lr=0.1, schedule=updater.StepDecay(every_versions=1000, gamma=0.5))
>>> u.lr_at(2500)
0.025

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

In sync mode one version is one global step (one averaged gradient of
``num_trainers x batch`` samples); in async mode every push is a version,
so an async job counts versions about ``num_trainers`` times faster.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch

from elasticps.config import OptimizerConfig
from elasticps.errors import ConfigError

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


def lr_at(config: OptimizerConfig, version: int) -> float:
    """The learning rate a parameter server uses for the step from ``version``.

    Pure: ``config.lr * schedule.factor(version)``.

    Args:
        config: the optimizer config; ``config.schedule`` is the schedule's JSON.
        version: the shard's model version before the step, >= 0.

    Raises:
        ValueError: ``version`` < 0.
        ConfigError: the schedule is invalid.
    """
    return config.lr * schedule_from_json(config.schedule).factor(version)


# --- updaters -------------------------------------------------------------------


def _schedule_text(schedule: Schedule | None) -> str:
    if schedule is None or isinstance(schedule, Constant):
        return ""
    return json.dumps(schedule.to_json(), sort_keys=True, separators=(",", ":"))


def _options_text(options: dict[str, JSONValue]) -> str:
    if not options:
        return ""
    try:
        return json.dumps(options, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"optimizer keyword arguments must be JSON-serialisable (they travel to the "
            f"parameter servers as flags, never pickled): {exc}"
        ) from exc


class Updater:
    """Base class of the updaters: an optimizer config plus a schedule.

    Subclasses set :attr:`config` in their constructor.
    """

    config: OptimizerConfig

    def to_config(self) -> OptimizerConfig:
        """The :class:`~elasticps.config.OptimizerConfig` the parameter servers run."""
        return self.config

    def lr_at(self, version: int) -> float:
        """The learning rate of the step from model ``version`` (see :func:`lr_at`)."""
        return lr_at(self.config, version)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Updater) and other.config == self.config

    def __hash__(self) -> int:
        return hash(self.config)


class SGD(Updater):
    """Plain SGD on the PS: ``w -= lr(version) * g`` (``torch.optim.SGD``).

    Args:
        lr: base learning rate, > 0.
        weight_decay: L2 penalty, >= 0.
        schedule: learning-rate schedule by model version; constant if None.

    Raises:
        ConfigError: invalid values.
    """

    def __init__(
        self, lr: float = 0.01, *, weight_decay: float = 0.0, schedule: Schedule | None = None
    ) -> None:
        self.config = OptimizerConfig(
            name="sgd", lr=lr, weight_decay=weight_decay, schedule=_schedule_text(schedule)
        )


class Momentum(Updater):
    """SGD with (heavy-ball) momentum on the PS (``torch.optim.SGD(momentum=...)``).

    Args:
        lr: base learning rate, > 0.
        momentum: momentum factor, in [0, 1).
        weight_decay: L2 penalty, >= 0.
        nesterov: Nesterov momentum (Sutskever et al. 2013).
        schedule: learning-rate schedule by model version.

    Raises:
        ConfigError: invalid values.
    """

    def __init__(
        self,
        lr: float = 0.01,
        momentum: float = 0.9,
        *,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        schedule: Schedule | None = None,
    ) -> None:
        self.config = OptimizerConfig(
            name="momentum",
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            options=_options_text({"nesterov": True} if nesterov else {}),
            schedule=_schedule_text(schedule),
        )


class Adam(Updater):
    """Adam on the PS (``torch.optim.Adam``, fused CPU kernel; Kingma & Ba 2015).

    Args:
        lr: base learning rate, > 0.
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator.
        weight_decay: L2 penalty, >= 0.
        schedule: learning-rate schedule by model version.

    Raises:
        ConfigError: invalid values.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        weight_decay: float = 0.0,
        schedule: Schedule | None = None,
    ) -> None:
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"Adam betas must be two numbers in [0, 1), got {betas}")
        if not eps > 0:
            raise ConfigError(f"Adam eps must be > 0, got {eps}")
        options: dict[str, JSONValue] = {}
        if tuple(betas) != (0.9, 0.999):
            options["betas"] = [float(betas[0]), float(betas[1])]
        if eps != 1e-8:
            options["eps"] = float(eps)
        self.config = OptimizerConfig(
            name="adam",
            lr=lr,
            weight_decay=weight_decay,
            options=_options_text(options),
            schedule=_schedule_text(schedule),
        )


class AdaGrad(Updater):
    """AdaGrad on the PS (``torch.optim.Adagrad``, fused; Duchi et al. 2011).

    Args:
        lr: base learning rate, > 0.
        eps: term added to the denominator.
        initial_accumulator_value: starting value of the sum of squares, >= 0.
        weight_decay: L2 penalty, >= 0.
        schedule: learning-rate schedule by model version.

    Raises:
        ConfigError: invalid values.
    """

    def __init__(
        self,
        lr: float = 0.01,
        eps: float = 1e-10,
        *,
        initial_accumulator_value: float = 0.0,
        weight_decay: float = 0.0,
        schedule: Schedule | None = None,
    ) -> None:
        if not eps > 0 or initial_accumulator_value < 0:
            raise ConfigError("AdaGrad needs eps > 0 and initial_accumulator_value >= 0")
        options: dict[str, JSONValue] = {}
        if eps != 1e-10:
            options["eps"] = float(eps)
        if initial_accumulator_value:
            options["initial_accumulator_value"] = float(initial_accumulator_value)
        self.config = OptimizerConfig(
            name="adagrad",
            lr=lr,
            weight_decay=weight_decay,
            options=_options_text(options),
            schedule=_schedule_text(schedule),
        )


# Optimizers whose step() needs a closure, or that need sparse gradients:
# the PS calls step() without a closure on a dense flat tensor.
_UNSUPPORTED_TORCH = {"LBFGS", "SparseAdam"}


def check_torch_optimizer(class_name: str) -> type[torch.optim.Optimizer]:
    """Return ``torch.optim.<class_name>``, checking that the PS can run it.

    Raises:
        ConfigError: no such class, not a ``torch.optim.Optimizer`` subclass,
            or one the PS cannot run (``LBFGS`` needs a closure,
            ``SparseAdam`` sparse gradients).
    """
    cls = getattr(torch.optim, class_name, None) if class_name.isidentifier() else None
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"torch.optim.{class_name} is not a torch.optim.Optimizer class")
    if class_name in _UNSUPPORTED_TORCH or cls is torch.optim.Optimizer:
        raise ConfigError(f"torch.optim.{class_name} cannot run on a parameter server")
    return cls


class Optimizer(Updater):
    """Any ``torch.optim`` optimizer class on the PS, with JSON keyword arguments.

    ``Optimizer(torch.optim.RMSprop, lr=1e-3, alpha=0.9)``. The class travels
    to the servers by name (``torch.optim.<name>``) and the keyword
    arguments as JSON, so only classes of ``torch.optim`` itself and
    JSON-serialisable arguments (numbers, booleans, strings, lists) work.
    The server steps one flat tensor per shard, which equals a step per
    parameter only for element-wise optimizers (all of ``torch.optim``
    except ``LBFGS``, which is refused).

    Args:
        torch_optim_class: a subclass of ``torch.optim.Optimizer`` defined in
            ``torch.optim``.
        lr: base learning rate, > 0.
        schedule: learning-rate schedule by model version.
        **kwargs: other constructor arguments (``weight_decay``, ``betas``...).

    Raises:
        ConfigError: not a ``torch.optim`` optimizer class, unknown keyword
            arguments, or arguments that are not JSON-serialisable.
    """

    def __init__(
        self,
        torch_optim_class: type[torch.optim.Optimizer],
        lr: float = 1e-3,
        *,
        schedule: Schedule | None = None,
        **kwargs: JSONValue,
    ) -> None:
        if not (
            inspect.isclass(torch_optim_class)
            and issubclass(torch_optim_class, torch.optim.Optimizer)
        ):
            raise ConfigError(
                f"Optimizer needs a torch.optim.Optimizer subclass, got {torch_optim_class!r}"
            )
        name = torch_optim_class.__name__
        if getattr(torch.optim, name, None) is not torch_optim_class:
            raise ConfigError(
                f"{torch_optim_class!r} is not in torch.optim; only torch.optim classes can be "
                "named on the parameter servers"
            )
        check_torch_optimizer(name)
        accepted = inspect.signature(torch_optim_class.__init__).parameters
        unknown = sorted(k for k in kwargs if k not in accepted)
        if unknown:
            raise ConfigError(f"torch.optim.{name} takes no argument(s) {', '.join(unknown)}")
        if "params" in kwargs:
            raise ConfigError("'params' is set by the parameter server")
        self.config = OptimizerConfig(
            name="torch",
            lr=lr,
            torch_class=name,
            options=_options_text(dict(kwargs)),
            schedule=_schedule_text(schedule),
        )


def from_config(config: OptimizerConfig) -> Updater:
    """Wrap an existing :class:`~elasticps.config.OptimizerConfig` as an updater."""
    wrapped = Updater.__new__(Updater)
    wrapped.config = config
    return wrapped


def as_config(updater: Updater | OptimizerConfig) -> OptimizerConfig:
    """The config of an updater, or the config itself.

    Raises:
        ConfigError: neither an :class:`Updater` nor an ``OptimizerConfig``.
    """
    if isinstance(updater, OptimizerConfig):
        return updater
    if isinstance(updater, Updater):
        return updater.to_config()
    raise ConfigError(
        f"expected an elasticps.updater updater or an OptimizerConfig, got {updater!r:.80}"
    )


def ps_flags(config: OptimizerConfig) -> list[str]:
    """The ``elasticps ps`` flags that carry ``config`` to a parameter server. Pure.

    ``--optimizer``, ``--lr``, ``--momentum``, ``--weight-decay``, then
    ``--optimizer-class``, ``--optimizer-options`` and ``--lr-schedule`` only
    when set, so launchers built before them keep working.
    """
    flags = [
        "--optimizer", config.name,
        "--lr", repr(config.lr),
        "--momentum", repr(config.momentum),
        "--weight-decay", repr(config.weight_decay),
    ]  # fmt: skip
    if config.torch_class:
        flags += ["--optimizer-class", config.torch_class]
    if config.options:
        flags += ["--optimizer-options", config.options]
    if config.schedule:
        flags += ["--lr-schedule", config.schedule]
    return flags


def make_torch_optimizer(
    params: list[torch.Tensor], config: OptimizerConfig
) -> torch.optim.Optimizer:
    """Build the ``torch.optim`` optimizer that ``config`` describes.

    Args:
        params: leaf float32 tensors to optimize.
        config: the optimizer config (name, lr, options JSON...).

    Returns:
        ``torch.optim.SGD`` (``sgd``; ``momentum`` sets its momentum),
        ``torch.optim.Adam`` or ``torch.optim.Adagrad`` (fused CPU kernels:
        on a 10M-element shard a step takes 5.5 ms instead of 45 ms for Adam,
        3.5 ms instead of 24.5 ms for AdaGrad, equal within 5e-7, see
        ``benchmarks/README.md``), or ``torch.optim.<torch_class>``.

    Raises:
        ConfigError: the options do not fit the optimizer class.
    """
    options = json.loads(config.options) if config.options else {}
    kwargs: dict[str, Any] = {"lr": config.lr}
    if config.weight_decay:
        kwargs["weight_decay"] = config.weight_decay
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    try:
        if config.name == "sgd":
            return torch.optim.SGD(params, **kwargs, **options)
        if config.name == "momentum":
            return torch.optim.SGD(params, momentum=config.momentum, **kwargs, **options)
        if config.name == "adam":
            return torch.optim.Adam(params, fused=True, **kwargs, **options)
        if config.name == "adagrad":
            return torch.optim.Adagrad(params, fused=True, **kwargs, **options)
        cls = check_torch_optimizer(config.torch_class)
        return cls(params, **kwargs, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot build optimizer {config.name!r}: {exc}") from exc
