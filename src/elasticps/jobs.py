"""Local jobs seen from another terminal: ``status``, ``logs``, ``stop`` and ``list``.

A local job is known by its output directory (``train --output``). Everything
these commands show is read from it, and from the job's own etcd and master
while it runs:

- ``run.json``: the state (``running``, ``stopping``, then ``finished``,
  ``stopped``, ``failed`` or ``interrupted``), the etcd endpoint, and at the
  end the passes, the evaluation and the progress;
- ``.lock``: the launcher's host, pid and start time (see
  :class:`~elasticps.launcher.output.OutputLock`); a ``running`` job whose
  launcher is gone is shown ``failed``;
- ``pids.json``: every process the job started;
- ``logs/<role>.log``: each process's log.

``elasticps train`` also records each run's output directory in a registry
of runs, one small JSON file per directory in ``STATE_DIR/runs/``
(:func:`state_dir`: ``$ELASTICPS_STATE_DIR``, else
``$XDG_STATE_HOME/elasticps``, else ``~/.local/state/elasticps``), so that
``elasticps list`` shows every run of this user and ``status``, ``logs``
and ``stop`` find a job by name. ``list DIR...`` scans directories instead.
A registry entry whose directory no longer holds a run is dropped.

``elasticps stop`` asks the launcher to end the job cleanly by creating the
file ``OUTPUT/.stop`` (:data:`~elasticps.launcher.output.STOP_FILE`), then
waits for ``run.json`` to say ``stopped``: the launcher has stopped the
trainers, taken the final consistent checkpoint (``OUTPUT/snapshot``, which
``train --resume`` accepts), saved ``model.safetensors`` and evaluated it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from elasticps.errors import ConfigError, ElasticPSError
from elasticps.launcher.output import LOCK_FILE, STOP_FILE

__all__ = [
    "ENDED_STATES",
    "PYTHON_LAUNCHERS",
    "ROLES",
    "STATE_DIR_ENV",
    "LocalRun",
    "find_run",
    "follow_logs",
    "iter_table",
    "list_runs",
    "log_files",
    "metrics_targets",
    "print_logs",
    "read_run",
    "register_run",
    "request_stop",
    "run_status",
    "run_summary",
    "scrape_targets",
    "shard_loads",
    "state_dir",
]

STATE_DIR_ENV: Final = "ELASTICPS_STATE_DIR"
"""Environment variable naming the directory of the registry of runs."""

ENDED_STATES: Final = frozenset({"finished", "stopped", "failed", "interrupted"})
"""States of a run whose launcher has ended."""

PYTHON_LAUNCHERS: Final = ("python-api", "dist_train")
"""``run.json``'s ``launcher`` for a job started from Python (:mod:`elasticps.api.record`):
such a job has no clean stop from another terminal."""

ROLES: Final = ("launcher", "master", "ps", "trainer", "etcd")
"""Roles whose logs ``elasticps logs --role`` prints (a local job's etcd keeps none; a
Kubernetes job has no launcher)."""

_POLL_S = 0.25
# "trainer-3" -> "trainer", "master-0.restart1" -> "master" (after the split on ".").
_ROLE_OF_NAME = re.compile(r"-\d+$")


def state_dir() -> Path:
    """The directory of elasticps's per-user state (the registry of runs).

    Returns:
        ``$ELASTICPS_STATE_DIR``, else ``$XDG_STATE_HOME/elasticps``, else
        ``~/.local/state/elasticps``.
    """
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "elasticps"


def local_dir_for_url(url: str, job: str) -> Path:
    """The local directory of a job whose ``--output`` is a storage URL.

    It holds what the launcher keeps on its own machine: the lock, the logs
    while the job runs, ``.stop``, ``pids.json`` and the live ``run.json``
    (``STATE_DIR/outputs/<job>-<hash of the URL>``, see :func:`state_dir`).
    """
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return state_dir() / "outputs" / f"{job}-{digest}"


def _registry() -> Path:
    return state_dir() / "runs"


def _entry_path(output: Path) -> Path:
    digest = hashlib.sha256(str(output).encode()).hexdigest()[:16]
    return _registry() / f"{digest}.json"


def register_run(output: Path, job: str) -> None:
    """Record a run's output directory in the registry of runs (best effort).

    A registry that cannot be written never stops a job: it only hides the
    run from ``elasticps list`` without arguments.

    Args:
        output: the run's output directory.
        job: the job name.
    """
    output = output.resolve()
    entry = {"output": str(output), "job": job, "registered_unix_s": round(time.time(), 3)}
    path = _entry_path(output)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry) + "\n")
        tmp.replace(path)


def _registered_outputs() -> list[Path]:
    """Output directories in the registry; entries whose run is gone are dropped."""
    outputs = []
    for path in sorted(_registry().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            output = Path(entry["output"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (output / "run.json").exists() or (output / LOCK_FILE).exists():
            outputs.append(output)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return outputs


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # An exited process its parent has not reaped yet (a zombie) has ended too.
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


@dataclass(frozen=True)
class LocalRun:
    """One local run, as its output directory shows it.

    Attributes:
        output: the output directory (absolute).
        record: ``run.json`` (empty before the job has started).
        lock: ``.lock``: the launcher's ``host``, ``pid``, ``started`` (ISO
            8601) and ``started_unix_s`` (seconds).
        alive: whether the launcher runs (its pid, on this host).
    """

    output: Path
    record: dict[str, Any] = field(default_factory=dict)
    lock: dict[str, Any] = field(default_factory=dict)
    alive: bool = False

    @property
    def job(self) -> str:
        """The job name (``train --job``)."""
        return str(self.record.get("job", "?"))

    @property
    def state(self) -> str:
        """``starting``, ``running``, ``stopping``, ``finished``, ``stopped``,
        ``failed`` or ``interrupted``.

        A run whose ``run.json`` says it runs while its launcher is gone
        (killed, or its machine restarted) is ``failed``.
        """
        recorded = str(self.record.get("state", "starting"))
        if recorded in ENDED_STATES:
            return recorded
        return recorded if self.alive else "failed"

    @property
    def started(self) -> str:
        """When the launcher took the output directory, ISO 8601, or ``""``."""
        return str(self.lock.get("started", ""))

    @property
    def etcd(self) -> str | None:
        """The job's etcd endpoint while it runs."""
        endpoint = self.record.get("etcd")
        return endpoint if isinstance(endpoint, str) and self.alive else None


