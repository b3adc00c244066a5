"""``elasticps.train`` on other machines: ``cluster=Hosts(...)`` or ``cluster=Slurm(...)``.

The job runs through the command line's own launcher: :func:`train_launched`
turns the call into the argument list of ``elasticps train --hosts FILE``
(or ``--launcher slurm``), :func:`train_argv` (pure), and runs that command
as a child process of this one, so placement, the preflight on every host,
the copy of the model file to each role, supervision and recovery are the
launcher's (:mod:`elasticps.launcher.local`, :mod:`elasticps.launcher.ssh`,
:mod:`elasticps.launcher.slurm`). A child process, not a call: the launcher
forks its fork server before any thread starts and turns SIGTERM into a clean
stop, which a notebook's or a script's process cannot promise.

The trainers are processes on the hosts, so what only this process holds
cannot reach them: the model must be a model file, and the data a location
that every host reads. What is refused says so by the argument's name
(:func:`launch_request`). When the launcher has ended, the parameters are
read from the run's final checkpoint (``OUTPUT/model.safetensors``, by
:func:`elasticps.checkpoint.load_checkpoint`). The events come from what the
launcher makes known: while it runs, the job's etcd (named in
``OUTPUT/run.json`` as soon as it is up) tells when a pass ends and when a
trainer joins or leaves; at the end, ``run.json`` and the checkpoint give the
rest.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, Protocol, TypeVar

from torch import Tensor, nn

from elasticps import updater as updater_mod
from elasticps.api.cluster import Hosts, Parquet, Slurm
from elasticps.checkpoint import load_checkpoint
from elasticps.config import OptimizerConfig, model_args_text
from elasticps.coord.store import JobStore, Watch
from elasticps.errors import (
    ConfigError,
    CoordinationError,
    DataError,
    JobFailedError,
    JobUserError,
)
from elasticps.events import BeginTraining, Checkpointed, EndPass, EndTraining, TrainingEvent
from elasticps.launcher.output import STOP_FILE
from elasticps.launcher.spawn import terminate, wait_or_kill
from elasticps.model_file import ModelSpec, load_model_file
from elasticps.parameters import ParameterSet
from elasticps.security import output_etcd_tls
from elasticps.storage import Location, is_url

__all__ = ["EventSink", "LaunchRequest", "launch_request", "train_argv", "train_launched"]

log = logging.getLogger(__name__)

EventHandler = Callable[[TrainingEvent], None]


class EventSink(Protocol):
    """Hands events to the user's handler one at a time (``elasticps.train``'s event hub)."""

    def emit(self, event: TrainingEvent) -> None:
        """Call the handler with ``event``, under the hub's lock."""


_Hub = TypeVar("_Hub", bound=EventSink)

# Lines of the launcher's standard error kept for the error of a failed job.
_TAIL_LINES = 200
# Seconds the launcher has to stop every role after SIGTERM before it is killed.
_STOP_TIMEOUT_S = 60.0
_ERROR_PREFIX = "elasticps: error: "
# Seconds between two looks at run.json for the job's etcd.
_POLL_S = 0.2


@dataclass(frozen=True)
class LaunchRequest:
    """What :func:`elasticps.train` asks of the launcher, after validation.

    Attributes:
        spec: the model file, validated here (the launcher validates it again).
        data: the ``--data`` location: a directory, a Parquet file or glob,
            or a storage URL.
        batch_size: ``--batch-size``, or None for the launcher's default.
        records_per_task: ``--records-per-task``, or None for its default.
        optimizer: the parameter servers' optimizer.
        num_passes: ``--epochs``.
    """

    spec: ModelSpec
    data: str
    batch_size: int | None
    records_per_task: int | None
    optimizer: OptimizerConfig
    num_passes: int


