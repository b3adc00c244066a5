"""Evaluate the model on the test set at the end of every pass, while training goes on.

``elasticps train --eval-each-pass`` (with a ``test.parquet`` beside the
training data): when the master writes ``/elasticps/<job>/passes/<n>`` (in the
transaction that completes pass ``n``), the launcher takes a consistent
snapshot of every parameter server into a temporary directory
(:func:`~elasticps.snapshot.take_consistent_checkpoint`: every shard frozen at
one model version for a few milliseconds), reads it back by parameter name,
deletes it, and evaluates it with :func:`~elasticps.evaluate.evaluate`, the
code that evaluates the final model. A model with sparse tables is evaluated
with the snapshot's rows (:func:`~elasticps.evaluate.checkpoint_tables`), read
before the snapshot is deleted. Trainers go on with the next pass
meanwhile, so the snapshot holds the few steps they took between the end of
the pass and the freeze; each result records that model version and the
moment the snapshot was taken. The results go to the launcher's log and to
``run.json`` (``pass_evaluations``); ``benchmarks/training.py`` reads them for
time-to-accuracy.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from elasticps.buffers import state_from_flat
from elasticps.coord.store import JobStore, Watch
from elasticps.data.parquet import FileName
from elasticps.errors import CoordinationError, ElasticPSError
from elasticps.evaluate import checkpoint_tables, evaluate
from elasticps.model_file import ModelSpec
from elasticps.sharing import canonical_names
from elasticps.snapshot import load_consistent_checkpoint, take_consistent_checkpoint
from elasticps.tables import TableSet

log = logging.getLogger(__name__)

_STOP = -1


@dataclass(frozen=True)
class PassEvaluation:
    """The test-set evaluation of the model at the end of one pass.

    Attributes:
        pass_id: the pass that had just ended (0-based).
        version: the model version of the snapshot evaluated.
        snapshot_time: Unix time (seconds) at which the snapshot was taken.
        time: Unix time (seconds) at which the evaluation finished.
        accuracy: share of test samples classified right, in [0, 1]; None
            for a model without an accuracy (see
            :class:`~elasticps.evaluate.MetricSet`).
        loss: mean loss over the test samples.
        samples: number of test samples.
        metrics: every metric of the evaluation (accuracy included), by name.
    """

    pass_id: int
    version: int
    snapshot_time: float
    time: float
    accuracy: float | None
    loss: float
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields."""
        return asdict(self)


