"""Training benchmark: samples/s with 2 trainers, elasticps vs torch DDP vs one process.

For each model (``mlp_small`` 784-512-512-10, ``mlp_20m`` 784-4096-4096-10,
``cnn`` = ``examples/mnist_cnn.py``; with ``--models resnet`` also
``examples/mnist_resnet.py``, a residual network with BatchNorm), on the MNIST Parquet files of
``elasticps data mnist`` (4,000 training rows, several epochs; ``mlp_20m``
trains on the first 2,000 rows, as it is 40x slower), and for each training
configuration (``--configs``, each the same on every side):

``sgd64`` (the configuration the targets judge)
    plain SGD (no momentum, no weight decay), lr 0.1, 64 rows per mini-batch
    per trainer. Default cases: ``elasticps-sync-2ps``,
    ``elasticps-sync-2ps-pipelined``, ``elasticps-async1-2ps``,
    ``elasticps-async10-2ps``, ``ddp``, ``compute-2x1``. Time-to-accuracy:
    both up to 10 passes (epochs).
``adam32`` (the configuration of the earlier results)
    Adam, lr 1e-3, 32 rows per mini-batch per trainer. Default cases:
    ``elasticps-sync-2ps``, ``elasticps-async4-2ps``, ``ddp``,
    ``compute-limit``, ``compute-2x1``. Time-to-accuracy: elasticps up to 4
    passes, DDP up to 8 epochs.

the cases are:

``elasticps-sync-1ps`` / ``elasticps-sync-2ps``
    ``elasticps train --trainers 2 --mode sync`` with 1 or 2 PS.
``elasticps-sync-2ps-pipelined``
    The same with ``--overlap-pull on``: pipelined sync steps, each averaging
    gradients computed on the parameters of the step before (information:
    the targets judge exact sync-SGD, ``elasticps-sync-2ps``).
``elasticps-async1-2ps``, ``elasticps-async4-1ps`` / ``elasticps-async4-2ps``,
``elasticps-async10-2ps``
    ``--mode async --push-every N --pull-every N``, N = 1, 4, 10 (1 or 2 PS).
``elasticps-sync-2ps-nobuffers`` / ``elasticps-async4-2ps-nobuffers``
    The same jobs with the model's buffers (BatchNorm statistics) left on
    each trainer instead of carried by the parameter servers (the benchmark
    knob ``ELASTICPS_BENCH_NO_BUFFERS``, see :mod:`elasticps.buffers`; the
    job then trains without a test file, since its saved model lacks the
    buffers): the B side of what carrying buffers costs. Against the
    plain case it gives that cost on ``resnet``, and shows it is nothing on
    ``cnn``, which has no buffers (the summary's ``buffers`` ratios).
``elasticps-sync-2ps-authoff`` / ``elasticps-async1-2ps-authoff``
    The same jobs with ``--auth off``: no job secret, no handshake, no gRPC
    token, no TLS, etcd without TLS. The summary's ``security`` ratios
    (samples/s with the default ``--auth on`` over samples/s with it off)
    give what security costs.
``elasticps-sync-2ps-metricsoff`` / ``elasticps-async1-2ps-metricsoff``
    The same jobs with ``--metrics off``: no role serves or updates its
    Prometheus metrics. The summary's ``metrics`` ratios (on over off) give
    what the metrics cost; with ``--scrape-every-s S``, every target of a job
    with metrics on is scraped every S seconds while it runs, as Prometheus
    would (the scrapes' own CPU, in this process, competes with the job).
``ddp``
    ``torchrun --standalone --nproc_per_node 2 benchmarks/ddp_worker.py``: torch
    DDP over gloo, ``torch.set_num_threads(1)`` per process.
``compute-limit``
    ``benchmarks/ddp_worker.py`` alone: one process, 2 torch threads, the
    total batch of the 2 trainers, no communication.
``compute-2x1``
    Two one-thread ``ddp_worker.py --shard r/2`` processes side by side, each
    with the configuration's rows per step, never synchronising: the rate 2
    trainers would reach if communication were free, each still running the
    optimizer locally. Unlike the 2-thread process it does not collapse when
    other processes load the machine (OpenMP barriers stall when one of their
    threads is preempted).

The default runs both configurations' default cases for the three models,
then time-to-accuracy for each configuration; ``--cases`` gives one case list
for every configuration (``all``: every case). Every case uses the same model
file, seed, optimizer, learning rate and rows per mini-batch per trainer
(the compute limit: the total of the 2 trainers in one step), 1 torch thread
per trainer. elasticps runs the product's defaults otherwise (512 rows per
task, 128 for ``mlp_20m`` so that its timeline has enough steps; periodic PS
checkpoints every 10 s).

Throughput is measured over the steady middle of each run, excluding start-up
and the tail: the time between the moments 15 % and 85 % of the run's samples
were done. For elasticps those moments come from ``run.json``'s ``timeline``
(the launcher polls the master every 0.25 s; samples count when a task is
reported done); for the baselines, from the worker's per-step timestamps.

Time-to-accuracy (``cnn``, target 0.93 test accuracy on the 1,000 test rows),
the same way for both, as DAWNBench's "time to 93 % accuracy": each system
trains once, evaluating on the test rows after every pass (elasticps sync, 2
trainers, 2 PS, ``--eval-each-pass``) or epoch (DDP, stopping at the
target), with the same evaluation code; the figure is the time from
starting the command to the end of the first evaluation that reaches the
target. Process start-up and the evaluations count; what comes after the
target (more passes, elasticps's final checkpoint, tear-down) does not.
``--tta-reps`` repetitions, interleaved elasticps/DDP, DDP/elasticps...;
medians.

Then ``--tta-reps`` runs of the main job (``cnn``, sync, 2 trainers, 2 PS,
no per-pass evaluation) of exactly as many passes as the median
time-to-accuracy run needed: its command's wall time, start-up to exit
(checkpoint, final evaluation and tear-down included), against DDP's whole
run (``command_wall_ratio``, the figure of earlier versions of this
benchmark), and against its own training time (``elasticps_job_overhead_s``
= command wall time minus training time). The training time runs from the
master's log line "first task dispatched by this master" to its "all passes
finished" (``training_s`` in the run lines too).

Every run line also says where the CPU went over the same steady window,
sampled from ``/proc`` every 0.1 s: ``cpu_ms_per_1k_samples`` (CPU
milliseconds, user + system, per 1,000 samples trained, per group of
processes: an elasticps job's ``trainer``, ``ps``, ``master``, ``etcd``,
``launcher`` and ``fork-server``; a baseline's ``command`` and its
``worker`` children; and the ``total``), ``cores_busy`` (the run's CPU
seconds per second) and ``machine_cores_busy`` (the whole machine's). A
case's rate is ``1e6 * cores_busy / total`` samples/s: the figures show
whether a case spends too much CPU per sample or waits.

Repetitions (``--reps``) are interleaved: each repetition runs every
(configuration, case) of a model, in an order rotated by one each time; the
reported figure is the median.

Prints one JSON line per run, one per (configuration, model, case) with the
median, the time-to-accuracy lines (``tta_run``, ``tta_job``, then ``tta``)
of each configuration, one ``"verdict": true`` line per target and
configuration (``counts``: true for ``sgd64``, whose figures the targets
judge; false for the others, information), and a summary line with the
ratios of the medians. Every line names its ``config``.

    .venv/bin/python benchmarks/training.py                  # both configurations, ~20-40 min
    .venv/bin/python benchmarks/training.py --configs sgd64 --reps 3   # the targets' run
    .venv/bin/python benchmarks/training.py --quick          # smoke run, sgd64, ~1-2 min
    .venv/bin/python benchmarks/training.py --smoke          # the test suite's run, one job each

``--smoke`` is ``--quick`` on fewer rows (256 training in 4 tasks, 100 test) where runs
that ``--quick`` starts with the same arguments share one job: every
elasticps job runs with ``--eval-each-pass`` and every DDP run evaluates each
epoch against the (zero) target, so the throughput case, the
time-to-accuracy run and the main-job run of elasticps are one
``elasticps train`` job, and DDP's throughput and time-to-accuracy runs one
``torchrun``. Every line and key of ``--quick`` is printed; its figures mean
nothing (it is there to keep the code paths working).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticps.config import LEDGER_ONLY_ENV
from elasticps.testing import process_cpu_s

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DDP_WORKER = BENCH / "ddp_worker.py"

TRAINERS = 2
WINDOW = (0.15, 0.85)  # steady middle: from 15 % to 85 % of the run's samples
TTA_TARGET = 0.93
JOB_TIMEOUT_S = 900.0
CPU_EVERY_S = 0.1  # how often a run's processes' CPU time is sampled


@dataclass(frozen=True)
class TrainConfig:
    """A training configuration, the same on every side (elasticps, DDP, compute limits).

    Attributes:
        name: short name used in the output (``sgd64``, ``adam32``).
        optimizer: ``sgd`` (plain SGD: no momentum, no weight decay) or
            ``adam``; ``elasticps train --optimizer`` and ``ddp_worker.py
            --optimizer``.
        lr: learning rate, > 0.
        batch: rows per mini-batch per trainer.
        default_cases: the cases run when ``--cases`` is not given.
        tta_elasticps_epochs: passes of an elasticps time-to-accuracy job
            (it runs all of them).
        tta_ddp_epochs: most epochs of a DDP time-to-accuracy run (it stops
            at the target).
    """

    name: str
    optimizer: str
    lr: float
    batch: int
    default_cases: tuple[str, ...]
    tta_elasticps_epochs: int
    tta_ddp_epochs: int


@dataclass(frozen=True)
class ModelCase:
    """A benchmarked model and how long to train it.

    Attributes:
        name: short name used in the output.
        path: the model file.
        epochs: passes over the training rows, for every case (``--scale`` multiplies).
        rows: train on the first ``rows`` rows of the 4,000 (None: all).
        records_per_task: elasticps ``--records-per-task``; smaller tasks give
            the launcher's timeline (one step per task done) a finer grain.
    """

    name: str
    path: Path
    epochs: int
    rows: int | None = None
    records_per_task: int = 512


# Sized so that the fastest cases train for several seconds past start-up on
# the 2-core machine and the whole default run stays near 5 minutes; use
# --scale 2.5 for steady windows of 15 s or more.
MODELS = {
    "mlp_small": ModelCase("mlp_small", BENCH / "models" / "mlp_small.py", epochs=10),
    "mlp_20m": ModelCase(
        "mlp_20m", BENCH / "models" / "mlp_20m.py", epochs=1, rows=2000, records_per_task=128
    ),
    "cnn": ModelCase("cnn", ROOT / "examples" / "mnist_cnn.py", epochs=10),
    "resnet": ModelCase("resnet", ROOT / "examples" / "mnist_resnet.py", epochs=3),
}
DEFAULT_MODELS = ("mlp_small", "mlp_20m", "cnn")
CASES = (
    "elasticps-sync-1ps",
    "elasticps-sync-2ps",
    "elasticps-async1-2ps",
    "elasticps-async10-2ps",
    "elasticps-sync-2ps-pipelined",
    "elasticps-sync-2ps-ledger",
    "elasticps-async4-2ps-ledger",
    "elasticps-sync-2ps-nobuffers",
    "elasticps-async4-2ps-nobuffers",
    "elasticps-sync-2ps-authoff",
    "elasticps-async1-2ps-authoff",
    "elasticps-sync-2ps-metricsoff",
    "elasticps-async1-2ps-metricsoff",
    "elasticps-async4-1ps",
    "elasticps-async4-2ps",
    "ddp",
    "compute-limit",
    "compute-2x1",
)
CONFIGS = {
    # Plain SGD, 64 rows per trainer per mini-batch; the targets are about it.
    "sgd64": TrainConfig(
        "sgd64",
        "sgd",
        0.1,
        64,
        (
            "elasticps-sync-2ps",
            "elasticps-sync-2ps-pipelined",
            "elasticps-async1-2ps",
            "elasticps-async10-2ps",
            "ddp",
            "compute-2x1",
        ),
        # The same cap on both sides: which trainer takes which task varies
        # from run to run, and with it the pass that first reaches the target.
        tta_elasticps_epochs=10,
        tta_ddp_epochs=10,
    ),
    # Adam (lr 1e-3), 32 rows: the configuration of the earlier results.
    "adam32": TrainConfig(
        "adam32",
        "adam",
        1e-3,
        32,
        ("elasticps-sync-2ps", "elasticps-async4-2ps", "ddp", "compute-limit", "compute-2x1"),
        tta_elasticps_epochs=4,
        tta_ddp_epochs=8,
    ),
}
DEFAULT_CONFIGS = ("sgd64", "adam32")
# The configuration whose figures the targets judge; the others' are information.
TARGET_CONFIG = "sgd64"


@dataclass
class Run:
    """The outcome of one run of one case."""

    config: str
    model: str
    case: str
    rep: int
    samples: int
    wall_s: float  # the command, start to exit
    samples_per_s: float | None  # over the steady window
    window_s: float
    accuracy: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> dict[str, Any]:
        return {
            "bench": "training",
            "config": self.config,
            "model": self.model,
            "case": self.case,
            "rep": self.rep,
            "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 1),
            "window_s": round(self.window_s, 2),
            "samples": self.samples,
            "wall_s": round(self.wall_s, 2),
            "accuracy": self.accuracy,
            **self.extra,
        }


def steady_rate(points: Sequence[Sequence[float]]) -> tuple[float | None, float]:
    """Samples/s between the first points at 15 % and 85 % of the final sample count.

    Args:
        points: ``(time s, samples done)`` in time order.

    Returns:
        ``(rate, window seconds)``; rate is None if the window is empty.
    """
    span = steady_span(points)
    if span is None:
        return None, 0.0
    (t0, s0), (t1, s1) = span
    return (s1 - s0) / (t1 - t0), t1 - t0


def steady_span(
    points: Sequence[Sequence[float]],
) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """The steady window's first and last ``(time s, samples done)`` points (see
    :func:`steady_rate`); None if the window is empty."""
    if not points:
        return None
    total = points[-1][1]
    lo = next(p for p in points if p[1] >= WINDOW[0] * total)
    hi = next(p for p in points if p[1] >= WINDOW[1] * total)
    if hi[0] <= lo[0]:
        return None
    return (lo[0], lo[1]), (hi[0], hi[1])


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all cores; idle and iowait excluded)."""
    with open("/proc/stat", "rb") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    """The PIDs of ``pid``'s descendants (Linux ``/proc/PID/task/*/children``).

    Reads only the descendants' own files: 0.3 ms a call here, against 1.5
    ms for :func:`elasticps.testing.child_pids`, which scans all of
    ``/proc``, and the sampler calls it 10 times a second beside the run it
    measures.
    """
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as kids:
                    new = [int(x) for x in kids.read().split()]
            except OSError:
                continue
            found.extend(new)
            todo.extend(new)
    return found


