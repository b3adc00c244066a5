"""The job commands of the command line: ``status``, ``logs``, ``stop``, ``list``,
``dashboard``, ``report``.

The same verbs, flags and output for local jobs (the default, ``--backend
local``: see :mod:`elasticps.jobs`) and Kubernetes jobs (``--backend
kubernetes``: see :mod:`elasticps.launcher.kubernetes`) and Slurm jobs
(``--backend slurm``: see :mod:`elasticps.launcher.slurm_jobs`). A local job is
named by ``JOB`` (the newest registered run of that name) or by ``--output
DIR``; a Kubernetes job by ``JOB`` in ``--namespace``; a Slurm job by the
``JOB`` it was submitted as.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticps.errors import ConfigError
from elasticps.jobs import ROLES

__all__ = [
    "add_job_commands",
    "cmd_dashboard",
    "cmd_list",
    "cmd_logs",
    "cmd_report",
    "cmd_status",
    "cmd_stop",
]

_BACKENDS = ("local", "kubernetes", "slurm")
_LIST_COLUMNS = ("job", "state", "pass", "accuracy", "started", "output")


def add_job_commands(sub: Any, add_cluster: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``status``, ``logs``, ``stop`` and ``list`` to the subcommands ``sub``.

    Args:
        sub: the ``add_subparsers()`` object of the ``elasticps`` parser.
        add_cluster: adds ``--namespace`` and ``--kubeconfig`` to a parser.
    """

    def job_parser(name: str, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help)
        p.add_argument("job", nargs="?", default=None,
                       help="the job name (train --job, submit --job)")  # fmt: skip
        p.add_argument("--backend", choices=_BACKENDS, default="local")
        p.add_argument("--output", type=Path, default=None,
                       help="local: the job's output directory (instead of JOB)")  # fmt: skip
        add_cluster(p)
        return p

    status = job_parser("status", "show a job's state, progress and processes (or pods)")
    status.add_argument("--json", action="store_true", help="one JSON object")

    logs = job_parser("logs", "print the logs of a job's processes (or pods) of one role")
    logs.add_argument("--role", choices=ROLES, default="master",
                      help="launcher: local jobs only")  # fmt: skip
    logs.add_argument("--tail", type=int, default=None, help="last N lines of each process")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="go on printing new lines until the job ends (or Ctrl-C)")  # fmt: skip

    stop = job_parser(
        "stop", "end a local job cleanly: final checkpoint, model, evaluation, run.json"
    )
    stop.add_argument("--timeout-s", type=float, default=300.0,
                      help="how long to wait for the job to stop, seconds")  # fmt: skip

    dash = sub.add_parser(
        "dashboard", help="serve a local job's live dashboard on 127.0.0.1 (until Ctrl-C)"
    )
    dash.add_argument("job", nargs="?", default=None, help="the job name (train --job)")
    dash.add_argument("--output", type=Path, default=None,
                      help="the job's output directory (instead of JOB)")  # fmt: skip
    dash.add_argument("--port", type=int, default=0,
                      help="TCP port on 127.0.0.1 (default: a free one, printed)")  # fmt: skip
    dash.add_argument("--interval-s", type=float, default=2.0,
                      help="seconds between reads of the job and page refreshes")  # fmt: skip

    report = sub.add_parser(
        "report", help="write one self-contained HTML report of a finished or failed job"
    )
    report.add_argument("target", metavar="OUTPUT|JOB",
                        help="the job's output directory; with --backend kubernetes, "
                        "the job's name")  # fmt: skip
    report.add_argument("--backend", choices=("local", "kubernetes"), default="local")
    report.add_argument("--to", type=Path, default=None, metavar="FILE",
                        help="where to write it (default OUTPUT/report.html; for a "
                        "Kubernetes job, JOB-report.html here)")  # fmt: skip
    add_cluster(report)

    listing = sub.add_parser("list", help="list local runs (or a namespace's Kubernetes jobs)")
    listing.add_argument(
        "dirs",
        nargs="*",
        type=Path,
        metavar="DIR",
        help="local: output directories, or directories of them, to scan (default: every "
        "run `elasticps train` registered for this user)",
    )
    listing.add_argument("--backend", choices=_BACKENDS, default="local")
    add_cluster(listing)
    listing.add_argument("--json", action="store_true", help="one JSON object per line")


