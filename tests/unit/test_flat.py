"""Tests of binding a model to flat parameter and gradient buffers
(``elasticps.trainer.flat``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from elasticps.errors import ModelContractError
from elasticps.trainer.flat import FlatModel, bind_flat_buffers

# Small enough that the 4x3 weight (12 elements) is sliced over the 2 shards.
NUM_SHARDS = 2
BOUND = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def make_input() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1))


def reference_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of ``model(x).square().sum()`` on an unbound copy, by name."""
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(model(x).square().sum(), params)
    return dict(zip(names, grads, strict=True))


def flat_slice(flat: FlatModel, buffer: torch.Tensor, name: str) -> torch.Tensor:
    off = flat.placement.flat_offsets[name]
    return buffer[off : off + flat.placement.param(name).numel]


def test_parameters_are_views_into_the_flat_buffer_at_their_offsets() -> None:
    model = make_model()

    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)

    sliced = [p for s in flat.placement.shards for p in s.pieces if p.param_start > 0]
    assert sliced  # precondition: the layout includes a parameter split over shards
    assert flat.params.shape == (flat.placement.total_numel,)
    assert flat.placement.total_numel == sum(p.numel() for p in model.parameters())
    storage = flat.params.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert p.untyped_storage().data_ptr() == storage
        offset = flat.placement.flat_offsets[name]
        assert p.storage_offset() == flat.params.storage_offset() + offset
        assert p.is_contiguous()


def test_binding_preserves_parameter_values() -> None:
    model = make_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)

    for name, p in model.named_parameters():
        assert_close(p.detach(), before[name])
        assert_close(flat_slice(flat, flat.params, name), before[name].reshape(-1))


def test_writing_the_flat_buffer_changes_the_model_output() -> None:
    model = make_model()
    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)
    x = make_input()

    flat.params.zero_()
    flat_slice(flat, flat.params, "2.bias").copy_(torch.tensor([1.5, -2.0]))

    # All weights zero: the output is the last layer's bias, for every input row.
    assert_close(model(x).detach(), torch.tensor([[1.5, -2.0]]).expand(5, 2))


def test_backward_accumulates_into_the_flat_gradient_buffer_in_place() -> None:
    model = make_model()
    expected = reference_grads(copy.deepcopy(model), make_input())
    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)
    grads_ptr = flat.grads.data_ptr()
    assert_close(flat.grads, torch.zeros_like(flat.grads))

    model(make_input()).square().sum().backward()

    assert flat.grads.data_ptr() == grads_ptr
    assert flat.grads_are_bound()
    for name, g in expected.items():
        assert_close(flat_slice(flat, flat.grads, name), g.reshape(-1))

    model(make_input()).square().sum().backward()

    assert flat.grads_are_bound()
    for name, g in expected.items():
        assert_close(flat_slice(flat, flat.grads, name), 2 * g.reshape(-1))


def test_zero_grad_zeroes_the_buffer_and_keeps_it_bound() -> None:
    model = make_model()
    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)
    model(make_input()).sum().backward()
    assert flat.grads.abs().sum() > 0

    flat.zero_grad()

    assert_close(flat.grads, torch.zeros_like(flat.grads))
    assert flat.grads_are_bound()
    for p in model.parameters():
        assert p.grad is not None
        assert_close(p.grad, torch.zeros_like(p))


def test_grads_are_unbound_after_model_zero_grad_sets_them_to_none() -> None:
    model = make_model()
    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)
    assert flat.grads_are_bound()

    model.zero_grad(set_to_none=True)

    assert not flat.grads_are_bound()


def test_grads_are_unbound_when_replaced_by_a_fresh_tensor() -> None:
    model = make_model()
    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)
    first = next(model.parameters())

    first.grad = torch.zeros_like(first)

    assert not flat.grads_are_bound()


class TiedModel(nn.Module):
    """Two layers that share one weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.tanh(self.a(x)))
        return out


def test_shared_parameter_is_placed_once_and_gets_both_gradients() -> None:
    model = TiedModel()
    expected = reference_grads(copy.deepcopy(model), make_input())

    flat = bind_flat_buffers(model, NUM_SHARDS, BOUND)

    assert sorted(p.name for p in flat.placement.params) == ["a.bias", "a.weight", "b.bias"]
    assert flat.placement.total_numel == 9 + 3 + 3
    assert model.b.weight is model.a.weight
    model(make_input()).square().sum().backward()
    assert flat.grads_are_bound()
    for name, g in expected.items():
        assert_close(flat_slice(flat, flat.grads, name), g.reshape(-1))


def test_float64_parameter_raises_model_contract_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1).double())

    with pytest.raises(ModelContractError):
        bind_flat_buffers(model, NUM_SHARDS, BOUND)


def test_model_without_parameters_raises_model_contract_error() -> None:
    with pytest.raises(ModelContractError):
        bind_flat_buffers(nn.ReLU(), NUM_SHARDS, BOUND)
