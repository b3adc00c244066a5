"""Training events, delivered to the ``event_handler`` of :func:`elasticps.train`.

Every event is a frozen dataclass. The training events carry the same five
fields (after PaddlePaddle's v2 API events):

- ``pass_id``: the pass (epoch), 0-based;
- ``batch_id``: the mini-batch; for a reader function, the index of the
  batch in ``reader()`` (0-based, unique within a pass whatever trainer
  trained it); for a Parquet dataset, the count of mini-batches the trainer
  began in this pass;
- ``cost``: the loss, a Python float (NaN where there is none yet);
- ``model_version``: the parameter servers' model version (number of
  optimizer steps applied; with several PS, the highest), an int;
- ``metrics``: a ``dict[str, float]``, e.g. ``samples`` (rows or examples);
  each event class says which keys it sets.

Order, within one job: :class:`BeginTraining`, then for each pass
:class:`BeginPass`, the iterations (:class:`BeginIteration` /
:class:`EndIteration` pairs of each trainer, interleaved when there are
several), :class:`EndPass`; then :class:`EndTraining`. :class:`TrainerJoined`
and :class:`TrainerLost` arrive when a trainer registers in etcd or its lease
ends; :class:`Checkpointed` when a checkpoint was written. Handlers are called
one at a time (under a lock), in the user's process, so they need not be
thread-safe; a handler that raises stops the job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

__all__ = [
    "BeginIteration",
    "BeginPass",
    "BeginTraining",
    "Checkpointed",
    "EndIteration",
    "EndPass",
    "EndTraining",
    "Event",
    "EventHandler",
    "TrainerJoined",
    "TrainerLost",
    "TrainingEvent",
]


@dataclass(frozen=True)
class TrainingEvent:
    """Base class of every event: pass id, batch id, cost, model version, metrics.

    Attributes:
        pass_id: pass (epoch), 0-based.
        batch_id: mini-batch (see the module docstring); 0 where meaningless.
        cost: loss as a float; NaN where there is none.
        model_version: model version on the parameter servers (optimizer steps).
        metrics: named float metrics; always has ``samples`` where counted.
        trainer_id: the trainer the event is about, or -1 for job-wide events.
    """

    pass_id: int = 0
    batch_id: int = 0
    cost: float = math.nan
    model_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    trainer_id: int = -1


@dataclass(frozen=True)
class BeginTraining(TrainingEvent):
    """The job starts: servers (if any) are up, the initial parameters are set.

    ``metrics``: ``num_passes``, ``num_trainers``, ``num_parameters`` (tensors)
    and ``numel`` (float32 elements).
    """


@dataclass(frozen=True)
class EndTraining(TrainingEvent):
    """The job is over; ``cost`` is the last pass's mean cost.

    ``batch_id`` is the number of mini-batches trained in the whole job;
    ``metrics``: ``samples`` and ``wall_s`` (seconds since :class:`BeginTraining`).
    """


@dataclass(frozen=True)
class BeginPass(TrainingEvent):
    """The first mini-batch of pass ``pass_id`` is about to be trained."""


@dataclass(frozen=True)
class EndPass(TrainingEvent):
    """Pass ``pass_id`` is over.

    ``cost`` is the sample-weighted mean cost of its mini-batches, ``batch_id``
    the number of mini-batches in it, ``metrics["samples"]`` its samples.
    """


@dataclass(frozen=True)
class BeginIteration(TrainingEvent):
    """Trainer ``trainer_id`` starts mini-batch ``batch_id`` (``cost`` is NaN)."""


@dataclass(frozen=True)
class EndIteration(TrainingEvent):
    """Trainer ``trainer_id`` trained mini-batch ``batch_id``.

    ``cost`` is the mini-batch's loss, ``model_version`` the version after its
    push and pull (when it pushed), ``metrics["samples"]`` its samples.
    """


@dataclass(frozen=True)
class TrainerJoined(TrainingEvent):
    """Trainer ``trainer_id`` registered in etcd (with ``Local``, ``Hosts`` or ``Slurm``)."""


@dataclass(frozen=True)
class TrainerLost(TrainingEvent):
    """Trainer ``trainer_id``'s registration ended (finished, or its lease expired)."""


@dataclass(frozen=True)
class Checkpointed(TrainingEvent):
    """A checkpoint of the parameters was written.

    Attributes:
        path: the checkpoint directory (``manifest.json`` and safetensors files).
    """

    path: Path = Path()


Event: TypeAlias = TrainingEvent
"""Any event of this module."""

EventHandler: TypeAlias = Callable[[TrainingEvent], None]
"""What :func:`elasticps.train` calls with each event."""