def read_run(output: Path) -> LocalRun | None:
    """Read a run's state from its output directory.

    Args:
        output: a directory.

    Returns:
        The run, or None if the directory holds none (no ``run.json``, and no
        launcher holding it).
    """
    output = output.resolve()
    record = _read_json(output / "run.json") or {}
    lock = _read_json(output / LOCK_FILE) or {}
    alive = lock.get("host") == socket.gethostname() and _pid_alive(lock.get("pid"))
    if not record and not alive:
        return None
    return LocalRun(output, record, lock, alive)


def list_runs(dirs: Sequence[Path] = ()) -> list[LocalRun]:
    """The runs of the registry, or of ``dirs`` (each a run, or a directory of runs).

    Args:
        dirs: directories to scan instead of the registry; each is a run's
            output directory, or holds some as subdirectories.

    Returns:
        The runs, oldest first.
    """
    outputs: list[Path] = []
    if not dirs:
        outputs = _registered_outputs()
    for d in dirs:
        if (d / "run.json").exists() or (d / LOCK_FILE).exists():
            outputs.append(d)
        elif d.is_dir():
            outputs += sorted(p for p in d.iterdir() if p.is_dir())
    runs = {}
    for output in outputs:
        run = read_run(output)
        if run is not None:
            runs[run.output] = run
    return sorted(runs.values(), key=lambda r: (float(r.lock.get("started_unix_s", 0)), r.output))