def launch_request(
    model: object,
    loss_fn: object,
    reader: object,
    *,
    cluster: Hosts | Slurm,
    updater: updater_mod.Updater | OptimizerConfig | None = None,
    frozen_parameters: Iterable[str] = (),
    num_passes: int = 1,
    parameters: Mapping[str, Tensor] | None = None,
    test_reader: object = None,
    metrics: object = None,
) -> LaunchRequest:
    """Check the arguments of :func:`elasticps.train` for a job on hosts.

    Args:
        model: the model file's path, or a :class:`~elasticps.model_file.ModelSpec`
            from :func:`~elasticps.model_file.load_model_file` (which carries
            the class name and the constructor's arguments).
        loss_fn: None, or the model file's own ``loss``.
        reader: a data location (``--data``: a directory with
            ``train.parquet``, a Parquet file or glob, a storage URL), or a
            :class:`~elasticps.api.cluster.Parquet` of one file or directory
            made with the model file's ``batch_to_tensors``
            (:meth:`Parquet.from_model_file`).
        cluster: the hosts.
        updater: as for :func:`elasticps.train`.
        frozen_parameters: must be empty.
        num_passes: passes over the data, >= 1.
        parameters: must be None (start from a checkpoint with ``resume``).
        test_reader: must be None (a ``test.parquet`` beside the data is evaluated).
        metrics: must be None (the model file's ``metrics()`` are used).

    Returns:
        The request.

    Raises:
        ConfigError: an argument that cannot reach processes on other
            machines; the message names it and says what to pass instead.
        ModelContractError: the model file breaks the contract.
    """
    where = type(cluster).__name__
    if isinstance(model, nn.Module):
        raise ConfigError(
            f"model: with {where} the trainers are processes on the hosts and build the model "
            "from a model file: pass the file's path (or load_model_file(path, model_class, "
            "model_args)), not a torch.nn.Module"
        )
    if isinstance(model, ModelSpec):
        if not model.path.is_file():
            raise ConfigError(
                f"model: with {where} the model must come from a model file; {model.path} is not "
                "one (a ModelSpec of an in-memory module cannot travel to the hosts)"
            )
        spec = model
    elif isinstance(model, str | Path):
        spec = load_model_file(model)
    else:
        raise ConfigError(f"model: with {where}, a model file's path, got {type(model).__name__}")
    if loss_fn is not None and not _same_function(loss_fn, spec.loss, spec.path):
        raise ConfigError(
            f"loss_fn: with {where} the trainers use the model file's loss "
            f"({spec.path.name}): pass None"
        )
    if num_passes < 1:
        raise ConfigError(f"num_passes must be >= 1, got {num_passes}")
    if tuple(frozen_parameters):
        raise ConfigError(f"frozen_parameters: not supported with {where}; pass none")
    if parameters is not None:
        raise ConfigError(
            f"parameters: with {where} a job starts from the model file's initial values, or "
            f"from a checkpoint: {where}(resume=...)"
        )
    if test_reader is not None:
        raise ConfigError(
            f"test_reader: not taken with {where}: a test.parquet beside train.parquet in the "
            "data directory is evaluated at the end (the EndTraining event's test_* metrics)"
        )
    if metrics is not None:
        raise ConfigError(f"metrics: with {where} the model file's metrics() are used; pass None")
    data, batch_size, records_per_task = _data_of(reader, spec, where)
    return LaunchRequest(
        spec=spec,
        data=data,
        batch_size=batch_size,
        records_per_task=records_per_task,
        optimizer=updater_mod.as_config(updater if updater is not None else updater_mod.Adam()),
        num_passes=num_passes,
    )


def _data_of(reader: object, spec: ModelSpec, where: str) -> tuple[str, int | None, int | None]:
    if isinstance(reader, Parquet):
        if len(reader.paths) != 1:
            raise ConfigError(
                f"reader: with {where} a Parquet names one file or directory (the job's data), "
                f"got {len(reader.paths)} files"
            )
        if not _same_function(reader.batch_to_tensors, spec.batch_to_tensors, spec.path):
            raise ConfigError(
                f"reader: with {where} the trainers use the model file's batch_to_tensors: make "
                f"the Parquet with Parquet.from_model_file(files, {str(spec.path)!r})"
            )
        if tuple(reader.columns) != spec.columns:
            raise ConfigError(
                f"reader: with {where} the trainers read the model file's COLUMNS "
                f"{spec.columns}, not {tuple(reader.columns)}"
            )
        return str(reader.paths[0]), reader.batch_size, reader.records_per_task
    if isinstance(reader, str | Path):
        text = str(reader)
        return (text if is_url(text) else str(Path(text).resolve())), None, None
    raise ConfigError(
        f"reader: with {where} the trainers read the data on the hosts: pass a data location "
        "(a directory with train.parquet, a Parquet file or a storage URL) or "
        "Parquet.from_model_file(...); a reader function cannot travel to the hosts"
    )


