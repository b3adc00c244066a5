"""The trainer process: get tasks, train mini-batches, push and pull.

Per mini-batch: forward, loss, backward (into the flat gradient buffer).
Every ``push_every`` (n) mini-batches the mean gradient is pushed to every
parameter server; every ``pull_every`` (m) mini-batches fresh parameters are
pulled. In sync mode n = m = 1 and a push waits for the step's new
parameters. Gradients still accumulated at the end of a task are pushed
before the task is reported done, so a done task's data is in the model.

Tasks: a trainer holds the task it trains and, when the master grants one
(see :meth:`~elasticps.master.taskqueue.TaskQueue.get_task`), the task it
trains next. At the end of a task it goes straight on with the held one;
the finished task's report waits on the reports thread until every push of
it is acknowledged, and asks for the task after the held one. Without a
held task (near the end of a pass), a task's end waits for its pushes and
its report, which brings the next task, as one call.

A task names rows of a Parquet file, or records of the master's virtual
source (:data:`~elasticps.master.main.VIRTUAL_SOURCE`): the Python API's
trainers read those as ``itertools.islice(reader(), start, end)``, one
record being one mini-batch. Gradients of frozen parameters are zeroed before
every push. With an ``on_event`` callback the trainer reports
:class:`~elasticps.events.BeginIteration` / :class:`~elasticps.events.EndIteration`;
without one, the training path does no event work at all.

Bad records: when the model file's ``batch_to_tensors``, ``forward`` or
``loss`` raises on a mini-batch, the trainer logs one line naming the model
file's line, the exception and the task's rows (the traceback goes to its
log file only). With ``--bad-records fail`` it then stops with a
:class:`~elasticps.errors.BadRecordError` (exit status 2); with ``skip`` it
drops the mini-batch and reports its records as skipped, until the task's
skip budget (``Task.skip_budget``) is spent: then the task is reported
failed, and the master sets it aside.

Sparse tables: a model with :mod:`elasticps.nn` tables trains them on the
parameter servers without ever holding them. Per mini-batch the trainer
takes the unique ids of each table from the inputs (:func:`elasticps.nn.batch_ids`),
pulls only those rows (one request per server, in parallel), runs forward
and backward with them bound to the model (:class:`elasticps.nn.SparseBatch`;
ids a module meets that the inputs did not announce are pulled on demand),
and pushes the rows' gradients with the dense gradient, in the same push
(averaged over the ``push_every`` mini-batches as the dense gradient is).
Rows of frozen tables are never pushed.

Buffers (BatchNorm statistics): before each forward the trainer takes the
buffer values of its last pull into the model, if they are new; each push
carries what the model's buffers did since (increments, see
:class:`~elasticps.buffers.BufferSync`). A push computed again after a
STALE answer first takes the freshly pulled values, so its mini-batches
count once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fnmatch
import functools
import itertools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import pyarrow as pa
import torch
from torch import Tensor

import elasticps.nn as enn
from elasticps import metrics
from elasticps.config import TrainerConfig, UpdateMode, ledger_only, parse_model_args
from elasticps.coord.store import JobStore, KeptLease, PSSlot
from elasticps.data.kafka import KafkaRangeReader, is_kafka_url, load_client_config
from elasticps.data.parquet import RangeReader, check_columns, first_rows
from elasticps.errors import (
    BadRecordError,
    CoordinationError,
    DataError,
    ElasticPSError,
    ModelContractError,
    ServiceUnavailableError,
    StaleTaskError,
    UnknownTrainerError,
)
from elasticps.events import BeginIteration, EndIteration, TrainingEvent
from elasticps.master.client import MasterClient
from elasticps.master.main import VIRTUAL_SOURCE
from elasticps.model_file import ModelSpec, call_model, describe_model_error, load_model_file
from elasticps.proto import master_pb2
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.sparse import TableSpec
from elasticps.pserver.sparse_shard import TableEntry
from elasticps.trainer.client import ParameterClient, PushHandle
from elasticps.trainer.flat import FlatModel, bind_flat_buffers, frozen_ranges
from elasticps.wire.frame import PushStatus

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]
"""One mini-batch: ``(inputs, targets)``; ``len(targets)`` is its number of samples."""

Reader = Callable[[], Iterable[Batch]]
"""A reader function: each call yields the same mini-batches, in the same order."""


class _ModelCodeError(ElasticPSError):
    """The model file's ``called`` function raised ``exc`` on a mini-batch (module-internal)."""

    def __init__(self, exc: Exception, called: str) -> None:
        super().__init__(f"{called} raised {type(exc).__name__}")
        self.exc = exc
        self.called = called


@dataclass
class _Accumulator:
    """Gradients accumulated since the last push, and what it takes to compute them again.

    ``first`` and ``end`` are the records of the task the gradients cover
    (counted from the task's first record), the push key's range; ``window``
    keeps the mini-batches, so that a push a server answers STALE can be
    computed again on fresh parameters.
    """

    batches: int = 0
    samples: int = 0
    first: int = 0
    end: int = 0
    window: list[Batch] = field(default_factory=list)


KILL_AFTER_ACK_ENV = "ELASTICPS_TEST_KILL_AFTER_ACK"
"""Test hook, ``"<trainer id>:<N>"``: that trainer SIGKILLs itself right after its
N-th push is acknowledged by every PS, before the progress report for it is sent
(the window where a trainer's records are applied but not yet in the ledger).
Unset in normal runs."""

MAX_STALE_RETRIES = 50
"""How many times a mini-batch is computed again after STALE answers before giving up."""

#: The first wait for work after a task, seconds; each further one doubles, up to
#: the master's ``wait_s``. The work a trainer waits for is usually a pass about to
#: start (the last task of a pass finishing on another trainer, then the check of
#: what the servers applied, ~10 ms), so the first asks come soon, and a long wait
#: settles at the master's pace (a few asks a second per trainer). An async
#: trainer's ask is mostly held by the master until there is work
#: (``wait_for_work``); it waits here only after a wait the master answered.
FIRST_IDLE_WAIT_S = 0.01


