"""ParameterSet: creation from models, one name one parameter, safetensors, inspection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from elasticps import parameters
from elasticps.errors import ConfigError, DataError, MissingParameterError
from elasticps.parameters import ParameterSet


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 3)
        self.dec = nn.Linear(3, 3)
        self.dec.weight = self.enc.weight  # shared between layers


def test_create_names_shapes_and_dtypes_of_one_model() -> None:
    ps = parameters.create(nn.Linear(3, 2))
    assert ps.names() == ["weight", "bias"]
    assert ps.shapes() == {"weight": (2, 3), "bias": (2,)}
    assert ps.dtypes() == {"weight": torch.float32, "bias": torch.float32}
    assert ps.numel() == 8
    assert ps.nbytes() == 32
    assert "2 parameters, 8 elements, 32 bytes" in ps.describe()


def test_a_tensor_shared_between_layers_is_one_parameter() -> None:
    ps = parameters.create(Tied())
    assert ps.names() == ["enc.weight", "enc.bias", "dec.bias"]


def test_same_name_in_several_models_is_one_parameter_with_the_first_value() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    ps = parameters.create([a, b])
    assert len(ps) == 2
    assert torch.equal(ps["weight"], a.weight)


def test_same_name_with_different_shapes_is_refused() -> None:
    with pytest.raises(ConfigError, match="one name is one parameter"):
        parameters.create([nn.Linear(2, 2), nn.Linear(3, 2)])


def test_the_set_is_a_copy_of_the_model() -> None:
    model = nn.Linear(2, 2)
    ps = parameters.create(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(ps["weight"], model.weight)


def test_save_and_load_round_trip_keeps_order_and_bits(tmp_path: Path) -> None:
    ps = parameters.create(Tied())
    path = ps.save(tmp_path / "sub" / "p.safetensors")
    loaded = parameters.load(path)
    assert loaded.names() == ps.names()
    assert loaded.equal(ps)


def test_load_of_a_missing_or_corrupt_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        parameters.load(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(DataError, match="cannot read"):
        parameters.load(bad)


def test_copy_into_names_missing_parameters() -> None:
    ps = ParameterSet({"weight": torch.zeros(2, 2)})
    model = nn.Linear(2, 2)
    with pytest.raises(MissingParameterError, match="bias"):
        ps.copy_into(model)
    assert ps.copy_into(model, strict=False) == ["bias"]
    assert torch.equal(model.weight, torch.zeros(2, 2))


def test_copy_into_refuses_a_shape_mismatch() -> None:
    ps = ParameterSet({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})
    with pytest.raises(ConfigError, match="shape"):
        ps.copy_into(nn.Linear(2, 2))


def test_select_by_glob_patterns() -> None:
    ps = ParameterSet({"D.w": torch.zeros(1), "D.b": torch.zeros(1), "G.w": torch.zeros(1)})
    assert ps.select({"D.*"}).names() == ["D.w", "D.b"]


def test_non_tensor_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="not a tensor"):
        ParameterSet({"w": [1.0]})  # type: ignore[dict-item]