def _same_function(given: object, own: object, path: Path) -> bool:
    """Whether ``given`` is the model file's function ``own`` (the file loaded again counts)."""
    if given is own:
        return True
    code, own_code = getattr(given, "__code__", None), getattr(own, "__code__", None)
    if code is None or own_code is None:
        return False
    return bool(
        Path(code.co_filename).resolve() == path.resolve()
        and getattr(given, "__qualname__", None) == getattr(own, "__qualname__", "")
    )


def _local(path: str | Path) -> str:
    return str(path) if is_url(str(path)) else str(Path(path).resolve())


def train_argv(cluster: Hosts | Slurm, request: LaunchRequest) -> list[str]:
    """The arguments of ``elasticps train`` that run ``request`` on ``cluster``. Pure.

    Every field of the cluster description becomes its flag; local paths
    become absolute, so that they name the same files on every host.
    """
    spec = request.spec
    argv = [
        "--model", str(spec.path),
        "--model-class", spec.model_class,
        "--data", request.data,
        "--output", _local(cluster.output),
        "--epochs", str(request.num_passes),
        "--trainers", str(cluster.trainers),
        "--ps", str(cluster.ps),
        "--mode", cluster.update_mode.value,
        "--push-every", str(cluster.push_every),
        "--pull-every", str(cluster.pull_every),
        "--big-array-bound", str(cluster.big_array_bound),
        "--placement", cluster.placement,
        "--lease-ttl-s", repr(float(cluster.lease_ttl_s)),
        "--task-timeout-s", repr(float(cluster.task_timeout_s)),
        "--checkpoint-every-s", repr(float(cluster.checkpoint_every_s)),
        "--sync-reduction", cluster.sync_reduction,
        "--max-restarts", str(cluster.max_restarts),
        "--seed", str(cluster.seed),
        "--job", cluster.job,
        "--no-progress",
        *updater_mod.ps_flags(request.optimizer),
    ]  # fmt: skip
    if spec.model_args:
        argv += ["--model-args", model_args_text(dict(spec.model_args))]
    if request.batch_size is not None:
        argv += ["--batch-size", str(request.batch_size)]
    if request.records_per_task is not None:
        argv += ["--records-per-task", str(request.records_per_task)]
    if cluster.overwrite:
        argv.append("--overwrite")
    if cluster.resume is not None:
        argv += ["--resume", _local(cluster.resume)]
    if cluster.remote_python:
        argv += ["--remote-python", cluster.remote_python]
    if cluster.advertise_address:
        argv += ["--advertise-address", cluster.advertise_address]
    if isinstance(cluster, Hosts):
        argv += ["--hosts", _local(cluster.hostfile)]
        if cluster.ssh_config is not None:
            argv += ["--ssh-config", _local(cluster.ssh_config)]
        argv += ["--etcd-replicas", str(cluster.etcd_replicas)]
    else:
        argv += ["--launcher", "slurm"]
    return argv


def train_launched(
    request: LaunchRequest,
    cluster: Hosts | Slurm,
    event_handler: EventHandler | None,
    make_hub: Callable[[EventHandler | None], _Hub],
    watch_trainers: Callable[[JobStore, _Hub], Watch],
) -> ParameterSet:
    """Run ``request`` with the launcher of ``elasticps train``, and return the final parameters.

    The launcher's lines (what ``elasticps train`` prints on its standard
    error) are written to this process's ``sys.stderr``. The events, one at
    a time:

    - :class:`~elasticps.events.BeginTraining` before the launcher starts;
    - while it runs, from the job's etcd: :class:`~elasticps.events.EndPass`
      when the master has audited a pass (``metrics["samples"]``: its records
      trained; ``cost`` NaN and ``model_version`` 0, neither known per pass),
      and :class:`~elasticps.events.TrainerJoined` /
      :class:`~elasticps.events.TrainerLost` as trainers register and leave;
    - once it has ended: the ``EndPass`` of any pass not reported yet (from
      ``run.json``), :class:`~elasticps.events.Checkpointed` for a local
      output (its ``path``), and :class:`~elasticps.events.EndTraining`
      (``samples``, ``wall_s``, and the evaluation of a ``test.parquet`` as
      ``test_*``).

    An exception of the handler stops the job as ``elasticps stop`` does (the
    trainers stop, the final checkpoint is written) and is raised as is once
    the launcher has ended.

    Args:
        request: what to train (:func:`launch_request`).
        cluster: where.
        event_handler: the user's handler, or None.
        make_hub: builds the event hub of :func:`elasticps.train` around a
            handler (its pass and trainer events, one at a time).
        watch_trainers: ``watch_trainers(store, hub)`` reports trainers
            joining and leaving the job to the hub; returns the watch.

    Raises:
        JobUserError: the launcher stopped on a user error (exit status 2:
            a bad host file, a host that cannot run the job, a model file
            that fails on the hosts...); the message is its own.
        JobFailedError: the launcher failed otherwise, or was interrupted.
        DataError: the run's final checkpoint cannot be read.
        KeyboardInterrupt: on Ctrl-C: the launcher is stopped first (every
            role of the job with it).
    """
    argv = train_argv(cluster, request)
    output = Location.of(_local(cluster.output))
    live = _LiveEvents(_run_dir(cluster), cluster.job, event_handler, make_hub, watch_trainers)
    live.emit(
        BeginTraining(
            metrics={
                "num_passes": float(request.num_passes),
                "num_trainers": float(cluster.trainers),
            }
        )
    )
    log.info("running elasticps train %s", " ".join(argv))
    live.start()
    try:
        status, tail = _run_launcher(argv)
    finally:
        live.stop()
    live.raise_failure()
    if status != 0:
        raise _launcher_error(status, tail, cluster)
    tensors, manifest = load_checkpoint(output)
    tables = None
    if output.is_local:
        from elasticps.evaluate import checkpoint_tables

        tables = checkpoint_tables(request.spec.build(), output.local_path)
    result = ParameterSet(tensors, tables)
    if event_handler is not None:
        for event in _run_events(output, manifest, live.passes_seen):
            live.emit(event)
    return result


