"""Tensors a model holds under several names: tied weights and shared buffers.

A model whose output projection reuses its embedding (``head.weight =
emb.weight``, as GPT-2 and T5 do) holds one ``nn.Parameter`` under two
names. ``named_parameters()`` lists it once, under its first name;
``state_dict()`` lists it under every name. elasticps trains, places,
pushes, checkpoints and saves each tensor once, under its first name (its
*canonical* name), and treats every other name as an *alias*: a file written
by elasticps (``model.safetensors``, a consistent checkpoint) holds one
tensor for the pair, and loading it into a freshly built model fills the
one shared tensor, so the names stay one parameter (``a is b``).

The same holds for a buffer shared between modules (the first name of
:func:`elasticps.buffers.model_buffers`).

>>> import torch
>>> emb = torch.nn.Embedding(5, 3)
>>> model = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(3, 5, bias=False)})
>>> model["head"].weight = emb.weight
>>> state_aliases(model)
{'head.weight': 'emb.weight'}
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from elasticps.buffers import model_buffers

__all__ = ["canonical_names", "state_aliases", "with_aliases", "without_aliases"]


def canonical_names(model: nn.Module) -> list[str]:
    """The names elasticps stores: ``state_dict()`` keys less every alias, in its order."""
    aliases = state_aliases(model)
    return [name for name in model.state_dict(keep_vars=True) if name not in aliases]


def state_aliases(model: nn.Module) -> dict[str, str]:
    """Every ``state_dict()`` name that holds a tensor listed under an earlier name.

    Args:
        model: the module.

    Returns:
        alias -> canonical name (the name ``named_parameters()``, or
        :func:`~elasticps.buffers.model_buffers` for a buffer, reports),
        in ``state_dict()`` order; empty for a model that shares nothing.
    """
    canonical: dict[int, str] = {}
    for name, param in model.named_parameters():
        canonical.setdefault(id(param), name)
    for name, buf in model_buffers(model):
        canonical.setdefault(id(buf), name)
    out: dict[str, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        first = canonical.get(id(value))
        if first is not None and first != name:
            out[name] = first
    return out


def with_aliases(tensors: Mapping[str, Tensor], aliases: Mapping[str, str]) -> dict[str, Tensor]:
    """``tensors`` plus each alias whose canonical name they hold, as that same tensor.

    What ``model.load_state_dict(..., strict=True)`` needs from a file that
    holds each shared tensor once. An alias ``tensors`` already has keeps its
    own value.
    """
    out = dict(tensors)
    for alias, name in aliases.items():
        if alias not in out and name in out:
            out[alias] = out[name]
    return out


def without_aliases(tensors: Mapping[str, Tensor], aliases: Mapping[str, str]) -> dict[str, Tensor]:
    """``tensors`` less every alias: each shared tensor once, under its canonical name."""
    return {name: value for name, value in tensors.items() if name not in aliases}