def cpu_group(name: str) -> str:
    """The group of a sampled process: its name without a numeric ``-N`` suffix
    (``trainer-0`` -> ``trainer``, ``fork-server`` stays)."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def cpu_breakdown(
    samples: Sequence[Sequence[Any]], t0: float, t1: float, rate: float
) -> dict[str, Any]:
    """CPU use in the window ``[t0, t1]`` (unix seconds) of a run training ``rate`` samples/s.

    Args:
        samples: :attr:`CpuSampler.samples`.

    Returns:
        ``cpu_ms_per_1k_samples``: CPU milliseconds per 1,000 samples
        trained, per process group and in ``total``; ``cores_busy``: the
        run's processes' CPU seconds per second; ``machine_cores_busy``: the
        whole machine's. Empty if fewer than 2 samples fall in the window.
    """
    inside = [x for x in samples if t0 <= x[0] <= t1]
    if len(inside) < 2 or rate <= 0:
        return {}
    (a_t, a_busy, _), (b_t, b_busy, _) = inside[0], inside[-1]
    groups: dict[str, float] = {}
    last: dict[str, float] = {}  # name -> CPU s at its previous sample
    for _, _, cpu in inside:
        for name, seconds in cpu.items():
            before = last.get(name, seconds)
            # A lower figure: the name's process was restarted (a new PID).
            used = seconds - before if seconds >= before else seconds
            group = cpu_group(name)
            groups[group] = groups.get(group, 0.0) + used
            last[name] = seconds
    trained = rate * (b_t - a_t)
    per_1k = {g: round(c / trained * 1e6, 1) for g, c in sorted(groups.items())}
    per_1k["total"] = round(sum(groups.values()) / trained * 1e6, 1)
    return {
        "cpu_ms_per_1k_samples": per_1k,
        "cores_busy": round(sum(groups.values()) / (b_t - a_t), 2),
        "machine_cores_busy": round((b_busy - a_busy) / (b_t - a_t), 2),
    }


class CpuSampler:
    """Samples the CPU time of a run's processes every :data:`CPU_EVERY_S`, on a thread.

    Args:
        pids: called at every sample; process name -> PID (a job's roles
            appear once its launcher has written ``pids.json``), grouped by
            :func:`cpu_group`.

    A process's CPU time counts from its first sample in a window.
    """

    def __init__(self, pids: Callable[[], Mapping[str, int]]) -> None:
        self._pids = pids
        self._stop = threading.Event()
        # (unix time s, machine busy CPU s, {name: CPU s})
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            now = time.time()
            cpu = {}
            for name, pid in self._pids().items():
                with contextlib.suppress(OSError):  # gone
                    cpu[name] = process_cpu_s(pid)
            self.samples.append((now, machine_busy_s(), cpu))
            if self._stop.wait(CPU_EVERY_S):
                return


FIRST_TASK_LOG = "first task dispatched by this master"
ALL_PASSES_LOG = "all passes finished"


def training_seconds(master_log: Path) -> float | None:
    """Seconds from the master's first task dispatched to its "all passes finished".

    The training time of a job (its first mini-batch to its last report), from
    the master's log lines, whose timestamps are local time with
    milliseconds. None if either line is missing (a master failover, say).
    """
    import datetime

    stamps: dict[str, float] = {}
    try:
        lines = master_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for text in lines:
        for key in (FIRST_TASK_LOG, ALL_PASSES_LOG):
            if key in text and key not in stamps:
                stamp = datetime.datetime.strptime(text[:23], "%Y-%m-%d %H:%M:%S,%f")
                stamps[key] = stamp.timestamp()
    if len(stamps) < 2:
        return None
    return round(stamps[ALL_PASSES_LOG] - stamps[FIRST_TASK_LOG], 2)


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


class Scraper:
    """Scrapes every target of ``OUTPUT/prometheus-targets.json`` every ``every_s``
    seconds on a thread, as a Prometheus server would, until :meth:`stop`."""

    def __init__(self, output: Path, every_s: float) -> None:
        self.output = output
        self.every_s = every_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from elasticps.jobs import scrape_targets

        while not self._stop.wait(self.every_s):
            for role in ("launcher", "master", "ps", "trainer"):
                self.scrapes += sum(1 for _ in scrape_targets(self.output, role))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Runner:
    """Starts the benchmark's subprocesses, each in its own session, and stops them by PID.

    Args:
        workdir: where every run gets a directory (logs, checkpoints, results).
        full_data: the directory written by ``elasticps data mnist``.
        test_rows: evaluate on only the first ``test_rows`` test rows (None: all).
        share_target: ``--smoke``: not None, every elasticps job runs with
            ``--eval-each-pass`` and every DDP run evaluates each epoch against
            this target accuracy, and a run asked for again with the same
            arguments returns the first one's results (and start time) instead
            of running again.
    """

    def __init__(
        self,
        workdir: Path,
        full_data: Path,
        test_rows: int | None = None,
        share_target: float | None = None,
        scrape_every_s: float = 0.0,
    ) -> None:
        self.workdir = workdir
        self.scrape_every_s = scrape_every_s
        self.full_data = full_data
        self.test_rows = test_rows
        self.share_target = share_target
        self.counter = 0
        # Unix time (seconds) at which the last command was started.
        self.last_started = 0.0
        # The CPU samples of the last command(s) run.
        self.last_cpu = CpuSampler(dict)
        self._subsets: dict[int | None, Path] = {}
        # share_target: results of the runs so far, with their start times.
        self._shared: dict[tuple[Any, ...], tuple[Any, float]] = {}

    def _recall(self, key: tuple[Any, ...]) -> Any:
        """With ``share_target``: the results of an earlier run of ``key`` (None: none)."""
        if self.share_target is None or key not in self._shared:
            return None
        result, started = self._shared[key]
        self.last_started = started
        return json.loads(json.dumps(result))  # a copy: callers may change it

    def _remember(self, key: tuple[Any, ...], result: Any) -> None:
        if self.share_target is not None:
            self._shared[key] = (json.loads(json.dumps(result)), self.last_started)

    def data_dir(self, rows: int | None, *, train_only: bool = False) -> Path:
        """A data directory whose train.parquet holds the first ``rows`` rows (None: all).

        With ``train_only``, the directory has no test.parquet (no evaluation).
        """
        if train_only:
            lone = self.workdir / f"mnist-{rows or 'all'}-train-only"
            if not lone.exists():
                lone.mkdir()
                (lone / "train.parquet").symlink_to(self.data_dir(rows) / "train.parquet")
            return lone
        if rows is None and self.test_rows is None:
            return self.full_data
        if rows not in self._subsets:
            import pyarrow.parquet as pq

            subset = self.workdir / f"mnist-{rows or 'all'}"
            subset.mkdir()
            for name, keep in (("train", rows), ("test", self.test_rows)):
                table = pq.read_table(self.full_data / f"{name}.parquet")
                if keep is not None:
                    table = table.slice(0, keep)
                # The same row-group size as `elasticps data mnist`.
                pq.write_table(table, subset / f"{name}.parquet", row_group_size=256)
            self._subsets[rows] = subset
        return self._subsets[rows]

    def _run(
        self,
        cmd: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        pids_file: Path | None = None,
    ) -> tuple[str, float]:
        """Run ``cmd`` to the end; returns its stdout and wall time. Raises on failure."""
        outs, wall = self._run_together([cmd], [log], env=env, pids_file=pids_file)
        return outs[0], wall

    def _run_together(
        self,
        cmds: list[list[str]],
        logs: list[Path],
        env: dict[str, str] | None = None,
        pids_file: Path | None = None,
    ) -> tuple[list[str], float]:
        """Run ``cmds`` side by side to the end; returns their stdouts and the wall time.

        The processes' CPU time is sampled meanwhile (:attr:`last_cpu`): an
        elasticps job's roles from its ``pids_file`` and its launcher
        (``launcher``), else each command (``command``) and its descendants
        (``worker``).
        """
        env = {**os.environ, **(env or {})}
        env["PYTHONUNBUFFERED"] = "1"
        self.last_started = time.time()
        t0 = time.monotonic()
        procs: list[subprocess.Popen[bytes]] = []
        outs: list[str] = []

        def pids() -> dict[str, int]:
            if pids_file is not None:
                try:
                    roles = json.loads(pids_file.read_text())
                except (OSError, ValueError):
                    roles = {}
                return {**roles, "launcher": procs[0].pid}
            found = {f"command-{i}": p.pid for i, p in enumerate(procs)}
            for p in procs:
                found.update({f"worker-{pid}": pid for pid in children_of(p.pid)})
            return found

        self.last_cpu = CpuSampler(pids)
        try:
            for cmd, log in zip(cmds, logs, strict=True):
                with open(log, "wb") as err:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdout=subprocess.PIPE,
                            stderr=err,
                            stdin=subprocess.DEVNULL,
                            env=env,
                            start_new_session=True,
                        )
                    )
            with self.last_cpu:
                for proc in procs:
                    outs.append(proc.communicate(timeout=JOB_TIMEOUT_S)[0].decode())
        except BaseException:
            for proc in procs:
                self._stop(proc)
            raise
        wall = time.monotonic() - t0
        for cmd, log, proc in zip(cmds, logs, procs, strict=True):
            if proc.returncode != 0:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{' '.join(cmd[:5])} ... exited {proc.returncode}:\n{tail}")
        return outs, wall

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes]) -> None:
        # SIGTERM first: the launcher then stops its own children by PID, and
        # torchrun its workers. Then SIGKILL the process group we created for it.
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def _out_dir(self, name: str) -> Path:
        self.counter += 1
        path = self.workdir / f"{self.counter:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def elasticps(
        self,
        model: ModelCase,
        tc: TrainConfig,
        *,
        mode: str,
        num_ps: int,
        epochs: int,
        every: int = 1,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        train_only: bool = False,
    ) -> tuple[dict[str, Any], dict[str, Any], float]:
        """One ``elasticps train`` job; returns its JSON line, its run.json and its wall time."""
        if self.share_target is not None and "--eval-each-pass" not in extra:
            extra = (*extra, "--eval-each-pass")
        key = ("elasticps", model, tc.name, mode, num_ps, epochs, every, tuple(extra),
               tuple(sorted((env or {}).items())), train_only)  # fmt: skip
        shared = self._recall(key)
        if shared is not None:
            return tuple(shared)  # type: ignore[return-value]
        out = self._out_dir(f"{tc.name}-{model.name}-{mode}{every}-{num_ps}ps")
        job = f"bench{os.getpid()}-{self.counter}"
        cmd = [
            sys.executable, "-m", "elasticps", "train",
            "--model", str(model.path),
            "--data", str(self.data_dir(model.rows, train_only=train_only)),
            "--trainers", str(TRAINERS),
            "--ps", str(num_ps),
            "--mode", mode,
            "--push-every", str(every),
            "--pull-every", str(every),
            "--batch-size", str(tc.batch),
            "--optimizer", tc.optimizer,
            "--lr", str(tc.lr),
            "--threads", "1",
            "--epochs", str(epochs),
            "--records-per-task", str(model.records_per_task),
            "--no-progress",
            "--job", job,
            "--output", str(out / "job"),
            *extra,
        ]  # fmt: skip
        scraper = None
        if self.scrape_every_s > 0 and "--metrics" not in extra:
            scraper = Scraper(out / "job", self.scrape_every_s)
        try:
            stdout, wall = self._run(
                cmd, out / "job.log", env=env, pids_file=out / "job" / "pids.json"
            )
        finally:
            if scraper is not None:
                scraper.stop()
            self._reap(out / "job" / "pids.json", job)
        line = json.loads(stdout.strip().splitlines()[-1])
        line["cpu_samples"] = self.last_cpu.samples
        if scraper is not None:
            line["scrapes"] = scraper.scrapes
        record = json.loads((out / "job" / "run.json").read_text())
        line["training_s"] = training_seconds(out / "job" / "logs" / "master-0.log")
        self._remember(key, [line, record, wall])
        return line, record, wall

    @staticmethod
    def _reap(pids_file: Path, job: str) -> None:
        """Back-up for a failed run: SIGKILL any process of the job still alive.

        The launcher stops its children itself. A PID from ``pids.json`` is
        killed only if its command line still names this job, so a PID reused
        by an unrelated process is left alone.
        """
        if not pids_file.exists():
            return
        try:
            pids = [int(pid) for pid in json.loads(pids_file.read_text()).values()]
        except (ValueError, TypeError, OSError):
            return
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone
            if job.encode() in cmdline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def baseline(
        self,
        model: ModelCase,
        tc: TrainConfig,
        *,
        ddp: bool,
        epochs: int,
        target: float | None = None,
    ) -> tuple[dict[str, Any], float]:
        """One DDP (torchrun, 2 workers) or single-process run; returns its result and wall."""
        if self.share_target is not None and ddp:
            target = self.share_target
        key = ("baseline", model, tc.name, ddp, epochs, target)
        shared = self._recall(key)
        if shared is not None:
            return shared[0], shared[1]
        out = self._out_dir(f"{tc.name}-{model.name}-{'ddp' if ddp else 'single'}")
        worker_args = [
            str(DDP_WORKER),
            "--model", str(model.path),
            "--data", str(self.data_dir(model.rows)),
            "--epochs", str(epochs),
            "--optimizer", tc.optimizer,
            "--lr", str(tc.lr),
            "--out", str(out / "result.json"),
        ]  # fmt: skip
        if target is not None:
            worker_args += ["--eval-each-epoch", "--target-accuracy", str(target)]
        if ddp:
            torchrun = Path(sys.executable).with_name("torchrun")
            cmd = [
                str(torchrun), "--standalone", "--nproc_per_node", str(TRAINERS),
                *worker_args, "--threads", "1", "--batch-size", str(tc.batch),
            ]  # fmt: skip
        else:
            cmd = [
                sys.executable, *worker_args,
                "--threads", str(TRAINERS), "--batch-size", str(TRAINERS * tc.batch),
            ]  # fmt: skip
        _, wall = self._run(cmd, out / "worker.log")
        result = json.loads((out / "result.json").read_text())
        result["cpu_samples"] = self.last_cpu.samples
        self._remember(key, [result, wall])
        return result, wall

    def independent(
        self, model: ModelCase, tc: TrainConfig, *, epochs: int
    ) -> tuple[list[dict[str, Any]], float]:
        """Two one-thread processes side by side, each on its half of the rows, no sync."""
        out = self._out_dir(f"{tc.name}-{model.name}-2x1")
        common = [
            sys.executable, str(DDP_WORKER),
            "--model", str(model.path),
            "--data", str(self.data_dir(model.rows)),
            "--epochs", str(epochs),
            "--optimizer", tc.optimizer,
            "--lr", str(tc.lr),
            "--threads", "1",
            "--batch-size", str(tc.batch),
        ]  # fmt: skip
        cmds = [
            [*common, "--shard", f"{rank}/{TRAINERS}", "--out", str(out / f"result{rank}.json")]
            for rank in range(TRAINERS)
        ]
        _, wall = self._run_together(cmds, [out / f"worker{r}.log" for r in range(TRAINERS)])
        results = [json.loads((out / f"result{r}.json").read_text()) for r in range(TRAINERS)]
        results[0]["cpu_samples"] = self.last_cpu.samples  # of both processes
        return results, wall


_VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    # Each step's gradients computed one version before it.
    "pipelined": ("--overlap-pull", "on"),
    # The job without its secret (the B side of what security costs).
    "authoff": ("--auth", "off"),
    # No role serves metrics (the B side of what they cost).
    "metricsoff": ("--metrics", "off"),
}
"""``elasticps train`` flags of a case's variant (``elasticps-sync-2ps-<variant>``)."""


