"""``elasticps.train`` and ``elasticps.infer``: training and inference from Python.

:func:`train` runs a job either in-process (``cluster=None``: no servers,
for debugging) or on real local servers (``cluster=Local(...)``: etcd, a
master and PS processes, trainers as threads of this process). Both apply
the same update: the gradient of each mini-batch goes into the flat gradient
buffer of the trainer (:func:`~elasticps.trainer.flat.bind_flat_buffers`) and
a :class:`~elasticps.pserver.shard.ParameterShard` applies it with the
updater's ``torch.optim`` optimizer at the scheduled learning rate, keeping
frozen parameters bit-identical. In-process, that shard lives in this
process and holds every parameter; with ``Local`` the PS processes hold it.
So in sync mode with one trainer both give the same parameters (within
float32 rounding of the sample-weighted mean). The model's persistent
buffers (BatchNorm statistics) are trained state too: both paths carry them
as the trainers do (:mod:`elasticps.buffers`) and return them in the
:class:`~elasticps.parameters.ParameterSet`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import elasticps.nn as enn
from elasticps import updater as updater_mod
from elasticps.api.cluster import Hosts, Local, Parquet, Slurm
from elasticps.api.record import RunRecord
from elasticps.api.servers import LocalServers, ServersConfig
from elasticps.buffers import model_buffers
from elasticps.config import CommonConfig, OptimizerConfig, TrainerConfig, UpdateMode
from elasticps.coord.store import JobStore, TrainerMap, Watch
from elasticps.data.parquet import RangeReader, check_columns, count_rows
from elasticps.errors import (
    ConfigError,
    DataError,
    ElasticPSError,
    JobFailedError,
    ModelContractError,
    UserError,
    one_line,
)
from elasticps.events import (
    BeginIteration,
    BeginPass,
    BeginTraining,
    Checkpointed,
    EndIteration,
    EndPass,
    EndTraining,
    TrainerJoined,
    TrainerLost,
    TrainingEvent,
)
from elasticps.launcher.supervisor import (
    Exited,
    FailJob,
    JobFinished,
    Kind,
    Replace,
    exit_status_for,
)
from elasticps.master.taskqueue import split_into_tasks
from elasticps.model_file import (
    ModelSpec,
    call_model,
    in_process_spec,
    lazy_names,
    materialize,
    materialize_as,
    model_arguments,
)
from elasticps.parameters import ParameterSet
from elasticps.pserver.shard import ParameterShard
from elasticps.pserver.sparse import TableSpec
from elasticps.pserver.sparse_shard import TABLES_KEY, RowGrads, ShardTables, tables_layout
from elasticps.snapshot import take_consistent_checkpoint
from elasticps.tables import TableSet, load_tables
from elasticps.trainer.client import ParameterClient
from elasticps.trainer.flat import FlatModel, bind_flat_buffers, frozen_ranges
from elasticps.trainer.worker import (
    Batch,
    Reader,
    Trainer,
    dense_frozen_patterns,
    table_entries,
)

__all__ = ["evaluate_model", "infer", "train"]

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], Tensor]
EventHandler = Callable[[TrainingEvent], None]

# Trainer id of the final pull; never a real trainer's (as the CLI launcher does).
_FINAL_PULL_ID = 2**31 - 1
# Seconds between two checks of the trainer threads and the server processes.
_POLL_S = 0.1


def train(
    model: nn.Module | str | Path | ModelSpec,
    loss_fn: LossFn | None,
    reader: Reader | Parquet | str | Path,
    *,
    updater: updater_mod.Updater | OptimizerConfig | None = None,
    event_handler: EventHandler | None = None,
    frozen_parameters: Iterable[str] = (),
    num_passes: int = 1,
    cluster: Local | Hosts | Slurm | None = Local(),  # noqa: B008 (a frozen value)
    parameters: Mapping[str, Tensor] | None = None,
    test_reader: Reader | Parquet | None = None,
    metrics: Callable[[], Mapping[str, Any]] | None = None,
) -> ParameterSet:
    """Train ``model`` and return its trained parameters.

    The model itself is not changed: every trainer works on a deep copy, and
    the result is a :class:`~elasticps.parameters.ParameterSet` (copy it back
    with ``result.copy_into(model)``). A model with lazy modules
    (``nn.LazyLinear``) is first materialized in place, as its first forward
    pass would: by one forward pass of the reader's first mini-batch, in
    eval mode, under seed 0.

    Args:
        model: a ``torch.nn.Module`` with float32 parameters. Parameters are
            named as ``model.named_parameters()`` names them; a tensor shared
            between layers is one parameter. With ``Hosts`` or ``Slurm``: a
            model file's path, or a ``ModelSpec`` from
            :func:`~elasticps.model_file.load_model_file` (see
            :func:`elasticps.api.launch.launch_request`).
        loss_fn: ``loss_fn(model(inputs), targets) -> Tensor``, a scalar mean
            loss over the mini-batch. With ``Hosts`` or ``Slurm``: None (the
            model file's ``loss``).
        reader: a reader function, called with no arguments, that yields
            mini-batches ``(inputs, targets)`` (tensors; ``len(targets)`` is
            the batch's sample count). Every call must yield the same batches
            in the same order: it is called once to count them, then once per
            task (``itertools.islice(reader(), start, end)``). Or a
            :class:`~elasticps.api.cluster.Parquet` dataset description.
            With ``Hosts`` or ``Slurm``: a data location that every host
            reads (``elasticps train --data``), or a Parquet of one file or
            directory made by :meth:`~elasticps.api.cluster.Parquet.from_model_file`.
        updater: the optimizer the parameter servers run, from
            :mod:`elasticps.updater` (default ``Adam(lr=1e-3)``), with its
            learning-rate schedule by model version.
        event_handler: called with every :mod:`elasticps.events` event, one at
            a time, in this process. An exception in it stops the job: it
            propagates as is with ``cluster=None``; with ``Local`` it is
            raised as a :class:`~elasticps.errors.JobFailedError` whose
            ``__cause__`` is the handler's exception.
        frozen_parameters: glob patterns (``fnmatch``) of parameters that are
            pulled but never updated, e.g. ``{"D.*"}``. Their values stay
            bit-identical.
        num_passes: passes over the data, >= 1.
        cluster: :class:`~elasticps.api.cluster.Local` (default: 2 trainers,
            2 PS, sync), or None to train in this process without servers
            (one trainer, sync-SGD cadence: one update per mini-batch), or
            :class:`~elasticps.api.cluster.Hosts` /
            :class:`~elasticps.api.cluster.Slurm` to run the PS and trainers
            as processes on other machines, through the launcher of
            ``elasticps train --hosts`` / ``--launcher slurm``
            (:func:`elasticps.api.launch.train_launched`: which events
            arrive, and what is refused).
        parameters: initial values by name (a ParameterSet from an earlier
            job); model parameters it lacks keep the model's values, extra
            names are ignored.
        test_reader: test data (a reader function or a Parquet dataset):
            the model is evaluated at the end of every pass (see
            :func:`evaluate_model`), and each :class:`~elasticps.events.EndPass`
            event's ``metrics`` get the results, prefixed ``test_``
            (``test_loss``, ``test_accuracy``...). The evaluation pauses the
            trainer that ends the pass.
        metrics: with ``test_reader``: returns fresh metric objects by name
            for each evaluation (see :func:`evaluate_model`).

    Returns:
        The trained parameters, float32 tensors by name, shaped as in
        ``model``, and its persistent buffers (BatchNorm's running
        statistics), in their own dtypes.

    Raises:
        ConfigError: bad arguments (unknown frozen pattern, shape mismatch...).
        ModelContractError: the model or the batches break the contract
            (non-float32 parameters, non-scalar loss, a reader that does not
            yield tensor pairs).
        DataError: the reader yields nothing, or a Parquet file is unusable.
        JobUserError: with ``Local``, a server process stopped on a user error; with
            ``Hosts`` or ``Slurm``, the launcher did (a host that cannot run the job...).
        JobFailedError: with ``Local``, the job could not go on: a server
            process died more than ``Local.max_restarts`` times, or trainer
            threads kept failing with internal errors (a trainer thread that
            fails otherwise is replaced by a new one, as ``elasticps train``
            replaces a trainer process). With ``Hosts`` or ``Slurm``: the
            launcher failed (:func:`elasticps.api.launch.train_launched`).
    """
    if isinstance(cluster, Hosts | Slurm):
        return _train_launched(
            model, loss_fn, reader, cluster, updater=updater, event_handler=event_handler,
            frozen_parameters=frozen_parameters, num_passes=num_passes, parameters=parameters,
            test_reader=test_reader, metrics=metrics,
        )  # fmt: skip
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is None:
        raise ConfigError("loss_fn is required (None only with cluster=Hosts or Slurm)")
    if num_passes < 1:
        raise ConfigError(f"num_passes must be >= 1, got {num_passes}")
    if isinstance(reader, str | Path) or not (callable(reader) or isinstance(reader, Parquet)):
        raise ConfigError("reader must be a function yielding (inputs, targets) or a Parquet")
    optimizer = updater_mod.as_config(updater if updater is not None else updater_mod.Adam())
    frozen = tuple(sorted(set(frozen_parameters)))
    if lazy_names(model):  # a lazy module cannot be copied before its first forward
        _materialize(model, reader)
    template = copy.deepcopy(model)
    if parameters is not None:
        ParameterSet(parameters).copy_into(template, strict=False)
    if isinstance(reader, Parquet):
        spec = in_process_spec(
            template,
            loss_fn,
            batch_to_tensors=reader.batch_to_tensors,
            columns=tuple(reader.columns),
        )
    else:
        spec = in_process_spec(template, loss_fn)
    hub = _EventHub(event_handler)
    if test_reader is not None:
        if not (callable(test_reader) or isinstance(test_reader, Parquet)):
            raise ConfigError(
                "test_reader must be a function yielding (inputs, targets) or a Parquet"
            )
        hub.test = (test_reader, metrics)
    job = _Job(spec, reader, optimizer, frozen, num_passes, hub)
    if cluster is None:
        return _train_in_process(job)
    return _train_local(job, cluster)


def _train_launched(
    model: object,
    loss_fn: object,
    reader: object,
    cluster: Hosts | Slurm,
    *,
    updater: updater_mod.Updater | OptimizerConfig | None,
    event_handler: EventHandler | None,
    frozen_parameters: Iterable[str],
    num_passes: int,
    parameters: Mapping[str, Tensor] | None,
    test_reader: object,
    metrics: object,
) -> ParameterSet:
    """``train`` with ``Hosts`` or ``Slurm``: the command line's launcher runs the job."""
    from elasticps.api.launch import launch_request, train_launched

    request = launch_request(
        model, loss_fn, reader, cluster=cluster, updater=updater,
        frozen_parameters=frozen_parameters, num_passes=num_passes, parameters=parameters,
        test_reader=test_reader, metrics=metrics,
    )  # fmt: skip
    return train_launched(request, cluster, event_handler, _EventHub, _watch_trainers)


def _materialize(model: nn.Module, reader: Reader | Parquet) -> None:
    """Materialize ``model``'s lazy modules with the reader's first mini-batch, under seed 0.

    Raises:
        DataError: the reader yields nothing.
        ModelContractError: the forward pass raised.
    """
    _, (inputs, _targets) = next(iter(_in_process_batches(reader)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            materialize(model, inputs)
        except ElasticPSError:
            raise
        except Exception as exc:
            raise ModelContractError(
                f"cannot materialize the lazy parameters of {type(model).__name__} with the "
                f"first mini-batch: {one_line(exc, with_type=True)}"
            ) from exc


def evaluate_model(
    model: nn.Module,
    parameters: Mapping[str, Tensor] | None,
    reader: Reader | Parquet,
    loss_fn: LossFn,
    *,
    metrics: Callable[[], Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """The mean loss and the metrics of ``model`` with ``parameters`` on test data.

    The same evaluation as the CLI's (:func:`elasticps.evaluate.evaluate`):
    the model runs in eval mode without gradients; the loss is the
    sample-weighted mean of ``loss_fn`` over the batches, and the metrics
    that fit the shapes of the outputs and targets are added (``accuracy``
    for class scores; ``accuracy`` and ``auc`` for one logit per sample with
    0/1 targets; ``mse`` and ``mae`` for other outputs shaped as their
    targets; see :class:`elasticps.evaluate.MetricSet`), then ``metrics()``'s.

    Args:
        model: the module; it is not changed (a copy is evaluated).
        parameters: name -> tensor, e.g. the result of :func:`train`
            (parameters, and buffers it holds); None evaluates the model's
            own values.
        reader: a reader function yielding ``(inputs, targets)``, or a
            :class:`~elasticps.api.cluster.Parquet` dataset.
        loss_fn: ``loss_fn(outputs, targets) -> Tensor``, a scalar mean loss.
        metrics: returns fresh metric objects by name (``torchmetrics``
            metrics, or anything with ``update(preds, target)`` and
            ``compute()``); None for the default metrics only.

    Returns:
        The metrics, then ``loss`` and ``samples``.

    Raises:
        MissingParameterError: ``parameters`` lacks some of the model's
            parameters.
        ConfigError: a shape differs from the model's.
        DataError: the data holds no sample.
        ModelContractError: the model has lazy parameters that
            ``parameters`` does not give shapes to.
    """
    params = None if parameters is None else ParameterSet(parameters)
    if params is not None:
        materialize_as(model, params)  # a lazy module cannot be copied before it has shapes
    left = lazy_names(model)
    if left:
        raise ModelContractError(
            f"{type(model).__name__} has lazy (uninitialized) parameters ({', '.join(left[:5])}): "
            "pass parameters that hold them, or run one forward pass first"
        )
    copy_ = copy.deepcopy(model)
    if params is not None:
        params.copy_into(copy_)
    return _evaluate_model(copy_, loss_fn, reader, metrics)


def _evaluate_model(
    model: nn.Module,
    loss_fn: LossFn,
    reader: Reader | Parquet,
    metrics: Callable[[], Mapping[str, Any]] | None,
) -> dict[str, float]:
    from elasticps.evaluate import evaluate_batches

    batches = (batch for _, batch in _in_process_batches(reader))
    return evaluate_batches(
        model, loss_fn, batches, metrics=metrics() if metrics is not None else None,
        what=type(model).__name__,
    )  # fmt: skip


def infer(model: nn.Module, parameters: Mapping[str, Tensor], inputs: object) -> object:
    """Run ``model(inputs)`` with the values of ``parameters``, without gradients.

    Works for any sub-network: only the parameters ``model`` has are looked
    up, by name (``model.named_parameters()``), and its persistent buffers
    that the set holds (BatchNorm statistics; the model's own otherwise), so a
    set trained on a whole
    GAN runs its generator alone if the names agree (build the sub-network
    under the same attribute names, or pass a sub-set). The model is not
    changed (``torch.func.functional_call``), but for lazy modules, which
    take the shapes and values of ``parameters``; it runs in eval mode, and its
    training flag is restored afterwards. A tensor the model holds under
    several names (tied weights) is looked up under its first name.

    Args:
        model: the module to run.
        parameters: name -> tensor, e.g. the result of :func:`train`.
        inputs: the model's input: a tensor of whatever shape it takes, a
            tuple of positional arguments, or a dict of keyword arguments
            (when ``forward`` takes its keys; else the dict is one argument,
            as :func:`~elasticps.model_file.call_model` decides).

    Returns:
        What ``model`` returns.

    Raises:
        MissingParameterError: ``parameters`` lacks some of the model's
            parameters or sparse tables; the message names them.
        ConfigError: a shape differs from the model's.
    """
    params = parameters if isinstance(parameters, ParameterSet) else ParameterSet(parameters)
    materialize_as(model, params)  # a lazy model built afresh takes the set's shapes
    values = {**params.tensors_for(model), **params.buffers_for(model)}
    was_training = model.training
    model.eval()
    with _tables_bound(model, params):
        try:
            with torch.no_grad():
                kwargs: dict[str, Any] = {}
                if isinstance(inputs, tuple):
                    args: tuple[object, ...] = inputs
                else:
                    args, kwargs = model_arguments(model, inputs)
                # Tied weights are looked up under their first name, and
                # functional_call (tie_weights=True) uses it for every name.
                return torch.func.functional_call(model, dict(values), args, kwargs)
        finally:
            model.train(was_training)


@contextlib.contextmanager
def _tables_bound(model: nn.Module, params: ParameterSet) -> Iterator[None]:
    """Let ``model``'s sparse modules read the set's trained tables, then restore theirs.

    Raises:
        MissingParameterError: the model has a sparse table the set lacks.
    """
    modules = enn.sparse_modules(model)
    if not modules:
        yield
        return
    saved = {name: m.local.table for name, m in modules.items()}
    params.tables.bind(model)
    try:
        yield
    finally:
        for name, m in modules.items():
            m.local.set_table(saved[name])


# --- events -----------------------------------------------------------------------


class _EventHub:
    """Serializes events to the user's handler and derives the pass and training events.

    Trainers report only iterations; a pass begins with its first
    :class:`BeginIteration` (the master dispatches no task of pass p + 1
    before every task of pass p is done, so every iteration of pass p has
    ended by then) and ends before the next pass begins or the job ends.
    """

    def __init__(self, handler: EventHandler | None) -> None:
        self.handler = handler
        # Test data and metrics for the end of every pass (train's test_reader).
        self.test: tuple[Reader | Parquet, Callable[[], Mapping[str, Any]] | None] | None = None
        # Evaluates the current model: set by the training path once it can pull.
        self.evaluate_now: Callable[[], dict[str, float]] | None = None
        self._lock = threading.Lock()
        self._pass = -1
        self._pass_cost = 0.0
        self._pass_samples = 0.0
        self._pass_batches = 0
        self._last_pass_cost = math.nan
        self._last_pass = 0
        self._version = 0
        self._batches = 0
        self._samples = 0.0
        self._started = time.monotonic()

    @property
    def on_iteration(self) -> EventHandler | None:
        """The trainers' callback, or None without a handler (no event work at all)."""
        return self._iteration if self.handler is not None else None

    def emit(self, event: TrainingEvent) -> None:
        if self.handler is not None:
            with self._lock:
                self.handler(event)

    def begin(self, metrics: dict[str, float], version: int) -> None:
        self._started = time.monotonic()
        self._version = version
        self.emit(BeginTraining(model_version=version, metrics=metrics))

    def end(self, version: int) -> None:
        if self.handler is None:
            return
        with self._lock:
            self._version = max(self._version, version)
            self._end_pass()
            self.handler(
                EndTraining(
                    pass_id=self._last_pass,
                    batch_id=self._batches,
                    cost=self._last_pass_cost,
                    model_version=version,
                    metrics={
                        "samples": self._samples,
                        "wall_s": time.monotonic() - self._started,
                    },
                )
            )

    def _iteration(self, event: TrainingEvent) -> None:
        try:
            self.deliver(event)
        except Exception as exc:  # the user's code: it fails the job (see train())
            raise _HandlerError from exc

    def deliver(self, event: TrainingEvent) -> None:
        """Hand an iteration event (and the pass events it implies) to the handler."""
        assert self.handler is not None
        with self._lock:
            if isinstance(event, BeginIteration) and event.pass_id != self._pass:
                self._end_pass()
                self._pass = event.pass_id
                self.handler(BeginPass(pass_id=self._pass, model_version=event.model_version))
            if isinstance(event, EndIteration):
                samples = event.metrics.get("samples", 0.0)
                self._pass_cost += event.cost * samples
                self._pass_samples += samples
                self._pass_batches += 1
                self._batches += 1
                self._samples += samples
                self._version = max(self._version, event.model_version)
            self.handler(event)

    def _end_pass(self) -> None:
        # Caller holds the lock.
        if self._pass < 0 or self.handler is None:
            return
        cost = self._pass_cost / self._pass_samples if self._pass_samples else math.nan
        self._last_pass_cost = cost
        self._last_pass = self._pass
        metrics = {"samples": self._pass_samples}
        if self.evaluate_now is not None:
            metrics.update({f"test_{k}": v for k, v in self.evaluate_now().items()})
        self.handler(
            EndPass(
                pass_id=self._pass,
                batch_id=self._pass_batches,
                cost=cost,
                model_version=self._version,
                metrics=metrics,
            )
        )
        self._pass_cost = self._pass_samples = 0.0
        self._pass_batches = 0
        self._pass = -1 - self._pass  # ended; a BeginIteration of any pass begins a new one

    def trainers_changed(self, now: set[str], before: set[str]) -> None:
        for name in sorted(now - before):
            self.emit(TrainerJoined(model_version=self._version, trainer_id=_trainer_int(name)))
        for name in sorted(before - now):
            self.emit(TrainerLost(model_version=self._version, trainer_id=_trainer_int(name)))


def _trainer_int(name: str) -> int:
    return int(name) if name.isdigit() else -1


@dataclass(frozen=True)
class _Job:
    """What :func:`train` was asked to do, after validation."""

    spec: ModelSpec
    reader: Reader | Parquet
    optimizer: OptimizerConfig
    frozen: tuple[str, ...]
    num_passes: int
    hub: _EventHub


# --- data -------------------------------------------------------------------------


def _count_batches(reader: Reader) -> int:
    count = sum(1 for _ in reader())
    if count == 0:
        raise DataError("the reader yielded no batches")
    return count


def _parquet_tasks(data: Parquet) -> list[tuple[str, int, int]]:
    """The master's tasks of a Parquet dataset: ``(file, start row, end row)``."""
    files = []
    for path in data.paths:
        check_columns(path, tuple(data.columns))
        files.append((str(path), count_rows(path)))
    ranges = split_into_tasks(files, data.records_per_task)
    if not ranges:
        raise DataError("the Parquet files have no rows")
    return [(r.file, r.start, r.end) for r in ranges]


def _in_process_batches(reader: Reader | Parquet) -> Iterator[tuple[int, Batch]]:
    """One pass: ``(batch id, (inputs, targets))`` in the order one trainer sees them."""
    if isinstance(reader, Parquet):
        rows = RangeReader()
        batch_id = 0
        for file, start, end in _parquet_tasks(reader):
            table = rows.read_rows(file, start, end, tuple(reader.columns))
            for lo in range(0, table.num_rows, reader.batch_size):
                yield batch_id, reader.batch_to_tensors(table.slice(lo, reader.batch_size))
                batch_id += 1
        return
    batch_id = -1
    for batch_id, item in enumerate(reader()):
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], Tensor)
            and isinstance(item[1], Tensor)
        ):
            raise ModelContractError(
                f"the reader must yield (inputs, targets) tensor pairs; batch {batch_id} is "
                f"{type(item).__name__}"
            )
        yield batch_id, (item[0], item[1])
    if batch_id < 0:
        raise DataError("the reader yielded no batches")


# --- in-process -------------------------------------------------------------------


def _result(flat: FlatModel) -> ParameterSet:
    """The model's parameters and buffers, after taking the buffers' last pulled values."""
    if flat.buffers is not None:
        flat.buffers.adopt(flat.params, force=True)
    return ParameterSet(
        {
            **{n: p.detach() for n, p in flat.model.named_parameters()},
            **dict(model_buffers(flat.model)),
        }
    )


def _metrics(flat: FlatModel, num_passes: int, trainers: int) -> dict[str, float]:
    return {
        "num_passes": float(num_passes),
        "num_trainers": float(trainers),
        "num_parameters": float(len(flat.placement.params)),
        # The model's elements (a paged flat buffer also has padding).
        "numel": float(sum(shard.numel for shard in flat.placement.shards)),
    }


def _train_in_process(job: _Job) -> ParameterSet:
    """One trainer, one in-process shard holding every parameter, sync-SGD cadence."""
    spec, reader, frozen, hub, num_passes = (
        job.spec,
        job.reader,
        job.frozen,
        job.hub,
        job.num_passes,
    )
    model = spec.instantiate(0)
    specs = enn.table_specs(model)
    flat = bind_flat_buffers(model, num_shards=1)
    ranges = frozen_ranges(flat.placement, dense_frozen_patterns(model, frozen))
    layout = flat.placement.shards[0]
    described = layout.describe()
    if specs:  # the same tables as on a server that holds every row
        described[TABLES_KEY] = tables_layout(list(specs.values()), enn.partitions(model), 1)
    shard = ParameterShard(
        described, layout.fingerprint, job.optimizer, UpdateMode.SYNC, frozen=frozen
    )
    tables = shard.tables
    shard.values.copy_(flat.params)  # what a trainer's INIT_VALUES does
    shard.set_live_trainers({0})
    if hub.test is not None:
        test_reader, test_metrics = hub.test

        def evaluate_now() -> dict[str, float]:
            model = copy.deepcopy(flat.model)
            if flat.buffers is not None:  # the values pulled last (the server's)
                ParameterSet(_result(flat)).copy_into(model)
            return _evaluate_model(model, spec.loss, test_reader, test_metrics)

        hub.evaluate_now = evaluate_now
    hub.begin(_metrics(flat, num_passes, 1), shard.version)
    # In this thread: what the handler raises propagates as is.
    on_event = hub.deliver if hub.handler is not None else None
    try:
        for pass_id in range(num_passes):
            for batch_id, (inputs, targets) in _in_process_batches(reader):
                if on_event is not None:
                    on_event(
                        BeginIteration(
                            pass_id=pass_id, batch_id=batch_id, model_version=shard.version
                        )
                    )
                rows_batch = _rows_batch(tables, specs)
                if flat.buffers is not None:
                    flat.buffers.adopt(flat.params)
                with (
                    rows_batch.bind(flat.model)
                    if rows_batch is not None
                    else contextlib.nullcontext()
                ):
                    loss = spec.loss(call_model(flat.model, inputs), targets)
                if loss.dim() != 0:
                    raise ModelContractError(
                        f"loss must return a scalar, got shape {tuple(loss.shape)}"
                    )
                loss.backward()  # type: ignore[no-untyped-call]
                if not flat.grads_are_bound():
                    raise ModelContractError(
                        "a parameter's .grad was replaced during backward; elasticps needs "
                        "gradients to accumulate in place"
                    )
                for lo, hi in ranges:
                    flat.grads[lo:hi].zero_()
                rows = (
                    _row_grads(tables, rows_batch.gradients())
                    if tables is not None and rows_batch is not None
                    else None
                )
                if flat.buffers is not None:
                    flat.buffers.write_push(flat.grads)  # a sync shard
                shard.push(0, flat.grads, shard.version, len(targets), rows=rows)
                flat.params.copy_(shard.values)  # the pull
                flat.zero_grad()
                if on_event is not None:
                    on_event(
                        EndIteration(
                            pass_id=pass_id,
                            batch_id=batch_id,
                            cost=float(loss.detach()),
                            model_version=shard.version,
                            metrics={"samples": float(len(targets))},
                        )
                    )
    finally:
        shard.close()
    hub.end(shard.version)
    result = _result(flat)
    if tables is not None:
        result = ParameterSet(dict(result), TableSet(tables.tables))
    return result


def _rows_batch(
    tables: ShardTables | None, specs: Mapping[str, TableSpec]
) -> enn.SparseBatch | None:
    """A mini-batch's rows, read from the in-process shard's tables as a trainer pulls them."""
    if tables is None:
        return None

    def pull(spec: TableSpec, ids: Tensor) -> Tensor:
        return tables.tables[spec.name].lookup(ids)

    return enn.SparseBatch(specs, pull=pull)


def _row_grads(tables: ShardTables, grads: Mapping[str, enn.SparseGrad]) -> RowGrads:
    """One mini-batch's row gradients as the shard takes them (frozen tables left out)."""
    ids, rows = [], []
    for entry in tables.entries:
        g = grads.get(entry.spec.name)
        if g is None or entry.spec.name in tables.frozen:
            ids.append(np.zeros(0, np.int64))
            rows.append(np.zeros(0, np.float32))
        else:
            ids.append(g.ids.numpy().astype(np.int64))
            rows.append(g.grads.reshape(-1).numpy().astype(np.float32))
    counts = np.array([len(i) for i in ids], dtype=np.int64)
    per_table = tables.split_ids(counts, np.concatenate(ids), unique=True)
    return tables.split_rows(per_table, np.concatenate(rows))


# --- local cluster ------------------------------------------------------------------


def _train_local(job: _Job, cluster: Local) -> ParameterSet:
    """Real etcd, master and PS processes; trainer threads running :class:`Trainer`."""
    spec, reader, frozen, num_passes = job.spec, job.reader, job.frozen, job.num_passes
    mode = cluster.update_mode
    # Checked before any server starts: bad frozen patterns, files or readers.
    probe_model = spec.instantiate(0)
    probe = bind_flat_buffers(probe_model, cluster.ps, cluster.big_array_bound, cluster.placement)
    frozen_ranges(probe.placement, dense_frozen_patterns(probe_model, frozen))
    data_files: tuple[Path, ...] = ()
    virtual_records = 0
    batch_reader: Reader | None = None
    if isinstance(reader, Parquet):
        _parquet_tasks(reader)
        data_files, records_per_task, batch_size = (
            reader.paths,
            reader.records_per_task,
            reader.batch_size,
        )
    else:
        virtual_records = _count_batches(reader)
        records_per_task = cluster.batches_per_task
        batch_reader = reader
        batch_size = 1  # unused: a virtual record is a whole batch
    servers_config = ServersConfig(
        num_ps=cluster.ps,
        mode=mode,
        optimizer=job.optimizer,
        frozen=frozen,
        num_passes=num_passes,
        task_timeout_s=cluster.task_timeout_s,
        lease_ttl_s=cluster.lease_ttl_s,
        startup_timeout_s=cluster.startup_timeout_s,
        data_files=data_files,
        virtual_records=virtual_records,
        records_per_task=records_per_task,
        checkpoint_every_s=cluster.checkpoint_every_s,
        ps_args=("--sync-reduction", cluster.sync_reduction),
        max_restarts=cluster.max_restarts,
    )
    record: contextlib.AbstractContextManager[RunRecord | None] = contextlib.nullcontext()
    if cluster.output is not None:
        record = RunRecord(
            Path(cluster.output), servers_config.job, "python-api", passes=num_passes
        )
    with record as run_record:
        return _train_on_servers(
            job,
            cluster,
            servers_config,
            run_record,
            probe_model=probe_model,
            probe=probe,
            batch_reader=batch_reader,
            batch_size=batch_size,
        )


def _train_on_servers(
    job: _Job,
    cluster: Local,
    servers_config: ServersConfig,
    record: RunRecord | None,
    *,
    probe_model: nn.Module,
    probe: FlatModel,
    batch_reader: Reader | None,
    batch_size: int,
) -> ParameterSet:
    """Start the servers, run the trainer threads, pull the result (see :func:`_train_local`)."""
    spec, hub, num_passes, mode = job.spec, job.hub, job.num_passes, cluster.update_mode
    with (
        LocalServers(servers_config) as servers,
        JobStore(servers.etcd_endpoint, servers.job) as store,
    ):
        if record is not None:
            record.running(servers.etcd_endpoint, servers.decision_records)
        common = CommonConfig(
            job=servers.job, etcd_endpoint=servers.etcd_endpoint, lease_ttl_s=cluster.lease_ttl_s
        )
        configs = [
            TrainerConfig(
                common=common,
                trainer_id=i,
                model_path=spec.path,
                model_class=spec.model_class,
                mode=mode,
                batch_size=batch_size,
                push_every=cluster.push_every,
                pull_every=cluster.pull_every,
                num_ps=cluster.ps,
                big_array_bound=cluster.big_array_bound,
                placement=cluster.placement,
                connect_timeout_s=cluster.startup_timeout_s,
            )
            for i in range(cluster.trainers)
        ]
        watch = _watch_trainers(store, hub) if hub.handler is not None else None
        if hub.test is not None and hub.handler is not None:
            hub.evaluate_now = _pass_evaluator(spec, cluster, servers, hub.test)
        try:
            hub.begin(_metrics(probe, num_passes, cluster.trainers), 0)
            _run_trainer_threads(job, configs, batch_reader, servers)
        finally:
            if watch is not None:
                watch.cancel()
        # A server may still die here: it is restarted meanwhile.
        result, version = servers.run_supervised(lambda: _pull_final(spec, cluster, servers))
        if enn.table_specs(probe_model):
            result = ParameterSet(dict(result), _final_tables(servers))
        if hub.evaluate_now is not None and hub.test is not None:
            # The last pass ends once the servers are gone: evaluate what was pulled.
            hub.evaluate_now = _evaluator_of(spec, result, hub.test)
        if cluster.checkpoint_dir is not None:
            from elasticps.launcher.local import checkpoint_job

            out = Path(cluster.checkpoint_dir)
            manifest = servers.run_supervised(
                lambda: checkpoint_job(
                    store, out, {"job": servers.job, "source": "elasticps.train"}
                )
            )
            checkpoint_version = manifest.get("version")
            hub.emit(
                Checkpointed(
                    model_version=checkpoint_version if isinstance(checkpoint_version, int) else 0,
                    path=out.resolve(),
                )
            )
    hub.end(version)
    return result


def _watch_trainers(store: JobStore, hub: _EventHub) -> Watch:
    live, revision = store.live_trainers()
    known = set(live)
    lock = threading.Lock()
    hub.trainers_changed(known, set())

    def on_change(current: TrainerMap) -> None:
        nonlocal known
        with lock:
            before, known = known, set(current)
        hub.trainers_changed(set(current), before)

    return store.watch_trainers(on_change, revision + 1)


class _HandlerError(Exception):
    """The user's event handler raised (its exception is the ``__cause__``)."""


def _run_trainer_threads(
    job: _Job, configs: list[TrainerConfig], reader: Reader | None, servers: LocalServers
) -> None:
    """Run one :class:`Trainer` per config in a thread, supervised by the job's policy.

    A trainer thread that ends on an exception is a trainer that died with
    the exit status its error maps to (:func:`~elasticps.launcher.supervisor.exit_status_for`):
    the servers' supervision policy (:meth:`LocalServers.decide`) replaces it
    with a new thread and a new trainer id, or fails the job (a user error, or
    trainers that keep failing). An exception of the event handler fails the
    job at once. The dead servers are restarted meanwhile
    (:meth:`LocalServers.check`).

    Raises:
        UserError: a trainer's user error (``ConfigError``, ``ModelContractError``,
            ``DataError``...), as raised.
        JobUserError: a server stopped on a user error.
        JobFailedError: the policy failed the job, or the event handler raised
            (its ``__cause__``).
    """
    stop = threading.Event()
    ended: queue.SimpleQueue[tuple[TrainerConfig, BaseException | None]] = queue.SimpleQueue()
    stores: dict[int, JobStore] = {}
    threads: dict[int, threading.Thread] = {}

    def run(config: TrainerConfig, store: JobStore) -> None:
        outcome: BaseException | None = None
        try:
            trainer = Trainer(
                config,
                job.spec,
                store,
                stop,
                reader=reader,
                on_event=job.hub.on_iteration,
                frozen=job.frozen,
            )
            trainer.run()
        except BaseException as exc:  # judged by the policy in the caller's thread
            outcome = exc
        ended.put((config, outcome))

    def start(config: TrainerConfig) -> None:
        store = JobStore(config.common.etcd_endpoint, config.common.job)
        stores[config.trainer_id] = store
        thread = threading.Thread(
            target=run, args=(config, store), name=f"trainer-{config.trainer_id}", daemon=True
        )
        thread.start()
        threads[config.trainer_id] = thread

    next_id = max(c.trainer_id for c in configs) + 1
    try:
        for config in configs:
            start(config)
        while threads:
            servers.check()
            try:
                config, exc = ended.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            threads.pop(config.trainer_id).join()
            with contextlib.suppress(Exception):
                stores.pop(config.trainer_id).close()
            name = f"trainer-{config.trainer_id}"
            if exc is None:  # the master told it that the job is finished
                servers.decide(Exited(name, Kind.TRAINER, status=0))
                servers.decide(JobFinished())
                continue
            if isinstance(exc, _HandlerError):
                raise JobFailedError(
                    f"the event handler raised {type(exc.__cause__).__name__}: {exc.__cause__}"
                ) from exc.__cause__
            action = servers.decide(
                Exited(
                    name,
                    Kind.TRAINER,
                    status=exit_status_for(exc),
                    message=f"{type(exc).__name__}: {' '.join(str(exc).split())}",
                )
            )
            if isinstance(action, FailJob):
                if isinstance(exc, UserError):
                    raise exc
                raise JobFailedError(action.message, decisions=servers.decision_records()) from exc
            if isinstance(action, Replace):
                log.warning("%s ended (%s: %s); replacing it", name, type(exc).__name__, exc)
                start(dataclasses.replace(config, trainer_id=next_id))
                next_id += 1
    finally:
        stop.set()
        for thread in threads.values():
            thread.join(timeout=30)
        for store in stores.values():
            with contextlib.suppress(Exception):
                store.close()


def _final_tables(servers: LocalServers) -> TableSet:
    """Every sparse table of the job, read from a consistent checkpoint of the servers."""
    with tempfile.TemporaryDirectory(prefix="elasticps-tables-") as tmp:
        addresses = [slot.address for slot in servers.ps_slots()]
        take_consistent_checkpoint(addresses, Path(tmp), ledger_revision=None, extra={})
        return load_tables(tmp)


def _pass_evaluator(
    spec: ModelSpec,
    cluster: Local,
    servers: LocalServers,
    test: tuple[Reader | Parquet, Callable[[], Mapping[str, Any]] | None],
) -> Callable[[], dict[str, float]]:
    """Evaluates the model the servers hold now (a pull, as the final one does).

    A model with sparse tables is evaluated with the servers' rows (a
    consistent checkpoint of them, as for the final result), not its own.
    """
    has_tables = bool(enn.table_specs(spec.instantiate(0)))

    def evaluate_now() -> dict[str, float]:
        result, _ = _pull_final(spec, cluster, servers)
        if has_tables:
            result = ParameterSet(dict(result), _final_tables(servers))
        return _evaluator_of(spec, result, test)()

    return evaluate_now


def _evaluator_of(
    spec: ModelSpec,
    values: ParameterSet,
    test: tuple[Reader | Parquet, Callable[[], Mapping[str, Any]] | None],
) -> Callable[[], dict[str, float]]:
    """Evaluates the model with ``values`` on the test data."""
    test_reader, test_metrics = test

    def evaluate_now() -> dict[str, float]:
        model = spec.instantiate(0)
        values.copy_into(model)
        return _evaluate_model(model, spec.loss, test_reader, test_metrics)

    return evaluate_now


def _pull_final(spec: ModelSpec, cluster: Local, servers: LocalServers) -> tuple[ParameterSet, int]:
    model = spec.instantiate(0)
    flat = bind_flat_buffers(model, cluster.ps, cluster.big_array_bound, cluster.placement)
    client = ParameterClient(
        flat.placement,
        servers.ps_slots(),
        flat.params,
        flat.grads,
        _FINAL_PULL_ID,
        tables=table_entries(model, cluster.ps),
    )
    try:
        client.hello(initialize=False)
        version = max(client.versions, default=0)
    finally:
        client.close()
    return _result(flat), version
