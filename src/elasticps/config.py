"""Frozen, validated configuration for every role of a job.

Configs are built in one place, :mod:`elasticps.cli`, from flags and
``ELASTICPS_*`` environment variables. Domain classes receive these
dataclasses, never an ``argparse.Namespace``. Units are in the names:
``_s`` is seconds, ``_bytes`` is bytes.
"""

from __future__ import annotations

import enum
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elasticps.errors import ConfigError
from elasticps.launcher.chaos import ChaosEvent, RandomChaos
from elasticps.launcher.checkpoint_health import DEFAULT_FATAL_AFTER_S
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND, DEFAULT_PLACEMENT, PLACEMENTS
from elasticps.schedules import schedule_from_json

if TYPE_CHECKING:
    import torch

    from elasticps.data.kafka import StreamLimits

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class UpdateMode(enum.Enum):
    """How a parameter server applies gradients.

    SYNC: sync-SGD. Gradients computed on model version ``v`` from every live
        trainer are averaged (weighted by samples) and applied once; the
        version then becomes ``v + 1``. A gradient computed on an older
        version is stale and dropped (as in ElasticDL).
    ASYNC: async-SGD. Each push is applied on arrival (Hogwild-style
        ordering, serialized per shard), and bumps the version.
    """

    SYNC = "sync"
    ASYNC = "async"


OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "torch")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer each parameter server runs on its shard (``torch.optim``).

    Attributes:
        name: one of ``sgd``, ``momentum``, ``adam``, ``adagrad``, or
            ``torch`` for ``torch.optim.<torch_class>``.
        lr: base learning rate, > 0.
        momentum: momentum factor for ``momentum`` (SGD with momentum), in [0, 1).
        weight_decay: L2 penalty, >= 0.
        torch_class: with ``name="torch"``: a ``torch.optim`` class name
            (``RMSprop``); else empty.
        options: JSON object of extra constructor keyword arguments
            (``{"betas": [0.9, 0.99]}``); empty for none.
        schedule: JSON learning-rate schedule by model version
            (:func:`elasticps.schedules.schedule_from_json`); empty for a constant lr.
    """

    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    torch_class: str = ""
    options: str = ""
    schedule: str = ""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}"
            )
        self._check_extensions()
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")

    def _check_extensions(self) -> None:
        import json

        if (self.name == "torch") != bool(self.torch_class):
            raise ConfigError("--optimizer-class is needed with, and only with, --optimizer torch")
        if self.options:
            try:
                options = json.loads(self.options)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--optimizer-options is not valid JSON: {exc}") from exc
            if not isinstance(options, dict):
                raise ConfigError("--optimizer-options must be a JSON object")
            if {"lr", "params"} & options.keys():
                raise ConfigError("--optimizer-options cannot set 'lr' or 'params'")
        if self.torch_class:
            check_torch_optimizer(self.torch_class)
        schedule_from_json(self.schedule)


# Optimizers whose step() needs a closure, or that need sparse gradients:
# the PS calls step() without a closure on a dense flat tensor.
_UNSUPPORTED_TORCH = {"LBFGS", "SparseAdam"}


def check_torch_optimizer(class_name: str) -> type[torch.optim.Optimizer]:
    """Return ``torch.optim.<class_name>``, checking that the PS can run it.

    Imports torch (only when called, so that the CLI starts light). Also
    available as :func:`elasticps.updater.check_torch_optimizer`.

    Raises:
        ConfigError: no such class, not a ``torch.optim.Optimizer`` subclass,
            or one the PS cannot run (``LBFGS`` needs a closure,
            ``SparseAdam`` sparse gradients).
    """
    import inspect

    import torch

    cls = getattr(torch.optim, class_name, None) if class_name.isidentifier() else None
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"torch.optim.{class_name} is not a torch.optim.Optimizer class")
    if class_name in _UNSUPPORTED_TORCH or cls is torch.optim.Optimizer:
        raise ConfigError(f"torch.optim.{class_name} cannot run on a parameter server")
    return cls


LEDGER_ONLY_ENV = "ELASTICPS_LEDGER_ONLY"
"""Benchmarks only: ``1`` turns off the exactly-once machinery (push keys, the
end-of-pass check on the parameter servers, sync realignment and aligned
checkpoints), leaving the ledger's bookkeeping alone, to measure what the
machinery costs (``benchmarks/training.py``). Never set it for real jobs: a
parameter server restart then loses the updates since its last checkpoint."""


def ledger_only() -> bool:
    """Whether :data:`LEDGER_ONLY_ENV` is set (benchmarks measuring the machinery's cost)."""
    return os.environ.get(LEDGER_ONLY_ENV, "") == "1"


def check_job_name(job: str) -> str:
    """Return ``job`` if it is a valid job name, else raise ConfigError."""
    if not _JOB_NAME.match(job):
        raise ConfigError(
            f"job name {job!r} must be 1-63 characters of letters, digits, '_', '.', '-'"
        )
    return job


@dataclass(frozen=True)
class CommonConfig:
    """Settings every process of a job shares.

    Attributes:
        job: job name; etcd keys live under ``/elasticps/<job>/``.
        etcd_endpoint: ``host:port`` of etcd.
        lease_ttl_s: TTL of trainer, PS and master leases, seconds (>= 1).
    """

    job: str
    etcd_endpoint: str
    lease_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        check_job_name(self.job)
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease TTL must be >= 1 s (etcd's minimum), got {self.lease_ttl_s}")


@dataclass(frozen=True)
class MasterConfig:
    """The master: task dispatch.

    Attributes:
        data_files: Parquet files to split into tasks, local paths or
            storage URLs (:mod:`elasticps.storage`).
        records_per_task: rows per task, >= 1.
        num_passes: passes (epochs) over the data, >= 1.
        task_timeout_s: seconds before a pending task goes back to todo.
        max_task_timeouts: timeouts (or failed attempts) a task may have in a
            pass before it is set aside as failed.
        host: interface the gRPC server binds.
        port: gRPC port; 0 picks a free one.
        virtual_records: if > 0, the data is a *virtual source* of this many
            records instead of files: tasks are ranges of record indices of
            :data:`elasticps.master.main.VIRTUAL_SOURCE` (the Python API uses
            it for the batches of a reader function). ``data_files`` must then
            be empty.
        mode: the job's update mode; in sync mode the master keeps the
            shards at one version (:mod:`elasticps.master.align`).
        checkpoint_every_s: sync mode: seconds between the aligned
            checkpoints the master has every shard take, > 0.
        stream: ``kafka://HOST:PORT/TOPIC``: the data is that topic's stream
            (one pass, tasks cut as records arrive); ``data_files`` must then be
            empty. Empty for files.
        kafka_config: the consumer settings file (``--kafka-config``), or None.
        task_window_s: a stream's task closes this many seconds after its first
            record arrived, if ``records_per_task`` did not close it first, > 0.
        until_offset: a stream ends when every partition reached this offset
            (exclusive); None: no such end.
        until_time: a stream ends at this wall-clock time, seconds since the
            epoch; None: no such end.
        stream_resume: a consistent checkpoint of a stream job whose offsets
            the stream goes on from (its untrained ranges first), or None.
    """

    common: CommonConfig
    data_files: tuple[str | Path, ...]
    records_per_task: int = 512
    num_passes: int = 1
    task_timeout_s: float = 60.0
    max_task_timeouts: int = 3
    host: str = "127.0.0.1"
    port: int = 0
    virtual_records: int = 0
    mode: UpdateMode = UpdateMode.ASYNC
    checkpoint_every_s: float = 30.0
    stream: str = ""
    kafka_config: Path | None = None
    task_window_s: float = 5.0
    until_offset: int | None = None
    until_time: float | None = None
    stream_resume: Path | None = None

    def __post_init__(self) -> None:
        if not self.checkpoint_every_s > 0:
            raise ConfigError(f"--checkpoint-every-s must be > 0, got {self.checkpoint_every_s}")
        if self.virtual_records < 0:
            raise ConfigError(f"--virtual-records must be >= 0, got {self.virtual_records}")
        if self.virtual_records and self.data_files:
            raise ConfigError("the master takes data files or --virtual-records, not both")
        if self.stream:
            from elasticps.data.kafka import KafkaSource

            KafkaSource.parse(self.stream)
            self.stream_limits()  # validates the window and the end
            if self.data_files or self.virtual_records:
                raise ConfigError("the master takes a kafka:// stream or data files, not both")
            if self.num_passes != 1:
                raise ConfigError(
                    f"a stream has no passes: --epochs must be 1, got {self.num_passes}"
                )
        elif not self.data_files and not self.virtual_records:
            raise ConfigError("the master needs at least one data file (or --virtual-records)")
        if self.records_per_task < 1:
            raise ConfigError(f"--records-per-task must be >= 1, got {self.records_per_task}")
        if self.num_passes < 1:
            raise ConfigError(f"--epochs must be >= 1, got {self.num_passes}")
        if not self.task_timeout_s > 0:
            raise ConfigError(f"--task-timeout-s must be > 0, got {self.task_timeout_s}")
        if self.max_task_timeouts < 0:
            raise ConfigError(f"--max-task-timeouts must be >= 0, got {self.max_task_timeouts}")
        _check_port(self.port, "--master-port")

    def stream_limits(self) -> StreamLimits:
        """How a stream is cut into tasks and where it ends.

        Raises:
            ConfigError: a value out of range.
        """
        from elasticps.data.kafka import StreamLimits

        return StreamLimits(
            records_per_task=self.records_per_task,
            window_s=self.task_window_s,
            until_offset=self.until_offset,
            until_time=self.until_time,
        )


@dataclass(frozen=True)
class PSConfig:
    """A parameter server.

    Attributes:
        mode: sync-SGD or async-SGD.
        optimizer: the optimizer run on the shard.
        host: interface the tensor-plane listener binds.
        port: tensor-plane TCP port; 0 picks a free one.
        init_timeout_s: seconds a trainer waits for another trainer to finish
            initializing the shard.
        checkpoint_dir: where the server keeps its own shard checkpoints, a
            local directory or a storage URL (:mod:`elasticps.storage`),
            ``<checkpoint_dir>/ps-<index>/shard-e<epoch>-v<version>.safetensors``
            (:class:`~elasticps.pserver.checkpoint.ShardFiles`); the newest is
            loaded on restart. None: no checkpoints.
        checkpoint_every_s: seconds between checkpoints (taken only if the
            version moved), > 0. In sync mode the master takes them, at the
            same version on every shard.
        checkpoint_every_versions: also checkpoint once the version moved by
            this much; 0 disables.
        resume_dir: a consistent checkpoint (``elasticps.snapshot``), a
            directory or a URL, to fill
            the shard from when the server has no checkpoint of its own; any
            number of servers can resume from it.
        claim_timeout_s: seconds to wait for a free ``/ps/<index>`` slot (a
            restarted server waits for its old lease to expire), >= 0.
        frozen: glob patterns (``fnmatch``) over parameter names; matching
            parameters never change and pushes with a non-zero gradient for
            them are refused.
        max_staleness: async mode: drop gradients computed more than this
            many versions behind the shard (bounded staleness); None accepts any.
        run_id: the job run the server's checkpoint files belong to; files of
            another run are never loaded. Empty: any run (tools, tests).
        sync_reduction: sync mode: ``"mean"`` (the trainers' gradients
            averaged by samples) or ``"sum"`` (summed).
        sparse_eviction: rows of sparse tables to evict, a JSON object
            (``--sparse-eviction``, see :func:`check_sparse_eviction`); empty: none.
    """

    common: CommonConfig
    mode: UpdateMode = UpdateMode.SYNC
    optimizer: OptimizerConfig = OptimizerConfig()
    host: str = "127.0.0.1"
    port: int = 0
    init_timeout_s: float = 60.0
    checkpoint_dir: str | Path | None = None
    checkpoint_every_s: float = 30.0
    checkpoint_every_versions: int = 0
    resume_dir: str | Path | None = None
    claim_timeout_s: float = 30.0
    frozen: tuple[str, ...] = ()
    max_staleness: int | None = None
    run_id: str = ""
    sync_reduction: str = "mean"
    sparse_eviction: str = ""

    def __post_init__(self) -> None:
        _check_port(self.port, "--ps-port")
        check_sparse_eviction(self.sparse_eviction)
        if self.sync_reduction not in ("mean", "sum"):
            raise ConfigError(f"--sync-reduction must be mean or sum, got {self.sync_reduction!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if any(not p for p in self.frozen):
            raise ConfigError("--frozen patterns must not be empty")
        if not self.checkpoint_every_s > 0:
            raise ConfigError(f"--checkpoint-every-s must be > 0, got {self.checkpoint_every_s}")
        if self.checkpoint_every_versions < 0:
            raise ConfigError(
                f"--checkpoint-every-versions must be >= 0, got {self.checkpoint_every_versions}"
            )
        if not self.claim_timeout_s >= 0:
            raise ConfigError(f"claim timeout must be >= 0 s, got {self.claim_timeout_s}")


SPARSE_EVICTION_KEYS = ("expire_versions", "min_count", "count_window_versions")
"""Keys of ``--sparse-eviction`` (:class:`elasticps.pserver.sparse.EvictionPolicy`)."""


def check_sparse_eviction(text: str) -> dict[str, int]:
    """Parse ``--sparse-eviction``: a JSON object of non-negative integers.

    ``{"expire_versions": N}`` evicts rows of sparse tables not updated for
    N versions; ``{"min_count": F, "count_window_versions": W}`` rows
    updated fewer than F times in their first W versions (Monolith's
    expiry and frequency filter). Empty text: no eviction.

    Returns:
        The options (empty for none).

    Raises:
        ConfigError: not such an object, an unknown key, or ``min_count``
            without a window.
    """
    if not text:
        return {}
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--sparse-eviction must be a JSON object: {exc}") from exc
    if (
        not isinstance(value, dict)
        or not set(value) <= set(SPARSE_EVICTION_KEYS)
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()
        )
    ):
        raise ConfigError(
            f"--sparse-eviction takes non-negative integers {', '.join(SPARSE_EVICTION_KEYS)}, "
            f"got {text!r}"
        )
    if value.get("min_count", 0) and value.get("count_window_versions", 0) < 1:
        raise ConfigError("--sparse-eviction: min_count needs count_window_versions >= 1")
    return dict(value)


GRAD_COMPRESSIONS = ("none", "fp16", "bf16")
"""Values of ``--grad-compression`` (:class:`TrainerConfig`)."""

MINIBATCHES_PER_TASK = 8
"""Mini-batches per task by default (see :func:`default_records_per_task`)."""

MIN_DEFAULT_RECORDS_PER_TASK = 512
"""The fewest rows per task by default."""


def default_records_per_task(batch_size: int | None) -> int:
    """Rows per task when ``--records-per-task`` is not given.

    :data:`MINIBATCHES_PER_TASK` mini-batches of ``batch_size`` rows, and at
    least :data:`MIN_DEFAULT_RECORDS_PER_TASK` (512 at 64 rows or fewer a
    mini-batch; 2,048 at 256). A task has fixed costs (a master round trip
    that reports it and brings the next one; with sparse tables, a first
    pull of rows of its own), so a task of too few mini-batches spends much
    of its time on them; ElasticDL sizes its tasks in mini-batches the same
    way (``--num_minibatches_per_task``). Measured in
    ``benchmarks/README.md`` ("2,048 rows a task").

    Args:
        batch_size: rows per mini-batch, or None when unknown (then 512).
    """
    if batch_size is None:
        return MIN_DEFAULT_RECORDS_PER_TASK
    return max(MIN_DEFAULT_RECORDS_PER_TASK, MINIBATCHES_PER_TASK * batch_size)


PS_TRANSPORTS = ("auto", "tcp", "unix", "shm")
"""Values of ``--ps-transport`` (:class:`TrainerConfig`)."""

OVERLAP_PULL: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""Values of ``--overlap-pull`` and the :attr:`TrainerConfig.overlap_pull` each stands for."""

AUTH_MODES = ("on", "off")
"""Values of ``--auth`` (:class:`JobConfig`): whether the job's planes ask for its secret."""

SPAWN_METHODS = ("fork", "exec")
"""Values of ``--spawn`` (:class:`JobConfig`): how the local launcher starts role processes."""

BAD_RECORDS = ("fail", "skip")
"""Values of ``--bad-records``: what a trainer does with a mini-batch the model file raises on."""


def parse_model_args(text: str) -> dict[str, object]:
    """``--model-args``: the model constructor's keyword arguments, a JSON object.

    Args:
        text: JSON text such as ``'{"hidden": 256}'``; empty for none.

    Returns:
        The keyword arguments (``{}`` for an empty text).

    Raises:
        ConfigError: the text is not JSON, or not a JSON object.
    """
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--model-args must be a JSON object, got {text!r:.80}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"--model-args must be a JSON object of keyword arguments "
            f"(e.g. '{{\"hidden\": 256}}'), got {text!r:.80}"
        )
    return value


def model_args_text(args: dict[str, object]) -> str:
    """The canonical ``--model-args`` text of ``args`` (sorted keys; ``""`` for none)."""
    return json.dumps(args, sort_keys=True, separators=(",", ":")) if args else ""


def _check_bad_records(value: str) -> None:
    if value not in BAD_RECORDS:
        raise ConfigError(f"--bad-records must be one of {', '.join(BAD_RECORDS)}, got {value!r}")


def _check_placement(value: str) -> None:
    if value not in PLACEMENTS:
        raise ConfigError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {value!r}")


@dataclass(frozen=True)
class TrainerConfig:
    """A trainer.

    Attributes:
        trainer_id: unique non-negative integer id of the trainer in the job.
        model_path: the user's model file (see docs/model-contract.md).
        model_class: name of the ``torch.nn.Module`` class in it.
        model_args: the class's constructor keyword arguments, a JSON object
            (``--model-args``); empty for none.
        mode: must match the parameter servers' mode.
        batch_size: rows per mini-batch, >= 1.
        push_every: push accumulated gradients every n mini-batches (1 in sync mode).
        pull_every: pull parameters every m mini-batches (1 in sync mode).
        num_ps: number of parameter servers.
        big_array_bound: parameters with more elements are always sliced over
            all PS (``balanced`` placement may slice smaller ones too).
        placement: ``balanced`` (bytes spread evenly over the PS) or ``hash``
            (a parameter's PS by CRC-32 of its name); see :mod:`elasticps.placement`.
        seed: seed for the initial parameters (equal on every trainer).
        threads: torch intra-op threads.
        connect_timeout_s: seconds to wait for the PS and the master to appear.
        grad_compression: dtype gradients are pushed in: ``none`` (float32),
            ``fp16`` or ``bf16`` (half the bytes; the PS widens them back).
        ps_transport: ``auto`` (AF_UNIX and shared memory to parameter
            servers on this host, TCP to others), ``tcp``, ``unix`` (AF_UNIX,
            every tensor through the socket) or ``shm`` (AF_UNIX and shared
            memory for dense float32 pushes and their parameters).
        overlap_push: async mode: send a push that does not pull in the
            background, overlapping the next mini-batches' compute (1.10-1.25x
            samples/s with spare CPU, 0.8-0.9x on a saturated machine:
            benchmarks/push_options.py). Only pushes handed an
            ``on_acknowledged`` callback go to the background, so progress
            is never reported for a push in flight. With ``pull_every`` 1
            every push pulls, so none could: the trainer then does not ask
            for it, and its buffers may be mapped from the servers' shared
            memory instead (see :mod:`elasticps.trainer.client`).
        overlap_pull: send pushes that pull in the background too, so that
            mini-batch ``k + 1`` is computed while push ``k`` travels, on the
            parameters (and rows) pulled by push ``k - 1``. Async mode: one
            step staler. Sync mode: a pipelined step (each step averages
            gradients computed on the parameters of the step before; the
            delay is always one step, so a run stays reproducible). None (the
            default) turns it on for async models with sparse tables, whose
            steps otherwise wait on their row pulls, and leaves sync mode
            exact.
        bad_records: ``fail``: a mini-batch the model file's
            ``batch_to_tensors``, ``forward`` or ``loss`` raises on stops the
            trainer with a :class:`~elasticps.errors.BadRecordError`;
            ``skip``: the mini-batch is dropped and its records are reported
            as skipped (at most ``Task.skip_budget`` per attempt).
        kafka_config: the consumer settings file (``--kafka-config``) for the
            tasks of a Kafka stream, or None.
        example_file: for a model with lazy modules: the training file whose
            first ``example_rows`` rows are the job's first mini-batch, which
            materializes them (set by the launcher); empty for other models.
        example_rows: rows of that mini-batch (the job's ``--batch-size``).
    """

    common: CommonConfig
    trainer_id: int
    model_path: Path
    model_class: str = "Model"
    mode: UpdateMode = UpdateMode.SYNC
    batch_size: int = 32
    push_every: int = 1
    pull_every: int = 1
    num_ps: int = 1
    big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND
    placement: str = DEFAULT_PLACEMENT
    seed: int = 0
    threads: int = 1
    connect_timeout_s: float = 60.0
    grad_compression: str = "none"
    ps_transport: str = "auto"
    overlap_push: bool = True
    overlap_pull: bool | None = None
    bad_records: str = "fail"
    model_args: str = ""
    kafka_config: Path | None = None
    example_file: str = ""
    example_rows: int = 0

    def __post_init__(self) -> None:
        _check_bad_records(self.bad_records)
        parse_model_args(self.model_args)
        if self.grad_compression not in GRAD_COMPRESSIONS:
            raise ConfigError(
                f"--grad-compression must be one of {', '.join(GRAD_COMPRESSIONS)}, "
                f"got {self.grad_compression!r}"
            )
        if self.ps_transport not in PS_TRANSPORTS:
            raise ConfigError(
                f"--ps-transport must be one of {', '.join(PS_TRANSPORTS)}, "
                f"got {self.ps_transport!r}"
            )
        if self.trainer_id < 0:
            raise ConfigError(f"trainer id must be >= 0, got {self.trainer_id}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.push_every < 1 or self.pull_every < 1:
            raise ConfigError("--push-every and --pull-every must be >= 1")
        if self.mode is UpdateMode.SYNC and (self.push_every != 1 or self.pull_every != 1):
            raise ConfigError("in sync mode --push-every and --pull-every must both be 1")
        if self.num_ps < 1:
            raise ConfigError(f"--ps must be >= 1, got {self.num_ps}")
        if self.big_array_bound < 1:
            raise ConfigError(f"--big-array-bound must be >= 1, got {self.big_array_bound}")
        _check_placement(self.placement)
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class JobConfig:
    """A whole job, as the local launcher runs it.

    Attributes:
        job: job name.
        model_path: the user's model file.
        model_class: its ``torch.nn.Module`` class.
        model_args: its constructor's keyword arguments, a JSON object
            (``--model-args``); empty for none (with ``resume``: those the
            checkpoint recorded).
        data: a directory holding ``train.parquet`` (and optionally
            ``test.parquet``), a directory or glob of many Parquet files, or
            one Parquet file; a local path or a storage URL (``s3://``,
            ``gs://``, ``hdfs://``, see :func:`elasticps.data.parquet.find_split`).
        output: directory for the final checkpoint and the run record. With
            ``output_url`` set, the local directory of the launcher's own
            state only: its lock, the logs while the job runs, ``.stop``,
            ``pids.json`` and the live ``run.json``.
        output_url: a storage URL (``s3://bucket/runs/x``) that receives what
            the job keeps: the PS checkpoints (``ps-checkpoints/``), the
            consistent checkpoint (``snapshot/``), ``model.safetensors``,
            ``manifest.json``, and at the end ``run.json``, ``config.toml``
            and ``logs/``. Empty: all of it in ``output``.
        trainers: number of trainers at the start (the initial wanted count), >= 1.
        min_trainers: fewest live trainers the worker manager keeps; None: ``trainers``.
        max_trainers: most live trainers; None: ``trainers``. ``elasticps scale``
            changes the wanted count within [min_trainers, max_trainers].
        stuck_after_s: replace a trainer that made no progress for this long,
            seconds; None disables stuck detection.
        ps: number of parameter servers, >= 1.
        mode: sync or async.
        epochs: passes over the data.
        batch_size: rows per mini-batch per trainer.
        push_every: n, push every n mini-batches.
        pull_every: m, pull every m mini-batches.
        optimizer: optimizer on the PS.
        big_array_bound: slicing threshold, elements (see :class:`TrainerConfig`).
        placement: placement strategy (see :class:`TrainerConfig`).
        records_per_task: rows per task.
        task_timeout_s: seconds before a pending task is re-dispatched.
        max_task_timeouts: timeouts per task and pass before it fails.
        lease_ttl_s: lease TTL for trainers, PS and the master, seconds.
        seed: initial-parameter seed.
        threads: torch threads per trainer.
        etcd_port: etcd client port; 0 picks a free one.
        master_port: master gRPC port; 0 picks a free one.
        progress: show a progress bar. Without one, a progress line goes to the
            launcher's log every ``progress_every_s`` seconds, and to stderr too
            with ``progress_lines``.
        progress_lines: without a bar, write the progress lines to stderr too
            (stderr is a file or a pipe: the job's log).
        progress_every_s: seconds between two progress lines, > 0.
        standby_masters: extra masters waiting on the master lock, >= 0.
        standby_ps: extra parameter servers waiting for a free slot, >= 0.
        max_restarts: restarts allowed per master, PS and etcd process, >= 0.
        chaos: scheduled SIGKILLs (see :mod:`elasticps.launcher.chaos`).
        random_chaos: SIGKILLs of random roles at random moments, or None.
        auth: ``on`` (default): the job makes a secret that every connection
            to a PS and every call to the master must prove (see
            :mod:`elasticps.security`); ``off``: they serve anyone, and the
            log and ``run.json`` say so.
        tls: ``on`` (default, with ``auth`` on): every TCP connection to a PS
            or the master is TLS 1.3 with certificates of the job's CA (see
            :mod:`elasticps.tls`); ``off``: plain TCP, with a warning in the
            log and ``run.json``.
        metrics: ``on`` (default): every role serves Prometheus metrics and the
            launcher writes ``prometheus-targets.json`` (:mod:`elasticps.metrics`);
            ``off``: none.
        tensorboard: a directory the launcher writes TensorBoard scalars into
            (:mod:`elasticps.launcher.tensorboard`); None: none.
        ca: a directory with the user's own CA (``ca.pem``, ``ca-key.pem``) to
            issue the job's certificates from; None: a new CA for the job.
        spawn: how role processes start: ``fork`` from a fork server that
            has imported torch already (:mod:`elasticps.launcher.spawn`),
            or ``exec`` (each a new ``python -m elasticps``).
        eval_each_pass: evaluate on the test set at the end of every pass
            (:mod:`elasticps.launcher.pass_eval`).
        checkpoint_every_s: seconds between a PS's shard checkpoints.
        resume: a consistent checkpoint directory (or URL) to start from, or None.
        max_staleness: async: the PS drop gradients more than this many
            versions behind (``--max-staleness``); None accepts any.
        sync_reduction: sync: ``"mean"`` or ``"sum"`` of the trainers'
            gradients per step (``--sync-reduction``).
        bad_records: ``fail`` or ``skip`` (see :class:`TrainerConfig`); with
            ``skip``, nulls in the data's columns are no error before launch.
        overwrite: an ``output`` that holds a previous run's files is cleaned
            first instead of refused.
        checkpoint_failures_fatal_after_s: seconds a PS's checkpoint writes may
            fail (a full disk, say) before the job stops, > 0.
        fallback_output: where the trained parameters go when ``output`` cannot
            be written; None picks ``<temp dir>/elasticps-fallback/<job>-<run id>``.
        sparse_eviction: passed to every PS (see :class:`PSConfig`).
        stream: ``kafka://HOST:PORT/TOPIC`` to train from that stream (then
            ``data`` is unused and ``epochs`` must be 1); empty for files.
        kafka_config, task_window_s, until_offset, until_time: a stream's
            consumer settings file, window and end (see :class:`MasterConfig`).
        test_data: a stream job's test set (a Parquet file, or a directory
            with ``test.parquet``) to evaluate at the end, or None.
        hosts_file: a host file (:mod:`elasticps.launcher.hostfile`): the PS and
            trainers run on its hosts over ssh (:mod:`elasticps.launcher.ssh`);
            None: on this machine.
        ssh_config: with ``hosts_file``, an ssh configuration file used instead
            of the user's; None: the user's.
        remote_python: with ``hosts_file``, the interpreter on the hosts; empty:
            this one's path.
        advertise_address: with ``hosts_file``, this machine's address that the
            hosts reach etcd and the master at; empty: its address on its route
            to the first host.
        etcd_replicas: with ``hosts_file``, 3 runs the job's etcd as three
            members on the first three hosts (:mod:`elasticps.launcher.etcd_hosts`);
            1: one etcd on this machine.
        launcher: ``local`` (this machine, or ``hosts_file``'s hosts over ssh) or
            ``slurm``: the PS and trainers run as job steps on the nodes of the
            Slurm allocation the launcher runs in (:mod:`elasticps.launcher.slurm`);
            ``remote_python`` and ``advertise_address`` apply to it too.
    """

    job: str
    model_path: Path
    data: str | Path
    output: Path
    output_url: str = ""
    model_class: str = "Model"
    trainers: int = 2
    ps: int = 2
    mode: UpdateMode = UpdateMode.SYNC
    epochs: int = 1
    batch_size: int = 32
    push_every: int = 1
    pull_every: int = 1
    optimizer: OptimizerConfig = OptimizerConfig()
    big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND
    placement: str = DEFAULT_PLACEMENT
    records_per_task: int = 512
    task_timeout_s: float = 60.0
    max_task_timeouts: int = 3
    lease_ttl_s: float = 5.0
    seed: int = 0
    threads: int = 1
    etcd_port: int = 0
    master_port: int = 0
    progress: bool = True
    progress_lines: bool = False
    progress_every_s: float = 10.0
    standby_masters: int = 0
    standby_ps: int = 0
    max_restarts: int = 3
    chaos: tuple[ChaosEvent, ...] = ()
    checkpoint_every_s: float = 10.0
    resume: str | Path | None = None
    max_staleness: int | None = None

    sync_reduction: str = "mean"
    min_trainers: int | None = None
    max_trainers: int | None = None
    stuck_after_s: float | None = None
    spawn: str = "fork"
    eval_each_pass: bool = False
    random_chaos: RandomChaos | None = None
    bad_records: str = "fail"
    overwrite: bool = False
    checkpoint_failures_fatal_after_s: float = DEFAULT_FATAL_AFTER_S
    fallback_output: Path | None = None
    sparse_eviction: str = ""
    model_args: str = ""
    stream: str = ""
    kafka_config: Path | None = None
    task_window_s: float = 5.0
    until_offset: int | None = None
    until_time: float | None = None
    test_data: Path | None = None
    hosts_file: Path | None = None
    ssh_config: Path | None = None
    remote_python: str = ""
    advertise_address: str = ""
    etcd_replicas: int = 1
    launcher: str = "local"
    auth: str = "on"
    tls: str = "on"
    ca: Path | None = None
    metrics: str = "on"
    tensorboard: Path | None = None

    def _check_slurm(self) -> None:
        """Refuse, by name, what a ``--launcher slurm`` job cannot take."""
        if self.hosts_file is not None:
            raise ConfigError(
                "--launcher slurm and --hosts: the Slurm allocation's nodes are the hosts"
            )
        if self.etcd_replicas != 1:
            raise ConfigError(
                "--launcher slurm and --etcd-replicas 3: the job's etcd runs on the launching node"
            )
        if self.ssh_config is not None:
            raise ConfigError("--launcher slurm and --ssh-config: Slurm runs the roles, not ssh")
        if self.chaos or self.random_chaos is not None:
            raise ConfigError(
                "--chaos kills processes of this machine; with --launcher slurm, kill nodes instead"
            )

    def __post_init__(self) -> None:
        check_job_name(self.job)
        if self.launcher not in ("local", "slurm"):
            raise ConfigError(f"--launcher must be local or slurm, got {self.launcher!r}")
        if self.launcher == "slurm":
            self._check_slurm()
        if self.etcd_replicas not in (1, 3):
            raise ConfigError(f"--etcd-replicas must be 1 or 3, got {self.etcd_replicas}")
        if self.etcd_replicas != 1 and self.hosts_file is None:
            raise ConfigError("--etcd-replicas 3 needs --hosts: its members run on three hosts")
        if self.hosts_file is None and (
            self.ssh_config is not None
            or (self.launcher != "slurm" and (self.remote_python or self.advertise_address))
        ):
            raise ConfigError("--ssh-config, --remote-python and --advertise-address need --hosts")
        if self.hosts_file is not None and (self.chaos or self.random_chaos is not None):
            raise ConfigError(
                "--chaos kills processes of this machine; with --hosts, kill hosts instead"
            )
        if self.stream:
            from elasticps.data.kafka import KafkaSource, StreamLimits

            KafkaSource.parse(self.stream)
            StreamLimits(self.records_per_task, self.task_window_s, self.until_offset)
            if self.epochs != 1:
                raise ConfigError(f"a stream has no passes: --epochs must be 1, got {self.epochs}")
            if self.eval_each_pass:
                raise ConfigError("--eval-each-pass needs passes; a stream has none")
        check_sparse_eviction(self.sparse_eviction)
        _check_placement(self.placement)
        if not self.checkpoint_failures_fatal_after_s > 0:
            raise ConfigError(
                "--checkpoint-failures-fatal-after-s must be > 0, "
                f"got {self.checkpoint_failures_fatal_after_s}"
            )
        _check_bad_records(self.bad_records)
        parse_model_args(self.model_args)
        if self.auth not in AUTH_MODES:
            raise ConfigError(f"--auth must be one of {', '.join(AUTH_MODES)}, got {self.auth!r}")
        if self.tls not in AUTH_MODES:
            raise ConfigError(f"--tls must be one of {', '.join(AUTH_MODES)}, got {self.tls!r}")
        if self.metrics not in AUTH_MODES:
            raise ConfigError(
                f"--metrics must be one of {', '.join(AUTH_MODES)}, got {self.metrics!r}"
            )
        if self.ca is not None and self.auth != "on":
            raise ConfigError(
                "--ca needs --auth on: a job without authentication has no certificates"
            )
        if self.spawn not in SPAWN_METHODS:
            raise ConfigError(
                f"--spawn must be one of {', '.join(SPAWN_METHODS)}, got {self.spawn!r}"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if self.trainers < 1:
            raise ConfigError(f"--trainers must be >= 1, got {self.trainers}")
        if not self.trainer_range[0] <= self.trainers <= self.trainer_range[1]:
            raise ConfigError(
                f"--trainers MIN:MAX needs 1 <= MIN <= initial {self.trainers} <= MAX, "
                f"got {self.trainer_range[0]}:{self.trainer_range[1]}"
            )
        if self.stuck_after_s is not None and not self.stuck_after_s > 0:
            raise ConfigError(f"--stuck-after-s must be > 0, got {self.stuck_after_s}")
        if self.ps < 1:
            raise ConfigError(f"--ps must be >= 1, got {self.ps}")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be >= 1, got {self.epochs}")
        if self.mode is UpdateMode.SYNC and (self.push_every != 1 or self.pull_every != 1):
            raise ConfigError("in sync mode --push-every and --pull-every must both be 1")
        if self.push_every < 1 or self.pull_every < 1:
            raise ConfigError("--push-every and --pull-every must be >= 1")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.records_per_task < 1:
            raise ConfigError(f"--records-per-task must be >= 1, got {self.records_per_task}")
        if self.lease_ttl_s < 1:
            raise ConfigError(f"--lease-ttl-s must be >= 1, got {self.lease_ttl_s}")
        _check_port(self.etcd_port, "--etcd-port")
        _check_port(self.master_port, "--master-port")
        if self.standby_masters < 0:
            raise ConfigError(f"--standby-masters must be >= 0, got {self.standby_masters}")
        if self.standby_ps < 0:
            raise ConfigError(f"--standby-ps must be >= 0, got {self.standby_ps}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.checkpoint_every_s > 0:
            raise ConfigError(f"--checkpoint-every-s must be > 0, got {self.checkpoint_every_s}")

    @property
    def trainer_range(self) -> tuple[int, int]:
        """``(min, max)`` live trainers the worker manager keeps."""
        low = self.trainers if self.min_trainers is None else self.min_trainers
        high = self.trainers if self.max_trainers is None else self.max_trainers
        return low, high


@dataclass(frozen=True)
class ManagerConfig:
    """The worker manager (:mod:`elasticps.launcher.manager`).

    Attributes:
        min_trainers: fewest live trainers, >= 1 (the wanted count is clamped up to it).
        max_trainers: most live trainers, >= min_trainers.
        stuck_after_s: a running trainer with no progress for this long is
            deleted and replaced, seconds; None disables.
        backoff_base_s: first delay before re-creating a worker that could not
            be scheduled, seconds, > 0; it doubles per attempt, plus a uniform
            jitter in [0, backoff_base_s].
        backoff_cap_s: longest delay between two attempts, seconds, >= backoff_base_s.
        tick_s: seconds between two periodic checks (stuck trainers, due retries), > 0.
    """

    min_trainers: int = 1
    max_trainers: int = 1
    stuck_after_s: float | None = None
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    tick_s: float = 1.0

    def __post_init__(self) -> None:
        if self.min_trainers < 1:
            raise ConfigError(
                f"the minimum number of trainers must be >= 1, got {self.min_trainers}"
            )
        if self.max_trainers < self.min_trainers:
            raise ConfigError(
                f"--trainers MIN:MAX needs MIN <= MAX, got {self.min_trainers}:{self.max_trainers}"
            )
        if self.stuck_after_s is not None and not self.stuck_after_s > 0:
            raise ConfigError(f"--stuck-after-s must be > 0, got {self.stuck_after_s}")
        if not self.backoff_base_s > 0:
            raise ConfigError(f"backoff base must be > 0 s, got {self.backoff_base_s}")
        if self.backoff_cap_s < self.backoff_base_s:
            raise ConfigError(
                f"backoff cap {self.backoff_cap_s} s must be >= its base {self.backoff_base_s} s"
            )
        if not self.tick_s > 0:
            raise ConfigError(f"tick must be > 0 s, got {self.tick_s}")

    def clamp(self, wanted: int) -> int:
        """``wanted`` trainers, clamped to [min_trainers, max_trainers]."""
        return max(self.min_trainers, min(self.max_trainers, wanted))


def _check_port(port: int, flag: str) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag} must be in 0..65535, got {port}")


# --- Kubernetes -----------------------------------------------------------------

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

#: Longest job name on Kubernetes: ``<job>-trainer-<index>`` must stay a DNS label (63).
MAX_KUBERNETES_JOB_NAME = 40

PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def check_kubernetes_job_name(job: str) -> str:
    """Return ``job`` if it can name Kubernetes objects, else raise ConfigError.

    Pod and Service names are ``<job>-<role>-<index>``: lower-case DNS labels
    (RFC 1123), so the job name must be one too, of at most
    :data:`MAX_KUBERNETES_JOB_NAME` characters.
    """
    check_job_name(job)
    if not _DNS_LABEL.match(job) or len(job) > MAX_KUBERNETES_JOB_NAME:
        raise ConfigError(
            f"on Kubernetes the job name {job!r} must be at most {MAX_KUBERNETES_JOB_NAME} "
            "lower-case letters, digits and '-', starting and ending with a letter or digit"
        )
    return job


@dataclass(frozen=True)
class PodResources:
    """CPU and memory of one pod's container, as Kubernetes quantities.

    Attributes:
        cpu_request: CPU the scheduler reserves (``"500m"`` is half a core).
        cpu_limit: CPU the container may use at most.
        memory_request: memory the scheduler reserves, bytes (``"1Gi"``).
        memory_limit: memory above which the container is OOM-killed, bytes.
    """

    cpu_request: str = "500m"
    cpu_limit: str = "2"
    memory_request: str = "1Gi"
    memory_limit: str = "4Gi"

    def __post_init__(self) -> None:
        for name in ("cpu_request", "cpu_limit", "memory_request", "memory_limit"):
            if not re.match(r"^[0-9.]+[a-zA-Z]*$", getattr(self, name)):
                raise ConfigError(
                    f"{name} must be a Kubernetes quantity, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class KubernetesConfig:
    """Where and how the pods of a job run on Kubernetes.

    Attributes:
        namespace: the namespace of every object of the job (a DNS label).
        image: the container image (see ``deploy/kubernetes/Dockerfile``).
        etcd_endpoint: ``host:port`` of etcd as seen from the pods; empty:
            the job's own etcd Service, ``<job>-etcd:2379``.
        service_account: the master's ServiceAccount (``deploy/kubernetes/rbac.yaml``).
        image_pull_policy: ``Always``, ``IfNotPresent`` or ``Never``.
        volume_claim: a PersistentVolumeClaim mounted at ``/data`` in every pod
            (data files and PS checkpoints), or None.
        master: resources of the master pod.
        ps: resources of each parameter-server pod.
        trainer: resources of each trainer pod.
        etcd_image: the image of the job's etcd pod.
    """

    namespace: str = "default"
    image: str = "elasticps:latest"
    etcd_endpoint: str = ""
    service_account: str = "elasticps"
    image_pull_policy: str = "IfNotPresent"
    volume_claim: str | None = None
    master: PodResources = PodResources("250m", "1", "512Mi", "1Gi")
    ps: PodResources = PodResources("500m", "2", "1Gi", "4Gi")
    trainer: PodResources = PodResources("1", "2", "1Gi", "4Gi")
    etcd_image: str = "quay.io/coreos/etcd:v3.5.17"

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ConfigError(f"--namespace must be a DNS label, got {self.namespace!r}")
        if not self.image.strip():
            raise ConfigError("--image must not be empty")
        if self.image_pull_policy not in PULL_POLICIES:
            raise ConfigError(
                f"image pull policy must be one of {', '.join(PULL_POLICIES)}, "
                f"got {self.image_pull_policy!r}"
            )
