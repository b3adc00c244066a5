"""Slurm batch jobs: ``elasticps submit --backend slurm`` and the job commands on them.

``submit --backend slurm [--nodes N] [--time T] [--partition P]
[--sbatch-option OPT]... [--job NAME] [--dry-run] TRAIN-OPTIONS...`` writes an
``sbatch`` script (:func:`batch_script`) that runs ``elasticps train
--launcher slurm TRAIN-OPTIONS`` on the first node of an allocation of N
whole nodes (``--exclusive``: each node's CPUs are its slots; ``--no-kill``: a
lost node does not end the allocation, the launcher re-places its roles),
submits it with ``sbatch --parsable``, and records the job in
``STATE_DIR/slurm/<job>.json`` (:func:`~elasticps.jobs.state_dir`), with
the batch output in ``STATE_DIR/slurm/<job>-<id>.out``. The train options are
checked as ``train`` checks them before anything is submitted.

``status``, ``logs``, ``stop`` and ``list`` with ``--backend slurm`` read that
record, ask ``squeue`` (then ``scontrol show job``) for the Slurm job's state,
and read the run's own ``run.json`` and logs in its output directory, which
must be on a file system shared with the nodes. There is no accounting
database: a job that Slurm has forgotten (``MinJobAge`` after its end) is
known by its ``run.json``. ``stop`` asks the launcher to stop cleanly (the
output directory's stop file) and cancels the Slurm job if it has not ended
within ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticps.errors import ConfigError, ElasticPSError

__all__ = [
    "SlurmJob",
    "SubmitRequest",
    "batch_script",
    "cmd_list",
    "cmd_logs",
    "cmd_status",
    "cmd_stop",
    "cmd_submit",
    "combined_state",
    "parse_sbatch_id",
    "parse_submit",
    "read_record",
    "submit_parser",
]

_ENDED_SLURM = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})  # fmt: skip
_ENDED_RUN = frozenset({"finished", "stopped", "failed", "interrupted"})
_CMD_TIMEOUT_S = 30.0
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_LIST_COLUMNS = ("job", "slurm_job_id", "state", "slurm_state", "nodes", "output")


@dataclass(frozen=True)
class SubmitRequest:
    """What ``submit --backend slurm`` submits.

    Attributes:
        job: the job name (``train --job`` and ``#SBATCH --job-name``).
        nodes: nodes of the allocation, >= 1.
        train_args: the ``train`` options, as given (``--launcher slurm``,
            ``--job`` and ``--no-progress`` are added).
        output: the run's output directory (absolute).
        log: the batch output file (absolute; ``%j`` is the job id).
        workdir: the directory the script runs in (absolute).
        python: the interpreter on the nodes.
        time_limit: ``#SBATCH --time``, or empty.
        partition: ``#SBATCH --partition``, or empty.
        sbatch_options: more ``#SBATCH`` lines, each one option.
    """

    job: str
    nodes: int
    train_args: tuple[str, ...]
    output: Path
    log: Path
    workdir: Path
    python: str = sys.executable
    time_limit: str = ""
    partition: str = ""
    sbatch_options: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not _JOB_NAME.match(self.job):
            raise ConfigError(f"--job {self.job!r}: letters, digits, '.', '_' and '-' only")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        for option in self.sbatch_options:
            if not option.startswith("-") or "\n" in option:
                raise ConfigError(f"--sbatch-option {option!r} is not one sbatch option")


def batch_script(request: SubmitRequest) -> str:
    """The ``sbatch`` script of ``request`` (pure).

    Returns:
        The script's text: ``#SBATCH`` lines, then one ``exec`` of ``train``.
    """
    lines = [
        "#!/bin/sh",
        f"#SBATCH --job-name={request.job}",
        f"#SBATCH --nodes={request.nodes}",
        "#SBATCH --exclusive",
        "#SBATCH --no-kill",
        f"#SBATCH --output={request.log}",
        f"#SBATCH --chdir={request.workdir}",
    ]
    if request.time_limit:
        lines.append(f"#SBATCH --time={request.time_limit}")
    if request.partition:
        lines.append(f"#SBATCH --partition={request.partition}")
    lines += [f"#SBATCH {option}" for option in request.sbatch_options]
    command = [request.python, "-m", "elasticps", "train", "--launcher", "slurm",
               *request.train_args, "--job", request.job, "--no-progress"]  # fmt: skip
    lines += [
        "# elasticps: the launcher runs here, on the allocation's first node; the PS and",
        "# trainers run as job steps on its nodes (elasticps train --launcher slurm).",
        f"exec {shlex.join(command)}",
        "",
    ]
    return "\n".join(lines)


def parse_sbatch_id(text: str) -> str:
    """The job id of ``sbatch --parsable``'s output (``ID`` or ``ID;CLUSTER``).

    Raises:
        ElasticPSError: it is not a job id.
    """
    first = text.strip().splitlines()[0] if text.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise ElasticPSError(f"sbatch printed no job id: {text.strip()[:200]!r}")
    return job_id


def combined_state(slurm_state: str, run_state: str) -> str:
    """A Slurm job's state as the other backends name it (pure).

    Args:
        slurm_state: squeue's or scontrol's ``JobState`` (``PENDING``,
            ``RUNNING``, ``COMPLETED``...), empty if Slurm no longer knows the job.
        run_state: ``run.json``'s ``state``, empty if there is none.

    Returns:
        ``pending``, then ``starting``, ``running``, ``stopping`` (until the Slurm
        job has ended, even when ``run.json`` says the run has); at the end the
        run's own ``finished``, ``stopped``, ``failed`` or ``interrupted``, or
        ``cancelled``/``failed`` when the run recorded no end.
    """
    slurm_state = slurm_state.split(maxsplit=1)[0].upper() if slurm_state.strip() else ""
    if slurm_state in ("PENDING", "CONFIGURING", "REQUEUED", "RESV_DEL_HOLD"):
        return "pending"
    if slurm_state and slurm_state not in _ENDED_SLURM:
        if run_state in ("running", "stopping", "starting"):
            return run_state
        # The run has ended but its launcher is still writing its last lines.
        return "stopping" if run_state in _ENDED_RUN else "starting"
    if run_state in _ENDED_RUN:
        return run_state
    return "cancelled" if slurm_state == "CANCELLED" else "failed"


# --- records ----------------------------------------------------------------------


def _records_dir() -> Path:
    from elasticps.jobs import state_dir

    return state_dir() / "slurm"


def _record_path(job: str) -> Path:
    if not _JOB_NAME.match(job):
        raise ConfigError(f"{job!r} is not a job name")
    return _records_dir() / f"{job}.json"


@dataclass(frozen=True)
class SlurmJob:
    """A submitted job's record (``STATE_DIR/slurm/<job>.json``).

    Attributes:
        job: its name.
        slurm_job_id: Slurm's job id.
        output: the run's output directory.
        log: the batch output file.
        nodes: nodes asked for.
        submitted: when, ISO 8601.
    """

    job: str
    slurm_job_id: str
    output: str
    log: str
    nodes: int
    submitted: str

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values."""
        return dict(self.__dict__)


def _write_record(record: SlurmJob) -> None:
    from elasticps.pserver.atomic import write_atomic

    path = _record_path(record.job)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(record.as_dict()) + "\n").encode())


