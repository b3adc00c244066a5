"""The trainer process: get tasks, train mini-batches, push and pull.

Per mini-batch: forward, loss, backward (into the flat gradient buffer).
Every ``push_every`` (n) mini-batches the mean gradient is pushed to every
parameter server; every ``pull_every`` (m) mini-batches fresh parameters are
pulled. In sync mode n = m = 1 and a push waits for the step's new
parameters. Gradients still accumulated at the end of a task are pushed
before the task is reported done, so a done task's data is in the model.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from elasticps.config import TrainerConfig, UpdateMode
from elasticps.coord.store import JobStore
from elasticps.data.parquet import RangeReader, check_columns
from elasticps.errors import ModelContractError
from elasticps.master.client import MasterClient
from elasticps.model_file import ModelSpec, load_model_file
from elasticps.proto import master_pb2
from elasticps.trainer.client import ParameterClient
from elasticps.trainer.flat import FlatModel, bind_flat_buffers

log = logging.getLogger(__name__)


@dataclass
class _Accumulator:
    """Gradients accumulated since the last push."""

    batches: int = 0
    samples: int = 0


class Trainer:
    """One trainer: its model, its connections, and the training loop.

    Args:
        config: trainer configuration.
        spec: the loaded model file.
        store: the job's etcd view.
        stop: set it to make the trainer stop after the current mini-batch.
    """

    def __init__(
        self, config: TrainerConfig, spec: ModelSpec, store: JobStore, stop: threading.Event
    ) -> None:
        self.config = config
        self.spec = spec
        self.store = store
        self.stop = stop
        self.name = str(config.trainer_id)
        model = spec.instantiate(config.seed)
        self.flat: FlatModel = bind_flat_buffers(model, config.num_ps, config.big_array_bound)
        self.reader = RangeReader()
        self._acc = _Accumulator()
        self._batches = 0
        self._checked_columns: set[str] = set()

    def run(self) -> None:
        """Train until the master says the job is finished or ``stop`` is set.

        Raises:
            ServiceUnavailableError: the master or a PS is unreachable.
            DataError / ModelContractError: the data does not fit the model file.
        """
        cfg = self.config
        addresses = self.store.ps_addresses(timeout_s=cfg.connect_timeout_s)
        client = ParameterClient(
            self.flat.placement,
            addresses,
            self.flat.params,
            self.flat.grads,
            cfg.trainer_id,
            timeout_s=cfg.connect_timeout_s,
        )
        lease = self.store.grant_lease(cfg.common.lease_ttl_s, on_lost=self.stop.set)
        master = None
        try:
            client.hello(initialize=True)
            self.store.register_trainer(self.name, {"pid": os.getpid()}, lease)
            master = MasterClient(self.store.master_address(timeout_s=cfg.connect_timeout_s))
            self._loop(master, client)
        finally:
            if master is not None:
                master.close()
            client.close()
            if not lease.lost.is_set():
                lease.revoke()

    def _loop(self, master: MasterClient, client: ParameterClient) -> None:
        sync = self.config.mode is UpdateMode.SYNC
        while not self.stop.is_set():
            reply = master.get_task(self.name)
            kind = reply.WhichOneof("result")
            if kind == "finished":
                log.info("trainer %s: job finished after %d mini-batches", self.name, self._batches)
                return
            if kind == "wait_s":
                if sync:
                    # Take part in the running step without a gradient, so that
                    # the trainers still working are not held up by us.
                    client.push_empty()
                self.stop.wait(min(reply.wait_s, 0.2) if sync else reply.wait_s)
                continue
            self._run_task(reply.task, master, client)

    def _run_task(
        self, task: master_pb2.Task, master: MasterClient, client: ParameterClient
    ) -> None:
        started = time.monotonic()
        samples = 0
        loss_sum = 0.0
        try:
            self._check_columns(task.file)
            table = self.reader.read_rows(task.file, task.start, task.end, self.spec.columns)
            for lo in range(0, table.num_rows, self.config.batch_size):
                if self.stop.is_set():
                    return  # the task times out and goes to another trainer
                batch = table.slice(lo, self.config.batch_size)
                loss = self._train_batch(batch, client)
                samples += batch.num_rows
                loss_sum += loss * batch.num_rows
            self._flush(client)
        except Exception as exc:
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
        master.report_task(
            master_pb2.ReportTaskRequest(
                trainer_id=self.name,
                task_id=task.task_id,
                pass_id=task.pass_id,
                attempt=task.attempt,
                success=True,
                samples=samples,
                mean_loss=loss_sum / samples if samples else math.nan,
                elapsed_s=time.monotonic() - started,
            )
        )

    def _check_columns(self, path: str) -> None:
        if path not in self._checked_columns:
            check_columns(path, self.spec.columns)
            self._checked_columns.add(path)

    def _train_batch(self, batch: object, client: ParameterClient) -> float:
        cfg = self.config
        inputs, targets = self.spec.batch_to_tensors(batch)  # type: ignore[arg-type]
        outputs = self.flat.model(inputs)
        loss = self.spec.loss(outputs, targets)
        if loss.dim() != 0:
            raise ModelContractError(f"loss must return a scalar, got shape {tuple(loss.shape)}")
        loss.backward()  # type: ignore[no-untyped-call]
        if self._batches == 0 and not self.flat.grads_are_bound():
            raise ModelContractError(
                "a parameter's .grad was replaced during backward; elasticps needs "
                "gradients to accumulate in place (do not call zero_grad(set_to_none=True))"
            )
        self._batches += 1
        self._acc.batches += 1
        self._acc.samples += len(targets)
        if self._acc.batches % cfg.push_every == 0:
            self._push(client, want_params=self._batches % cfg.pull_every == 0)
        elif self._batches % cfg.pull_every == 0:
            client.pull()
        return float(loss.detach())

    def _push(self, client: ParameterClient, *, want_params: bool) -> None:
        acc = self._acc
        if acc.batches > 1:
            self.flat.grads.div_(acc.batches)  # mean of per-batch mean gradients
        client.push(acc.samples, want_params=want_params or self.config.mode is UpdateMode.SYNC)
        self.flat.zero_grad()
        self._acc = _Accumulator()

    def _flush(self, client: ParameterClient) -> None:
        if self._acc.batches:
            self._push(client, want_params=True)


def run_trainer(config: TrainerConfig, stop: threading.Event) -> None:
    """Run one trainer process until the job finishes.

    Raises:
        ModelContractError: the model file breaks the contract.
        DataError: a data file is missing or lacks the model's columns.
        CoordinationError / ServiceUnavailableError: etcd, PS or master unreachable.
    """
    torch.set_num_threads(config.threads)
    spec = load_model_file(config.model_path, config.model_class)
    store = JobStore(config.common.etcd_endpoint, config.common.job)
    try:
        Trainer(config, spec, store, stop).run()
    finally:
        store.close()
