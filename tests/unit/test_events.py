"""Events of elasticps.train: frozen dataclasses, their order and their contents (in-process)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

import elasticps
from elasticps import events

X = torch.linspace(-1, 1, 48).reshape(-1, 1)
Y = 3 * X.squeeze(-1) + 1


def reader() -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(0, 48, 16):
        yield X[i : i + 16], Y[i : i + 16]


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    return torch.nn.functional.mse_loss(outputs.squeeze(-1), targets)


def run(num_passes: int = 2) -> list[events.TrainingEvent]:
    got: list[events.TrainingEvent] = []
    elasticps.train(
        nn.Linear(1, 1),
        mse,
        reader,
        updater=elasticps.updater.SGD(lr=0.1),
        event_handler=got.append,
        num_passes=num_passes,
        cluster=None,
    )
    return got


def test_events_are_frozen_dataclasses() -> None:
    event = events.EndIteration(pass_id=1, batch_id=2, cost=0.5, model_version=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.cost = 1.0  # type: ignore[misc]
    assert math.isnan(events.BeginPass().cost)


def test_event_order_of_an_in_process_job() -> None:
    names = [type(e).__name__ for e in run()]
    per_pass = ["BeginPass"] + ["BeginIteration", "EndIteration"] * 3 + ["EndPass"]
    assert names == ["BeginTraining", *per_pass, *per_pass, "EndTraining"]


def test_iteration_events_carry_pass_batch_cost_and_version() -> None:
    ends = [e for e in run() if isinstance(e, events.EndIteration)]
    assert [(e.pass_id, e.batch_id) for e in ends] == [(p, b) for p in (0, 1) for b in (0, 1, 2)]
    assert [e.model_version for e in ends] == [1, 2, 3, 4, 5, 6]
    assert all(e.metrics["samples"] == 16 for e in ends)
    assert ends[5].cost < ends[2].cost  # the same batch, one pass later


def test_end_pass_cost_is_the_sample_weighted_mean_of_its_iterations() -> None:
    got = run(num_passes=1)
    costs = [e.cost for e in got if isinstance(e, events.EndIteration)]
    end_pass = next(e for e in got if isinstance(e, events.EndPass))
    assert end_pass.cost == pytest.approx(sum(costs) / len(costs))
    assert end_pass.batch_id == 3
    assert end_pass.metrics["samples"] == 48
    end = got[-1]
    assert isinstance(end, events.EndTraining)
    assert end.batch_id == 3
    assert end.model_version == 3
    assert end.cost == end_pass.cost


def test_begin_training_describes_the_job() -> None:
    begin = run(num_passes=1)[0]
    assert isinstance(begin, events.BeginTraining)
    assert begin.metrics == {
        "num_passes": 1.0,
        "num_trainers": 1.0,
        "num_parameters": 2.0,
        "numel": 2.0,
    }


def test_a_handler_that_raises_stops_the_job() -> None:
    def handler(event: events.TrainingEvent) -> None:
        if isinstance(event, events.EndIteration):
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        elasticps.train(nn.Linear(1, 1), mse, reader, event_handler=handler, cluster=None)
