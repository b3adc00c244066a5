"""Where :func:`elasticps.train` runs a job, and what data it reads.

- :class:`Local`: real servers on this machine (etcd, a master and parameter
  servers as processes, see :class:`~elasticps.api.servers.LocalServers`)
  and trainers as threads of the calling process.
- :class:`Hosts` and :class:`Slurm`: the parameter servers and trainers as
  processes on other machines (over ssh, or as the job steps of a Slurm
  allocation), run by the launcher of ``elasticps train --hosts`` /
  ``--launcher slurm``; the model then comes from a model file.
- :class:`Parquet`: a dataset description for Parquet files, read the way
  the CLI reads them (tasks of ``records_per_task`` rows, mini-batches of
  ``batch_size`` rows made by a model-file style ``batch_to_tensors``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
from torch import Tensor

from elasticps.config import UpdateMode
from elasticps.errors import ConfigError
from elasticps.model_file import load_model_file
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND, DEFAULT_PLACEMENT, PLACEMENTS

__all__ = ["Hosts", "Local", "Parquet", "Slurm"]


@dataclass(frozen=True)
class Local:
    """Run the job on this machine, through the same machinery as ``elasticps train``.

    :func:`elasticps.train` starts a real etcd, one master and ``ps``
    parameter servers as child processes (stopped by PID at the end), and runs
    ``trainers`` instances of the real trainer (:class:`elasticps.trainer.worker.Trainer`)
    as **threads of the calling process**, each with its own deep copy of the
    model. Events reach the ``event_handler`` in the calling process. Threads
    share one Python interpreter, so trainer threads run concurrently only
    inside torch kernels; for trainer processes use the CLI, or :class:`Hosts`.

    Args:
        trainers: trainer threads, >= 1.
        ps: parameter-server processes, >= 1.
        mode: ``"sync"`` (sync-SGD) or ``"async"`` (async-SGD), or an :class:`UpdateMode`.
        push_every: async: push accumulated gradients every n mini-batches (1 in sync).
        pull_every: async: pull parameters every m mini-batches (1 in sync).
        batches_per_task: for a reader function: mini-batches per master task, >= 1.
        big_array_bound: parameters with more elements are always sliced
            across all PS (``balanced`` placement may slice smaller ones too).
        placement: ``"balanced"`` (bytes spread evenly over the PS) or
            ``"hash"`` (a whole parameter on the PS given by CRC-32 of its name); see
            :mod:`elasticps.placement`.
        lease_ttl_s: lease TTL of every role, seconds, >= 1.
        task_timeout_s: seconds before the master re-dispatches a pending task.
        startup_timeout_s: seconds to wait for the servers to come up.
        checkpoint_dir: if set, a consistent checkpoint of every PS is written
            there at the end (``manifest.json`` + safetensors; a
            :class:`~elasticps.events.Checkpointed` event follows).
        checkpoint_every_s: seconds between the parameter servers' own
            checkpoints (kept in the job's work directory), from which a
            restarted server recovers without losing updates, > 0.
        sync_reduction: sync mode: ``"mean"`` (the trainers' gradients
            averaged by samples) or ``"sum"`` (summed; for losses summed over
            the batch, and the audit model).
        max_restarts: restarts allowed per server process (etcd, the master,
            each parameter server), >= 0. A trainer thread that fails is
            replaced (see :mod:`elasticps.launcher.supervisor`).
        output: if set, a directory where the job records itself, as
            ``elasticps train --output`` does, so that ``elasticps status``
            and ``elasticps list`` show it: ``run.json`` (``running``, then
            ``finished``, ``failed`` or ``interrupted``, with the
            supervision policy's decisions) and a lock held while the job
            runs (see :mod:`elasticps.api.record`). It must not hold a run of
            ``elasticps train``; a previous record of a Python job is replaced.

    Raises:
        ConfigError: a value is out of range.
    """

    trainers: int = 2
    ps: int = 2
    mode: UpdateMode | str = UpdateMode.SYNC
    push_every: int = 1
    pull_every: int = 1
    batches_per_task: int = 8
    big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND
    placement: str = DEFAULT_PLACEMENT
    lease_ttl_s: float = 5.0
    task_timeout_s: float = 60.0
    startup_timeout_s: float = 60.0
    checkpoint_dir: Path | None = None
    checkpoint_every_s: float = 10.0
    sync_reduction: str = "mean"
    max_restarts: int = 3
    output: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _check_job_values(self))
        if self.batches_per_task < 1:
            raise ConfigError(f"batches_per_task must be >= 1, got {self.batches_per_task}")

    @property
    def update_mode(self) -> UpdateMode:
        """``mode`` as an :class:`~elasticps.config.UpdateMode`."""
        return UpdateMode(self.mode)


class _JobValues(Protocol):
    """The fields that every cluster description of a job checks the same way."""

    @property
    def trainers(self) -> int: ...
    @property
    def ps(self) -> int: ...
    @property
    def mode(self) -> UpdateMode | str: ...
    @property
    def push_every(self) -> int: ...
    @property
    def pull_every(self) -> int: ...
    @property
    def placement(self) -> str: ...
    @property
    def lease_ttl_s(self) -> float: ...
    @property
    def checkpoint_every_s(self) -> float: ...
    @property
    def sync_reduction(self) -> str: ...
    @property
    def max_restarts(self) -> int: ...


def _check_job_values(values: _JobValues) -> UpdateMode:
    """Check the fields :class:`Local`, :class:`Hosts` and :class:`Slurm` share; return the mode.

    Raises:
        ConfigError: a value is out of range; the message names the field.
    """
    if values.max_restarts < 0:
        raise ConfigError(f"max_restarts must be >= 0, got {values.max_restarts}")
    if values.sync_reduction not in ("mean", "sum"):
        raise ConfigError(f"sync_reduction must be mean or sum, got {values.sync_reduction!r}")
    if not values.checkpoint_every_s > 0:
        raise ConfigError(f"checkpoint_every_s must be > 0, got {values.checkpoint_every_s}")
    try:
        mode = UpdateMode(values.mode)
    except ValueError:
        raise ConfigError(f"mode must be 'sync' or 'async', got {values.mode!r}") from None
    if values.trainers < 1:
        raise ConfigError(f"trainers must be >= 1, got {values.trainers}")
    if values.ps < 1:
        raise ConfigError(f"ps must be >= 1, got {values.ps}")
    if values.push_every < 1 or values.pull_every < 1:
        raise ConfigError("push_every and pull_every must be >= 1")
    if mode is UpdateMode.SYNC and (values.push_every, values.pull_every) != (1, 1):
        raise ConfigError("in sync mode push_every and pull_every must both be 1")
    if values.lease_ttl_s < 1:
        raise ConfigError(f"lease_ttl_s must be >= 1, got {values.lease_ttl_s}")
    if values.placement not in PLACEMENTS:
        raise ConfigError(
            f"placement must be one of {', '.join(PLACEMENTS)}, got {values.placement!r}"
        )
    return mode


@dataclass(frozen=True, kw_only=True)
class _LaunchedJob:
    """The fields :class:`Hosts` and :class:`Slurm` share: flags of ``elasticps train``."""

    output: str | Path
    trainers: int = 2
    ps: int = 2
    mode: UpdateMode | str = UpdateMode.SYNC
    push_every: int = 1
    pull_every: int = 1
    big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND
    placement: str = DEFAULT_PLACEMENT
    lease_ttl_s: float = 5.0
    task_timeout_s: float = 60.0
    checkpoint_every_s: float = 10.0
    sync_reduction: str = "mean"
    max_restarts: int = 3
    seed: int = 0
    job: str = "job"
    overwrite: bool = False
    resume: str | Path | None = None
    remote_python: str = ""
    advertise_address: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _check_job_values(self))
        if not str(self.output):
            raise ConfigError("output must name the run's directory (or a storage URL)")
        if not self.task_timeout_s > 0:
            raise ConfigError(f"task_timeout_s must be > 0, got {self.task_timeout_s}")
        if self.big_array_bound < 1:
            raise ConfigError(f"big_array_bound must be >= 1, got {self.big_array_bound}")
        if not self.job or "/" in self.job:
            raise ConfigError(f"job must be a non-empty name without '/', got {self.job!r}")

    @property
    def update_mode(self) -> UpdateMode:
        """``mode`` as an :class:`~elasticps.config.UpdateMode`."""
        return UpdateMode(self.mode)


@dataclass(frozen=True)
class Hosts(_LaunchedJob):
    """Run the job's PS and trainers on the hosts of a host file, over ssh.

    :func:`elasticps.train` runs ``elasticps train --hosts HOSTFILE`` with
    the flags these fields give (see ``docs/hosts.md``): the same launcher,
    placement, preflight, supervision and recovery as on the command line.
    etcd, the active master and the launcher stay on this machine; the
    trainers are processes on the hosts, so the model must come from a model
    file, which the launcher copies to each role.

    Args:
        hostfile: the host file, one host a line:
            ``HOST[:SSHPORT] [slots=N] [roles=ps,trainer]`` (``--hosts``).
        ssh_config: an ssh configuration file used instead of
            ``~/.ssh/config`` (``--ssh-config``), or None.
        etcd_replicas: 1 (one etcd on this machine) or 3 (three members on
            the first three hosts, ``--etcd-replicas``).
        output: the run's directory (``--output``), on a file system that
            every host mounts at the same path, or a storage URL
            (``s3://...``): the PS write their shard checkpoints there, and
            :func:`elasticps.train` reads the final parameters from it.
        trainers: trainer processes, >= 1.
        ps: parameter-server processes, >= 1.
        mode: ``"sync"`` or ``"async"``, or an :class:`UpdateMode`.
        push_every: async: push accumulated gradients every n mini-batches.
        pull_every: async: pull parameters every m mini-batches.
        big_array_bound: parameters with more elements are sliced across all PS.
        placement: ``"balanced"`` or ``"hash"`` (see :mod:`elasticps.placement`).
        lease_ttl_s: lease TTL of every role, seconds, >= 1.
        task_timeout_s: seconds before the master re-dispatches a pending task, > 0.
        checkpoint_every_s: seconds between each PS's shard checkpoints, > 0.
        sync_reduction: sync mode: ``"mean"`` or ``"sum"`` of the trainers' gradients.
        max_restarts: restarts allowed per master, PS and etcd process, >= 0.
        seed: the seed every trainer builds the model with (``--seed``).
        job: the job name (etcd key prefix, ``--job``).
        overwrite: remove a previous run's files from ``output`` first
            (``--overwrite``) instead of refusing to start.
        resume: start from a consistent checkpoint directory or URL
            (``--resume``, e.g. an earlier run's ``OUTPUT/snapshot``).
        remote_python: the interpreter on the hosts that has elasticps
            (``--remote-python``); empty: this interpreter's path.
        advertise_address: this machine's address for the hosts
            (``--advertise-address``); empty: its address on its route to
            the first host.

    Raises:
        ConfigError: a value is out of range; the message names the field.
    """

    hostfile: str | Path
    ssh_config: str | Path | None = None
    etcd_replicas: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not str(self.hostfile):
            raise ConfigError("hostfile must name a host file")
        if self.etcd_replicas not in (1, 3):
            raise ConfigError(f"etcd_replicas must be 1 or 3, got {self.etcd_replicas}")


@dataclass(frozen=True)
class Slurm(_LaunchedJob):
    """Run the job's PS and trainers as job steps of the Slurm allocation this process runs in.

    :func:`elasticps.train` runs ``elasticps train --launcher slurm`` with the
    flags these fields give (see ``docs/hosts.md``, "Slurm"): the
    allocation's nodes take the place of a host file's hosts. Call it inside
    an allocation (``salloc``, ``sbatch``); the model must come from a model
    file, as with :class:`Hosts`.

    Its fields (``output``, ``trainers``, ``ps``, ``mode``...) are those of
    :class:`Hosts`, and mean the same, but ``hostfile``, ``ssh_config`` and
    ``etcd_replicas``, which a Slurm job does not take.

    Raises:
        ConfigError: a value is out of range; the message names the field.
    """


@dataclass(frozen=True)
class Parquet:
    """Parquet files as the data of :func:`elasticps.train`.

    Args:
        files: one path or several; read in order.
        batch_to_tensors: ``pyarrow.Table -> (inputs, targets)`` for one
            mini-batch (the model-file contract's function).
        columns: the columns it reads (the model file's ``COLUMNS``).
        batch_size: rows per mini-batch, >= 1.
        records_per_task: rows per master task, >= 1. In-process training
            cuts mini-batches at the same task boundaries, so both paths see
            the same mini-batches.

    Raises:
        ConfigError: no files, no columns, or a value out of range.
    """

    files: str | Path | Sequence[str | Path]
    batch_to_tensors: Callable[[pa.Table], tuple[Tensor, Tensor]]
    columns: Sequence[str]
    batch_size: int = 32
    records_per_task: int = 512

    def __post_init__(self) -> None:
        files = self.files
        paths = (files,) if isinstance(files, str | Path) else tuple(files)
        object.__setattr__(self, "files", tuple(Path(p).resolve() for p in paths))
        object.__setattr__(self, "columns", tuple(self.columns))
        if not self.paths:
            raise ConfigError("Parquet needs at least one file")
        if not self.columns:
            raise ConfigError("Parquet needs the columns that batch_to_tensors reads")
        if not callable(self.batch_to_tensors):
            raise ConfigError("batch_to_tensors must be callable")
        if self.batch_size < 1 or self.records_per_task < 1:
            raise ConfigError("batch_size and records_per_task must be >= 1")

    @property
    def paths(self) -> tuple[Path, ...]:
        """The files, as absolute paths."""
        files = self.files
        assert isinstance(files, tuple)
        return tuple(Path(p) for p in files)

    @classmethod
    def from_model_file(
        cls,
        files: str | Path | Sequence[str | Path],
        model_file: str | Path,
        *,
        batch_size: int = 32,
        records_per_task: int = 512,
    ) -> Parquet:
        """Take ``batch_to_tensors`` and ``COLUMNS`` from a model file (``examples/mnist_mlp.py``).

        Raises:
            ModelContractError: the model file breaks the contract.
        """
        spec = load_model_file(model_file)
        return cls(
            files,
            spec.batch_to_tensors,
            spec.columns,
            batch_size=batch_size,
            records_per_task=records_per_task,
        )
