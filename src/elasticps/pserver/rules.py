"""Update rules: one optimizer step over a shard's flat float32 parameter tensor.

Pure: no I/O. A :class:`~elasticps.pserver.shard.ParameterShard` holds one
rule, built by :func:`make_update_rule` from its
:class:`~elasticps.config.OptimizerConfig`, and calls :meth:`UpdateRule.step`
once per update with the learning rate its schedule gives.

The four built-in optimizers (``sgd``, ``momentum``, ``adam``, ``adagrad``)
call the very kernels ``torch.optim`` runs on CPU (SGD's single-tensor
update, ``torch._fused_adam_``/``torch._fused_adamw_`` and
``torch._fused_adagrad_``, as ``torch.optim.Adam(fused=True)`` and
``torch.optim.Adagrad(fused=True)`` do), but not through
``torch.optim.Optimizer``: its constructor, ``step``, ``state_dict`` and
``load_state_dict`` import ``torch._dynamo`` on first use, which costs 1.8 s
of CPU on a 2-core machine, paid by every parameter server at
every start and restart, on the cores the trainers share. The results are
bit-identical to ``torch.optim`` (``tests/unit/test_rules.py``), and the state
has ``torch.optim``'s names (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ``momentum_buffer``, ``sum``), so checkpoints written by
either load into the other.

Any other ``torch.optim`` class (``--optimizer torch``), or an option the
built-in rules do not take (see :data:`BUILTIN_OPTIONS`), runs through
:class:`TorchOptimizerRule`, the ``torch.optim`` object itself.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from elasticps.config import OptimizerConfig
from elasticps.errors import ConfigError
from elasticps.updater import make_torch_optimizer

StateValue = Tensor | int | float
"""One entry of an optimizer's state: a tensor (``[numel]`` or 0-d) or a number."""

BUILTIN_OPTIONS: dict[str, frozenset[str]] = {
    "sgd": frozenset({"maximize"}),
    "momentum": frozenset({"dampening", "nesterov", "maximize"}),
    "adam": frozenset({"betas", "eps", "amsgrad", "maximize", "decoupled_weight_decay"}),
    "adagrad": frozenset({"lr_decay", "initial_accumulator_value", "eps", "maximize"}),
}
"""The ``--optimizer-options`` keys each built-in rule takes; others fall back to torch.optim."""


class UpdateRule(abc.ABC):
    """An optimizer bound to one flat float32 parameter tensor.

    Args:
        param: the parameters, float32 ``[numel]``, updated in place.
    """

    def __init__(self, param: Tensor) -> None:
        self.param = param

    @abc.abstractmethod
    def step(self, grad: Tensor, lr: float) -> None:
        """Apply one update to :attr:`param`.

        Args:
            grad: float32 ``[numel]``, the gradient; not modified.
            lr: the learning rate of this step.
        """

    @abc.abstractmethod
    def state(self) -> dict[str, StateValue]:
        """The optimizer state, by ``torch.optim``'s per-parameter names.

        Returns:
            Live references (copy them to keep them): ``[numel]`` float32
            tensors, 0-d tensors (Adam's ``step``) and numbers. Empty before
            the first step for optimizers that create their state lazily.
        """

    @abc.abstractmethod
    def load_state(self, state: Mapping[str, StateValue]) -> None:
        """Replace the optimizer state with ``state`` (as :meth:`state` returns it).

        An empty mapping resets the state.

        Raises:
            ValueError: keys or tensor sizes that this rule cannot use.
        """


