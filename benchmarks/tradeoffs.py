"""Sync vs async vs bounded staleness, measured on MNIST: accuracy and samples/s.

Runs real ``elasticps train`` jobs (2 trainers, 2 parameter servers, the MLP
of ``examples/mnist_mlp.py``, Adam with lr 1e-3, 32 rows per mini-batch per
trainer, one torch thread per trainer, 256 rows per task, the same
``--seed`` and ``--epochs`` everywhere) on the Parquet files of
``elasticps data mnist``, one job at a time. The cases:

``sync``
    ``--mode sync``: a PS step waits for a gradient from every live trainer.
``async1``
    ``--mode async --push-every 1 --pull-every 1``.
``async4``
    ``--mode async --push-every 4 --pull-every 4``.
``async1-sN`` / ``async4-sN``
    The same with ``--max-staleness N`` (for each N of ``--staleness``), only
    if ``elasticps train --help`` offers that flag; otherwise one line
    ``{"skipped": ..., "reason": "no --max-staleness flag"}`` is printed.

Repetitions are interleaved (every case once, then again in an order rotated
by one), so that a busy machine hurts every case alike.

Prints one JSON line per run:

``case``, ``rep``, ``mode``, ``push_every``, ``pull_every``, ``max_staleness``
    what ran;
``accuracy``, ``loss``
    the job's own final evaluation on the 1,000 rows of ``test.parquet``;
``samples_trained``, ``job_wall_s``, ``command_wall_s``
    from the job's JSON line (launch to checkpoint, seconds) and around the
    whole command (with start-up, evaluation and tear-down, seconds);
``samples_per_s``
    training rate over the steady middle of the run: samples between the
    moments 15 % and 85 % of the run's samples were done, from ``run.json``'s
    ``timeline`` (samples count when a task is reported done);
``params_sha256``
    SHA-256 of the final ``model.safetensors`` (first 16 hex digits), to see
    which repeats ended with bit-identical parameters;
``model_versions``, ``pushes_sent``, ``dropped_share``
    each shard's final model version; in async mode the pushes sent by all
    trainers together, and the share of them the shards dropped as too stale
    (every applied push bumps a shard's version);
``loadavg``
    the 1-minute load average before the run.

then one summary line per case with the median, minimum and maximum of
``accuracy``, ``loss`` and ``samples_per_s`` and the number of distinct
parameter hashes, and with ``--markdown`` a Markdown table on stderr.

    .venv/bin/elasticps data mnist --output /tmp/c-mnist
    .venv/bin/python benchmarks/tradeoffs.py --data /tmp/c-mnist --epochs 3 --reps 2
    .venv/bin/python benchmarks/tradeoffs.py --data /tmp/c-mnist --quick   # smoke, 1-3 min

A failed job is retried once; if it fails again, a line
``{"case", "rep", "error"}`` is printed and the grid goes on (the summary
counts the successful runs). To measure a fixed copy of the code while the
tree is being edited, put it first on the path:
``PYTHONPATH=/tmp/snapshot/src .venv/bin/python benchmarks/tradeoffs.py ...``
(the launcher passes the environment to every role process).

Every process is started by this script or by the launcher it starts, and
stopped by PID: the launcher stops its children; if a job fails, any PID of
its ``pids.json`` whose command line still names the job is SIGKILLed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "mnist_mlp.py"
TRAINERS = 2
NUM_PS = 2
BATCH_PER_TRAINER = 32
LR = 1e-3
JOB_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Case:
    """One configuration of the grid.

    Attributes:
        name: short label, e.g. ``async4-s0``.
        mode: ``sync`` or ``async``.
        every: ``--push-every`` and ``--pull-every`` (mini-batches).
        max_staleness: ``--max-staleness`` (model versions), or None for no flag.
    """

    name: str
    mode: str
    every: int = 1
    max_staleness: int | None = None


def has_staleness_flag() -> bool:
    """Whether ``elasticps train --help`` lists ``--max-staleness``."""
    out = subprocess.run(
        [sys.executable, "-m", "elasticps", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return "--max-staleness" in out.stdout


def build_cases(names: list[str], staleness: list[int], staleness_ok: bool) -> list[Case]:
    """The grid: the base cases named, then each async one with every staleness bound."""
    base = {"sync": Case("sync", "sync"), "async1": Case("async1", "async", 1)}
    base["async4"] = Case("async4", "async", 4)
    cases = [base[n] for n in names]
    if staleness_ok:
        for case in list(cases):
            if case.mode == "async":
                cases += [Case(f"{case.name}-s{s}", "async", case.every, s) for s in staleness]
    return cases


def steady_rate(
    points: list[tuple[float, int]], lo: float = 0.15, hi: float = 0.85
) -> float | None:
    """Samples/s between the moments ``lo`` and ``hi`` of the run's samples were done.

    Args:
        points: ``(unix time s, samples done)`` from ``run.json``'s timeline.
        lo: fraction of the final sample count that opens the window.
        hi: fraction that closes it.

    Returns:
        The rate, or None if the window is empty (too few timeline steps).
    """
    if not points:
        return None
    total = points[-1][1]
    start = next(((t, s) for t, s in points if s >= lo * total), None)
    end = next(((t, s) for t, s in points if s >= hi * total), None)
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


def pushes_sent(rows: int, records_per_task: int, every: int) -> int:
    """Pushes the trainers send in one pass, all trainers together.

    A task of r rows is ceil(r / batch) mini-batches; a push goes every
    ``every`` mini-batches, plus one for the remainder at the end of the task.
    In async mode every applied push bumps each shard's model version by one,
    so ``1 - version / pushes_sent`` is the share of pushes a shard dropped as
    too stale (assuming no task was re-dispatched, as in a run without faults).
    """
    total = 0
    for start in range(0, rows, records_per_task):
        batches = math.ceil(min(records_per_task, rows - start) / BATCH_PER_TRAINER)
        total += math.ceil(batches / every)
    return total


def reap(pids_file: Path, job: str) -> None:
    """SIGKILL any process of a failed job that is still alive.

    A PID from ``pids.json`` is killed only if its command line still names
    this job, so a PID reused by an unrelated process is left alone.
    """
    if not pids_file.exists():
        return
    try:
        pids = [int(pid) for pid in json.loads(pids_file.read_text()).values()]
    except (ValueError, TypeError, OSError, AttributeError):
        return
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if job.encode() in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def run_job(
    case: Case, rep: int, args: argparse.Namespace, work: Path, attempt: int = 0
) -> dict[str, Any]:
    """Run one ``elasticps train`` job and return its JSON line.

    Raises:
        RuntimeError: the job exited with a non-zero status (its log tail is
            in the message).
    """
    job = f"tradeoffs{os.getpid()}-{case.name}-{rep}-{attempt}"
    out = work / f"{case.name}-{rep}-{attempt}"
    cmd = [
        sys.executable, "-m", "elasticps", "train",
        "--model", str(MODEL),
        "--data", str(args.data),
        "--trainers", str(TRAINERS),
        "--ps", str(NUM_PS),
        "--mode", case.mode,
        "--push-every", str(case.every),
        "--pull-every", str(case.every),
        "--batch-size", str(BATCH_PER_TRAINER),
        "--optimizer", "adam",
        "--lr", str(LR),
        "--threads", "1",
        "--seed", str(args.seed),
        "--epochs", str(args.epochs),
        "--records-per-task", str(args.records_per_task),
        "--no-progress",
        "--job", job,
        "--output", str(out),
    ]  # fmt: skip
    if case.max_staleness is not None:
        cmd += ["--max-staleness", str(case.max_staleness)]
    load = round(os.getloadavg()[0], 2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if case.max_staleness is not None:
        # Also through the environment, which every role command reads
        # (ELASTICPS_<FLAG>): the PS gets the bound even from a launcher
        # that does not forward the flag.
        env["ELASTICPS_MAX_STALENESS"] = str(case.max_staleness)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(out.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env
        )
        try:
            stdout, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reap(out / "pids.json", job)
            raise
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        reap(out / "pids.json", job)
        tail = out.with_suffix(".log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{case.name} rep {rep} exited {proc.returncode}:\n{tail}")
    line = json.loads(stdout.decode().strip().splitlines()[-1])
    record = json.loads((out / "run.json").read_text())
    points = [(float(t), int(s)) for t, _, s in record["timeline"]]
    rate = steady_rate(points)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    versions = [int(v) for v in json.loads((out / "manifest.json").read_text())["model_versions"]]
    rows = int(record["passes"][0]["records"]) if record.get("passes") else 0
    pushes = pushes_sent(rows, args.records_per_task, case.every) * args.epochs
    return {
        "case": case.name,
        "rep": rep,
        "mode": case.mode,
        "push_every": case.every,
        "pull_every": case.every,
        "max_staleness": case.max_staleness,
        "seed": args.seed,
        "epochs": args.epochs,
        "accuracy": line.get("accuracy"),
        "loss": line.get("loss"),
        "samples_trained": line.get("samples_trained"),
        "job_wall_s": line.get("wall_s"),
        "command_wall_s": round(wall, 2),
        "samples_per_s": None if rate is None else round(rate, 1),
        "params_sha256": digest[:16],
        "model_versions": versions,
        "pushes_sent": pushes if case.mode == "async" else None,
        "dropped_share": (
            round(1 - statistics.mean(versions) / pushes, 4)
            if case.mode == "async" and pushes
            else None
        ),
        "loadavg": load,
    }


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def summarize(case: Case, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary line of one case: medians and the spread over its runs."""

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in runs if r.get(key) is not None]

    return {
        "summary": case.name,
        "runs": len(runs),
        "accuracy": _spread(values("accuracy")),
        "loss": _spread(values("loss")),
        "samples_per_s": _spread(values("samples_per_s")),
        "dropped_share": _spread(values("dropped_share")),
        "distinct_params": len({r["params_sha256"] for r in runs}),
    }


