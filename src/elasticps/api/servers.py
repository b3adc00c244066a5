"""Start the servers of a job (etcd, the master, the parameter servers) as local processes.

:class:`LocalServers` is the piece of the local launcher that the Python API
(:func:`elasticps.train` with :class:`elasticps.Local`), ``dist_train`` and the
KVStore's ``dist_*`` modes share: it starts a real etcd
(:class:`~elasticps.coord.etcd_server.EtcdServer`, temporary data directory,
free loopback port), optionally one master, and ``num_ps`` parameter servers,
each as ``python -m elasticps master|ps ...`` behind the
:func:`~elasticps.netutil.die_with_parent_prefix` prefix, waits until every PS
slot is claimed, and stops everything by PID on exit. Trainers are not its
business: the caller runs them (in its own process, or as processes).

While the job runs, the caller calls :meth:`LocalServers.check` now and then:
it applies the job's supervision policy
(:mod:`elasticps.launcher.supervisor`, the same as ``elasticps train``'s): a
dead etcd, master or PS is restarted (etcd on its data directory, a PS under
its index: it reclaims its slot and reloads its own checkpoint), up to
``max_restarts`` times each, unless it exited with status 2. The caller
feeds its trainers' ends to the same policy through :meth:`LocalServers.decide`;
:meth:`LocalServers.check` tells the policy when the master reports task
progress (which resets its count of trainers failing in a row) and when the
job is finished (trainer deaths no longer matter).

Example::

    cfg = ServersConfig(num_ps=2, virtual_records=100, records_per_task=10)
    with LocalServers(cfg) as servers:
        store = JobStore(servers.etcd_endpoint, servers.job)
        ...  # run trainers against servers.etcd_endpoint / servers.job

Each child's output (stdout and stderr) goes to ``<workdir>/<role>.log``;
:meth:`LocalServers.log_tail` quotes it, and errors about a child that died
include its last lines.

Start it from the thread that will live longest (normally the main thread):
``setpriv --pdeathsig`` sends the children SIGTERM when the *thread* that
started them exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

import grpc

from elasticps.config import OptimizerConfig, UpdateMode, check_job_name
from elasticps.coord.etcd_auth import enable_auth
from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig
from elasticps.coord.keys import Keys
from elasticps.coord.store import JobStore, PSSlot
from elasticps.errors import (
    ConfigError,
    CoordinationError,
    ElasticPSError,
    JobFailedError,
    JobUserError,
)
from elasticps.jobca import JobCA
from elasticps.launcher.local_processes import DecisionLog, release_keys
from elasticps.launcher.spawn import child_env, run_beside, terminate, wait_or_kill
from elasticps.launcher.supervisor import (
    EXIT_USER_ERROR,
    Action,
    Decision,
    Event,
    Exited,
    FailJob,
    JobFinished,
    Kind,
    Progressed,
    Restart,
    RestartFailed,
    Supervisor,
    SupervisorConfig,
    error_line,
)
from elasticps.master.client import MasterClient
from elasticps.netutil import RUNTIME_DIR_ENV, die_with_parent_prefix
from elasticps.security import etcd_tls_from_env, job_credentials, write_etcd_server_tls
from elasticps.storage import Location
from elasticps.updater import ps_flags

__all__ = ["LocalServers", "ServersConfig"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Seconds between two checks of the children while waiting for them.
_POLL_S = 0.05

# Seconds between two looks at the master's task progress (see LocalServers.check).
_PROGRESS_EVERY_S = 1.0


def _default_job() -> str:
    return f"api-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class ServersConfig:
    """What :class:`LocalServers` starts.

    Attributes:
        job: job name (etcd prefix ``/elasticps/<job>/``); a fresh unique name
            by default.
        num_ps: parameter servers to start (and PS slots), >= 1.
        mode: sync-SGD or async-SGD on the parameter servers.
        optimizer: the optimizer each PS runs (``--optimizer``, ``--lr``, ...).
        ps_args: extra ``elasticps ps`` arguments (for example an updater's
            schedule flags), appended as given.
        frozen: glob patterns (``fnmatch``) of frozen parameter names, passed
            as ``elasticps ps --frozen PATTERN...``; the PS refuses non-zero
            gradients for them and never changes them.
        with_master: also start one master.
        data_files: the master's Parquet files, paths or storage URLs (exclusive
            with ``virtual_records``).
        virtual_records: records of a virtual source for the master (see
            :attr:`elasticps.config.MasterConfig.virtual_records`).
        records_per_task: records per task, >= 1.
        num_passes: passes over the data, >= 1.
        task_timeout_s: seconds before the master re-dispatches a pending task.
        lease_ttl_s: lease TTL of the master and the PS, seconds, >= 1.
        checkpoint_dir: directory or storage URL for the PS's own shard checkpoints
            (``--checkpoint-dir``); None: ``ps-checkpoints/`` in the servers'
            work directory (removed at the end).
        checkpoint_every_s: seconds between shard checkpoints, > 0.
        startup_timeout_s: seconds to wait for every PS slot to be claimed
            (and for the master to hold its lock), > 0.
        stop_timeout_s: seconds between SIGTERM and SIGKILL when stopping.
        max_restarts: restarts allowed per etcd, master and PS process, >= 0.
        replace_trainers: whether the caller's trainers are replaced when they
            die (:attr:`SupervisorConfig.replace_trainers
            <elasticps.launcher.supervisor.SupervisorConfig.replace_trainers>`).
        auth: the servers ask for a secret made for them (:mod:`elasticps.security`),
            which this process's clients are given until :meth:`LocalServers.stop`;
            False serves any process (a warning in the log).
        tls: with ``auth``, TCP connections to the PS and the master are TLS 1.3
            with certificates of a CA made for them (:mod:`elasticps.tls`).

    Raises:
        ConfigError: a value is out of range, or the master has no data.
    """

    job: str = field(default_factory=_default_job)
    num_ps: int = 1
    mode: UpdateMode = UpdateMode.SYNC
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ps_args: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    with_master: bool = True
    data_files: tuple[str | Path, ...] = ()
    virtual_records: int = 0
    records_per_task: int = 512
    num_passes: int = 1
    task_timeout_s: float = 60.0
    lease_ttl_s: float = 5.0
    checkpoint_dir: str | Path | None = None
    checkpoint_every_s: float = 30.0
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    max_restarts: int = 3
    replace_trainers: bool = True
    auth: bool = True
    tls: bool = True

    def __post_init__(self) -> None:
        check_job_name(self.job)
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.num_ps < 1:
            raise ConfigError(f"num_ps must be >= 1, got {self.num_ps}")
        if self.with_master and not self.data_files and self.virtual_records < 1:
            raise ConfigError("the master needs data_files or virtual_records > 0")
        if self.data_files and self.virtual_records:
            raise ConfigError("give data_files or virtual_records, not both")
        if self.records_per_task < 1:
            raise ConfigError(f"records_per_task must be >= 1, got {self.records_per_task}")
        if self.num_passes < 1:
            raise ConfigError(f"num_passes must be >= 1, got {self.num_passes}")
        if not self.task_timeout_s > 0:
            raise ConfigError(f"task_timeout_s must be > 0, got {self.task_timeout_s}")
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease_ttl_s must be >= 1, got {self.lease_ttl_s}")
        if not self.checkpoint_every_s > 0:
            raise ConfigError(f"checkpoint_every_s must be > 0, got {self.checkpoint_every_s}")
        if not self.startup_timeout_s > 0:
            raise ConfigError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if any(not p for p in self.frozen):
            raise ConfigError("frozen parameter patterns must be non-empty strings")


@dataclass
class _Child:
    role: str
    args: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    restarts: int = 0
    ended: bool = False
    log_start: int = 0  # where this incarnation's output begins in the log

    @property
    def kind(self) -> Kind:
        return Kind(self.role.split("-", maxsplit=1)[0])


class LocalServers:
    """etcd, an optional master and ``num_ps`` parameter servers as local processes.

    A context manager: entering starts everything and waits until it is ready,
    leaving stops every process by PID (SIGTERM, then SIGKILL after
    ``stop_timeout_s``) and removes the temporary directory. :meth:`start`
    and :meth:`stop` do the same without ``with``.

    Args:
        config: what to start.

    Attributes:
        config: the configuration.
    """

    def __init__(self, config: ServersConfig) -> None:
        self.config = config
        self._workdir: Path | None = None
        # The job secret's hold on this process's environment, from start() to stop().
        self._credentials = contextlib.ExitStack()
        self._etcd: EtcdServer | None = None
        self._children: list[_Child] = []
        self._ps_addresses: list[str] = []
        self._master_address: str | None = None
        self._policy = Supervisor(
            SupervisorConfig(
                max_restarts=config.max_restarts, replace_trainers=config.replace_trainers
            )
        )
        self._decision_log = DecisionLog()
        self._lock = threading.RLock()
        self._started: list[int] = []
        self._etcd_restarts = 0
        # The master's progress, as check() last saw it (see _watch_progress).
        self._master: MasterClient | None = None
        self._progress_store: JobStore | None = None
        self._progress_at = 0.0
        self._tasks_done = -1

    # --- what callers use -------------------------------------------------------

    @property
    def job(self) -> str:
        """The job name."""
        return self.config.job

    @property
    def etcd_endpoint(self) -> str:
        """``host:port`` of the running etcd.

        Raises:
            CoordinationError: the servers are not started.
        """
        if self._etcd is None:
            raise CoordinationError("the servers are not started")
        return self._etcd.endpoint

    @property
    def ps_addresses(self) -> list[str]:
        """``host:port`` of PS slot ``i`` at index ``i``, as claimed at startup."""
        return list(self._ps_addresses)

    def ps_slots(self) -> list[PSSlot]:
        """The parameter servers' current slots (address and epoch), by index.

        Raises:
            CoordinationError: not all claimed within 30 s, or etcd failed.
        """
        with JobStore(self.etcd_endpoint, self.config.job) as store:
            return store.wait_ps_slots(30.0)

    @property
    def master_address(self) -> str | None:
        """``host:port`` of the master at startup, or None without a master."""
        return self._master_address

    @property
    def workdir(self) -> Path:
        """The temporary directory (etcd data and the children's logs).

        Raises:
            CoordinationError: the servers are not started.
        """
        if self._workdir is None:
            raise CoordinationError("the servers are not started")
        return self._workdir

    @property
    def pids(self) -> dict[str, int]:
        """PID of every running process: ``etcd``, ``master``, ``ps-0``, ``ps-1``..."""
        out: dict[str, int] = {}
        if self._etcd is not None and self._etcd.pid is not None:
            out["etcd"] = self._etcd.pid
        for child in self._children:
            out[child.role] = child.proc.pid
        return out

    @property
    def started_pids(self) -> list[int]:
        """PID of every process ever started, restarts included."""
        with self._lock:
            return list(self._started)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by role (``etcd``, ``master``, ``ps-1``...); absent: none."""
        with self._lock:
            out = {c.role: c.restarts for c in self._children if c.restarts}
            if self._etcd_restarts:
                out["etcd"] = self._etcd_restarts
            return out

    def decide(self, event: Event) -> Action:
        """The job's supervision policy's answer to ``event`` (thread-safe).

        The caller feeds it its trainers' ends, so that one policy (and one
        count of failures) covers the whole job.
        """
        with self._lock:
            return self._decision_log.decide(self._policy, event)

    @property
    def decisions(self) -> list[Decision]:
        """The policy's decisions so far, oldest first (task progress is not recorded)."""
        return self._decision_log.records()

    def decision_records(self) -> list[dict[str, object]]:
        """:attr:`decisions` as ``run.json`` lists them (:attr:`JobFailedError.decisions`)."""
        return self._decision_log.as_json()

    def check(self) -> None:
        """Supervise the servers once: restart those that died, as the policy allows.

        A restarted etcd comes back on its data directory and endpoint; a
        restarted master restores the ledger from etcd; a restarted PS
        reclaims its slot (released at once here, not one lease TTL later)
        and reloads its checkpoint. With a master, once a second it also asks
        the master for the job's progress and tells the policy
        (:class:`~elasticps.launcher.supervisor.Progressed`,
        :class:`~elasticps.launcher.supervisor.JobFinished`).

        Raises:
            JobUserError: a server stopped on a user error (exit status 2).
            JobFailedError: no restarts left, or a server could not be
                restarted; names the role and quotes its last log lines.
        """
        with self._lock:
            if self._etcd is not None and not self._etcd.alive():
                self._restart_etcd(self._etcd)
            for child in self._children:
                if child.ended:
                    continue
                status = child.proc.poll()
                if status is None:
                    continue
                self._release_slot(child)
                message = ""
                for line in self._output(child).splitlines():
                    message = error_line(line) or message
                action = self.decide(Exited.of_returncode(child.role, child.kind, status, message))
                if isinstance(action, FailJob):
                    self._fail(action, child.role)
                if not isinstance(action, Restart):
                    child.ended = True
                    continue
                log.warning(
                    "%s (pid %d) exited with status %s; restarting it (%d/%d)",
                    child.role, child.proc.pid, status, action.attempt, self.config.max_restarts,
                )  # fmt: skip
                self._restart(child)
            self._watch_progress()

    def _watch_progress(self) -> None:
        """Tell the policy when the master's count of done tasks grows, or the job finished."""
        if self._master_address is None or self._etcd is None or not self._etcd.alive():
            return
        now = time.monotonic()
        if now - self._progress_at < _PROGRESS_EVERY_S:
            return
        self._progress_at = now
        try:
            if self._master is None:
                store = JobStore(self._etcd.endpoint, self.config.job)
                self._progress_store = store
                self._master = MasterClient(
                    lambda: store.master_address(timeout_s=0.2), rpc_timeout_s=1.0, retry_s=0.0
                )
            status = self._master.job_status()
        except (ElasticPSError, grpc.RpcError) as exc:  # a master or etcd being restarted
            log.debug("no job status from the master: %s", exc)
            return
        if status.tasks_done_all_passes > self._tasks_done:
            if self._tasks_done >= 0:
                self.decide(Progressed())
            self._tasks_done = status.tasks_done_all_passes
        if status.finished:
            self.decide(JobFinished())

    def run_supervised(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` in a helper thread while this thread calls :meth:`check`.

        For work that needs the servers up (the final pull, a checkpoint)
        while one may die and be restarted. Call it from the thread that
        started the servers: a restarted child is signalled when the thread
        that started it exits (see the module docstring).

        Returns:
            What ``work`` returned.

        Raises:
            JobUserError, JobFailedError: as :meth:`check`.
            Exception: what ``work`` raised.
        """
        return run_beside(work, self.check, _POLL_S, "servers-work")

    def fail(self, action: FailJob) -> None:
        """Raise the error of a :class:`FailJob` decision (see :meth:`decide`).

        Raises:
            JobUserError: ``action`` is a user error (exit status 2).
            JobFailedError: otherwise.
        """
        self._fail(action, None)

    def _fail(self, action: FailJob, role: str | None) -> None:
        if action.exit_code == EXIT_USER_ERROR:
            raise JobUserError(action.message)
        tail = self.log_tail(role) if role is not None else ""
        raise JobFailedError(
            action.message + (f":\n{tail}" if tail else ""), decisions=self.decision_records()
        )

    def _restart_etcd(self, etcd: EtcdServer) -> None:
        code = etcd.returncode
        event: Event = Exited.of_returncode("etcd", Kind.ETCD, code)
        while True:
            action = self.decide(event)
            if isinstance(action, FailJob):
                self._fail(action, None)
            if not isinstance(action, Restart):
                return
            self._etcd_restarts += 1
            log.warning("etcd died; restarting it on its data dir (%d)", action.attempt)
            try:
                etcd.restart()
            except CoordinationError as exc:
                event = RestartFailed("etcd", Kind.ETCD, " ".join(str(exc).split())[:200])
                continue
            if etcd.pid is not None:
                self._started.append(etcd.pid)
            return

    def _release_slot(self, child: _Child) -> None:
        """Delete the PS slot or master lock a dead child held under its lease.

        The process is reaped, so certainly dead: its restart can claim the
        slot now rather than one lease TTL later. Only a key that still
        names that pid is deleted.
        """
        if self._etcd is None or not self._etcd.alive():
            return  # the lease TTL will do it
        try:
            with JobStore(self._etcd.endpoint, self.config.job) as store:
                release_keys(store, child.kind, child.proc.pid, self.config.num_ps)
        except ElasticPSError as exc:
            log.info("could not release the keys of %s: %s", child.role, exc)

    def _restart(self, child: _Child) -> None:
        while True:
            start = _size(child.log_path)
            try:
                child.proc = self._popen(child.args, child.role, child.log_file)
            except OSError as exc:
                action = self.decide(RestartFailed(child.role, child.kind, str(exc)))
                if isinstance(action, FailJob):
                    self._fail(action, child.role)
                if not isinstance(action, Restart):
                    child.ended = True
                    return
                continue
            child.log_start = start
            child.restarts += 1
            self._started.append(child.proc.pid)
            return

    def _output(self, child: _Child) -> str:
        """What the child's current incarnation wrote (its last 64 KiB at most)."""
        with contextlib.suppress(OSError), child.log_path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(child.log_start, end - 65536))
            return f.read().decode(errors="replace")
        return ""

    def log_tail(self, role: str, lines: int = 20) -> str:
        """The last ``lines`` lines of a child's log (``master``, ``ps-0``...)."""
        for child in self._children:
            if child.role == role:
                with contextlib.suppress(OSError):
                    text = child.log_path.read_text(errors="replace")
                    return "\n".join(text.splitlines()[-lines:])
        return ""

    # --- lifecycle ----------------------------------------------------------------

    def __enter__(self) -> LocalServers:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start etcd, the master and the PS; return once every PS slot is claimed.

        Raises:
            CoordinationError: etcd did not start, or the PS / master were not
                ready within ``startup_timeout_s``.
            JobFailedError: a master or PS process kept exiting during startup
                (no restarts left).
            JobUserError: a master or PS stopped on a user error.
        """
        if self._workdir is not None:
            raise CoordinationError("the servers are already started")
        cfg = self.config
        self._workdir = Path(tempfile.mkdtemp(prefix=f"elasticps-{cfg.job}-"))
        try:
            # etcd's certificate, and one per role, from the job's own CA.
            ca = JobCA.generate(cfg.job) if cfg.auth else None
            tls = write_etcd_server_tls(ca, self._workdir / "etcd-tls") if ca else None
            self._credentials.enter_context(
                job_credentials(
                    self._workdir,
                    auth=cfg.auth,
                    tls=cfg.tls,
                    ca=ca,
                    etcd_tls=ca is not None,
                    job=cfg.job,
                )
            )
            self._etcd = EtcdServer(
                EtcdServerConfig(data_dir=self._workdir / "etcd", client_port=0, tls=tls),
                log_path=self._workdir / "etcd.log",
            )
            self._etcd.start()
            root = etcd_tls_from_env()
            if ca is not None and root is not None:
                enable_auth(self._etcd.endpoint, Keys(cfg.job), root)
            if self._etcd.pid is not None:
                self._started.append(self._etcd.pid)
            with JobStore(self._etcd.endpoint, cfg.job) as store:
                store.set_ps_desired(cfg.num_ps)
                if cfg.with_master:
                    self._spawn("master", self._master_args())
                for i in range(cfg.num_ps):
                    self._spawn(f"ps-{i}", self._ps_args())
                self._wait_ready(store)
        except BaseException:
            self.stop()
            raise
        log.info("servers of job %s ready: %s", cfg.job, self.pids)

    def stop(self) -> None:
        """Stop every process by PID (PS, then the master, then etcd); idempotent."""
        cfg = self.config
        with self._lock:  # no restart from now on
            children, self._children = self._children, []
            master, self._master = self._master, None
            store, self._progress_store = self._progress_store, None
        if master is not None:
            master.close()
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        # PS before the master, as the launcher does.
        children.sort(key=lambda c: 0 if c.role.startswith("ps") else 1)
        procs = [child.proc for child in children]
        terminate(procs)
        wait_or_kill(procs, cfg.stop_timeout_s)
        for child in children:
            child.log_file.close()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        self._credentials.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # --- internals ------------------------------------------------------------------

    def _common_args(self) -> list[str]:
        return [
            "--job", self.config.job,
            "--etcd", self.etcd_endpoint,
            "--lease-ttl-s", repr(self.config.lease_ttl_s),
        ]  # fmt: skip

    def _master_args(self) -> list[str]:
        cfg = self.config
        if cfg.virtual_records:
            data = ["--virtual-records", str(cfg.virtual_records)]
        else:
            data = ["--data", *(str(Location.of(p).resolve()) for p in cfg.data_files)]
        return [
            "master", *self._common_args(), *data,
            "--epochs", str(cfg.num_passes),
            "--records-per-task", str(cfg.records_per_task),
            "--task-timeout-s", repr(cfg.task_timeout_s),
            "--mode", cfg.mode.value,
            "--checkpoint-every-s", repr(cfg.checkpoint_every_s),
        ]  # fmt: skip

    def _ps_args(self) -> list[str]:
        cfg = self.config
        args = [
            "ps", *self._common_args(),
            "--mode", cfg.mode.value,
            *ps_flags(cfg.optimizer),
            "--claim-timeout-s", repr(cfg.startup_timeout_s),
        ]  # fmt: skip
        # Always: a restarted PS recovers from its own checkpoints.
        checkpoints = (
            Location.of(cfg.checkpoint_dir).resolve()
            if cfg.checkpoint_dir is not None
            else self.workdir / "ps-checkpoints"
        )
        args += [
            "--checkpoint-dir", str(checkpoints),
            "--checkpoint-every-s", repr(cfg.checkpoint_every_s),
            "--run-id", cfg.job,
        ]  # fmt: skip
        if cfg.frozen:
            args += ["--frozen", *cfg.frozen]
        return args + list(cfg.ps_args)

    def _spawn(self, role: str, args: list[str]) -> None:
        assert self._workdir is not None
        log_path = self._workdir / f"{role}.log"
        log_file = log_path.open("ab")
        try:
            proc = self._popen(args, role, log_file)
        except BaseException:
            log_file.close()
            raise
        self._children.append(_Child(role, args, proc, log_path, log_file))
        self._started.append(proc.pid)

    def _popen(self, args: list[str], role: str, log_file: IO[bytes]) -> subprocess.Popen[bytes]:
        # The environment of every launcher's role processes (its allocator
        # settings, and the parent PID the child stops itself without).
        env = child_env(role)
        if self._workdir is not None:
            env[RUNTIME_DIR_ENV] = str(self._workdir)  # removed when the servers stop
        return subprocess.Popen(
            [*die_with_parent_prefix(), sys.executable, "-m", "elasticps", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            # Own session: a Ctrl-C in a notebook or terminal reaches only us,
            # and we stop the children by PID.
            start_new_session=True,
        )

    def _wait_ready(self, store: JobStore) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.startup_timeout_s
        while True:
            self.check()
            remaining = deadline - time.monotonic()
            try:
                self._ps_addresses = store.ps_addresses(timeout_s=min(0.5, max(remaining, 0.0)))
                if cfg.with_master:
                    self._master_address = store.master_address(timeout_s=0.1)
                return
            except CoordinationError:
                if remaining <= 0:
                    raise CoordinationError(
                        f"the servers of job {cfg.job} were not ready within "
                        f"{cfg.startup_timeout_s:g} s"
                    ) from None
            time.sleep(_POLL_S)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
