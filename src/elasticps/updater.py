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

The schedules are defined in :mod:`elasticps.schedules` (so that the config
can validate one without importing torch) and offered here.

In sync mode one version is one global step (one averaged gradient of
``num_trainers x batch`` samples); in async mode every push is a version,
so an async job counts versions about ``num_trainers`` times faster.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch

from elasticps.config import OptimizerConfig, check_torch_optimizer
from elasticps.errors import ConfigError
from elasticps.schedules import (
    Constant,
    ExponentialDecay,
    JSONValue,
    Piecewise,
    Schedule,
    StepDecay,
    Warmup,
    schedule_from_json,
)

__all__ = [
    "SGD",
    "AdaGrad",
    "Adam",
    "Constant",
    "ExponentialDecay",
    "JSONValue",
    "Momentum",
    "Optimizer",
    "Piecewise",
    "Schedule",
    "StepDecay",
    "Updater",
    "Warmup",
    "as_config",
    "check_torch_optimizer",
    "from_config",
    "lr_at",
    "make_torch_optimizer",
    "ps_flags",
    "schedule_from_json",
]


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