def _run_dir(cluster: Hosts | Slurm) -> Path:
    """The local directory of the launcher's ``run.json`` (for a URL output, its state dir)."""
    output = _local(cluster.output)
    if is_url(output):
        from elasticps.jobs import local_dir_for_url

        return local_dir_for_url(Location.of(output).url, cluster.job)
    return Path(output)


class _LiveEvents(Generic[_Hub]):
    """The events the job's etcd tells while the launcher runs, and the handler's failure.

    A thread waits for ``run.json`` to name the job's etcd (written by this
    launcher: newer than :meth:`start`), then watches the pass audits and the
    live trainers. What cannot be watched (etcd not reachable from here) is
    left out; the pass ends then come from ``run.json`` at the end. The
    handler is called through one event hub, so one event at a time; its
    first exception asks the launcher to stop
    (``OUTPUT/.stop``, as ``elasticps stop`` does) and is kept for
    :meth:`raise_failure`.
    """

    def __init__(
        self,
        run_dir: Path,
        job: str,
        handler: EventHandler | None,
        make_hub: Callable[[EventHandler | None], _Hub],
        watch_trainers: Callable[[JobStore, _Hub], Watch],
    ) -> None:
        self._run_dir = run_dir
        self._job = job
        self._handler = handler
        self._hub = make_hub(self._guarded if handler is not None else None)
        self._watch_trainers = watch_trainers
        self._failure: Exception | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: JobStore | None = None
        self._watches: list[Watch] = []
        self._started_ns = 0
        self._running = False  # while the launcher runs, a failure asks it to stop
        self.passes_seen: set[int] = set()

    def emit(self, event: TrainingEvent) -> None:
        """Hand ``event`` to the handler (raises the handler's exception, if it raised)."""
        self._hub.emit(event)
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the handler's first exception, if any."""
        if self._failure is not None:
            raise self._failure

    def start(self) -> None:
        """Watch the job the launcher is about to start (nothing without a handler)."""
        if self._handler is None:
            return
        self._running = True
        self._started_ns = time.time_ns()
        self._thread = threading.Thread(
            target=self._watch, name="elasticps-job-events", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the launcher has ended)."""
        self._running = False
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for watch in self._watches:
            watch.cancel()
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()

    def _guarded(self, event: TrainingEvent) -> None:
        if self._failure is not None or self._handler is None:
            return
        try:
            self._handler(event)
        except Exception as exc:  # the user's code: it stops the job
            self._failure = exc
            if self._running:
                with contextlib.suppress(OSError):
                    (self._run_dir / STOP_FILE).touch()

    def _etcd_endpoint(self) -> str | None:
        path = self._run_dir / "run.json"
        try:
            if path.stat().st_mtime_ns < self._started_ns:
                return None  # an earlier run's
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        endpoint = record.get("etcd") if isinstance(record, dict) else None
        running = isinstance(record, dict) and record.get("state") == "running"
        return endpoint if running and isinstance(endpoint, str) and endpoint else None

    def _watch(self) -> None:
        endpoint = None
        while endpoint is None:
            if self._done.wait(_POLL_S):
                return
            endpoint = self._etcd_endpoint()
        try:
            # The launcher's own credential, from the job's output directory.
            self._store = JobStore(endpoint, self._job, tls=output_etcd_tls(self._run_dir))
            self._watches.append(self._store.watch_pass_summaries(self._passes))
            self._watches.append(self._watch_trainers(self._store, self._hub))
        except CoordinationError as exc:  # then run.json alone tells the passes
            log.info("the job's events are not watched: %s", exc)

    def _passes(self, audits: Mapping[int, Mapping[str, object]]) -> None:
        for pass_id in sorted(audits):
            if pass_id not in self.passes_seen:
                self.passes_seen.add(pass_id)
                self._hub.emit(_end_pass(pass_id, audits[pass_id]))


def _end_pass(pass_id: int, audit: Mapping[str, object]) -> EndPass:
    return EndPass(pass_id=pass_id, metrics={"samples": _number(audit.get("records_trained"))})


def _run_launcher(argv: list[str]) -> tuple[int, list[str]]:
    """Run ``elasticps train ARGV`` to its end; return its exit status and the last stderr lines.

    Raises:
        KeyboardInterrupt: (or any exception while waiting) after the launcher
            was stopped with SIGTERM, which stops every role of the job.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticps", "train", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stdout is not None and proc.stderr is not None
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    relay = threading.Thread(
        target=_relay, args=(proc.stderr, tail), name="elasticps-launcher-stderr", daemon=True
    )
    relay.start()
    try:
        proc.stdout.read()  # the result line; run.json says more
        status = proc.wait()
    except BaseException:
        terminate([proc])
        wait_or_kill([proc], _STOP_TIMEOUT_S)
        raise
    finally:
        relay.join(timeout=10)
        proc.stdout.close()
    return status, list(tail)