def cmd_dashboard(args: argparse.Namespace) -> int:
    """``elasticps dashboard``: serve until interrupted.

    Raises:
        ConfigError: no such job, or a bad ``--interval-s`` or ``--port``.
        MissingExtraError: the ``dashboard`` extra is not installed.
    """
    from elasticps.dashboard import serve
    from elasticps.jobs import find_run

    if args.interval_s <= 0:
        raise ConfigError(f"--interval-s must be > 0, got {args.interval_s}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    run = find_run(args.job, args.output)

    def ready(url: str) -> None:
        print(f"dashboard of job {run.job}: {url} (Ctrl-C to stop)", flush=True)

    try:
        serve(run.output, port=args.port, interval_s=args.interval_s, on_ready=ready)
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        raise ConfigError(f"cannot serve the dashboard on 127.0.0.1:{args.port}: {exc}") from None
    return 0


def cmd_report(args: argparse.Namespace, core_api: Callable[[argparse.Namespace], Any]) -> int:
    """``elasticps report``: write the HTML file and print its path.

    Raises:
        ConfigError: OUTPUT holds no readable ``run.json``, or flags of the other backend.
        KubernetesError: the Kubernetes API failed.
        MissingExtraError: the ``dashboard`` extra is not installed.
        OSError: the file cannot be written.
    """
    from elasticps.report import build_kubernetes_report, write_report

    if args.backend == "local":
        _check_local(args)
        print(write_report(Path(args.target), args.to))
        return 0
    from elasticps.launcher.kubernetes import job_logs, job_status, pod_name
    from elasticps.launcher.supervisor import Decision, failing_worker
    from elasticps.pserver.atomic import write_atomic

    api = core_api(args)
    status = job_status(api, args.namespace, args.target)
    logs: dict[str, str] = {}
    decisions = [d for d in map(Decision.from_dict, status.get("decisions") or []) if d]
    worker = failing_worker(decisions)
    if worker is not None:  # a PS's or a trainer's pod is named after it
        role = worker.partition("-")[0]
        for pod, text in job_logs(api, args.namespace, args.target, role, tail_lines=30):
            if pod == pod_name(args.target, worker):
                logs[f"pod {pod}"] = text
    target = args.to if args.to is not None else Path(f"{args.target}-report.html")
    write_atomic(target, build_kubernetes_report(status, logs).encode())
    print(target.resolve())
    return 0


def _check_local(args: argparse.Namespace) -> None:
    if args.namespace != "default" or args.kubeconfig is not None:
        raise ConfigError(
            f"--namespace and --kubeconfig are for Kubernetes jobs: "
            f"elasticps {args.command} --backend kubernetes"
        )


def _local_run(args: argparse.Namespace) -> Any:
    from elasticps.jobs import find_run

    _check_local(args)
    return find_run(args.job, args.output)


def _kubernetes_job(args: argparse.Namespace) -> str:
    if args.job is None:
        raise ConfigError(f"elasticps {args.command} --backend kubernetes needs JOB")
    if args.output is not None:
        raise ConfigError("--output names a local job; a Kubernetes job is named by JOB")
    return str(args.job)


def cmd_status(args: argparse.Namespace, core_api: Callable[[argparse.Namespace], Any]) -> int:
    """``elasticps status``.

    Raises:
        ConfigError: no such job, or flags of the other backend.
        KubernetesError: the Kubernetes API failed.
    """
    if args.backend == "slurm":
        from elasticps.launcher import slurm_jobs

        _check_local(args)
        return slurm_jobs.cmd_status(args)
    if args.backend == "kubernetes":
        from elasticps.launcher.kubernetes import job_status

        job = _kubernetes_job(args)
        status = job_status(core_api(args), args.namespace, job)
        if args.json:
            print(json.dumps(status))
            return 0
        failure = f" ({status['failure']})" if status["failure"] else ""
        print(f"job {job} (namespace {args.namespace}): {status['state']}{failure}, "
              f"wanted trainers: {status['wanted_trainers']}")  # fmt: skip
        _print_workers(status["pods"], "no pods")
        return 0
    from elasticps.jobs import run_status

    status = run_status(_local_run(args))
    if args.json:
        print(json.dumps(status))
        return 0
    progress = ""
    if "pass" in status:
        progress = (
            f", pass {status['pass']}/{status['passes']}, "
            f"tasks {status['tasks_done_all_passes']}/{status['tasks_all_passes']}"
        )
    accuracy = "" if status["accuracy"] is None else f", accuracy {status['accuracy']}"
    print(f"job {status['job']} (output {status['output']}): {status['state']}{progress}"
          f"{accuracy}, wanted trainers: {status['wanted_trainers']}")  # fmt: skip
    if status.get("stragglers"):
        steps = status["trainer_step_s"]
        slow = ", ".join(f"trainer {t} ({steps[t]:.3f} s a step)" for t in status["stragglers"])
        print(f"stragglers: {slow}")
    _print_workers(status["processes"], "no processes")
    return 0


def _print_workers(rows: list[dict[str, Any]], empty: str) -> None:
    if not rows:
        print(empty)
    for row in rows:
        print(f"  {row['name']:<40} {row['phase']:<10} {row['state']:<14} {row['reason']}")


def cmd_logs(args: argparse.Namespace, core_api: Callable[[argparse.Namespace], Any]) -> int:
    """``elasticps logs``: each line as ``[<process or pod>] <line>``.

    Raises:
        ConfigError: no such job, or flags of the other backend.
        KubernetesError: the Kubernetes API failed.
    """
    if args.backend == "slurm":
        from elasticps.launcher import slurm_jobs

        _check_local(args)
        return slurm_jobs.cmd_logs(args)
    if args.backend == "kubernetes":
        from elasticps.launcher.kubernetes import follow_job_logs, job_logs

        job = _kubernetes_job(args)
        if args.role == "launcher":
            raise ConfigError("--role launcher is for local jobs (the master pod runs the job)")
        api = core_api(args)
        if args.follow:
            follow_job_logs(
                api, args.namespace, job, args.role, tail_lines=args.tail, emit=_print_line
            )
            return 0
        for name, text in job_logs(api, args.namespace, job, args.role, args.tail):
            for line in text.splitlines():
                print(f"[{name}] {line}")
        return 0
    from elasticps.jobs import follow_logs, print_logs

    run = _local_run(args)
    if args.role == "etcd":
        raise ConfigError("a local job's etcd keeps no log file; see --role launcher")
    if args.follow:
        try:
            follow_logs(run, args.role, args.tail, sys.stdout)
        except KeyboardInterrupt:
            return 130
        return 0
    print_logs(run, args.role, args.tail, sys.stdout)
    return 0


def _print_line(name: str, line: str) -> None:
    print(f"[{name}] {line}", flush=True)


def cmd_stop(args: argparse.Namespace, core_api: Callable[[argparse.Namespace], Any]) -> int:
    """``elasticps stop``: prints the job's ``list`` line once it has stopped.

    Raises:
        ConfigError: no such running job, or ``--backend kubernetes``.
        ElasticPSError: the job did not stop within ``--timeout-s``.
    """
    if args.backend == "slurm":
        from elasticps.launcher import slurm_jobs

        _check_local(args)
        return slurm_jobs.cmd_stop(args)
    if args.backend == "kubernetes":
        raise ConfigError(
            "stop is for local jobs; a Kubernetes job ends after its last pass, and "
            "`elasticps delete JOB` removes it at any time"
        )
    from elasticps.jobs import request_stop, run_summary

    run = _local_run(args)
    if run.state not in ("running", "stopping", "starting"):
        raise ConfigError(f"job {run.job!r} in {run.output} is not running (state {run.state})")
    print(f"stopping job {run.job} (output {run.output})", file=sys.stderr)
    ended = request_stop(run, args.timeout_s)
    print(json.dumps(run_summary(ended)))
    return 0 if ended.state in ("stopped", "finished") else 1


def cmd_list(args: argparse.Namespace, core_api: Callable[[argparse.Namespace], Any]) -> int:
    """``elasticps list``: one line per run (job, state, pass, accuracy, start, output).

    Raises:
        KubernetesError: the Kubernetes API failed.
    """
    if args.backend == "slurm":
        from elasticps.launcher import slurm_jobs

        _check_local(args)
        return slurm_jobs.cmd_list(args)
    from elasticps.jobs import iter_table

    if args.backend == "kubernetes":
        from elasticps.launcher.kubernetes import list_jobs

        if args.dirs:
            raise ConfigError("DIR arguments are for local runs")
        rows = list_jobs(core_api(args), args.namespace)
        columns: tuple[str, ...] = ("job", "state", "pass", "accuracy", "started", "pods")
    else:
        from elasticps.jobs import list_runs, run_summary

        _check_local(args)
        rows = [run_summary(run) for run in list_runs(args.dirs)]
        columns = _LIST_COLUMNS
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for line in iter_table(rows, columns):
        print(line)
    return 0
