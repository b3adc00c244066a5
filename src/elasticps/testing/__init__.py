"""Helpers for testing elasticps jobs and code built on it.

Tests wait on conditions with deadlines, never on fixed sleeps: use
:func:`wait_for` with a predicate over something observable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elasticps.testing.command_server import CommandServer


def wait_for(
    predicate: Callable[[], bool],
    what: str = "the condition",
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
) -> None:
    """Poll ``predicate`` until it returns True.

    Args:
        predicate: the condition; called every ``interval_s`` seconds.
        what: what is awaited, for the failure message.
        timeout_s: deadline, seconds.
        interval_s: time between two polls, seconds.

    Raises:
        AssertionError: the condition did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def wait_for_shard_checkpoint(output: Path, timeout_s: float = 120.0) -> None:
    """Wait until the local job writing to ``output`` has saved its first PS shard checkpoint.

    Args:
        output: the job's ``--output``.
        timeout_s: deadline, seconds.

    Raises:
        AssertionError: no shard checkpoint appeared within ``timeout_s``.
    """
    wait_for(
        lambda: any((output / "ps-checkpoints").glob("ps-*/shard-*.safetensors")),
        "a first shard checkpoint",
        timeout_s=timeout_s,
        interval_s=0.05,
    )


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far.

    Raises:
        OSError: no process has PID ``pid`` (Linux: read from ``/proc``).
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_gone(pid: int) -> bool:
    """Whether no process has PID ``pid`` any more (a zombie still counts as present)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def kill_leftovers(pids_file: Path, grace_s: float = 5.0) -> list[str]:
    """SIGKILL the processes of a job's ``pids.json`` still running after ``grace_s``.

    Args:
        pids_file: the job's ``OUTPUT/pids.json`` (role -> PID); missing is fine.
        grace_s: how long, in seconds, the processes get to exit on their own.

    Returns:
        ``"role:pid"`` of each process that had to be killed (a job that ended
        cleanly leaves none).
    """
    killed: list[str] = []
    if not pids_file.exists():
        return killed
    deadline = time.monotonic() + grace_s
    for role, pid in json.loads(pids_file.read_text()).items():
        while not pid_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pid_gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{role}:{pid}")
    return killed


def run_train(
    args: Sequence[str | Path],
    *,
    pids_file: Path | None,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, object], str]:
    """Run ``elasticps train ARGS --no-progress`` to its end, then SIGKILL what it left.

    Args:
        args: the command's arguments after ``train``.
        pids_file: the job's ``OUTPUT/pids.json`` (see :func:`kill_leftovers`),
            or None when the output is not a local directory.
        timeout_s: longest run, seconds.
        env: variables added to this process's environment.

    Returns:
        The job's result line (the last JSON line on stdout) and its stderr.

    Raises:
        AssertionError: the command exited non-zero, or left processes running.
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    try:
        proc = run_elasticps(
            ["train", *map(str, args), "--no-progress"],
            timeout_s=timeout_s,
            env={**os.environ, **(env or {})},
        )
    finally:
        leftovers = kill_leftovers(pids_file) if pids_file is not None else []
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    if leftovers:
        raise AssertionError(f"processes left behind: {leftovers}")
    line: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return line, proc.stderr


class _Commands:
    """Where :func:`run_elasticps` runs commands (see :func:`fork_commands`)."""

    def __init__(self) -> None:
        self.fork = False
        self.server: CommandServer | None = None


_COMMANDS = _Commands()


def fork_commands(enabled: bool) -> None:
    """Whether :func:`run_elasticps` (and so :func:`run_train`) forks each command
    from one :class:`~elasticps.testing.command_server.CommandServer` rather
    than starting a new interpreter for it: about 3.5 s of CPU less per job.

    The server starts at the first command, in the calling thread, which must
    outlive it (a test session's main thread); turning this off stops it.

    Raises:
        ElasticPSError: turning off, the server did not stop cleanly.
    """
    _COMMANDS.fork = enabled
    if not enabled and _COMMANDS.server is not None:
        server, _COMMANDS.server = _COMMANDS.server, None
        server.close()


def child_pids(parent: int | None = None) -> list[int]:
    """PIDs of the processes whose parent is ``parent`` (exited ones not yet reaped too).

    Args:
        parent: a PID; default this process, whose command server (see
            :func:`fork_commands`), which lives for the session, is left out.

    Returns:
        The PIDs, in no order (Linux: read from ``/proc``).
    """
    skip = set()
    if parent is None:
        parent = os.getpid()
        if _COMMANDS.server is not None:
            skip.add(_COMMANDS.server.pid)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # Field 4, after the command name in parentheses (which may hold spaces).
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def run_elasticps(
    args: Sequence[str | Path],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m elasticps ARGS`` to its end, capturing its output as text.

    Forked from a command server when :func:`fork_commands` is on.

    Args:
        args: the command's arguments (``["train", ...]``).
        timeout_s: longest run, seconds; past it the command is killed.
        env: its whole environment; default this process's.
        cwd: its working directory; default this process's.

    Returns:
        Its exit status, stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    argv = [str(a) for a in args]
    if _COMMANDS.fork:
        if _COMMANDS.server is None:
            from elasticps.testing.command_server import CommandServer

            _COMMANDS.server = CommandServer()
        return _COMMANDS.server.run(argv, timeout_s=timeout_s, env=env, cwd=cwd)
    return subprocess.run(
        [sys.executable, "-m", "elasticps", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