class SGDRule(UpdateRule):
    """SGD, with optional momentum, as ``torch.optim.SGD`` does on CPU.

    ``p -= lr * g`` with ``g = grad + weight_decay * p``; with momentum,
    ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` at the first
    step) and ``g = buf``, or ``g + momentum * buf`` with Nesterov
    (Sutskever et al. 2013, "On the importance of initialization and momentum
    in deep learning", as PyTorch formulates it).

    Raises:
        ConfigError: a hyper-parameter out of range.
    """

    def __init__(
        self,
        param: Tensor,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        maximize: bool = False,
    ) -> None:
        super().__init__(param)
        if momentum < 0 or weight_decay < 0:
            raise ConfigError("SGD momentum and weight decay must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError("Nesterov momentum requires a momentum and zero dampening")
        self.momentum = momentum
        self.dampening = dampening
        self.nesterov = nesterov
        self.weight_decay = weight_decay
        self.maximize = maximize
        self._buf: Tensor | None = None

    def step(self, grad: Tensor, lr: float) -> None:
        p = self.param
        g = -grad if self.maximize else grad
        if self.weight_decay != 0:
            g = g.add(p, alpha=self.weight_decay)
        if self.momentum != 0:
            if self._buf is None:
                self._buf = g.detach().clone()
            else:
                self._buf.mul_(self.momentum).add_(g, alpha=1 - self.dampening)
            g = g.add(self._buf, alpha=self.momentum) if self.nesterov else self._buf
        p.add_(g, alpha=-lr)

    def state(self) -> dict[str, StateValue]:
        return {} if self._buf is None else {"momentum_buffer": self._buf}

    def load_state(self, state: Mapping[str, StateValue]) -> None:
        if not state:
            self._buf = None
            return
        if self.momentum == 0 or set(state) != {"momentum_buffer"}:
            raise ValueError(f"SGD state cannot be {sorted(state)}")
        self._buf = _flat_copy(state, "momentum_buffer", self.param.numel())


class AdamRule(UpdateRule):
    """Adam (Kingma and Ba 2015, "Adam: A Method for Stochastic Optimization",
    algorithm 1), or AdamW with ``decoupled_weight_decay`` (Loshchilov and
    Hutter 2019), through ``torch._fused_adam_`` as ``torch.optim.Adam(fused=True)``.

    State, created at the first step: ``step`` (float32 0-d), ``exp_avg``,
    ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq`` (float32 ``[numel]``).

    Raises:
        ConfigError: a hyper-parameter out of range.
    """

    def __init__(
        self,
        param: Tensor,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        super().__init__(param)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"Adam betas must be two numbers in [0, 1), got {betas!r}")
        if eps < 0 or weight_decay < 0:
            raise ConfigError("Adam eps and weight decay must be >= 0")
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = eps
        self.weight_decay = weight_decay
        self.amsgrad = amsgrad
        self.maximize = maximize
        self._kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        self._state: dict[str, Tensor] = {}

    def _keys(self) -> set[str]:
        return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if self.amsgrad else set())

    def step(self, grad: Tensor, lr: float) -> None:
        s = self._state
        if not s:
            s["step"] = torch.zeros((), dtype=torch.float32)
            s["exp_avg"] = torch.zeros_like(self.param)
            s["exp_avg_sq"] = torch.zeros_like(self.param)
            if self.amsgrad:
                s["max_exp_avg_sq"] = torch.zeros_like(self.param)
        s["step"].add_(1)
        self._kernel(
            [self.param],
            [grad],
            [s["exp_avg"]],
            [s["exp_avg_sq"]],
            [s["max_exp_avg_sq"]] if self.amsgrad else [],
            [s["step"]],
            amsgrad=self.amsgrad,
            lr=lr,
            beta1=self.beta1,
            beta2=self.beta2,
            weight_decay=self.weight_decay,
            eps=self.eps,
            maximize=self.maximize,
            grad_scale=None,
            found_inf=None,
        )

    def state(self) -> dict[str, StateValue]:
        return dict(self._state)

    def load_state(self, state: Mapping[str, StateValue]) -> None:
        if state and set(state) != self._keys():
            raise ValueError(f"Adam state must have {sorted(self._keys())}, got {sorted(state)}")
        self._state = _load_stepped(state, self.param.numel())


class AdagradRule(UpdateRule):
    """AdaGrad (Duchi et al. 2011, "Adaptive Subgradient Methods for Online
    Learning and Stochastic Optimization"), through ``torch._fused_adagrad_``
    as ``torch.optim.Adagrad(fused=True)``.

    State, created at once: ``step`` (float32 0-d) and ``sum`` (float32
    ``[numel]``, starting at ``initial_accumulator_value``).

    Raises:
        ConfigError: a hyper-parameter out of range.
    """

    def __init__(
        self,
        param: Tensor,
        *,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        maximize: bool = False,
    ) -> None:
        super().__init__(param)
        if min(lr_decay, weight_decay, initial_accumulator_value, eps) < 0:
            raise ConfigError(
                "AdaGrad lr_decay, weight decay, initial_accumulator_value and eps must be >= 0"
            )
        self.lr_decay = lr_decay
        self.weight_decay = weight_decay
        self.initial_accumulator_value = initial_accumulator_value
        self.eps = eps
        self.maximize = maximize
        self._state: dict[str, Tensor] = {}
        self.load_state({})

    def step(self, grad: Tensor, lr: float) -> None:
        s = self._state
        s["step"].add_(1)
        torch._fused_adagrad_(
            [self.param],
            [grad],
            [s["sum"]],
            [s["step"]],
            lr=lr,
            lr_decay=self.lr_decay,
            weight_decay=self.weight_decay,
            eps=self.eps,
            maximize=self.maximize,
            grad_scale=None,
            found_inf=None,
        )

    def state(self) -> dict[str, StateValue]:
        return dict(self._state)

    def load_state(self, state: Mapping[str, StateValue]) -> None:
        if not state:
            self._state = {
                "step": torch.zeros((), dtype=torch.float32),
                "sum": torch.full_like(self.param, self.initial_accumulator_value),
            }
            return
        if set(state) != {"step", "sum"}:
            raise ValueError(f"AdaGrad state must have ['step', 'sum'], got {sorted(state)}")
        self._state = _load_stepped(state, self.param.numel())


