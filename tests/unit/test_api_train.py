"""elasticps.train in-process (cluster=None), elasticps.infer, and the trainer-side freeze."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import Tensor, nn

import elasticps
from elasticps.errors import ConfigError, DataError, MissingParameterError, ModelContractError
from elasticps.placement import ParamSpec, plan_placement
from elasticps.trainer.flat import frozen_ranges

X = torch.linspace(-1, 1, 64).reshape(-1, 1)
Y = 3 * X.squeeze(-1) + 1


def reader() -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(0, 64, 16):
        yield X[i : i + 16], Y[i : i + 16]


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    return torch.nn.functional.mse_loss(outputs.squeeze(-1), targets)


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Linear(1, 4)
        self.B = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.B(torch.tanh(self.A(x)))


def test_in_process_training_fits_a_line_and_leaves_the_model_alone() -> None:
    model = nn.Linear(1, 1)
    before = elasticps.parameters.create(model)
    result = elasticps.train(
        model, mse, reader, updater=elasticps.updater.SGD(lr=0.3), num_passes=30, cluster=None
    )
    assert result["weight"].item() == pytest.approx(3.0, abs=0.05)
    assert result["bias"].item() == pytest.approx(1.0, abs=0.05)
    assert before.equal(elasticps.parameters.create(model))


def test_frozen_parameters_stay_bit_identical_even_under_adam_with_weight_decay() -> None:
    model = Two()
    before = elasticps.parameters.create(model)
    result = elasticps.train(
        model,
        mse,
        reader,
        updater=elasticps.updater.Adam(lr=0.05, weight_decay=0.1),
        frozen_parameters={"A.*"},
        num_passes=3,
        cluster=None,
    )
    assert torch.equal(result["A.weight"], before["A.weight"])
    assert torch.equal(result["A.bias"], before["A.bias"])
    assert not torch.equal(result["B.weight"], before["B.weight"])


def test_a_frozen_pattern_that_matches_nothing_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'C\.\*' match no parameter"):
        elasticps.train(Two(), mse, reader, frozen_parameters={"C.*"}, cluster=None)


def test_a_bad_frozen_pattern_fails_before_any_server_starts() -> None:
    with pytest.raises(ConfigError, match="match no parameter"):
        elasticps.train(
            Two(), mse, reader, frozen_parameters={"C.*"}, cluster=elasticps.Local(trainers=1, ps=1)
        )


def test_initial_values_come_from_a_parameter_set() -> None:
    start = elasticps.ParameterSet({"weight": torch.full((1, 1), 3.0), "bias": torch.ones(1)})
    result = elasticps.train(
        nn.Linear(1, 1),
        mse,
        reader,
        updater=elasticps.updater.SGD(lr=0.1),
        parameters=start,
        cluster=None,
    )
    # Already at the optimum: the gradients are ~0.
    assert torch.allclose(result["weight"], start["weight"], atol=1e-5)


def test_a_schedule_by_model_version_is_applied_in_process() -> None:
    start = elasticps.parameters.create(nn.Linear(1, 1))
    one_step = elasticps.train(
        nn.Linear(1, 1),
        mse,
        lambda: iter([(X, Y)]),
        updater=elasticps.updater.SGD(lr=0.1),
        parameters=start,
        cluster=None,
    )
    # Full rate for version 0 only, then (almost) nothing: three steps move like one.
    tiny = elasticps.updater.Piecewise(boundaries=(1,), factors=(1.0, 1e-12))
    scheduled = elasticps.train(
        nn.Linear(1, 1),
        mse,
        lambda: iter([(X, Y), (X, Y), (X, Y)]),
        updater=elasticps.updater.SGD(lr=0.1, schedule=tiny),
        parameters=start,
        cluster=None,
    )
    assert not torch.equal(one_step["weight"], start["weight"])
    assert torch.allclose(scheduled["weight"], one_step["weight"], atol=1e-6)


def test_a_reader_that_yields_no_pairs_breaks_the_contract() -> None:
    with pytest.raises(ModelContractError, match="tensor pairs"):
        elasticps.train(nn.Linear(1, 1), mse, lambda: iter([X]), cluster=None)


def test_an_empty_reader_is_a_data_error() -> None:
    with pytest.raises(DataError, match="no batches"):
        elasticps.train(nn.Linear(1, 1), mse, lambda: iter([]), cluster=None)


def test_a_loss_that_is_not_a_scalar_breaks_the_contract() -> None:
    def per_sample(outputs: Tensor, targets: Tensor) -> Tensor:
        return (outputs.squeeze(-1) - targets) ** 2

    with pytest.raises(ModelContractError, match="scalar"):
        elasticps.train(nn.Linear(1, 1), per_sample, reader, cluster=None)


def test_infer_runs_a_sub_network_with_a_subset_of_the_parameters() -> None:
    class OnlyB(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.B = nn.Linear(4, 1)

        def forward(self, h: Tensor) -> Tensor:
            return self.B(h)

    full = elasticps.parameters.create(Two())
    sub = OnlyB()
    sub.train()
    out = elasticps.infer(sub, full, torch.ones(2, 4))
    expected = torch.ones(2, 4) @ full["B.weight"].T + full["B.bias"]
    assert isinstance(out, Tensor)
    assert torch.allclose(out, expected)
    assert not out.requires_grad
    assert sub.training  # restored


def test_infer_names_the_missing_parameters() -> None:
    with pytest.raises(MissingParameterError, match=r"A\.weight, A\.bias"):
        elasticps.infer(Two(), {"B.weight": torch.zeros(1, 4), "B.bias": torch.zeros(1)}, X)


def test_parquet_dataset_in_process(tmp_path: Path) -> None:
    path = tmp_path / "line.parquet"
    pq.write_table(pa.table({"x": X.squeeze(-1).tolist(), "y": Y.tolist()}), path)

    def to_tensors(batch: pa.Table) -> tuple[Tensor, Tensor]:
        x = torch.tensor(batch.column("x").to_pylist()).unsqueeze(-1)
        return x, torch.tensor(batch.column("y").to_pylist())

    seen: list[int] = []
    data = elasticps.Parquet(path, to_tensors, ("x", "y"), batch_size=10, records_per_task=25)
    elasticps.train(
        nn.Linear(1, 1),
        mse,
        data,
        cluster=None,
        event_handler=lambda e: (
            seen.append(int(e.metrics["samples"]))
            if isinstance(e, elasticps.events.EndIteration)
            else None
        ),
    )
    # Mini-batches never cross a task boundary (tasks of 25 rows), as on a trainer.
    assert seen == [10, 10, 5, 10, 10, 5, 10, 4]


def test_local_cluster_settings_are_validated() -> None:
    assert elasticps.Local(mode="async", push_every=2).update_mode.value == "async"
    with pytest.raises(ConfigError, match="sync"):
        elasticps.Local(mode="sideways")
    with pytest.raises(ConfigError, match="push_every"):
        elasticps.Local(mode="sync", push_every=2)
    with pytest.raises(ConfigError, match="trainers"):
        elasticps.Local(trainers=0)


def test_frozen_ranges_cover_matching_parameters_in_the_flat_buffer() -> None:
    placement = plan_placement([ParamSpec("D.w", (2, 3)), ParamSpec("G.w", (4,))], 1)
    lo = placement.flat_offsets["D.w"]
    assert frozen_ranges(placement, {"D.*"}) == [(lo, lo + 6)]
    assert frozen_ranges(placement, ()) == []
