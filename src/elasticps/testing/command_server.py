"""Run ``elasticps`` commands forked from one process that has imported torch already.

A test suite that runs a hundred jobs pays, for each, about 3.5 s of CPU in the
launcher importing torch, gRPC, pyarrow and pandas before the job starts
(the launcher's roles are forked from it and share those imports). A
:class:`CommandServer` pays it once: it is a
:class:`~elasticps.launcher.spawn.ForkServer` whose children run the
``elasticps`` command itself, each with its own arguments, environment,
working directory, standard output and standard error. The children are
real processes, as ``python -m elasticps ...`` would start; what they skip is
only the interpreter's start and the imports, which tests of the command's
start-up run the usual way.

Example (a pytest fixture)::

    @pytest.fixture(scope="session")
    def commands():
        with CommandServer() as server:
            yield server

    def test_a_job(commands, tmp_path):
        done = commands.run(["train", "--model", "m.py", ...], timeout_s=300)
        assert done.returncode == 0, done.stderr

The process runs ``python -m elasticps.testing.command_server FD PRELOAD``
(:func:`elasticps.launcher.spawn.serve`); each request's first three
arguments are the child's working directory and the files its standard
output and standard error go to.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from elasticps.launcher.spawn import PRELOAD, ForkServer, child_env, exit_now, serve

__all__ = ["CommandServer"]


class CommandServer:
    """A server that forks ``elasticps`` commands (see the module docstring).

    Start it from the thread that outlives it (the server gets SIGTERM when
    that thread ends). Its children get SIGTERM if it dies.

    Raises:
        ElasticPSError: the server process could not be started.
    """

    def __init__(self) -> None:
        self._server = ForkServer(child_env("command-server"), PRELOAD, server_module=__name__)
        self._files = tempfile.TemporaryDirectory(prefix="elasticps-commands-")
        self._count = 0

    @property
    def pid(self) -> int:
        """The server's process ID."""
        return self._server.pids()["fork-server"]

    def run(
        self,
        args: Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``elasticps ARGS`` to its end, as :func:`subprocess.run` would.

        Args:
            args: the command's arguments (``["train", ...]``).
            timeout_s: longest run, seconds; past it the command is SIGKILLed.
            env: the command's whole environment; default this process's.
            cwd: its working directory; default this process's.

        Returns:
            Its exit status (``-N`` for signal ``N``), stdout and stderr.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (and was killed).
            ElasticPSError: the server is gone or did not fork it.
        """
        self._count += 1
        out = Path(self._files.name) / f"{self._count}.out"
        err = Path(self._files.name) / f"{self._count}.err"
        request = [str(cwd if cwd is not None else Path.cwd()), str(out), str(err), *args]
        child = self._server.start(request, dict(os.environ if env is None else env))
        if child.stdout is not None:
            child.stdout.close()  # the command writes to its files
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(
                list(args), timeout_s, _read(out).encode(), _read(err).encode()
            ) from None
        except BaseException:  # interrupted (a test's timeout): no command left behind
            child.kill()
            raise
        done = subprocess.CompletedProcess(list(args), code, _read(out), _read(err))
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
        return done

    def close(self) -> None:
        """Stop the server; a command still running gets SIGTERM."""
        self._server.close()
        self._files.cleanup()

    def __enter__(self) -> CommandServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def run_redirected(request: list[str]) -> int:
    """In a forked child: ``elasticps ARGS`` in the request's directory, with its
    standard streams on the request's files; its exit status."""
    cwd, out, err, *args = request
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    # As in a new interpreter: Ctrl-C raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [sys.executable, *args]
    from elasticps.cli import main

    return main(args)


if __name__ == "__main__":
    exit_now(serve(sys.argv[1:], run_redirected))