class TorchOptimizerRule(UpdateRule):
    """A ``torch.optim`` optimizer over the flat tensor (any class the PS can run).

    Element-wise optimizers only: one step over the flat tensor equals one
    step per parameter (see :func:`elasticps.updater.check_torch_optimizer`).

    Raises:
        ConfigError: the options do not fit the optimizer class.
    """

    def __init__(self, param: Tensor, config: OptimizerConfig) -> None:
        super().__init__(param)
        self._leaf = torch.nn.Parameter(param, requires_grad=True)
        self.optimizer = make_torch_optimizer([self._leaf], config)

    def step(self, grad: Tensor, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._leaf.grad = grad
        try:
            self.optimizer.step()
        finally:
            self._leaf.grad = None

    def state(self) -> dict[str, StateValue]:
        per_param: dict[str, StateValue] = self.optimizer.state_dict()["state"].get(0, {})
        return dict(per_param)

    def load_state(self, state: Mapping[str, StateValue]) -> None:
        template = self.optimizer.state_dict()
        template["state"] = {0: dict(state)} if state else {}
        self.optimizer.load_state_dict(template)


def make_update_rule(param: Tensor, config: OptimizerConfig) -> UpdateRule:
    """The update rule ``config`` names, bound to ``param``.

    Args:
        param: float32 ``[numel]``, contiguous; updated in place by every step.
        config: name, weight decay, momentum and ``options`` (JSON). The
            built-in rules take the options in :data:`BUILTIN_OPTIONS`; any
            other option, or ``name="torch"``, gives a :class:`TorchOptimizerRule`.

    Returns:
        :class:`SGDRule` (``sgd``, ``momentum``), :class:`AdamRule`,
        :class:`AdagradRule`, or :class:`TorchOptimizerRule`.

    Raises:
        ConfigError: a hyper-parameter out of range, or options the
            optimizer does not take.
    """
    options: dict[str, Any] = json.loads(config.options) if config.options else {}
    allowed = BUILTIN_OPTIONS.get(config.name)
    if allowed is None or not options.keys() <= allowed:
        return TorchOptimizerRule(param, config)
    wd = config.weight_decay
    try:
        if config.name == "sgd":
            return SGDRule(param, weight_decay=wd, **options)
        if config.name == "momentum":
            return SGDRule(param, momentum=config.momentum, weight_decay=wd, **options)
        if config.name == "adam":
            if "betas" in options:
                options["betas"] = tuple(options["betas"])
            return AdamRule(param, weight_decay=wd, **options)
        return AdagradRule(param, weight_decay=wd, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot build optimizer {config.name!r}: {exc}") from exc


def _flat_copy(state: Mapping[str, StateValue], key: str, numel: int) -> Tensor:
    value = state[key]
    if not isinstance(value, Tensor) or value.numel() != numel:
        raise ValueError(f"optimizer state {key!r} must be a tensor of {numel} elements")
    return value.detach().reshape(-1).to(torch.float32).clone()


def _load_stepped(state: Mapping[str, StateValue], numel: int) -> dict[str, Tensor]:
    """Copy a ``step`` counter (kept as float32 0-d) and ``[numel]`` tensors."""
    out: dict[str, Tensor] = {}
    for key in state:
        if key == "step":
            step = state[key]
            value = float(step.item()) if isinstance(step, Tensor) else float(step)
            if not value >= 0:
                raise ValueError(f"optimizer state 'step' must be >= 0, got {value}")
            out[key] = torch.tensor(value, dtype=torch.float32)
        else:
            out[key] = _flat_copy(state, key, numel)
    return out