def read_record(job: str) -> SlurmJob:
    """The record of submitted job ``job``.

    Raises:
        ConfigError: none, or it is malformed.
    """
    path = _record_path(job)
    try:
        data = json.loads(path.read_text())
        return SlurmJob(
            job=str(data["job"]),
            slurm_job_id=str(data["slurm_job_id"]),
            output=str(data["output"]),
            log=str(data["log"]),
            nodes=int(data["nodes"]),
            submitted=str(data["submitted"]),
        )
    except FileNotFoundError:
        raise ConfigError(
            f"no Slurm job {job!r} was submitted from here (elasticps submit --backend slurm)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the record {path} is unreadable: {exc}") from None


def _records() -> list[SlurmJob]:
    out = []
    for path in sorted(_records_dir().glob("*.json")):
        try:
            out.append(read_record(path.stem))
        except ConfigError:
            continue
    return sorted(out, key=lambda r: r.submitted)


# --- Slurm's commands -------------------------------------------------------------


def _run(argv: Sequence[str], *, check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise ConfigError(f"--backend slurm needs Slurm's {argv[0]} on the PATH") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ElasticPSError(f"{shlex.join(argv)}: {exc}") from None
    if check and done.returncode != 0:
        why = " ".join(done.stderr.split())[:300] or f"exit {done.returncode}"
        raise ElasticPSError(f"{shlex.join(argv)}: {why}")
    return done.stdout


def _slurm_state(job_id: str) -> tuple[str, str]:
    """``(JobState, NodeList)`` of a Slurm job; empty strings once Slurm forgot it."""
    line = _run(["squeue", "-h", "-j", job_id, "-o", "%T %N"], check=False).strip()
    if line:
        state, _, nodes = line.partition(" ")
        return state, nodes.strip()
    shown = _run(["scontrol", "show", "job", "-o", job_id], check=False)
    fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
    return fields.get("JobState", ""), fields.get("NodeList", "")


def _run_record(output: str) -> dict[str, Any]:
    try:
        data = json.loads((Path(output) / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _status(record: SlurmJob) -> dict[str, Any]:
    slurm_state, nodes = _slurm_state(record.slurm_job_id)
    run = _run_record(record.output)
    state = combined_state(slurm_state, str(run.get("state", "")))
    return {
        "job": record.job,
        "slurm_job_id": record.slurm_job_id,
        "state": state,
        "slurm_state": slurm_state or "(forgotten)",
        "nodes": nodes or "",
        "output": record.output,
        "log": record.log.replace("%j", record.slurm_job_id),
        "submitted": record.submitted,
    }


# --- commands -----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def submit_parser() -> argparse.ArgumentParser:
    """The options of ``submit --backend slurm`` itself; the rest are ``train``'s."""
    p = _Parser(prog="elasticps submit --backend slurm", allow_abbrev=False, add_help=False)
    p.add_argument("--backend", choices=["slurm"], required=True)
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    p.add_argument("--job", default=None, help="job name (default: elasticps-<random>)")
    p.add_argument("--time", default="", help="#SBATCH --time")
    p.add_argument("--partition", default="", help="#SBATCH --partition")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                   help="one more #SBATCH option, such as --exclusive (repeatable)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    return p


def _refuse_submit_flags(train_args: Sequence[str]) -> None:
    for flag in ("--launcher", "--job", "--no-progress"):
        if flag in train_args:
            raise ConfigError(f"elasticps submit --backend slurm: {flag} is set by submit")


def parse_submit(
    argv: Sequence[str], parse_train: Callable[[list[str]], argparse.Namespace]
) -> argparse.Namespace:
    """Parse ``submit --backend slurm ...``: submit's own options, then ``train``'s.

    Args:
        argv: the arguments after ``submit``.
        parse_train: ``elasticps``'s parser of a command line (here a ``train`` one).

    Returns:
        ``command="submit"``, ``backend="slurm"``, ``slurm`` (submit's own
        options, the job name resolved), ``train_args`` (as given) and ``train``
        (them parsed, with ``--launcher slurm --job JOB``).

    Raises:
        ConfigError: a bad option, or one that submit sets itself.
    """
    own, train_args = submit_parser().parse_known_args(list(argv))
    own.job = own.job or f"elasticps-{uuid.uuid4().hex[:6]}"
    _refuse_submit_flags(train_args)
    train = parse_train(["train", *train_args, "--launcher", "slurm", "--job", own.job])
    return argparse.Namespace(
        command="submit",
        backend="slurm",
        log_level="warning",
        log_format=getattr(train, "log_format", "text"),
        slurm=own,
        train_args=list(train_args),
        train=train,
    )


def cmd_submit(args: argparse.Namespace, train_config: Callable[[argparse.Namespace], Any]) -> int:
    """``elasticps submit --backend slurm ...`` (see the module docstring).

    Args:
        args: from :func:`parse_submit`.
        train_config: ``train``'s ``JobConfig`` of ``args.train``, checked as
            ``train`` checks it (nothing runs).

    Raises:
        ConfigError: a bad train option, a job of that name already recorded,
            or no Slurm client.
        ElasticPSError: sbatch failed.
    """
    own = args.slurm
    job = own.job
    config = train_config(args.train)
    output = Path(config.output).resolve()
    log = _records_dir() / f"{job}-%j.out"
    request = SubmitRequest(
        job=job,
        nodes=own.nodes,
        train_args=tuple(args.train_args),
        output=output,
        log=log,
        workdir=Path.cwd(),
        time_limit=own.time,
        partition=own.partition,
        sbatch_options=tuple(own.sbatch_option),
    )
    script = batch_script(request)
    if own.dry_run:
        print(script, end="")
        return 0
    path = _record_path(job)
    if path.exists():
        raise ConfigError(f"a Slurm job named {job!r} is recorded already ({path}); pick --job")
    path.parent.mkdir(parents=True, exist_ok=True)
    script_path = path.with_suffix(".sh")
    script_path.write_text(script)
    job_id = parse_sbatch_id(_run(["sbatch", "--parsable", str(script_path)]))
    now = datetime.datetime.now().astimezone().isoformat("T", "seconds")
    record = SlurmJob(job, job_id, str(output), str(log), own.nodes, now)
    _write_record(record)
    print(json.dumps({"job": job, "slurm_job_id": job_id, "output": str(output)}))
    print(f"job {job} submitted as Slurm job {job_id}. Follow it with:", file=sys.stderr)
    for verb in ("status", "logs", "stop"):
        print(f"  elasticps {verb} {job} --backend slurm", file=sys.stderr)
    return 0


def _named(args: argparse.Namespace) -> SlurmJob:
    if args.job is None:
        raise ConfigError(f"elasticps {args.command} --backend slurm needs JOB")
    if getattr(args, "output", None) is not None:
        raise ConfigError("--output names a local job; a Slurm job is named by JOB")
    return read_record(str(args.job))


def cmd_status(args: argparse.Namespace) -> int:
    """``elasticps status JOB --backend slurm``."""
    status = _status(_named(args))
    run = _run_record(status["output"])
    for key in ("pass", "passes", "tasks_done_all_passes", "tasks_all_passes"):
        if key in run:
            status[key] = run[key]
    if args.json:
        print(json.dumps(status))
        return 0
    print(
        f"job {status['job']} (Slurm job {status['slurm_job_id']}, output {status['output']}): "
        f"{status['state']} (Slurm: {status['slurm_state']}), nodes {status['nodes'] or '-'}"
    )
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """``elasticps logs JOB --backend slurm``: the run's logs of ``--role``; for
    ``launcher``, the batch output first."""
    from elasticps.jobs import LocalRun, print_logs

    record = _named(args)
    if args.follow:
        raise ConfigError("logs --follow is for local and Kubernetes jobs")
    if args.role == "launcher":
        batch = Path(record.log.replace("%j", record.slurm_job_id))
        if batch.exists():
            lines = batch.read_text(errors="replace").splitlines()
            if args.tail is not None:
                lines = lines[-args.tail :] if args.tail > 0 else []
            for line in lines:
                print(f"[sbatch] {line}")
    print_logs(LocalRun(Path(record.output)), args.role, args.tail, sys.stdout)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """``elasticps stop JOB --backend slurm``: a clean stop, then ``scancel`` after
    ``--timeout-s``; prints the job's status once it has ended.

    Raises:
        ConfigError: the job has ended already.
    """
    from elasticps.launcher.output import STOP_FILE

    record = _named(args)
    status = _status(record)
    if status["state"] not in ("pending", "starting", "running", "stopping"):
        raise ConfigError(f"job {record.job!r} is not running (state {status['state']})")
    print(f"stopping job {record.job} (Slurm job {record.slurm_job_id})", file=sys.stderr)
    if status["state"] == "pending" or not (Path(record.output) / "run.json").exists():
        _run(["scancel", record.slurm_job_id])
    else:
        (Path(record.output) / STOP_FILE).write_text(
            json.dumps({"requested": time.time(), "pid": os.getpid()}) + "\n"
        )
    deadline = time.monotonic() + args.timeout_s
    cancelled = False
    while True:
        status = _status(record)
        if status["state"] not in ("pending", "starting", "running", "stopping"):
            break
        if time.monotonic() > deadline and not cancelled:
            print(f"job {record.job} did not stop in {args.timeout_s:g} s: cancelling it",
                  file=sys.stderr)  # fmt: skip
            _run(["scancel", record.slurm_job_id])
            cancelled = True
            deadline = time.monotonic() + _CMD_TIMEOUT_S
        elif time.monotonic() > deadline:
            raise ElasticPSError(f"Slurm job {record.slurm_job_id} did not end after scancel")
        time.sleep(0.5)
    print(json.dumps(status))
    return 0 if status["state"] in ("stopped", "finished") else 1


def cmd_list(args: argparse.Namespace) -> int:
    """``elasticps list --backend slurm``: every job submitted from here."""
    from elasticps.jobs import iter_table

    if args.dirs:
        raise ConfigError("DIR arguments are for local runs")
    rows = [_status(record) for record in _records()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for line in iter_table(rows, _LIST_COLUMNS):
        print(line)
    return 0