def find_run(job: str | None, output: Path | None) -> LocalRun:
    """The run named by ``--output DIR``, or else the newest registered run of ``job``.

    Args:
        job: a job name, or None.
        output: an output directory, or None.

    Returns:
        The run.

    Raises:
        ConfigError: neither names a run.
    """
    if output is not None:
        run = read_run(output)
        if run is None:
            raise ConfigError(f"--output {output} holds no run (no run.json)")
        if job is not None and run.job != job:
            raise ConfigError(f"--output {output} holds job {run.job!r}, not {job!r}")
        return run
    if job is None:
        raise ConfigError("name the job: JOB or --output DIR")
    runs = [r for r in list_runs() if r.job == job]
    if not runs:
        raise ConfigError(
            f"no local run of job {job!r} is registered; pass --output DIR "
            "(or --backend kubernetes for a Kubernetes job)"
        )
    running = [r for r in runs if r.alive]
    return (running or runs)[-1]


def _live_progress(run: LocalRun) -> dict[str, Any]:
    """Progress from the job's master and wanted trainers from its etcd ({} if unreachable)."""
    endpoint = run.etcd
    if endpoint is None:
        return {}
    from elasticps.coord.store import JobStore
    from elasticps.master.client import MasterClient
    from elasticps.security import output_etcd_tls, output_secret, output_tls

    progress: dict[str, Any] = {}
    with (
        contextlib.suppress(ElasticPSError),
        JobStore(endpoint, run.job, tls=output_etcd_tls(run.output)) as store,
    ):
        progress["wanted_trainers"] = store.trainers_wanted()
        master = MasterClient(
            lambda: store.master_address(timeout_s=1.0),
            retry_s=2.0,
            rpc_timeout_s=2.0,
            secret=output_secret(run.output),
            tls=output_tls(run.output),
        )
        try:
            status = master.job_status()
        finally:
            master.close()
        progress.update(
            {
                "pass": min(int(status.pass_id) + 1, int(status.num_passes)),
                "passes": int(status.num_passes),
                "tasks_done_all_passes": int(status.tasks_done_all_passes),
                "tasks_all_passes": int(status.tasks_total * status.num_passes),
                "samples": int(status.samples_done),
            }
        )
    return progress


def metrics_targets(output: Path, role: str) -> list[tuple[str, str]]:
    """``(id, "host:port")`` of each ``role`` process serving metrics, from the
    ``OUTPUT/prometheus-targets.json`` the launcher keeps ([] without one)."""
    try:
        groups = json.loads((output / "prometheus-targets.json").read_text())
    except (OSError, ValueError):
        return []
    found = []
    group: Any
    for group in groups if isinstance(groups, list) else []:
        labels = group.get("labels", {}) if isinstance(group, dict) else {}
        targets = group.get("targets", []) if isinstance(group, dict) else []
        if isinstance(labels, dict) and labels.get("role") == role and targets:
            found.append((str(labels.get("id")), str(targets[0])))
    return found


def scrape_targets(output: Path, role: str, timeout_s: float = 2.0) -> Iterator[tuple[str, str]]:
    """``(id, Prometheus text)`` of each ``role`` target of ``metrics_targets`` that
    answers within ``timeout_s`` seconds (one that ended since the file was written
    is skipped)."""
    import urllib.request

    for role_id, address in metrics_targets(output, role):
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
                text = reply.read().decode()
        except (OSError, ValueError):
            continue
        yield role_id, text


def shard_loads(output: Path, timeout_s: float = 2.0) -> dict[str, dict[str, float]]:
    """Each PS shard's load (:func:`elasticps.metrics.shard_load`) from the parameter
    servers' metrics, by shard ({} when none answers)."""
    from elasticps import metrics

    loads: dict[str, dict[str, float]] = {}
    for _, text in scrape_targets(output, "ps", timeout_s):
        with contextlib.suppress(ValueError):
            loads.update(metrics.shard_load(text))
    return loads


def _trainer_steps(run: LocalRun) -> dict[str, Any]:
    """Each live trainer's mean step time, scraped from its metrics (the targets the
    launcher lists in ``OUTPUT/prometheus-targets.json``), and the stragglers among them."""
    from elasticps import metrics

    steps: dict[str, float] = {}
    for role_id, text in scrape_targets(run.output, "trainer"):
        try:
            mean = metrics.mean_step_s(text)
        except ValueError:
            continue
        if mean is not None:
            steps[role_id] = round(mean, 4)
    if not steps:
        return {}
    return {"trainer_step_s": steps, "stragglers": metrics.stragglers(steps)}


