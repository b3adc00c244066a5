"""Bind a model's parameters and gradients to flat buffers.

After :func:`bind_flat_buffers`, every parameter ``p`` of the model is a view
into one flat float32 parameter buffer, and ``p.grad`` a view into one flat
gradient buffer, at the offsets the :class:`~elasticps.placement.Placement`
gives. Autograd accumulates into an existing ``.grad`` in place, so
``loss.backward()`` writes the gradient buffer directly, and pulls written
into the parameter buffer change the model directly.

The model's persistent buffers (BatchNorm statistics) have a place in both
flat buffers too, after the parameters, but are not views into them (an
integer buffer cannot be): :class:`~elasticps.buffers.BufferSync` copies
their increments into the gradient buffer before a push and pulled values
out of the parameter buffer (see :mod:`elasticps.buffers`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from elasticps.buffers import BufferSync, buffer_specs
from elasticps.errors import ConfigError, ModelContractError
from elasticps.placement import (
    DEFAULT_BIG_ARRAY_BOUND,
    DEFAULT_PLACEMENT,
    ParamSpec,
    Placement,
    plan_placement,
)
from elasticps.trainer.pages import page_aligned_zeros


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """The model's parameters as :class:`ParamSpec`, in ``named_parameters`` order.

    Parameters shared between layers appear once, under their first name.

    Raises:
        ModelContractError: a parameter is not float32, or there are none.
    """
    specs = []
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ModelContractError(f"parameter {name} is {p.dtype}; elasticps trains float32")
        specs.append(ParamSpec(name, tuple(p.shape)))
    if not specs:
        raise ModelContractError("the model has no parameters")
    return specs


@dataclass(frozen=True)
class FlatModel:
    """A model bound to flat buffers.

    Attributes:
        model: the module; its parameters are views into ``params``.
        placement: where each parameter lives on the parameter servers.
        params: float32 ``[placement.total_numel]``.
        grads: float32 ``[placement.total_numel]``; the ``.grad`` of every parameter.
        buffers: the account of the model's persistent buffers; None if it has none.
        page_aligned: ``params`` and ``grads`` were allocated by
            :func:`elasticps.trainer.pages.page_aligned_zeros`, so that a
            :class:`~elasticps.trainer.client.ParameterClient` may map shared
            memory over their pages (``map_buffers``).
    """

    model: torch.nn.Module
    placement: Placement
    params: torch.Tensor
    grads: torch.Tensor
    buffers: BufferSync | None = None
    page_aligned: bool = False

    def zero_grad(self) -> None:
        """Zero the gradient buffer in place (never ``set_to_none``)."""
        self.grads.zero_()

    def grads_are_bound(self) -> bool:
        """True if every parameter's ``.grad`` still shares the flat gradient buffer."""
        base = self.grads.data_ptr()
        end = base + self.grads.numel() * 4
        for p in self.model.parameters():
            g = p.grad
            if g is None or not base <= g.data_ptr() < end:
                return False
        return True


def bind_flat_buffers(
    model: torch.nn.Module,
    num_shards: int,
    big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND,
    strategy: str = DEFAULT_PLACEMENT,
) -> FlatModel:
    """Move the model's parameters into flat buffers laid out for ``num_shards`` PS.

    The parameter values are kept; gradients start at zero. The model's
    persistent buffers get their place after the parameters, holding their
    current (encoded) values in ``params`` and zeros in ``grads``.

    Args:
        model: the model; modified in place.
        num_shards: number of parameter servers.
        big_array_bound: slicing threshold, elements.
        strategy: placement strategy, one of
            :data:`elasticps.placement.PLACEMENTS`.

    Returns:
        The bound model.

    Raises:
        ModelContractError: see :func:`param_specs` and
            :func:`elasticps.buffers.buffer_specs`.
        ConfigError: see :func:`elasticps.placement.plan_placement`.
    """
    specs = buffer_specs(model)
    placement = plan_placement(param_specs(model), num_shards, big_array_bound, specs, strategy)
    # Page-aligned, so that the client may map the servers' shared memory over them.
    params = page_aligned_zeros(placement.total_numel)
    grads = page_aligned_zeros(placement.total_numel)
    with torch.no_grad():
        for name, p in model.named_parameters():
            off = placement.flat_offsets[name]
            n = p.numel()
            params[off : off + n].copy_(p.reshape(-1))
            p.data = params[off : off + n].view_as(p)
            p.grad = grads[off : off + n].view_as(p)
    sync = BufferSync(model, specs, placement.flat_offsets) if specs else None
    if sync is not None:
        sync.encode_into(params)
    return FlatModel(model, placement, params, grads, sync, page_aligned=True)


def frozen_ranges(placement: Placement, patterns: Iterable[str]) -> list[tuple[int, int]]:
    """Flat-buffer element ranges ``[start, end)`` of the parameters matching ``patterns``.

    Args:
        placement: the flat layout.
        patterns: glob patterns (``fnmatch.fnmatchcase``) over parameter names,
            e.g. ``{"D.*"}``.

    Returns:
        Ranges in flat order; empty for no patterns.

    Raises:
        ConfigError: a pattern matches no parameter (a typo would otherwise
            silently train what was meant to be frozen).
    """
    pats = list(patterns)
    ranges = []
    used: set[str] = set()
    for spec in placement.params:
        hits = [p for p in pats if fnmatch.fnmatchcase(spec.name, p)]
        if hits:
            used.update(hits)
            start = placement.flat_offsets[spec.name]
            ranges.append((start, start + spec.numel))
    unused = [p for p in pats if p not in used]
    if unused:
        names = ", ".join(s.name for s in placement.params[:8])
        raise ConfigError(
            f"frozen pattern(s) {', '.join(map(repr, unused))} match no parameter "
            f"(parameters: {names}{', ...' if len(placement.params) > 8 else ''})"
        )
    return sorted(ranges)
