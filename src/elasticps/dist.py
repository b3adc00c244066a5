"""One entry point from laptop to cluster: :func:`dist_train`.

The same script runs everywhere. Started by hand (no ``ELASTICPS_ROLE`` in
the environment), :func:`dist_train` is the **launcher**: with the local
backend it starts etcd and the parameter servers as processes
(:class:`~elasticps.api.servers.LocalServers`), then ``workers`` copies of
the very command that is running (``sys.executable`` and its arguments)
with the environment below, waits for them, and stops everything by PID.
Started by a launcher (``ELASTICPS_ROLE`` set), it looks at its role: a
``trainer`` calls the user's function and returns its result, a ``ps`` or
``master`` runs that role's entry point (``elasticps ps`` / ``elasticps
master``, configured by the ``ELASTICPS_*`` variables) and exits.

This follows the pseudo-code of ``paddle.dist_train`` in the PaddlePaddle
API design (PaddlePaddle/Paddle, ``doc/design/api.md``, section
"Distributed Training"): without the cluster's environment variables the
function works as a launcher; with them it finds its role and becomes the
master, a parameter server or a trainer.

Environment of a launched job
-----------------------------
Set by the launcher for every process it starts (a Kubernetes backend sets
the same ones in the pod spec):

==============================  ===============================================
``ELASTICPS_ROLE``              ``trainer``, ``ps`` or ``master``.
``ELASTICPS_RANK``              trainer: its rank, ``0 .. NUM_WORKERS - 1``
                                (also its trainer id, ``ELASTICPS_TRAINER_ID``).
``ELASTICPS_NUM_WORKERS``       number of trainers (workers).
``ELASTICPS_JOB``               job name; etcd keys live under ``/elasticps/<job>/``.
``ELASTICPS_ETCD``              etcd endpoint, ``host:port``.
``ELASTICPS_MODE``              ``sync`` or ``async``: the servers' update mode.
``ELASTICPS_PS``                number of parameter servers.
``ELASTICPS_OPTIMIZER_CONFIG``  the servers' optimizer as JSON (an
                                :class:`~elasticps.config.OptimizerConfig`), so
                                that ``kv.set_optimizer`` can check it.
``ELASTICPS_BIGARRAY_BOUND``    values with more elements are sliced over every
                                server (default 1,000,000); passed through.
``ELASTICPS_LEASE_TTL_S``       lease TTL of every role, seconds.
``ELASTICPS_PARENT_PID``        the launcher's PID (children stop if it dies).
==============================  ===============================================

The ``ps`` and ``master`` roles read their other flags from ``ELASTICPS_*``
variables as the CLI documents (``ELASTICPS_OPTIMIZER``, ``ELASTICPS_LR``,
``ELASTICPS_LR_SCHEDULE``, ``ELASTICPS_FROZEN``, ``ELASTICPS_MAX_STALENESS``,
``ELASTICPS_DATA``...).

Example (``examples/kvstore_mnist.py``)::

    def main() -> None:
        kv = elasticps.kvstore.create("dist_sync")
        ...  # init, then push / pull per mini-batch

    if __name__ == "__main__":
        elasticps.dist.dist_train(main, workers=2, ps=2, mode="sync",
                                  updater=elasticps.updater.SGD(lr=0.1))
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import ConfigError, JobFailedError, JobUserError
from elasticps.launcher.spawn import child_env, terminate, wait_or_kill
from elasticps.launcher.supervisor import EXIT_USER_ERROR, Exited, FailJob, Kind
from elasticps.netutil import die_with_parent_prefix
from elasticps.updater import Updater, as_config

if TYPE_CHECKING:
    from elasticps.api.servers import LocalServers

__all__ = ["BACKENDS", "LaunchResult", "dist_train"]

log = logging.getLogger(__name__)

T = TypeVar("T")

BACKENDS = ("local", "kubernetes")
"""Launcher backends :func:`dist_train` knows."""

# Seconds between two checks of the children; seconds from SIGTERM to SIGKILL.
_POLL_S = 0.05
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LaunchResult:
    """What :func:`dist_train` returns when it was the launcher.

    Attributes:
        exit_codes: exit status of each worker, by rank (all 0).
        wall_s: seconds from the start of the servers to the last worker's exit.
        job: the job name.
    """

    exit_codes: tuple[int, ...]
    wall_s: float
    job: str


def dist_train(
    train_fn: Callable[[], T],
    *,
    workers: int = 2,
    ps: int = 1,
    mode: str | UpdateMode = "sync",
    updater: Updater | OptimizerConfig | None = None,
    frozen: Sequence[str] = (),
    max_staleness: int | None = None,
    backend: str = "local",
    argv: Sequence[str] | None = None,
    timeout_s: float | None = None,
    lease_ttl_s: float = 5.0,
    output: str | Path | None = None,
) -> T | LaunchResult:
    """Run ``train_fn`` on ``workers`` trainers against ``ps`` parameter servers.

    Inside a launched job (``ELASTICPS_ROLE`` set; see the module docstring)
    the keyword arguments are ignored: a trainer returns ``train_fn()``, a
    PS or master runs its role and exits the process. Outside one, this
    process becomes the launcher and returns a :class:`LaunchResult` once
    every worker exited with status 0.

    Args:
        train_fn: the training function each worker runs (typically creating
            a ``dist_*`` :mod:`elasticps.kvstore` store).
        workers: number of trainer processes, >= 1.
        ps: number of parameter servers, >= 1.
        mode: ``"sync"`` (``dist_sync``) or ``"async"`` (``dist_async``).
        updater: the optimizer the servers run (:mod:`elasticps.updater`);
            the default is :class:`~elasticps.config.OptimizerConfig`'s (Adam,
            lr 1e-3). Workers' ``kv.set_optimizer`` must pass the same one.
        frozen: glob patterns of frozen parameter names (``elasticps ps --frozen``).
        max_staleness: async: servers drop gradients more than this many
            versions behind (``elasticps ps --max-staleness``).
        backend: ``"local"`` (processes on this machine) or ``"kubernetes"``
            (not implemented yet).
        argv: the command each worker runs after ``sys.executable``; by
            default this process's own (``sys.orig_argv[1:]``).
        timeout_s: stop everything and fail after this many seconds; None: no limit.
        lease_ttl_s: lease TTL of servers and workers, seconds, >= 1.
        output: if set, a directory where the launch records itself, so that
            ``elasticps status`` and ``elasticps list`` show it: ``run.json``
            (``running``, then ``finished``, ``failed`` or ``interrupted``,
            with the supervision policy's decisions) and a lock held while it
            runs (see :mod:`elasticps.api.record`). Only the launcher writes
            it; the workers' outputs are theirs.

    Returns:
        In a trainer, ``train_fn()``'s result; in the launcher, the
        :class:`LaunchResult`.

    Raises:
        ConfigError: invalid arguments, an unknown role or backend, the
            ``kubernetes`` backend (not built: submit the job with ``elasticps submit``),
            or an ``output`` that holds a run of ``elasticps train``.
        OutputInUseError: another job holds ``output``.
        JobFailedError: a worker exited with a non-zero status (the others
            are stopped; the message names the exit codes), a server died,
            or the timeout passed.
        SystemExit: in a ``ps`` or ``master`` role, with the role's exit status.
    """
    role = os.environ.get("ELASTICPS_ROLE")
    if role:
        return _run_role(role, train_fn)
    if workers < 1 or ps < 1:
        raise ConfigError(f"dist_train needs workers >= 1 and ps >= 1, got {workers} and {ps}")
    update_mode = mode if isinstance(mode, UpdateMode) else UpdateMode(mode)
    config = as_config(updater) if updater is not None else OptimizerConfig()
    if backend == "kubernetes":
        raise ConfigError(
            "dist_train has no kubernetes backend; run the job "
            "with backend='local', or with the Kubernetes launcher (elasticps.launcher.kubernetes)"
        )
    if backend != "local":
        raise ConfigError(f"unknown dist_train backend {backend!r}; expected one of {BACKENDS}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    command = list(argv) if argv is not None else list(sys.orig_argv[1:])
    return _launch_local(
        command,
        workers=workers,
        ps=ps,
        mode=update_mode,
        optimizer=config,
        frozen=tuple(frozen),
        max_staleness=max_staleness,
        timeout_s=timeout_s,
        lease_ttl_s=lease_ttl_s,
        output=Path(output) if output is not None else None,
    )


def _run_role(role: str, train_fn: Callable[[], T]) -> T:
    if role == "trainer":
        return train_fn()
    if role in ("ps", "master"):
        from elasticps.cli import main

        raise SystemExit(main([role]))
    raise ConfigError(f"ELASTICPS_ROLE must be trainer, ps or master, got {role!r}")


def worker_env(
    *,
    rank: int,
    workers: int,
    job: str,
    etcd_endpoint: str,
    mode: UpdateMode,
    ps: int,
    optimizer: OptimizerConfig,
    lease_ttl_s: float,
) -> dict[str, str]:
    """The ``ELASTICPS_*`` variables of trainer ``rank`` (see the module docstring). Pure."""
    from elasticps.kvstore import ENV_OPTIMIZER, optimizer_env

    return {
        "ELASTICPS_ROLE": "trainer",
        "ELASTICPS_RANK": str(rank),
        "ELASTICPS_TRAINER_ID": str(rank),
        "ELASTICPS_NUM_WORKERS": str(workers),
        "ELASTICPS_JOB": job,
        "ELASTICPS_ETCD": etcd_endpoint,
        "ELASTICPS_MODE": mode.value,
        "ELASTICPS_PS": str(ps),
        ENV_OPTIMIZER: optimizer_env(optimizer),
        "ELASTICPS_LEASE_TTL_S": repr(lease_ttl_s),
    }


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.proc = proc
        self.pump = threading.Thread(target=self._pump, name=f"worker-{rank}-log", daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        stream: IO[bytes] | None = self.proc.stdout
        assert stream is not None
        prefix = f"worker-{self.rank}| "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            print(prefix + line, flush=True)


def _launch_local(
    command: list[str],
    *,
    workers: int,
    ps: int,
    mode: UpdateMode,
    optimizer: OptimizerConfig,
    frozen: tuple[str, ...],
    max_staleness: int | None,
    timeout_s: float | None,
    lease_ttl_s: float,
    output: Path | None,
) -> LaunchResult:
    from elasticps.api.record import RunRecord
    from elasticps.api.servers import LocalServers, ServersConfig

    ps_args = ("--max-staleness", str(max_staleness)) if max_staleness is not None else ()
    servers_config = ServersConfig(
        num_ps=ps,
        mode=mode,
        optimizer=optimizer,
        frozen=frozen,
        ps_args=ps_args,
        with_master=False,
        lease_ttl_s=lease_ttl_s,
        # A worker runs the user's whole script: a replacement would train
        # its data again, so a worker that fails fails the launch.
        replace_trainers=False,
    )
    started = time.monotonic()
    running: list[_Worker] = []
    record = (
        RunRecord(output, servers_config.job, "dist_train")
        if output is not None
        else contextlib.nullcontext()
    )
    with record as run_record, LocalServers(servers_config) as servers:
        if run_record is not None:
            run_record.running(servers.etcd_endpoint, servers.decision_records)
        try:
            for rank in range(workers):
                # A worker is a trainer: the environment of every launcher's
                # trainers, plus the dist_train contract's variables.
                env = child_env(
                    "trainer",
                    worker_env(
                        rank=rank,
                        workers=workers,
                        job=servers.job,
                        etcd_endpoint=servers.etcd_endpoint,
                        mode=mode,
                        ps=ps,
                        optimizer=optimizer,
                        lease_ttl_s=lease_ttl_s,
                    ),
                )
                proc = subprocess.Popen(
                    [*die_with_parent_prefix(), sys.executable, *command],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    # Own session: Ctrl-C reaches only us; we stop workers by PID.
                    start_new_session=True,
                )
                running.append(_Worker(rank, proc))
            log.info(
                "dist_train: job %s, %d workers (pids %s), servers %s",
                servers.job, workers, [w.proc.pid for w in running], servers.pids,
            )  # fmt: skip
            codes = _wait(running, servers, started, timeout_s)
            log.info(
                "dist_train: every worker exited after %.1f s; stopping the servers",
                time.monotonic() - started,
            )
        finally:
            _stop(running)
    return LaunchResult(tuple(codes), time.monotonic() - started, servers_config.job)


def _wait(
    running: list[_Worker],
    servers: LocalServers,
    started: float,
    timeout_s: float | None,
) -> list[int]:
    """Wait for every worker; raise at the first failure (the caller stops the rest).

    Each worker's end goes through the job's supervision policy
    (:mod:`elasticps.launcher.supervisor`, the servers' own, without trainer
    replacement), which fails the launch on any status but 0: with status 2
    (a user error) as :class:`~elasticps.errors.JobUserError`, else as
    :class:`~elasticps.errors.JobFailedError` with the policy's decisions.
    """
    while True:
        codes = [w.proc.poll() for w in running]
        failed = [(w.rank, c) for w, c in zip(running, codes, strict=True) if c not in (None, 0)]
        if failed:
            for w in running:
                w.pump.join(timeout=1.0)
            actions = [
                servers.decide(Exited.of_returncode(f"trainer-{rank}", Kind.TRAINER, code))
                for rank, code in failed
            ]
            message = "dist_train: worker(s) failed: " + ", ".join(
                f"rank {rank} exited with status {code}" for rank, code in failed
            )
            if any(isinstance(a, FailJob) and a.exit_code == EXIT_USER_ERROR for a in actions):
                raise JobUserError(message + " (a user error; see its output above)")
            raise JobFailedError(message, decisions=servers.decision_records())
        if all(c == 0 for c in codes):
            for w in running:
                w.pump.join(timeout=5.0)
            return [0] * len(running)
        servers.check()
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise JobFailedError(
                f"dist_train: the workers did not finish within {timeout_s:g} s",
                decisions=servers.decision_records(),
            )
        time.sleep(_POLL_S)


def _stop(running: list[_Worker]) -> None:
    """Stop every worker still running by PID: SIGTERM, then SIGKILL after a grace period."""
    procs = [w.proc for w in running]
    terminate(procs)
    wait_or_kill(procs, _STOP_TIMEOUT_S)
    for w in running:
        w.pump.join(timeout=1.0)
        if w.proc.stdout is not None:
            w.proc.stdout.close()