def idle_wait_s(idle: int, master_wait_s: float) -> float:
    """Seconds to wait before asking again after ``idle`` waits in a row.

    Args:
        idle: waits for work since the last task (0 for the first).
        master_wait_s: the master's ``wait_s`` (the longest wait, seconds).

    Returns:
        ``min(master_wait_s, FIRST_IDLE_WAIT_S * 2**idle)``, in seconds.
    """
    return min(master_wait_s, FIRST_IDLE_WAIT_S * 2.0 ** min(idle, 30))


PROGRESS_EVERY_S = 1.0
"""Seconds between two progress reports of one trainer (at most one report each)."""


class ProgressReporter:
    """Reports progress inside tasks to the master from a background thread.

    The training loop only records the latest acknowledged offset; the
    thread sends it (coalescing updates) so that the round trip to the
    master and its etcd transaction never sit on the training path, and at
    most one report per ``min_interval_s`` seconds, so that a job pushing
    every mini-batch does not keep the master and etcd busy with a report per
    push (about a fifth of a 2-core machine with 2 trainers, measured in
    ``benchmarks/README.md``). The cost is a lag of up to ``min_interval_s``
    in what the master knows, which only matters if the trainer dies: the
    next attempt trains those records again and every parameter server drops
    their pushes as duplicates (docs/fault-tolerance.md, "Push keys").
    """

    def __init__(
        self,
        master: MasterClient,
        trainer_id: str,
        min_interval_s: float = PROGRESS_EVERY_S,
    ) -> None:
        self._master = master
        self._trainer_id = trainer_id
        self._min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._latest: master_pb2.ReportProgressRequest | None = None
        # An update taken by the thread and not yet answered by the master.
        self._sending = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def update(self, task: master_pb2.Task, offset: int, skipped: int = 0) -> None:
        """Record that rows ``[task.start, task.start + offset)`` are trained and acknowledged
        (``skipped`` of them, by this attempt, skipped as bad records)."""
        request = master_pb2.ReportProgressRequest(
            trainer_id=self._trainer_id,
            task_id=task.task_id,
            pass_id=task.pass_id,
            attempt=task.attempt,
            offset=offset,
            skipped=skipped,
        )
        with self._cond:
            idle = self._latest is None
            self._latest = request
            if idle:
                # Otherwise the thread knows there is an update, and sends the
                # newest when its interval is over: no wake-up per push.
                self._cond.notify()

    def discard(self, task_id: int | None = None) -> None:
        """Drop any unsent update (of task ``task_id`` only, if given), and wait for
        the one being sent, if any.

        Called before a task is reported done or failed: that report then
        reaches the master after every progress report of the task, which
        would otherwise arrive late and be rejected as stale (harmlessly, but
        logged).
        """
        with self._cond:
            if task_id is None or (self._latest is not None and self._latest.task_id == task_id):
                self._latest = None
            self._cond.wait_for(lambda: not self._sending)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send the last recorded update, then stop the thread.

        A trainer that leaves on purpose (scaled down, SIGTERM) thus lets the
        master resume its task exactly after the last acknowledged push. The
        wait is bounded by ``timeout_s`` seconds; past it the update is lost
        and those rows are trained again by the next attempt.
        """
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        next_at = 0.0  # monotonic time before which no report is sent (unless closing)
        while True:
            with self._cond:
                while not self._closed:
                    if self._latest is None:
                        self._cond.wait()
                        continue
                    wait_s = next_at - time.monotonic()
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                if self._latest is None:
                    return  # closed, nothing left to send
                request, self._latest = self._latest, None
                self._sending = True
            next_at = time.monotonic() + self._min_interval_s
            try:
                self._master.report_progress(request)
            except StaleTaskError:
                pass  # the attempt is over (re-dispatched after a timeout or a lost lease)
            except (ElasticPSError, grpc.RpcError) as exc:
                log.warning("could not report progress of task %d: %s", request.task_id, exc)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()


class Trainer:
    """One trainer: its model, its connections, and the training loop.

    Args:
        config: trainer configuration.
        spec: the loaded model file.
        store: the job's etcd view.
        stop: set it to make the trainer stop after the current mini-batch.
        reader: the reader function behind tasks of the virtual source
            (Python API); None for Parquet-only trainers.
        on_event: called with a :class:`~elasticps.events.BeginIteration` and
            an :class:`~elasticps.events.EndIteration` per mini-batch, from
            the training thread; None for no events.
        frozen: glob patterns of frozen parameter names; their gradients are
            zeroed before every push.

    Raises:
        ConfigError: a frozen pattern matches no parameter.
    """

    def __init__(
        self,
        config: TrainerConfig,
        spec: ModelSpec,
        store: JobStore,
        stop: threading.Event,
        *,
        reader: Reader | None = None,
        on_event: Callable[[TrainingEvent], None] | None = None,
        frozen: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.spec = spec
        self.store = store
        self.stop = stop
        self.name = str(config.trainer_id)
        model = spec.instantiate(config.seed)
        self._tables = enn.table_specs(model)
        # Found once: every batch binds them and reads their features' ids.
        self._sparse_modules = enn.sparse_module_objects(model)
        self._table_entries = table_entries(model, config.num_ps)
        self._frozen_tables = frozenset(
            name for name in self._tables if any(fnmatch.fnmatchcase(name, p) for p in frozen)
        )
        self._sparse_grads: list[dict[str, enn.SparseGrad]] = []
        # Pushes that pull go in the background, and the next mini-batch trains
        # on the parameters of the push before (see ParameterClient's
        # overlap_pull): in async mode one step staler; in sync mode a
        # pipelined step, each gradient computed one version before the step
        # it joins. On by default only for async models with sparse tables,
        # whose step waits on row pulls.
        self._overlap_pull = (
            config.overlap_pull
            if config.overlap_pull is not None
            else config.mode is UpdateMode.ASYNC and bool(self._tables)
        )
        # The inputs of the mini-batch whose rows the next push pulls in the same
        # round trip (see _push), if known (same task): the one after the one in
        # training, or with overlap_pull the one after that.
        self._next_inputs: object = None
        # overlap_pull: the inputs of the mini-batch right after the one in
        # training (same task), whose rows a pull of this one's fetches too.
        self._following_inputs: object = None
        # (inputs, ids by table, the push that pulls their rows or the rows
        # pulled already), oldest first.
        self._prefetched: list[
            tuple[object, dict[str, Tensor], PushHandle | dict[str, Tensor]]
        ] = []
        # Reading the mini-batch after the one in training, when left to the
        # wait of its push (see _run_task), and what that reading raised.
        self._pending_read: Callable[[], None] | None = None
        self._read_error: Exception | None = None
        self.flat: FlatModel = bind_flat_buffers(
            model, config.num_ps, config.big_array_bound, config.placement
        )
        self._frozen = frozen_ranges(self.flat.placement, dense_frozen_patterns(model, frozen))
        self._batch_reader = reader
        self._on_event = on_event
        self._pass_id = -1
        self._pass_batches = 0
        self.reader = RangeReader()
        self._stream_reader: KafkaRangeReader | None = None
        self._acc = _Accumulator()
        self._batches = 0
        self._checked_columns: set[str] = set()
        self._skip_traceback_logged = False
        self._lease_lost = threading.Event()
        self._lease: KeptLease | None = None
        self._metrics_address: str | None = None
        # PS slot -> address, kept current by a watch on ps/; a lost PS's
        # successor is found here.
        self._ps_cond = threading.Condition()
        self._ps_slots: dict[int, PSSlot] = {}
        self._client: ParameterClient | None = None
        self._task: master_pb2.Task | None = None
        self._inflight: (
            tuple[PushHandle, _Accumulator, PushKey | None, Callable[[], None] | None] | None
        ) = None
        # The task trained next, held while the current one trains (see
        # _loop): the master call that answers it, on the reports thread.
        self._ahead: concurrent.futures.Future[master_pb2.GetTaskResponse | None] | None = None
        # A finished task's report, sent (with the request for the task after
        # the held one) once its last push is acknowledged.
        self._deferred: master_pb2.ReportTaskRequest | None = None
        self._reports: concurrent.futures.ThreadPoolExecutor | None = None
        self._master: MasterClient | None = None
        self._progress: ProgressReporter | None = None
        self._acknowledged_pushes = 0
        self._ledger_only = ledger_only()
        who, _, after = os.environ.get(KILL_AFTER_ACK_ENV, "").partition(":")
        self._kill_after_ack = (
            int(after) if after.isdigit() and who == str(config.trainer_id) else None
        )

    def run(self) -> None:
        """Train until the master says the job is finished or ``stop`` is set.

        Raises:
            ServiceUnavailableError: the master or a PS is unreachable for too long.
            DataError / ModelContractError: the data does not fit the model file.
        """
        cfg = self.config
        slots = self.store.wait_ps_slots(cfg.connect_timeout_s, cancel=self.stop)
        self._on_ps_slots({slot.index: slot for slot in slots})
        ps_watch = self.store.watch_ps_slots(self._on_ps_slots)
        client = ParameterClient(
            self.flat.placement,
            slots,
            self.flat.params,
            self.flat.grads,
            cfg.trainer_id,
            timeout_s=cfg.connect_timeout_s,
            resolve=self._ps_slot,
            reconnect_timeout_s=cfg.connect_timeout_s,
            stop=self.stop,
            transport=cfg.ps_transport,
            grad_compression=cfg.grad_compression,
            # Only a push that does not pull goes in the background: with a pull
            # every mini-batch there is none, and the buffers may be mapped instead.
            overlap_push=cfg.overlap_push and cfg.mode is UpdateMode.ASYNC and cfg.pull_every > 1,
            overlap_pull=self._overlap_pull,
            initial_values=self._initial_values,
            sync=cfg.mode is UpdateMode.SYNC,
            tables=self._table_entries,
            map_buffers=self.flat.page_aligned,
        )
        self._client = client
        master = MasterClient(
            lambda: self.store.master_address(timeout_s=1.0), retry_s=cfg.connect_timeout_s
        )
        progress = ProgressReporter(master, self.name)
        self._master, self._progress = master, progress
        self._reports = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reports")
        try:
            client.hello(initialize=True)
            self._register()
            self._loop(master, client, progress)
        finally:
            ps_watch.cancel()
            # A push still in flight reports its progress when acknowledged.
            with contextlib.suppress(ElasticPSError, OSError):
                client.flush()
            self._last_report()
            progress.close()
            master.close()
            client.close()
            if self._stream_reader is not None:
                self._stream_reader.close()
            if self._lease is not None and not self._lease.lost.is_set():
                self._lease.revoke()

    def _register(self) -> None:
        """Register ``trainers/<id>`` under a fresh lease (again, after a lost one)."""
        self._lease_lost.clear()
        self._lease = self.store.grant_lease(
            self.config.common.lease_ttl_s, on_lost=self._lease_lost.set
        )
        self.store.register_trainer(self.name, {"pid": os.getpid()}, self._lease)
        if metrics.enabled():
            if self._metrics_address is None:
                self._metrics_address = metrics.serve(_metrics_host())
                log.info(
                    "trainer %s metrics on http://%s/metrics", self.name, self._metrics_address
                )
            metrics.register(self.store, self._lease, "trainer", self.name, self._metrics_address)

    def _ps_slot(self, index: int) -> PSSlot:
        """The current claim of PS slot ``index``, as the watch on ``ps/`` last saw it."""
        with self._ps_cond:
            # Give the watch a moment to report a new claim before retrying.
            self._ps_cond.wait_for(lambda: index in self._ps_slots, timeout=0.5)
            slot = self._ps_slots.get(index)
        if slot is None:
            raise CoordinationError(f"parameter server slot {index} is not claimed")
        return slot

    def _on_ps_slots(self, slots: dict[int, PSSlot]) -> None:
        with self._ps_cond:
            self._ps_slots = dict(slots)
            self._ps_cond.notify_all()
        if self._client is not None:
            self._client.slots_changed(slots)

    def _initial_values(self) -> Tensor:
        """The job's initial parameters, flat as the parameter buffer (for an empty shard).

        Every trainer builds the model under the same seed, so this is the
        same on all of them, and a shard that lost its state restarts from
        exactly the job's starting point (see docs/fault-tolerance.md).
        """
        model = self.spec.instantiate(self.config.seed)
        fresh = bind_flat_buffers(
            model, self.config.num_ps, self.config.big_array_bound, self.config.placement
        )
        return fresh.params

    def _loop(
        self, master: MasterClient, client: ParameterClient, progress: ProgressReporter
    ) -> None:
        sync = self.config.mode is UpdateMode.SYNC
        idle = 0  # consecutive waits for work
        # The answer the last task's report brought (it asks for the next task).
        reply: master_pb2.GetTaskResponse | None = None
        while not self.stop.is_set():
            if self._lease_lost.is_set():
                log.warning("trainer %s: lease lost; registering again", self.name)
                # The master took back every task we held, the one held ahead too.
                self._take_ahead(client)
                self._register()
            if reply is None:
                held = self._take_ahead(client)
                # Async: with nothing to do, the master answers once there is
                # work (sync: we join the running steps while we wait).
                reply = (
                    master_pb2.GetTaskResponse(task=held)
                    if held is not None
                    else master.get_task(self.name, wait_for_work=not sync)
                )
            kind = reply.WhichOneof("result")
            if kind == "finished":
                log.info("trainer %s: job finished after %d mini-batches", self.name, self._batches)
                return
            if kind == "wait_s":
                if sync:
                    # Take part in the running step without a gradient, so that
                    # the trainers still working are not held up by us. If some
                    # trainer trained in that step, ask for work again at once.
                    # From a consistent view only: an empty push that one shard
                    # takes and another refuses as stale would leave the second
                    # waiting for us in a step the first has closed.
                    if not client.consistent:
                        client.pull_consistent()
                    before = client.versions
                    client.push_empty()
                    if client.versions != before:
                        reply = None
                        continue
                self.stop.wait(idle_wait_s(idle, reply.wait_s))
                reply = None
                idle += 1
                continue
            idle = 0
            reply = self._run_task(reply.task, master, client, progress)

    def _run_task(
        self,
        task: master_pb2.Task,
        master: MasterClient,
        client: ParameterClient,
        progress: ProgressReporter,
    ) -> master_pb2.GetTaskResponse | None:
        """Train one task and report it; returns the next task if the report brought it."""
        started = time.monotonic()
        samples = 0
        records = 0  # rows (Parquet) or batches (virtual source) of this attempt
        skipped = skipped_batches = 0  # bad records (--bad-records skip) of this attempt
        loss_sum = 0.0
        if task.pass_id > self._pass_id:
            # A repair of an earlier, sealed pass (see elasticps.master.repairs)
            # is trained within the current pass: events keep its number.
            self._pass_id = task.pass_id
            self._pass_batches = 0
        self._task = task
        self._acc = _Accumulator(first=task.offset, end=task.offset)
        self._pending_read = self._read_error = None
        if self._ahead is None and self._deferred is None:
            # Have the next task at hand when this one ends (see _loop).
            self._ahead = self._call_master(master.get_task, self.name, holding=[task.task_id])
        batches = self._task_batches(task)
        self._prefetched.clear()
        try:
            # Batches read ahead: a push can then pull the rows of the next one
            # (or, with overlap_pull, of the one after, while the next trains).
            depth = 2 if self._overlap_pull else 1
            ahead = collections.deque(itertools.islice(batches, depth + 1))
            # The deque's last batch is needed only after this one's push (with
            # overlap_pull, by it): it is read while the push waits for the
            # servers, on a core that would otherwise wait too.
            read_late = not self._overlap_pull
            while True:
                self._read_ahead()  # if the push did not
                self._raise_read_error()
                if not ahead:
                    break
                batch_id_or_none, batch, num_records = ahead.popleft()
                read = functools.partial(_read_into, ahead, batches, depth + 1)
                if read_late:
                    self._pending_read = read
                else:
                    read()
                batch_id = self._pass_batches if batch_id_or_none is None else batch_id_or_none
                target = ahead[depth - 1] if len(ahead) >= depth else None
                self._next_inputs = (
                    target[1][0]
                    if target is not None and not isinstance(target[1], _ModelCodeError)
                    else None
                )
                self._following_inputs = (
                    ahead[0][1][0]
                    if self._overlap_pull and ahead and not isinstance(ahead[0][1], _ModelCodeError)
                    else None
                )
                if self.stop.is_set():
                    return None  # the master re-dispatches the rest from the last progress
                first = task.start + task.offset + records
                records += num_records
                # Progress is reported only once the push is acknowledged by
                # every PS (it may be sent in the background, see overlap_push).
                acknowledged = functools.partial(
                    progress.update, task, task.offset + records, skipped
                )
                try:
                    if isinstance(batch, _ModelCodeError):
                        raise batch
                    inputs, targets = batch
                    loss = self._train_batch(
                        inputs, targets, client, batch_id, acknowledged, num_records=num_records
                    )
                except _ModelCodeError as raised:
                    error = self._bad_record(raised, task, first, first + num_records)
                    if self.config.bad_records != "skip":
                        raise error from raised.exc
                    skipped += num_records
                    skipped_batches += 1
                    # The records stay in the push key of the next push (or of a
                    # push without a gradient at the end of the task): every
                    # parameter server holds them, as skipped.
                    self._acc.end += num_records
                    if skipped_batches > task.skip_budget:
                        self._set_task_aside(
                            task, master, client, progress,
                            offset=task.offset + records, skipped=skipped,
                            skipped_batches=skipped_batches, error=error,
                        )  # fmt: skip
                        return None
                    continue
                samples += len(targets)
                loss_sum += loss * len(targets)
            self._next_inputs = self._following_inputs = None
            acknowledged = functools.partial(progress.update, task, task.offset + records)
            if self._ahead is None:
                self._flush(client, acknowledged)
            elif self._acc.end > self._acc.first:
                # Acknowledged in the background: the report waits for it (_submit_deferred).
                self._push(client, want_params=True, on_acknowledged=acknowledged)
        except Exception as exc:
            self._next_inputs = self._following_inputs = None
            self._pending_read = self._read_error = None
            self._prefetched.clear()
            progress.discard()
            report = master_pb2.ReportTaskRequest(
                trainer_id=self.name,
                task_id=task.task_id,
                pass_id=task.pass_id,
                attempt=task.attempt,
                success=False,
                error=f"{type(exc).__name__}: {exc}",
            )
            try:
                master.report_task(report)
            except Exception:  # the original error matters more
                log.exception("could not report the failure of task %d", task.task_id)
            raise
        report = master_pb2.ReportTaskRequest(
            trainer_id=self.name,
            task_id=task.task_id,
            pass_id=task.pass_id,
            attempt=task.attempt,
            success=True,
            samples=samples,
            mean_loss=loss_sum / samples if samples else math.nan,
            elapsed_s=time.monotonic() - started,
            skipped=skipped,
            skipped_batches=skipped_batches,
            # One call for the report and the next task (the master's
            # ledger writes both at once); not while stopping or
            # registering again.
            get_next=not self.stop.is_set() and not self._lease_lost.is_set(),
        )
        held = self._take_ahead(client)
        if held is not None:
            # Train the held task now; the report goes once this task's last
            # push is acknowledged, and asks for the task after the held one.
            report.holding.append(held.task_id)
            self._deferred = report
            self._submit_deferred()
            return master_pb2.GetTaskResponse(task=held)
        # Nothing held: in async mode, as get_task in _loop.
        report.wait_for_work = self.config.mode is UpdateMode.ASYNC
        self._flush(client, functools.partial(progress.update, task, task.offset + records))
        return self._report(report)

    def _report(self, report: master_pb2.ReportTaskRequest) -> master_pb2.GetTaskResponse | None:
        """Report a task (after every push of it is acknowledged); the next task, if asked."""
        assert self._master is not None and self._progress is not None
        self._progress.discard(report.task_id)
        try:
            return self._master.report_task(report)
        except StaleTaskError as exc:
            # We were presumed dead (lease lost, or timed out) and the task went
            # to another trainer. Our pushes carried their keys, so the other
            # attempt's pushes of the same records are duplicates: nothing was
            # applied twice.
            log.warning(
                "trainer %s: report of task %d rejected: %s", self.name, report.task_id, exc
            )
            return None
        except UnknownTrainerError as exc:
            # etcd expired our lease while the task ran (an etcd leader lost for
            # longer than the TTL, say), and the master took the task back with
            # our registration: as above, nothing of it is applied twice. The
            # loop registers again.
            if not self._lease_lost.wait(self.config.common.lease_ttl_s):
                raise  # our registration is gone while our lease lives: a bug
            log.warning(
                "trainer %s: report of task %d refused after the lease was lost: %s",
                self.name, report.task_id, exc,
            )  # fmt: skip
            return None

    def _call_master(
        self, call: Callable[..., master_pb2.GetTaskResponse | None], *args: object, **kw: object
    ) -> concurrent.futures.Future[master_pb2.GetTaskResponse | None]:
        """Run a master call that may dispatch a task on the reports thread."""
        assert self._reports is not None
        return self._reports.submit(call, *args, **kw)

    def _take_ahead(self, client: ParameterClient) -> master_pb2.Task | None:
        """The task held to train next, once its master call has answered; None if none.

        A deferred report is sent first (its pushes acknowledged), as it asks
        for that task.

        Raises:
            ServiceUnavailableError: from the master call.
        """
        if self._deferred is not None:
            # It waits for the push in flight; resolving that push sends it.
            self._retrain_stale_inflight(client)
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        reply = ahead.result()
        if reply is None or reply.WhichOneof("result") != "task":
            return None
        if self._lease_lost.is_set():
            return None  # the master took it back with the lease
        return reply.task

    def _submit_deferred(self) -> None:
        """Send the deferred report once no push of it awaits an answer."""
        report = self._deferred
        if report is None or self._inflight is not None:
            return
        self._deferred = None
        assert self._ahead is None
        self._ahead = self._call_master(self._report, report)

    def _last_report(self) -> None:
        """On the way out: send the deferred report if its pushes are acknowledged,
        without asking for more; wait for the reports thread."""
        if self._reports is None:
            return
        inflight = self._inflight
        report, self._deferred = self._deferred, None
        if report is not None and (
            inflight is None or (inflight[0].done and not inflight[0].stale)
        ):
            report.get_next = False
            del report.holding[:]
            self._reports.submit(self._report, report)
        # Whatever it answers: the tasks we held go back to todo with our lease.
        self._reports.shutdown(wait=True)

    def _bad_record(
        self, raised: _ModelCodeError, task: master_pb2.Task, first: int, end: int
    ) -> BadRecordError:
        """Log (traceback in the log file only) and return the one-line error of a bad batch.

        ``[first, end)`` are the mini-batch's rows (records of the virtual source).
        """
        cause = describe_model_error(
            raised.exc, self.spec.path, str(self.config.model_path), raised.called
        )
        message = (
            f"{cause}; on rows [{first}, {end}) of {task.file} "
            f"(task {task.task_id}: rows [{task.start}, {task.end}), pass {task.pass_id})"
        )
        skip = self.config.bad_records == "skip"
        # One traceback in the log is enough to debug the model file.
        with_traceback = not skip or not self._skip_traceback_logged
        self._skip_traceback_logged = self._skip_traceback_logged or skip
        log.error(
            "%s%s",
            "skipped a mini-batch: " if skip else "",
            message,
            exc_info=raised.exc if with_traceback else None,
        )
        return BadRecordError(message)

    def _set_task_aside(
        self,
        task: master_pb2.Task,
        master: MasterClient,
        client: ParameterClient,
        progress: ProgressReporter,
        *,
        offset: int,
        skipped: int,
        skipped_batches: int,
        error: BadRecordError,
    ) -> None:
        """Report a task failed after it skipped more mini-batches than its budget.

        Its trained records are pushed and acknowledged first, then its
        progress (the records up to ``offset``, ``skipped`` of them skipped) is
        reported, so the ledger has every record this attempt covered; the
        failure then counts ``skipped_batches`` against the task, which sets
        it aside as failed for the pass.
        """
        self._flush(client)
        progress.discard()
        log.warning(
            "trainer %s: task %d skipped %d mini-batches, more than its budget of %d; "
            "reporting it failed",
            self.name, task.task_id, skipped_batches, task.skip_budget,
        )  # fmt: skip
        try:
            master.report_progress(
                master_pb2.ReportProgressRequest(
                    trainer_id=self.name,
                    task_id=task.task_id,
                    pass_id=task.pass_id,
                    attempt=task.attempt,
                    offset=offset,
                    skipped=skipped,
                )
            )
            master.report_task(
                master_pb2.ReportTaskRequest(
                    trainer_id=self.name,
                    task_id=task.task_id,
                    pass_id=task.pass_id,
                    attempt=task.attempt,
                    success=False,
                    error=f"{skipped_batches} mini-batches skipped, the last: {error}",
                    skipped=skipped,
                    skipped_batches=skipped_batches,
                )
            )
        except StaleTaskError as exc:
            log.warning("trainer %s: task %d is no longer ours: %s", self.name, task.task_id, exc)

    def _to_tensors(self, batch: pa.Table) -> Batch | _ModelCodeError:
        """The model file's ``batch_to_tensors(batch)``, or what it raised."""
        try:
            return self.spec.batch_to_tensors(batch)
        except ElasticPSError:
            raise
        except Exception as exc:
            return _ModelCodeError(exc, "batch_to_tensors")

    def _task_batches(
        self, task: master_pb2.Task
    ) -> Iterator[tuple[int | None, Batch | _ModelCodeError, int]]:
        """The task's remaining mini-batches: ``(batch id, (inputs, targets), records)``;
        instead of the tensors, what ``batch_to_tensors`` raised on them. A batch
        id of None: the number of batches of the pass trained before this one."""
        first = task.start + task.offset
        if task.file == VIRTUAL_SOURCE:
            if self._batch_reader is None:
                raise DataError(
                    "the master hands out tasks of a virtual source (a reader function), "
                    "but this trainer has no reader"
                )
            source = itertools.islice(self._batch_reader(), first, task.end)
            for batch_id, item in enumerate(source, start=first):
                yield batch_id, _as_batch(item, batch_id), 1
            return
        if is_kafka_url(task.file):
            if self._stream_reader is None:
                self._stream_reader = KafkaRangeReader(
                    load_client_config(self.config.kafka_config),
                    timeout_s=self.config.connect_timeout_s,
                )
            table = self._stream_reader.read_rows(task.file, first, task.end, self.spec.columns)
        else:
            self._check_columns(task.file)
            table = self.reader.read_rows(task.file, first, task.end, self.spec.columns)
        for lo in range(0, table.num_rows, self.config.batch_size):
            batch = table.slice(lo, self.config.batch_size)
            yield None, self._to_tensors(batch), batch.num_rows

    def _check_columns(self, path: str) -> None:
        if path not in self._checked_columns:
            check_columns(path, self.spec.columns)
            self._checked_columns.add(path)

    def _model_version(self, client: ParameterClient) -> int:
        return max(client.versions, default=0)

    def _forward_backward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One mini-batch's forward and backward, accumulating into the gradient buffer.

        Raises:
            _ModelCodeError: the model file's forward or loss raised.
            ModelContractError: the loss is not a scalar, or .grad was replaced.
        """
        if self.flat.buffers is not None:
            self.flat.buffers.adopt(self.flat.params)
        called = "forward"
        batch = self._sparse_batch(inputs) if self._tables else None
        try:
            with (
                batch.bind(self.flat.model, self._sparse_modules)
                if batch is not None
                else contextlib.nullcontext()
            ):
                outputs = call_model(self.flat.model, inputs)
                called = "loss"
                loss = self.spec.loss(outputs, targets)
        except ElasticPSError:
            raise
        except Exception as exc:
            raise _ModelCodeError(exc, called) from exc
        if loss.dim() != 0:
            raise ModelContractError(f"loss must return a scalar, got shape {tuple(loss.shape)}")
        loss.backward()  # type: ignore[no-untyped-call]
        if batch is not None:
            self._sparse_grads.append(batch.gradients())
        if self._batches == 0 and not self.flat.grads_are_bound():
            raise ModelContractError(
                "a parameter's .grad was replaced during backward; elasticps needs "
                "gradients to accumulate in place (do not call zero_grad(set_to_none=True))"
            )
        return loss

    def _sparse_batch(self, inputs: object) -> enn.SparseBatch:
        """The rows of a mini-batch's ids, pulled from the servers that hold them.

        Ids the inputs announce (modules with a ``feature``) are pulled
        before the forward pass, every table in one request per server;
        others are pulled when a module meets them.
        """
        client = self._client
        assert client is not None

        def pull(spec: TableSpec, ids: Tensor) -> Tensor:
            return client.pull_rows({spec.name: ids})[spec.name]

        batch = enn.SparseBatch(self._tables, pull=pull)
        prefetched = self._take_prefetched(inputs)
        if prefetched is not None:
            ids_by_table, source = prefetched
            if isinstance(source, PushHandle):
                if not source.done:
                    client.flush()  # overlap_pull: the push before this batch's compute
                rows = source.rows if not source.stale else None
            else:
                rows = source
            if rows is not None:
                # Pulled right after that push (or with the batch before): what a
                # pull then would have read.
                for name, ids in ids_by_table.items():
                    batch.supply(name, ids, rows[name])
                return batch
        wanted = enn.batch_ids(self.flat.model, inputs, self._sparse_modules)
        if wanted:
            # overlap_pull: the next batch's rows come too, as no push before it
            # pulls them (the first two batches of a task).
            following = self._following_inputs
            ahead: dict[str, Tensor] = {}
            if following is not None and not any(p[0] is following for p in self._prefetched):
                with contextlib.suppress(ElasticPSError):  # it raises in its own turn
                    ahead = enn.batch_ids(self.flat.model, following, self._sparse_modules)
            request = dict(wanted)
            for name, ids in ahead.items():
                request[name] = torch.cat([request[name], ids]) if name in request else ids
            rows = client.pull_rows(request)
            for name, ids in wanted.items():
                batch.supply(name, ids, rows[name][: len(ids)])
            if ahead:
                self._prefetched.append(
                    (following, ahead, {n: rows[n][len(wanted.get(n, ())) :] for n in ahead})
                )
        return batch

    def _take_prefetched(
        self, inputs: object
    ) -> tuple[dict[str, Tensor], PushHandle | dict[str, Tensor]] | None:
        """The prefetch of ``inputs``' rows, if one was made; older ones are dropped."""
        for i, (of, ids_by_table, source) in enumerate(self._prefetched):
            if of is inputs:
                del self._prefetched[: i + 1]
                return ids_by_table, source
        return None

    def _sparse_rows(self, batches: int) -> dict[str, tuple[Tensor, Tensor]] | None:
        """The rows to push: the mean over ``batches`` mini-batches, frozen tables left out."""
        if not self._sparse_grads:
            return None
        merged = enn.merge_gradients(self._sparse_grads, 1.0 / batches if batches > 1 else 1.0)
        return {
            name: (g.ids, g.grads)
            for name, g in merged.items()
            if name not in self._frozen_tables and len(g.ids)
        }

    def _train_batch(
        self,
        inputs: Tensor,
        targets: Tensor,
        client: ParameterClient,
        batch_id: int,
        on_acknowledged: Callable[[], None] | None = None,
        *,
        num_records: int = 0,
    ) -> float:
        """Train one mini-batch; returns its loss.

        ``on_acknowledged`` runs once this batch's gradients, if pushed now,
        are acknowledged by every PS. ``num_records`` is the records of the
        task the batch covers (0 outside a task: no push key).
        """
        cfg = self.config
        started = time.perf_counter()
        on_event = self._on_event
        if on_event is not None:
            on_event(
                BeginIteration(
                    pass_id=self._pass_id,
                    batch_id=batch_id,
                    model_version=self._model_version(client),
                    trainer_id=cfg.trainer_id,
                )
            )
        self._pass_batches += 1
        if cfg.mode is UpdateMode.SYNC and not client.consistent:
            # Never train on a mixture of versions (shards being realigned).
            client.pull_consistent()
            self._prefetched.clear()  # rows read before: pulled again
        loss = self._forward_backward(inputs, targets)
        self._batches += 1
        acc = self._acc
        acc.batches += 1
        acc.samples += len(targets)
        acc.end += num_records
        acc.window.append((inputs, targets))
        if acc.batches % cfg.push_every == 0:
            pushed = time.perf_counter()
            self._push(
                client,
                want_params=self._batches % cfg.pull_every == 0,
                on_acknowledged=on_acknowledged,
            )
            metrics.TRAINER_PUSH_SECONDS.observe(time.perf_counter() - pushed)
        elif self._batches % cfg.pull_every == 0:
            client.pull()
        cost = float(loss.detach())
        metrics.TRAINER_SAMPLES.inc(len(targets))
        metrics.TRAINER_STEP_SECONDS.observe(time.perf_counter() - started)
        if on_event is not None:
            on_event(
                EndIteration(
                    pass_id=self._pass_id,
                    batch_id=batch_id,
                    cost=cost,
                    model_version=self._model_version(client),
                    metrics={"samples": float(len(targets))},
                    trainer_id=cfg.trainer_id,
                )
            )
        return cost

    def _key(self, acc: _Accumulator) -> PushKey | None:
        task = self._task
        if task is None or acc.end <= acc.first or self._ledger_only:
            return None
        return PushKey(task.pass_id, task.task_id, acc.first, acc.end)

    def _push(
        self,
        client: ParameterClient,
        *,
        want_params: bool,
        on_acknowledged: Callable[[], None] | None = None,
    ) -> None:
        """Push the accumulated gradient with its key; compute it again while STALE."""
        acc = self._acc
        key = self._key(acc)
        sync = self.config.mode is UpdateMode.SYNC
        self._retrain_stale_inflight(client)
        if not acc.batches:
            # Only skipped records: cover them on every server, without a gradient.
            if key is not None:
                self._cover(client, key)
            if on_acknowledged is not None:
                on_acknowledged()
            self._acc = _Accumulator(first=acc.end, end=acc.end)
            return
        prefetch = self._prefetch_ids()
        for attempt in range(MAX_STALE_RETRIES + 1):
            grads = self.flat.grads
            for lo, hi in self._frozen:
                grads[lo:hi].zero_()  # pulled, never updated: the PS refuses non-zero gradients
            if acc.batches > 1:
                grads.div_(acc.batches)  # mean of per-batch mean gradients
            if self.flat.buffers is not None:
                self.flat.buffers.write_push(grads, float_values=not sync)
            handle = client.push(
                acc.samples,
                want_params=want_params or sync,
                on_acknowledged=self._on_ack(on_acknowledged),
                key=key,
                rows=self._sparse_rows(acc.batches),
                prefetch=prefetch,
                zero_grad=True,
                while_waiting=self._read_ahead,  # a no-op when nothing is left to read
            )
            self._raise_read_error()
            self._sparse_grads = []
            if prefetch is not None:
                # A retry's prefetch replaces the one of the push answered STALE.
                self._prefetched = [p for p in self._prefetched if p[0] is not self._next_inputs]
                self._prefetched.append((self._next_inputs, prefetch, handle))
            if not handle.done:
                # Sent in the background: a STALE answer is handled before the next push.
                self._inflight = (handle, acc, key, on_acknowledged)
                break
            if not handle.stale:
                break
            if attempt == MAX_STALE_RETRIES:
                raise ServiceUnavailableError(
                    f"a push was answered STALE {MAX_STALE_RETRIES + 1} times in a row"
                )
            self._recompute(client, acc)
        self._acc = _Accumulator(first=acc.end, end=acc.end)

    def _read_ahead(self) -> None:
        """Read the next mini-batch now, if ``_run_task`` left it to a push's wait.

        Runs while the push waits for its answers, where an error must not
        cut the exchange short: it waits for :meth:`_raise_read_error`.
        """
        read, self._pending_read = self._pending_read, None
        if read is None:
            return
        try:
            read()
        except Exception as exc:  # raised by _raise_read_error, once the push is answered
            self._read_error = exc

    def _raise_read_error(self) -> None:
        error, self._read_error = self._read_error, None
        if error is not None:
            raise error

    def _prefetch_ids(self) -> dict[str, Tensor] | None:
        """The ids of the next mini-batch's rows, for a push to pull (None: none known)."""
        if not self._tables or self._next_inputs is None:
            return None
        try:
            wanted = enn.batch_ids(self.flat.model, self._next_inputs, self._sparse_modules)
        except ElasticPSError:
            return None  # the next batch raises it in its own turn
        return wanted or None

    def _cover(self, client: ParameterClient, key: PushKey) -> None:
        """Have every server hold ``key``'s records without a gradient (they were skipped)."""
        for attempt in range(MAX_STALE_RETRIES + 1):
            if self.config.mode is UpdateMode.SYNC and not client.consistent:
                client.pull_consistent()
            statuses = client.push_empty(key=key)
            if PushStatus.STALE not in statuses:
                return
            if attempt == MAX_STALE_RETRIES:
                raise ServiceUnavailableError(
                    f"a push was answered STALE {MAX_STALE_RETRIES + 1} times in a row"
                )
            client.pull()

    def _on_ack(self, then: Callable[[], None] | None) -> Callable[[], None] | None:
        """Wrap an acknowledgement callback with the kill-after-ack test hook."""
        if self._kill_after_ack is None:
            return then

        def acknowledged() -> None:
            self._acknowledged_pushes += 1
            if self._acknowledged_pushes == self._kill_after_ack:
                log.warning("trainer %s: test hook: SIGKILL after push %d's acknowledgement",
                            self.name, self._acknowledged_pushes)  # fmt: skip
                os.kill(os.getpid(), signal.SIGKILL)
            if then is not None:
                then()

        return acknowledged

    def _recompute(self, client: ParameterClient, acc: _Accumulator) -> None:
        """Compute ``acc``'s gradient again on fresh parameters (after a STALE answer)."""
        client.pull()
        if self.config.mode is UpdateMode.SYNC and not client.consistent:
            client.pull_consistent()
        if self.flat.buffers is not None:
            # The model's buffers ran these mini-batches already: start them again
            # from the pulled values (what they did since the last push stays pending).
            self.flat.buffers.adopt(self.flat.params, force=True)
        self.flat.zero_grad()
        self._sparse_grads = []
        for inputs, targets in acc.window:
            self._forward_backward(inputs, targets)

    def _retrain_stale_inflight(self, client: ParameterClient) -> None:
        """If the push sent in the background was answered STALE, push it again now."""
        inflight = self._inflight
        if inflight is None:
            return
        handle, acc, key, on_acknowledged = inflight
        client.flush()
        self._inflight = None
        if not handle.stale:
            self._submit_deferred()
            return
        log.info("trainer %s: a background push was stale; computing it again", self.name)
        saved = self.flat.grads.clone()  # the accumulation in progress
        saved_rows = self._sparse_grads
        for attempt in range(MAX_STALE_RETRIES + 1):
            self._recompute(client, acc)
            if acc.batches > 1:
                self.flat.grads.div_(acc.batches)
            if self.flat.buffers is not None:
                self.flat.buffers.write_push(
                    self.flat.grads, float_values=self.config.mode is UpdateMode.ASYNC
                )
            retry = client.push(
                acc.samples,
                want_params=True,
                on_acknowledged=None,
                key=key,
                rows=self._sparse_rows(acc.batches),
            )
            if not retry.stale:
                if on_acknowledged is not None:
                    on_acknowledged()
                break
            if attempt == MAX_STALE_RETRIES:
                raise ServiceUnavailableError(
                    f"a push was answered STALE {MAX_STALE_RETRIES + 1} times in a row"
                )
        if self.config.mode is UpdateMode.SYNC and self._acc.batches:
            # Pipelined sync: the accumulation in progress was computed before
            # the retry, on parameters and rows of versions the retry moved past;
            # computed again, it joins the next step as any pipelined gradient.
            self._recompute(client, self._acc)
        else:
            self.flat.grads.copy_(saved)
            self._sparse_grads = saved_rows
        self._submit_deferred()

    def _flush(
        self, client: ParameterClient, on_acknowledged: Callable[[], None] | None = None
    ) -> None:
        """Push what is accumulated; return once every push of the task is acknowledged."""
        if self._acc.end > self._acc.first:
            self._push(client, want_params=True, on_acknowledged=on_acknowledged)
        self._retrain_stale_inflight(client)
        client.flush()