def _progress(run: LocalRun) -> dict[str, Any]:
    if run.state in ("running", "stopping"):
        return {**_live_progress(run), **_trainer_steps(run)}
    recorded = run.record.get("progress")
    progress = dict(recorded) if isinstance(recorded, dict) else {}
    if "samples" in run.record:
        progress["samples"] = run.record["samples"]
    return progress


def _accuracy(run: LocalRun) -> float | None:
    evaluation = run.record.get("evaluation")
    if isinstance(evaluation, dict) and isinstance(evaluation.get("accuracy"), int | float):
        return float(evaluation["accuracy"])
    return None


def run_summary(run: LocalRun) -> dict[str, Any]:
    """One line of ``elasticps list``.

    Returns:
        ``{"job", "state", "pass", "accuracy", "started", "output"}``; ``pass``
        is ``"P/N"`` (the pass running, or reached when the run ended) or
        ``""``, ``accuracy`` the final test accuracy or None.
    """
    progress = _progress(run)
    passes = f"{progress['pass']}/{progress['passes']}" if "pass" in progress else ""
    return {
        "job": run.job,
        "state": run.state,
        "pass": passes,
        "accuracy": _accuracy(run),
        "started": run.started,
        "output": str(run.output),
    }


def _processes(run: LocalRun) -> list[dict[str, Any]]:
    pids = _read_json(run.output / "pids.json") or {}
    rows = []
    for name, pid in pids.items():
        running = run.alive and _pid_alive(pid)
        role = _ROLE_OF_NAME.sub("", name.split(".", 1)[0])
        rows.append(
            {
                "name": name,
                "role": role,
                "pid": pid,
                "phase": "Running" if running else "Exited",
                "state": "running" if running else "exited",
                "reason": "",
            }
        )
    return sorted(rows, key=lambda r: str(r["name"]))


def run_status(run: LocalRun) -> dict[str, Any]:
    """What ``elasticps status`` shows of a local run.

    Returns:
        ``{"job", "output", "state", "started", "wanted_trainers", "pass",
        "passes", "tasks_done_all_passes", "tasks_all_passes", "accuracy",
        "trainer_step_s", "stragglers",
        "processes": [{"name", "role", "pid", "phase", "state", "reason"}...]}``;
        progress keys are missing when neither the master nor ``run.json``
        has them; ``trainer_step_s`` (each live trainer's mean step time,
        seconds, from its metrics) and ``stragglers`` (the trainers above
        :data:`~elasticps.metrics.STRAGGLER_FACTOR` times the median) only
        while the job runs with metrics on.
    """
    progress = _progress(run)
    trainers = run.record.get("trainers")
    wanted = progress.pop("wanted_trainers", None)
    if wanted is None and isinstance(trainers, dict):
        wanted = trainers.get("initial")
    return {
        "job": run.job,
        "output": str(run.output),
        "state": run.state,
        "started": run.started,
        "wanted_trainers": wanted,
        **progress,
        "accuracy": _accuracy(run),
        "processes": _processes(run),
    }


def log_files(run: LocalRun, role: str) -> list[Path]:
    """The log files of one role's processes (``master-0.log``...), sorted by name.

    Args:
        run: the run.
        role: ``launcher``, ``master``, ``ps`` or ``trainer``.

    Returns:
        The files present now.
    """
    logs = run.output / "logs"
    if role == "launcher":
        return [p for p in [logs / "launcher.log"] if p.exists()]
    return sorted(logs.glob(f"{role}-*.log"))


def print_logs(run: LocalRun, role: str, tail: int | None, out: TextIO) -> None:
    """Print one role's logs, each line prefixed by ``[<process>]``, as for Kubernetes pods.

    Args:
        run: the run.
        role: see :func:`log_files`.
        tail: the last lines of each file only, or None for all.
        out: where to print.
    """
    for path in log_files(run, role):
        lines = path.read_text(errors="replace").splitlines()
        if tail is not None:
            lines = lines[-tail:] if tail > 0 else []
        for line in lines:
            print(f"[{path.stem}] {line}", file=out)