def run_case(
    runner: Runner, model: ModelCase, tc: TrainConfig, case: str, *, rep: int, epochs: int
) -> Run:
    """Run one throughput case once."""
    load = round(os.getloadavg()[0], 2)
    if case.startswith("elasticps-"):
        _, mode_every, ps, *variant = case.split("-")
        mode = "sync" if mode_every == "sync" else "async"
        every = 1 if mode == "sync" else int(mode_every.removeprefix("async"))
        # "-ledger": the exactly-once machinery off (the A side of its cost);
        # "-nobuffers": buffers left on the trainers (the B side of carrying them).
        env = {LEDGER_ONLY_ENV: "1"} if variant == ["ledger"] else None
        if variant == ["nobuffers"]:
            # Imported here: elasticps.buffers imports torch, which this process never uses.
            from elasticps.buffers import NO_BUFFERS_ENV

            env = {NO_BUFFERS_ENV: "1"}
        line, record, wall = runner.elasticps(
            model,
            tc,
            mode=mode,
            num_ps=int(ps.removesuffix("ps")),
            epochs=epochs,
            every=every,
            extra=_VARIANT_FLAGS.get("-".join(variant), ()),
            env=env,
            train_only=variant == ["nobuffers"],
        )
        points = [(t, s) for t, _, s in record["timeline"]]
        rate, window = steady_rate(points)
        return Run(
            tc.name, model.name, case, rep, int(line["samples_trained"]), wall, rate, window,
            line.get("accuracy"),
            {"job_wall_s": line["wall_s"], "training_s": line["training_s"],
             "loadavg_before": load, **_cpu_in(line["cpu_samples"], [points]),
             **({"scrapes": line["scrapes"]} if "scrapes" in line else {})},
        )  # fmt: skip
    if case == "compute-2x1":
        results, wall = runner.independent(model, tc, epochs=epochs)
        rates = [steady_rate(r["steps"]) for r in results]
        total = None if any(r is None for r, _ in rates) else sum(r or 0.0 for r, _ in rates)
        return Run(
            tc.name, model.name, case, rep, sum(int(r["samples"]) for r in results), wall, total,
            min(w for _, w in rates), None,
            {"loadavg_before": load,
             **_cpu_in(results[0]["cpu_samples"], [r["steps"] for r in results])},
        )  # fmt: skip
    result, wall = runner.baseline(model, tc, ddp=case == "ddp", epochs=epochs)
    rate, window = steady_rate(result["steps"])
    return Run(
        tc.name, model.name, case, rep, int(result["samples"]), wall, rate, window, None,
        {"startup_s": round(result["ready"] - result["started"], 2), "loadavg_before": load,
         **_cpu_in(result["cpu_samples"], [result["steps"]])},
    )  # fmt: skip


