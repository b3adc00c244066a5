"""Frozen, validated configuration for every role of a job.

Configs are built in one place, :mod:`elasticps.cli`, from flags and
``ELASTICPS_*`` environment variables. Domain classes receive these
dataclasses, never an ``argparse.Namespace``. Units are in the names:
``_s`` is seconds, ``_bytes`` is bytes.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from elasticps.errors import ConfigError
from elasticps.launcher.chaos import ChaosEvent
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND

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


OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer each parameter server runs on its shard (``torch.optim``).

    Attributes:
        name: one of ``sgd``, ``momentum``, ``adam``, ``adagrad``.
        lr: learning rate, > 0.
        momentum: momentum factor for ``momentum`` (SGD with momentum), in [0, 1).
        weight_decay: L2 penalty, >= 0.
    """

    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}"
            )
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")


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
        data_files: Parquet files to split into tasks.
        records_per_task: rows per task, >= 1.
        num_passes: passes (epochs) over the data, >= 1.
        task_timeout_s: seconds before a pending task goes back to todo.
        max_task_timeouts: timeouts (or failed attempts) a task may have in a
            pass before it is set aside as failed.
        host: interface the gRPC server binds.
        port: gRPC port; 0 picks a free one.
    """

    common: CommonConfig
    data_files: tuple[Path, ...]
    records_per_task: int = 512
    num_passes: int = 1
    task_timeout_s: float = 60.0
    max_task_timeouts: int = 3
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not self.data_files:
            raise ConfigError("the master needs at least one data file")
        if self.records_per_task < 1:
            raise ConfigError(f"--records-per-task must be >= 1, got {self.records_per_task}")
        if self.num_passes < 1:
            raise ConfigError(f"--epochs must be >= 1, got {self.num_passes}")
        if not self.task_timeout_s > 0:
            raise ConfigError(f"--task-timeout-s must be > 0, got {self.task_timeout_s}")
        if self.max_task_timeouts < 0:
            raise ConfigError(f"--max-task-timeouts must be >= 0, got {self.max_task_timeouts}")
        _check_port(self.port, "--master-port")


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
        checkpoint_dir: where the server keeps its own shard checkpoint,
            ``<checkpoint_dir>/ps-<index>/shard.safetensors``; it is loaded
            on restart. None: no checkpoints.
        checkpoint_every_s: seconds between checkpoints (taken only if the
            version moved), > 0.
        checkpoint_every_versions: also checkpoint once the version moved by
            this much; 0 disables.
        resume_dir: a consistent checkpoint (``elasticps.snapshot``) to fill
            the shard from when the server has no checkpoint of its own; any
            number of servers can resume from it.
        claim_timeout_s: seconds to wait for a free ``/ps/<index>`` slot (a
            restarted server waits for its old lease to expire), >= 0.
    """

    common: CommonConfig
    mode: UpdateMode = UpdateMode.SYNC
    optimizer: OptimizerConfig = OptimizerConfig()
    host: str = "127.0.0.1"
    port: int = 0
    init_timeout_s: float = 60.0
    checkpoint_dir: Path | None = None
    checkpoint_every_s: float = 30.0
    checkpoint_every_versions: int = 0
    resume_dir: Path | None = None
    claim_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check_port(self.port, "--ps-port")
        if not self.checkpoint_every_s > 0:
            raise ConfigError(f"--checkpoint-every-s must be > 0, got {self.checkpoint_every_s}")
        if self.checkpoint_every_versions < 0:
            raise ConfigError(
                f"--checkpoint-every-versions must be >= 0, got {self.checkpoint_every_versions}"
            )
        if not self.claim_timeout_s >= 0:
            raise ConfigError(f"claim timeout must be >= 0 s, got {self.claim_timeout_s}")


@dataclass(frozen=True)
class TrainerConfig:
    """A trainer.

    Attributes:
        trainer_id: unique non-negative integer id of the trainer in the job.
        model_path: the user's model file (see the README's model-file contract).
        model_class: name of the ``torch.nn.Module`` class in it.
        mode: must match the parameter servers' mode.
        batch_size: rows per mini-batch, >= 1.
        push_every: push accumulated gradients every n mini-batches (1 in sync mode).
        pull_every: pull parameters every m mini-batches (1 in sync mode).
        num_ps: number of parameter servers.
        big_array_bound: parameters with more elements are sliced over all PS.
        seed: seed for the initial parameters (equal on every trainer).
        threads: torch intra-op threads.
        connect_timeout_s: seconds to wait for the PS and the master to appear.
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
    seed: int = 0
    threads: int = 1
    connect_timeout_s: float = 60.0

    def __post_init__(self) -> None:
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
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class JobConfig:
    """A whole job, as the local launcher runs it.

    Attributes:
        job: job name.
        model_path: the user's model file.
        model_class: its ``torch.nn.Module`` class.
        data: a directory holding ``train.parquet`` (and optionally
            ``test.parquet``), or one Parquet file.
        output: directory for the final checkpoint and the run record.
        trainers: number of trainers, >= 1.
        ps: number of parameter servers, >= 1.
        mode: sync or async.
        epochs: passes over the data.
        batch_size: rows per mini-batch per trainer.
        push_every: n, push every n mini-batches.
        pull_every: m, pull every m mini-batches.
        optimizer: optimizer on the PS.
        big_array_bound: slicing threshold, elements.
        records_per_task: rows per task.
        task_timeout_s: seconds before a pending task is re-dispatched.
        max_task_timeouts: timeouts per task and pass before it fails.
        lease_ttl_s: lease TTL for trainers, PS and the master, seconds.
        seed: initial-parameter seed.
        threads: torch threads per trainer.
        etcd_port: etcd client port; 0 picks a free one.
        master_port: master gRPC port; 0 picks a free one.
        progress: show a progress bar.
        standby_masters: extra masters waiting on the master lock, >= 0.
        standby_ps: extra parameter servers waiting for a free slot, >= 0.
        max_restarts: restarts allowed per master, PS and etcd process, >= 0.
        chaos: scheduled SIGKILLs (see :mod:`elasticps.launcher.chaos`).
        checkpoint_every_s: seconds between a PS's shard checkpoints.
        resume: a consistent checkpoint directory to start from, or None.
    """

    job: str
    model_path: Path
    data: Path
    output: Path
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
    records_per_task: int = 512
    task_timeout_s: float = 60.0
    max_task_timeouts: int = 3
    lease_ttl_s: float = 5.0
    seed: int = 0
    threads: int = 1
    etcd_port: int = 0
    master_port: int = 0
    progress: bool = True
    standby_masters: int = 0
    standby_ps: int = 0
    max_restarts: int = 3
    chaos: tuple[ChaosEvent, ...] = ()
    checkpoint_every_s: float = 10.0
    resume: Path | None = None

    def __post_init__(self) -> None:
        check_job_name(self.job)
        if self.trainers < 1:
            raise ConfigError(f"--trainers must be >= 1, got {self.trainers}")
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


def _check_port(port: int, flag: str) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag} must be in 0..65535, got {port}")