def follow_logs(
    run: LocalRun,
    role: str,
    tail: int | None,
    out: TextIO,
    *,
    poll_s: float = _POLL_S,
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Print one role's logs, then their new lines as they come, until the job ends.

    Files that appear later (a replaced trainer's) are followed from their
    start. It returns once the launcher has ended (after printing what was
    left), or when ``should_stop`` returns True.

    Args:
        run: the run.
        role: see :func:`log_files`.
        tail: as for :func:`print_logs`, for the files present at the start.
        out: where to print.
        poll_s: seconds between two looks at the files.
        should_stop: checked every poll.
    """
    offsets: dict[Path, int] = {}
    for path in log_files(run, role):
        text = path.read_bytes()
        end = text.rfind(b"\n") + 1  # a partial last line is printed once it is complete
        lines = text[:end].decode(errors="replace").splitlines()
        if tail is not None:
            lines = lines[-tail:] if tail > 0 else []
        for line in lines:
            print(f"[{path.stem}] {line}", file=out)
        offsets[path] = end
    out.flush()
    while True:
        ended = not _launcher_alive(run)
        for path in log_files(run, role):
            offsets[path] = _print_new_lines(path, offsets.get(path, 0), out)
        out.flush()
        if ended or should_stop():
            return
        time.sleep(poll_s)


def _print_new_lines(path: Path, offset: int, out: TextIO) -> int:
    with contextlib.suppress(OSError), path.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].decode(errors="replace").splitlines():
            print(f"[{path.stem}] {line}", file=out)
        return offset + end
    return offset


def _launcher_alive(run: LocalRun) -> bool:
    now = read_run(run.output)
    return now is not None and now.alive and now.lock.get("pid") == run.lock.get("pid")


def request_stop(run: LocalRun, timeout_s: float, *, poll_s: float = _POLL_S) -> LocalRun:
    """Ask a running local job to stop cleanly, and wait until it has.

    Args:
        run: a running run.
        timeout_s: how long to wait for the final checkpoint, seconds.
        poll_s: seconds between two looks at ``run.json``.

    Returns:
        The run as it ended (state ``stopped``, or ``finished`` if its last
        pass ended first, or ``failed``).

    Raises:
        ConfigError: the run is not running, or was started from Python
            (:data:`PYTHON_LAUNCHERS`).
        ElasticPSError: it had not ended after ``timeout_s``.
    """
    if run.state not in ("running", "stopping", "starting"):
        raise ConfigError(f"job {run.job!r} in {run.output} is not running (state {run.state})")
    launcher = run.record.get("launcher")
    if launcher in PYTHON_LAUNCHERS:
        raise ConfigError(
            f"job {run.job!r} in {run.output} was started from Python ({launcher}) and has "
            f"no clean stop from here; interrupt its process (pid {run.lock.get('pid')})"
        )
    (run.output / STOP_FILE).write_text(
        json.dumps({"requested": _now_iso(), "pid": os.getpid()}) + "\n"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        now = read_run(run.output)
        if now is not None and (
            now.record.get("state") in ENDED_STATES
            or not now.alive
            or now.lock.get("pid") != run.lock.get("pid")
        ):
            return now
        if time.monotonic() > deadline:
            raise ElasticPSError(
                f"job {run.job!r} in {run.output} did not stop within {timeout_s:g} s; "
                "it goes on stopping (see its logs)"
            )
        time.sleep(poll_s)


def _now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat("T", "seconds")


def iter_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Iterator[str]:
    """Rows as aligned text columns, with a header of the column names in capitals.

    Args:
        rows: dicts holding every column.
        columns: the keys to show, in order.

    Yields:
        Lines, header first.
    """
    cells = [[c.upper() for c in columns]]
    for row in rows:
        cells.append(["-" if row[c] is None or row[c] == "" else str(row[c]) for c in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        padded = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        yield "  ".join(padded).rstrip()