def _cpu_in(
    samples: Sequence[Sequence[Any]], timelines: Sequence[Sequence[Sequence[float]]]
) -> dict[str, Any]:
    """:func:`cpu_breakdown` over the steady windows' overlap of ``timelines``
    (each ``(time s, samples done)``; their rates add up)."""
    spans = [steady_span(points) for points in timelines]
    if any(span is None for span in spans):
        return {}
    t0 = max(span[0][0] for span in spans if span is not None)
    t1 = min(span[1][0] for span in spans if span is not None)
    rate = sum((b[1] - a[1]) / (b[0] - a[0]) for a, b in (span for span in spans if span))
    return cpu_breakdown(samples, t0, t1, rate) if t1 > t0 else {}


def time_to_accuracy(
    runner: Runner,
    model: ModelCase,
    tc: TrainConfig,
    target: float,
    *,
    ddp_epochs: int,
    elasticps_epochs: int,
    reps: int,
) -> dict[str, Any]:
    """Time-to-accuracy of elasticps sync (2 PS) and DDP; see the module docstring."""
    result: dict[str, Any] = {"bench": "training", "tta": True, "config": tc.name}
    result["model"] = model.name
    result["target_accuracy"] = target
    mine: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for rep in range(reps):
        for side in ("elasticps", "ddp") if rep % 2 == 0 else ("ddp", "elasticps"):
            if side == "elasticps":
                _, record, wall = runner.elasticps(
                    model, tc, mode="sync", num_ps=2, epochs=elasticps_epochs,
                    extra=("--eval-each-pass",),
                )  # fmt: skip
                evals = record["pass_evaluations"]
            else:
                ddp, wall = runner.baseline(model, tc, ddp=True, epochs=ddp_epochs, target=target)
                evals = [{**e, "pass_id": e["epoch"] - 1} for e in ddp["evals"]]
            reached = [e for e in evals if e["accuracy"] >= target]
            first = min(reached, key=lambda e: e["pass_id"]) if reached else None
            run = {
                "rep": rep,
                "time_to_target_s": None
                if first is None
                else round(first["time"] - runner.last_started, 2),
                "epochs": None if first is None else first["pass_id"] + 1,
                "accuracy_per_epoch": [round(e["accuracy"], 4) for e in evals],
                "command_wall_s": round(wall, 2),
            }
            (mine if side == "elasticps" else theirs).append(run)
            _emit(
                {"bench": "training", "tta_run": side, "config": tc.name, "model": model.name,
                 **run}
            )  # fmt: skip
    for name, runs in (("elasticps", mine), ("ddp", theirs)):
        times = [r["time_to_target_s"] for r in runs]
        result[f"{name}_time_to_target_s"] = (
            None if None in times else round(statistics.median(times), 2)
        )
        result[f"{name}_runs"] = runs
    if result["elasticps_time_to_target_s"] and result["ddp_time_to_target_s"]:
        result["elasticps_over_ddp"] = round(
            result["elasticps_time_to_target_s"] / result["ddp_time_to_target_s"], 3
        )
    # Whole commands (the figure of earlier versions of this benchmark), and
    # the main job's overhead: the command's wall time over its training time.
    needed = [r["epochs"] for r in mine if r["epochs"] is not None]
    if needed:
        epochs = round(statistics.median(needed))
        jobs = []
        for rep in range(reps):
            line, _, wall = runner.elasticps(model, tc, mode="sync", num_ps=2, epochs=epochs)
            job = {
                "rep": rep,
                "command_wall_s": round(wall, 2),
                "job_wall_s": line["wall_s"],
                "training_s": line["training_s"],
                "overhead_s": None
                if line["training_s"] is None
                else round(wall - line["training_s"], 2),
            }
            jobs.append(job)
            _emit(
                {"bench": "training", "tta_job": True, "config": tc.name, "model": model.name,
                 "epochs": epochs, **job}
            )  # fmt: skip
        result["elasticps_job_epochs"] = epochs
        result["elasticps_job_wall_s"] = round(
            statistics.median(j["command_wall_s"] for j in jobs), 2
        )
        result["ddp_wall_s"] = round(statistics.median(r["command_wall_s"] for r in theirs), 2)
        result["command_wall_ratio"] = round(
            result["elasticps_job_wall_s"] / result["ddp_wall_s"], 3
        )
        overheads = [j["overhead_s"] for j in jobs if j["overhead_s"] is not None]
        if overheads:
            result["elasticps_job_training_s"] = round(
                statistics.median(j["training_s"] for j in jobs if j["training_s"] is not None), 2
            )
            result["elasticps_job_overhead_s"] = round(statistics.median(overheads), 2)
    return result