def markdown(summaries: list[dict[str, Any]], cases: list[Case]) -> str:
    """A Markdown table of the summaries."""
    rows = [
        "| case | mode | push/pull every | max staleness | runs | accuracy median (min-max) "
        "| loss median | samples/s median (min-max) | pushes dropped | distinct final params |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, s in zip(cases, summaries, strict=True):
        acc, loss, rate = s["accuracy"], s["loss"], s["samples_per_s"]
        dropped = "-" if s["dropped_share"]["median"] is None else s["dropped_share"]["median"]
        rows.append(
            f"| `{case.name}` | {case.mode} | {case.every} | "
            f"{'-' if case.max_staleness is None else case.max_staleness} | {s['runs']} | "
            f"{acc['median']} ({acc['min']}-{acc['max']}) | {loss['median']} | "
            f"{rate['median']} ({rate['min']}-{rate['max']}) | {dropped} | "
            f"{s['distinct_params']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the grid; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="output of elasticps data mnist")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--records-per-task", type=int, default=256, help="rows per task (finer timeline)"
    )
    parser.add_argument("--cases", default="sync,async1,async4", help="base cases, comma-separated")
    parser.add_argument(
        "--staleness", default="0,2", help="--max-staleness bounds for the async cases"
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch, 1 rep, sync and async1")
    parser.add_argument("--markdown", action="store_true", help="also print a table on stderr")
    parser.add_argument("--work", type=Path, default=None, help="keep job outputs here")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.reps, args.cases, args.staleness = 1, 1, "sync,async1", "0"
    if not (args.data / "train.parquet").exists():
        parser.error(f"{args.data}/train.parquet not found (run elasticps data mnist --output DIR)")
    staleness_ok = has_staleness_flag()
    staleness = [int(s) for s in args.staleness.split(",") if s]
    cases = build_cases(args.cases.split(","), staleness, staleness_ok)
    if not staleness_ok and staleness:
        print(json.dumps({"skipped": "max-staleness cases", "reason": "no --max-staleness flag"}))
    with contextlib.ExitStack() as stack:
        if args.work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tradeoffs-")))
        else:
            work = args.work
            work.mkdir(parents=True, exist_ok=True)
        results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
        for rep in range(args.reps):
            order = cases[rep % len(cases) :] + cases[: rep % len(cases)]
            for case in order:
                try:
                    line = run_job(case, rep, args, work)
                except RuntimeError as first:
                    print(json.dumps({"case": case.name, "rep": rep, "retry": str(first)[:300]}))
                    try:
                        line = run_job(case, rep, args, work, attempt=1)
                    except RuntimeError as exc:
                        print(json.dumps({"case": case.name, "rep": rep, "error": str(exc)[:2000]}))
                        continue
                results[case.name].append(line)
                print(json.dumps(line), flush=True)
        summaries = [summarize(c, results[c.name]) for c in cases]
        for s in summaries:
            print(json.dumps(s), flush=True)
        if args.markdown:
            print(markdown(summaries, cases), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