def _relay(stream: IO[str], tail: collections.deque[str]) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))
        try:
            sys.stderr.write(line)
        except (OSError, ValueError):  # a closed or broken stderr: keep the tail only
            continue


def _launcher_error(status: int, tail: list[str], cluster: Hosts | Slurm) -> Exception:
    """The exception for the launcher's exit ``status``, with its own error lines."""
    for i, line in enumerate(tail):
        if line.startswith(_ERROR_PREFIX):
            message = "\n".join([line[len(_ERROR_PREFIX) :], *tail[i + 1 :]]).strip()
            break
    else:
        message = tail[-1] if tail else "no output"
    if status == 2:
        return JobUserError(message)
    logs = _run_dir(cluster) / "logs" / "launcher.log"
    return JobFailedError(f"elasticps train exited with status {status}: {message} (see {logs})")


def _run_events(
    output: Location, manifest: Mapping[str, object], passes_seen: set[int]
) -> list[TrainingEvent]:
    """The events of an ended run not reported yet (``run.json``, the checkpoint's manifest)."""
    try:
        record = json.loads((output / "run.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read the run record {output / 'run.json'}: {exc}") from exc
    if not isinstance(record, dict):
        raise DataError(f"the run record {output / 'run.json'} is not a JSON object")
    versions = manifest.get("model_versions")
    version = max(
        (v for v in versions if isinstance(v, int)) if isinstance(versions, list) else (),
        default=0,
    )
    events: list[TrainingEvent] = []
    passes = record.get("passes")
    audited = [a for a in (passes if isinstance(passes, list) else []) if isinstance(a, dict)]
    last_pass = 0
    for audit in audited:
        pass_id = audit.get("pass_id")
        if isinstance(pass_id, int):
            last_pass = max(last_pass, pass_id)
            if pass_id not in passes_seen:
                events.append(_end_pass(pass_id, audit))
    if output.is_local:
        events.append(Checkpointed(model_version=version, path=output.local_path))
    metrics: dict[str, float] = {
        "samples": _number(record.get("samples")),
        "wall_s": _number(record.get("wall_s")),
    }
    evaluation = record.get("evaluation")
    if isinstance(evaluation, dict):
        metrics.update(
            {f"test_{k}": float(v) for k, v in evaluation.items() if isinstance(v, int | float)}
        )
    events.append(
        EndTraining(pass_id=last_pass, cost=math.nan, model_version=version, metrics=metrics)
    )
    return events


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