# The targets: (model, elasticps case, reference case, least ratio of the medians).
THROUGHPUT_TARGETS = (
    ("mlp_small", "elasticps-sync-2ps", "ddp", 1.2),
    ("mlp_small", "elasticps-async1-2ps", "ddp", 1.5),
    ("mlp_small", "elasticps-async1-2ps", "compute-2x1", 0.6),
    ("mlp_20m", "elasticps-sync-2ps", "ddp", 1.2),
    ("mlp_20m", "elasticps-async1-2ps", "compute-2x1", 0.9),
    ("cnn", "elasticps-sync-2ps", "ddp", 1.2),
)
TTA_TARGET_RATIO = 1.0  # elasticps's time to the target accuracy over DDP's, at most
OVERHEAD_TARGET_S = 2.0  # the main job's command wall time minus its training time, at most


def verdicts(
    config: str,
    medians: dict[str, dict[str, float]],
    tta: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """One verdict per target for ``config``: the ratio of the medians and whether it is met.

    ``counts`` is True for the target configuration (``TARGET_CONFIG``), False
    for the others (information). ``met`` is None when the run lacks a case.
    """
    out: list[dict[str, Any]] = []
    base = {"bench": "training", "verdict": True, "config": config}
    base["counts"] = config == TARGET_CONFIG
    for model, case, ref, least in THROUGHPUT_TARGETS:
        m = medians.get(model, {})
        value = round(m[case] / m[ref], 3) if case in m and ref in m else None
        out.append(
            {
                **base,
                "target": f"{model} {case} >= {least}x {ref}",
                "value": value,
                "met": None if value is None else value >= least,
            }
        )
    tta_ratio = None if tta is None else tta.get("elasticps_over_ddp")
    tta_model = "cnn" if tta is None else tta["model"]
    tta_target = TTA_TARGET if tta is None else tta["target_accuracy"]
    out.append(
        {
            **base,
            "target": f"{tta_model} time to {tta_target} accuracy <= {TTA_TARGET_RATIO}x ddp",
            "value": tta_ratio,
            "met": None if tta_ratio is None else tta_ratio <= TTA_TARGET_RATIO,
        }
    )
    overhead = None if tta is None else tta.get("elasticps_job_overhead_s")
    out.append(
        {
            **base,
            "target": f"main job ({tta_model} sync, 2 trainers, 2 PS) command wall time "
            f"<= training time + {OVERHEAD_TARGET_S} s",
            "value": overhead,
            "training_s": None if tta is None else tta.get("elasticps_job_training_s"),
            "command_wall_s": None if tta is None else tta.get("elasticps_job_wall_s"),
            "met": None if overhead is None else overhead <= OVERHEAD_TARGET_S,
        }
    )
    return out


def _variant_ratios(
    medians: dict[str, dict[str, dict[str, float]]], cases: Sequence[str], variant: str
) -> dict[str, dict[str, dict[str, float]]]:
    """``{config: {model: {case: rate of case / rate of case-variant}}}`` where both ran."""
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for config, per_model in medians.items():
        for model, m in per_model.items():
            for case in cases:
                if case in m and f"{case}-{variant}" in m:
                    ratios.setdefault(config, {}).setdefault(model, {})[case] = round(
                        m[case] / m[f"{case}-{variant}"], 3
                    )
    return ratios


def summarize(
    runs: list[Run],
    ttas: dict[str, dict[str, Any]],
    configs: Sequence[str],
    models: Sequence[str],
) -> None:
    """Print the per-case medians, the verdicts and the summary line with the ratios."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for config in configs:
        for model in models:
            for case in CASES:
                rates = [
                    r.samples_per_s
                    for r in runs
                    if r.config == config and r.model == model and r.case == case
                ]
                values = [x for x in rates if x is not None]
                if not values:
                    continue
                med = statistics.median(values)
                medians.setdefault(config, {}).setdefault(model, {})[case] = round(med, 1)
                _emit(
                    {
                        "bench": "training",
                        "config": config,
                        "model": model,
                        "case": case,
                        "median": True,
                        "samples_per_s": round(med, 1),
                        "runs": len(values),
                        "all": [round(x, 1) for x in values],
                    }
                )
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for config, per_model in medians.items():
        for model, m in per_model.items():
            for case, rate in m.items():
                if not case.startswith("elasticps-"):
                    continue
                for base in ("ddp", "compute-limit", "compute-2x1"):
                    if base in m:
                        ratios.setdefault(config, {}).setdefault(model, {})[f"{case}/{base}"] = (
                            round(rate / m[base], 3)
                        )
    checks: dict[str, bool | None] = {}
    for config in configs:
        for v in verdicts(config, medians.get(config, {}), ttas.get(config)):
            _emit(v)
            checks[f"{config}: {v['target']}"] = v["met"]
    # What carrying buffers costs: samples/s with them over samples/s without.
    buffers = _variant_ratios(medians, ("elasticps-sync-2ps", "elasticps-async4-2ps"), "nobuffers")
    for config in medians:
        for case, ratio in buffers.get(config, {}).get("cnn", {}).items():
            checks[f"{config}: cnn {case} carrying buffers costs <= 2%"] = ratio >= 0.98
    # What security costs: samples/s with --auth on (the default) over --auth off.
    security = _variant_ratios(medians, ("elasticps-sync-2ps", "elasticps-async1-2ps"), "authoff")
    # What the metrics cost: samples/s with --metrics on (the default) over off.
    metrics = _variant_ratios(medians, ("elasticps-sync-2ps", "elasticps-async1-2ps"), "metricsoff")
    tta_keys = (
        "elasticps_time_to_target_s",
        "ddp_time_to_target_s",
        "elasticps_over_ddp",
        "elasticps_job_wall_s",
        "elasticps_job_training_s",
        "elasticps_job_overhead_s",
        "ddp_wall_s",
        "command_wall_ratio",
        "target_accuracy",
    )
    _emit(
        {
            "summary": True,
            "bench": "training",
            "target_config": TARGET_CONFIG,
            "samples_per_s": medians,
            "ratios": ratios,
            "time_to_accuracy": {c: {k: t.get(k) for k in tta_keys} for c, t in ttas.items()},
            "buffers": buffers,
            "security": security,
            "metrics": metrics,
            "targets": checks,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default=None, help=f"comma-separated (default {','.join(DEFAULT_MODELS)})"
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, from {', '.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})",
    )
    parser.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated, or 'all', for every configuration; from {', '.join(CASES)} "
        "(default: each configuration's own set, see the module docstring)",
    )
    parser.add_argument("--reps", type=int, default=1, help="interleaved repetitions")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every model's epochs")
    parser.add_argument("--no-tta", action="store_true", help="skip time-to-accuracy")
    parser.add_argument(
        "--tta-reps", type=int, default=3, help="interleaved time-to-accuracy repetitions"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep every run's files here")
    parser.add_argument(
        "--scrape-every-s",
        type=float,
        default=0.0,
        help="scrape every metrics target of each elasticps job with metrics on every this "
        "many seconds while it runs (default 0: none)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: small MLP on 512 rows, 1 epoch, one case of each kind, sgd64 only "
        "(~1-2 min); with --models, --configs or --cases, those on 512 rows, 1 epoch",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: --quick on 256 rows in 4 tasks, where the runs of the same "
        "arguments share one job (one elasticps job, one torchrun, one compute-limit run); its "
        "figures mean nothing",
    )
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    # SIGTERM unwinds like Ctrl-C, so that every process started here is stopped.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    model_names = args.models or ",".join(DEFAULT_MODELS)
    models = [MODELS[name] for name in _choices(parser, model_names, tuple(MODELS), "model")]
    config_names = args.configs or ",".join(DEFAULT_CONFIGS)
    configs = [CONFIGS[n] for n in _choices(parser, config_names, tuple(CONFIGS), "config")]
    cases_of: dict[str, list[str]] = {}
    for tc in configs:
        if args.cases == "all":
            cases_of[tc.name] = list(CASES)
        elif args.cases:
            cases_of[tc.name] = _choices(parser, args.cases, CASES, "case")
        else:
            cases_of[tc.name] = list(tc.default_cases)
    tta_model, target, tta_reps = MODELS["cnn"], TTA_TARGET, args.tta_reps
    tta_epochs = {tc.name: (tc.tta_ddp_epochs, tc.tta_elasticps_epochs) for tc in configs}
    test_rows = None
    if args.quick:
        chosen = models if args.models else [MODELS["mlp_small"]]
        # --smoke: 4 tasks of one step per trainer, so that the timeline has a window.
        rows, per_task = (256, 64) if args.smoke else (512, 512)
        models = [ModelCase(m.name, m.path, 1, rows, per_task) for m in chosen]
        if not args.configs:
            configs = configs[:1]
        if not args.cases:
            cases_of = {tc.name: ["elasticps-sync-2ps", "ddp", "compute-limit"] for tc in configs}
        # Target 0 is reached after one epoch: the code path runs at the cost
        # of one 1-epoch job of each kind, and one more elasticps job.
        tta_model, target, tta_reps, test_rows = models[0], 0.0, 1, 100 if args.smoke else 200
        tta_epochs = {tc.name: (1, 1) for tc in configs}

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="elasticps-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    failures = 0
    _emit(
        {
            "bench": "training",
            "start": True,
            "models": [m.name for m in models],
            "configs": {
                tc.name: {
                    "optimizer": tc.optimizer,
                    "lr": tc.lr,
                    "rows_per_trainer_step": tc.batch,
                    "cases": cases_of[tc.name],
                }
                for tc in configs
            },
            "reps": args.reps,
            "scale": args.scale,
            "smoke": args.smoke,
            "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "workdir": str(workdir),
            "job_prefix": f"bench{os.getpid()}-",
        }
    )
    try:
        from elasticps.data.mnist import prepare_mnist

        full = workdir / "mnist"
        prepare_mnist(full)  # what `elasticps data mnist` writes
        runner = Runner(
            workdir,
            full,
            test_rows,
            share_target=target if args.smoke else None,
            scrape_every_s=args.scrape_every_s,
        )
        runs: list[Run] = []
        for model in models:
            epochs = max(1, round(model.epochs * args.scale))
            # Every repetition runs each configuration's cases, configurations
            # and cases in an order rotated by one each time.
            pairs = [(tc, case) for tc in configs for case in cases_of[tc.name]]
            for rep in range(args.reps):
                shift = rep % len(pairs)
                for tc, case in pairs[shift:] + pairs[:shift]:
                    try:
                        run = run_case(runner, model, tc, case, rep=rep, epochs=epochs)
                    except (RuntimeError, OSError, ValueError, KeyError) as exc:
                        # Report and go on with the other cases; exit 1 at the end.
                        failures += 1
                        _emit(
                            {
                                "bench": "training",
                                "config": tc.name,
                                "model": model.name,
                                "case": case,
                                "rep": rep,
                                "error": str(exc)[-2000:],
                            }
                        )
                        continue
                    runs.append(run)
                    _emit(run.line())
        ttas: dict[str, dict[str, Any]] = {}
        if not args.no_tta:
            for tc in configs:
                ddp_epochs, elasticps_epochs = tta_epochs[tc.name]
                tta = time_to_accuracy(
                    runner,
                    tta_model,
                    tc,
                    target,
                    ddp_epochs=ddp_epochs,
                    elasticps_epochs=elasticps_epochs,
                    reps=tta_reps,
                )
                ttas[tc.name] = tta
                _emit(tta)
        summarize(runs, ttas, [tc.name for tc in configs], [m.name for m in models])
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


def _choices(
    parser: argparse.ArgumentParser, value: str, allowed: Sequence[str], what: str
) -> list[str]:
    names = value.split(",")
    for name in names:
        if name not in allowed:
            parser.error(f"unknown {what} {name!r}; choose from {', '.join(allowed)}")
    return names


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