class PassEvaluator:
    """Evaluates a running job at the end of every pass (see the module docstring).

    One thread takes each pass's snapshot as soon as the pass ends, another
    evaluates the snapshots in order, so a slow evaluation never delays the
    next snapshot. A failed snapshot or evaluation is logged and skipped,
    never failing the job.

    Args:
        store: the job's etcd view.
        spec: the model file, to rebuild parameter shapes and evaluate.
        seed: the job's seed (the model is built once, for its shapes).
        test_path: the test Parquet file.
        work_dir: where snapshots are written and deleted (the PS write them,
            so it must be on their file system).
    """

    def __init__(
        self,
        store: JobStore,
        spec: ModelSpec,
        seed: int,
        test_path: FileName,
        work_dir: Path,
    ) -> None:
        self._store = store
        self._spec = spec
        self._model = spec.instantiate(seed)  # for shapes and buffer dtypes only
        self._test_path = test_path
        self._work_dir = work_dir
        self._passes: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._snapshots: queue.SimpleQueue[_Snapshot | None] = queue.SimpleQueue()
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._results: list[PassEvaluation] = []
        self._watch: Watch | None = None
        self._threads_before: int | None = None
        self._threads = [
            threading.Thread(target=self._snapshot_loop, name="pass-snapshot", daemon=True),
            threading.Thread(target=self._evaluate_loop, name="pass-eval", daemon=True),
        ]

    def start(self) -> None:
        """Start following ``passes/`` in etcd.

        Raises:
            CoordinationError: etcd failed.
        """
        # One intra-op thread while training runs: on a machine whose cores
        # the trainers keep busy, a second OpenMP thread mostly waits at
        # barriers for a core (the first evaluation took 1.2 s with two here).
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
        for thread in self._threads:
            thread.start()
        self._watch = self._store.watch_pass_summaries(self._on_passes)

    def results(self) -> list[PassEvaluation]:
        """The evaluations finished so far, by pass (a copy)."""
        with self._lock:
            return list(self._results)

    def close(self) -> list[PassEvaluation]:
        """Stop following passes, finish the evaluations already due, and return all results.

        The passes are read once more first: the watch may not have delivered
        the last one yet when the job ends with it.
        """
        try:
            self._on_passes(self._store.pass_summaries())
        except CoordinationError as exc:
            log.warning("could not read the passes that ended last, to evaluate them: %s", exc)
        if self._watch is not None:
            self._watch.cancel()
        self._passes.put(_STOP)
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        with self._lock:
            return list(self._results)

    def _on_passes(self, passes: dict[int, dict[str, object]]) -> None:
        with self._lock:
            new = sorted(set(passes) - self._seen)
            self._seen.update(new)
        for pass_id in new:
            self._passes.put(pass_id)

    def _snapshot_loop(self) -> None:
        while (pass_id := self._passes.get()) != _STOP:
            try:
                self._snapshots.put(self._snapshot(pass_id))
            except (ElasticPSError, OSError, ValueError) as exc:
                log.warning("could not snapshot the model after pass %d: %s", pass_id, exc)
            except Exception:  # a bug here must not stop the job's evaluations
                log.exception("snapshot after pass %d failed", pass_id)
        self._snapshots.put(None)

    def _evaluate_loop(self) -> None:
        # torchmetrics is not imported ahead: the default metrics but the AUC
        # do without it (elasticps.evaluate), and its import is costly.
        while (snapshot := self._snapshots.get()) is not None:
            try:
                result = self._evaluate(snapshot)
            except (ElasticPSError, OSError, ValueError) as exc:
                log.warning("could not evaluate the model after pass %d: %s", snapshot.pass_id, exc)
                continue
            except Exception:
                log.exception("evaluation after pass %d failed", snapshot.pass_id)
                continue
            with self._lock:
                self._results.append(result)
            shown = ", ".join(f"{k} {v:.4g}" for k, v in result.metrics.items())
            log.info(
                "pass %d: test %s%sloss %.4f (model version %d)",
                result.pass_id, shown, ", " if shown else "", result.loss, result.version,
            )  # fmt: skip

    def _snapshot(self, pass_id: int) -> _Snapshot:
        directory = self._work_dir / f"pass-{pass_id}"
        try:
            taken = time.time()
            manifest = take_consistent_checkpoint(
                self._store.ps_addresses(timeout_s=30.0),
                directory,
                ledger_revision=None,
                extra={"pass": pass_id, "purpose": "evaluation"},
            )
            values = load_consistent_checkpoint(directory).values
            tables = checkpoint_tables(self._model, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        version = manifest.get("version")
        tensors = _shaped(values, self._model)
        return _Snapshot(
            pass_id, version if isinstance(version, int) else -1, taken, tensors, tables
        )

    def _evaluate(self, snapshot: _Snapshot) -> PassEvaluation:
        result = evaluate(self._spec, snapshot.tensors, self._test_path, tables=snapshot.tables)
        metrics = {k: v for k, v in result.items() if k not in ("loss", "samples")}
        return PassEvaluation(
            pass_id=snapshot.pass_id,
            version=snapshot.version,
            snapshot_time=snapshot.taken,
            time=time.time(),
            accuracy=metrics.get("accuracy"),
            loss=float(result["loss"]),
            samples=int(result["samples"]),
            metrics=metrics,
        )


@dataclass(frozen=True)
class _Snapshot:
    pass_id: int
    version: int
    taken: float  # Unix time, seconds
    tensors: dict[str, torch.Tensor]
    tables: TableSet | None  # the sparse tables' rows, if the model has any


def _shaped(values: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Flat values (by name) as the model's ``state_dict``; ValueError if they differ.

    A tensor shared under several names is held once, under its first name
    (:mod:`elasticps.sharing`).
    """
    expected = set(canonical_names(model))
    if set(values) != expected:
        differ = sorted(set(values) ^ expected)
        raise ValueError(f"the snapshot's parameters differ from the model's: {differ}")
    return state_from_flat(model, values, what="the snapshot")