def table_entries(model: torch.nn.Module, num_ps: int) -> tuple[TableEntry, ...]:
    """The model's sparse tables as the parameter servers hold them (the HELLO's ``tables``).

    Raises:
        ModelContractError: two modules declare one table name differently.
    """
    partitions = enn.partitions(model)
    return tuple(
        TableEntry(spec, partitions[name], num_ps) for name, spec in enn.table_specs(model).items()
    )


def dense_frozen_patterns(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """The frozen patterns that are about dense parameters (those naming only tables are not).

    Args:
        model: the model.
        patterns: ``fnmatch`` patterns over parameter and sparse-table names.

    Returns:
        The patterns that match a dense parameter, or match no sparse table
        (so that a pattern matching nothing is still reported as a typo).
    """
    tables = list(enn.table_specs(model))
    params = [name for name, _ in model.named_parameters()]
    return [
        p
        for p in patterns
        if any(fnmatch.fnmatchcase(n, p) for n in params)
        or not any(fnmatch.fnmatchcase(t, p) for t in tables)
    ]


_T = TypeVar("_T")


def _read_into(ahead: collections.deque[_T], items: Iterator[_T], size: int) -> None:
    """Take items from ``items`` until ``ahead`` holds ``size`` (or ``items`` ends)."""
    ahead.extend(itertools.islice(items, size - len(ahead)))


def _as_batch(item: object, batch_id: int) -> Batch:
    """Check that a reader yielded ``(inputs, targets)`` tensors."""
    if (
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], Tensor)
        and isinstance(item[1], Tensor)
    ):
        return item[0], item[1]
    raise ModelContractError(
        f"the reader must yield (inputs, targets) tensor pairs; batch {batch_id} is "
        f"{type(item).__name__}"
    )


def run_trainer(config: TrainerConfig, stop: threading.Event) -> None:
    """Run one trainer process until the job finishes.

    Raises:
        ModelContractError: the model file breaks the contract.
        DataError: a data file is missing or lacks the model's columns.
        CoordinationError / ServiceUnavailableError: etcd, PS or master unreachable.
    """
    torch.set_num_threads(config.threads)
    spec = load_model_file(
        config.model_path, config.model_class, parse_model_args(config.model_args)
    )
    if config.example_file:
        spec = spec.with_example(
            functools.partial(first_rows, config.example_file, config.example_rows, spec.columns)
        )
    store = JobStore(config.common.etcd_endpoint, config.common.job)
    try:
        Trainer(config, spec, store, stop).run()
    finally:
        store.close()


def _metrics_host() -> str:
    """The address a trainer serves its metrics on: its host's on the route to the
    launcher (``ELASTICPS_HOST``, set on remote hosts), else 127.0.0.1."""
    return os.environ.get("ELASTICPS_HOST", "") or "127.0.0.1"
