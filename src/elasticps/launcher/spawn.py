"""How the local launchers start role processes: exec'ed, or forked from a fork server.

:class:`ExecSpawner` starts each as a new ``python -m elasticps <role>``.
:class:`ForkServer`, the default of ``elasticps train`` (``--spawn fork``),
forks each from a server that has imported torch already. Both return
handles with the :class:`subprocess.Popen` methods the launchers use
(:class:`ProcessHandle`), and give every child its own session, stdin from
``/dev/null`` and one pipe for its stdout and stderr.

Why fork: a role process started as ``python -m elasticps <role>`` spends about
1.8 s of CPU importing torch before it does anything. A local job starts its
parameter servers and trainers at once, so on a 2-core machine
those imports queue behind each other: 3.7 s from spawning the role processes
to the first task of a 2-trainer, 2-PS job. A :class:`ForkServer` pays the
import once, in a process started before the launcher validates its inputs
(so the two imports run side by side), and forks every role process from it.
Measured figures are in benchmarks/README.md.

This is the pattern of ``multiprocessing``'s forkserver with
``set_forkserver_preload`` (and of Android's zygote), written out because the
launcher needs what that module does not give: each child in its own session,
its stdout and stderr on a pipe the launcher reads and prefixes, the exit
status of every child, and no pickle between the processes.

Protocol, over a ``SOCK_SEQPACKET`` Unix socket pair, one JSON object per
message:

- launcher -> server: ``{"op": "spawn", "id": n, "args": [...], "env":
  {...}}``, with one file descriptor attached (``SCM_RIGHTS``): the write end
  of the pipe the child's stdout and stderr go to. ``args`` are the arguments
  of the ``elasticps`` command (``["ps", "--job", ...]``); ``env`` is the
  child's whole environment.
- server -> launcher: ``{"op": "started", "id": n, "pid": p}``, or
  ``{"op": "failed", "id": n, "error": "..."}``; later, for every child,
  ``{"op": "exited", "pid": p, "returncode": r}`` (``-N`` for signal ``N``,
  as :class:`subprocess.Popen` reports it).

The server exits when the launcher's end of the socket closes; it gets
SIGTERM if the launcher dies (``setpriv --pdeathsig``), and each child gets
SIGTERM if the server dies (``PR_SET_PDEATHSIG``). Children find the server's
pid in ``ELASTICPS_PARENT_PID`` and stop when they are orphaned.

Fork safety: the server forks from a single Python thread and imports only
:data:`PRELOAD`: torch, gRPC, the etcd client, pyarrow (and pandas, which pyarrow
imports when it reads a table) and the role modules, so that a child starts its
role without importing anything (about 1 s of CPU per role process saved).
Importing is all it does with them: no gRPC channel or server, etcd
connection, Arrow allocation or thread pool exists before a fork (gRPC sets
itself up when the first channel or server is made, in the child).
The only native threads are numpy's OpenBLAS server, which has its own fork
handlers, as PyTorch's ``DataLoader`` workers rely on, and none of
Arrow's jemalloc: its background thread is switched off
(``JE_ARROW_MALLOC_CONF``, see :func:`child_env`; Arrow allocates with
mimalloc by default anyway). ``tests/integration/test_spawn.py`` checks the
server's threads. Glibc reads ``MALLOC_*`` variables and Python reads
``PYTHONUNBUFFERED`` when a process starts, so those come from the server's
own environment (see :func:`child_env`), not from the per-child ``env``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import io
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import IO, NoReturn, Protocol, TypeVar

from elasticps.errors import ElasticPSError
from elasticps.logs import PROCESS_ENV
from elasticps.netutil import die_with_parent_prefix
from elasticps.security import role_credential_env

log = logging.getLogger(__name__)

PRELOAD = (
    "torch",
    "safetensors.torch",
    "grpc",
    "pyetcd",
    "tenacity",
    "pyarrow.parquet",
    # pyarrow imports pandas, when installed, on the first table it reads (for the
    # pandas metadata a schema may carry): about 0.6 s of CPU in every trainer.
    "pandas",
    "elasticps.cli",
    "elasticps.master.main",
    "elasticps.pserver.main",
    "elasticps.trainer.worker",
)
"""Modules the server imports before forking: what the roles import (see Fork safety).

One that cannot be imported (an extra not installed) is left to the child,
which then says what is missing."""

MAX_MESSAGE_BYTES = 1 << 20
"""Largest protocol message, bytes (a spawn request carries the child's environment)."""

SPAWN_TIMEOUT_S = 120.0
"""How long a spawn waits for the server (which may still be importing), seconds."""

_PR_SET_PDEATHSIG = 1

#: The module the fork server runs as (it calls :func:`serve`).
_SERVER_MODULE = "elasticps.launcher.fork_server_main"


def child_env(role: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a role process started by the local launchers.

    Args:
        role: ``master``, ``ps`` or ``trainer`` (a ``-<i>`` suffix is dropped).
        extra: more variables; they win.

    A job with certificates gives the role its own
    (:func:`~elasticps.security.role_credential_env`).
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["ELASTICPS_ROLE"] = role.split("-", maxsplit=1)[0]
    env[PROCESS_ENV] = role  # its name in the logs (--log-format json)
    # glibc returns big freed blocks to the OS at once by default, so a
    # 64 MB gradient tensor costs ~16k page faults on every backward;
    # keeping them in the heap cut a 20M-parameter step from 92 to 65 ms
    # here (benchmarks/README.md). A user's own settings win.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
    # No jemalloc background thread in the fork server (it imports pyarrow
    # before forking) nor in its children; see Fork safety above.
    env.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    # The child stops itself if the launcher dies (even by SIGKILL).
    env["ELASTICPS_PARENT_PID"] = str(os.getpid())
    env.update(extra or {})
    return role_credential_env(env, role)


class Stoppable(Protocol):
    """What the stop sequence (:func:`terminate`, :func:`wait_or_kill`) uses of a
    process; every :class:`subprocess.Popen` has it, whatever its stream mode."""

    def poll(self) -> int | None:
        """The exit status if the process has ended, else None."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end and return its exit status."""
        ...

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` if the process is still running."""
        ...

    def kill(self) -> None:
        """SIGKILL the process if it is still running."""
        ...


class ProcessHandle(Stoppable, Protocol):
    """What the launchers use of a child process; :class:`subprocess.Popen` has it too."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None


class Spawner(Protocol):
    """Starts ``elasticps`` role processes."""

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        """Start ``elasticps <args>`` with environment ``env``.

        The child runs in its own session, with stdin from ``/dev/null`` and
        stdout and stderr on one pipe, the handle's ``stdout``.

        Raises:
            ElasticPSError: the process could not be started.
        """
        ...

    def pids(self) -> dict[str, int]:
        """Name -> pid of the spawner's own processes (none, or the fork server)."""
        ...


def terminate(procs: Sequence[Stoppable]) -> None:
    """Send SIGTERM to each process of ``procs`` still running, in order."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)


def wait_or_kill(procs: Sequence[Stoppable], timeout_s: float) -> None:
    """Wait for every process of ``procs`` to end within ``timeout_s`` seconds in all.

    A process still running at the deadline is SIGKILLed; every process is
    reaped before this returns. The one stop sequence of the local launchers:
    :func:`terminate`, then this.
    """
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def popen_child(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child of the launchers: its own session, stdin from
    ``/dev/null``, stdout and stderr on one pipe (the handle's ``stdout``).

    Raises:
        OSError: the program could not be started.
    """
    return subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(env),
        # Own session: Ctrl-C reaches only the launcher, which stops the
        # children in order, by PID.
        start_new_session=True,
    )


class ExecSpawner:
    """Each role process is a new ``[setpriv --pdeathsig TERM] python -m elasticps``."""

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        """Start ``python -m elasticps <args>`` (see :meth:`Spawner.start`).

        Raises:
            ElasticPSError: the interpreter could not be started.
        """
        try:
            return popen_child(
                [*die_with_parent_prefix(), sys.executable, "-m", "elasticps", *args], env
            )
        except OSError as exc:
            raise ElasticPSError(f"could not start elasticps {' '.join(args[:1])}: {exc}") from exc

    def pids(self) -> dict[str, int]:
        """No process of its own: ``{}``."""
        return {}


class ForkedProcess:
    """A child of the fork server, with the :class:`subprocess.Popen` methods the launchers use.

    Its exit status arrives from the server; ``wait`` raises
    :class:`subprocess.TimeoutExpired` like ``Popen.wait``.
    """

    def __init__(self, args: Sequence[str], stdout: IO[bytes]) -> None:
        self.args = list(args)
        self.pid = -1
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = stdout
        self._cond = threading.Condition()

    def poll(self) -> int | None:
        """The exit status if the process has ended, else None."""
        with self._cond:
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds (None: forever) for the exit status.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            assert self.returncode is not None
            return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process has ended (its pid may be reused then)."""
        with self._cond:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM the process if it is still running."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process if it is still running."""
        self.send_signal(signal.SIGKILL)

    def _exited(self, returncode: int) -> None:
        with self._cond:
            self.returncode = returncode
            self._cond.notify_all()


class ForkServer:
    """The launcher's side of a fork server (see the module docstring).

    Args:
        env: the server's own environment; its ``MALLOC_*`` and
            ``PYTHONUNBUFFERED`` settings hold for every child.
        preload: modules the server imports before its first fork.
        inline_entry: with it, make the server by forking this process
            after importing ``preload`` here (see :func:`_fork_server_here`),
            rather than by starting a new Python that imports them again:
            about 2 s of CPU less per job for a launcher that needs torch
            itself. It is what each child runs (the ``elasticps`` command's
            ``main``: passed in, because this module must not import the
            command). Only while this process runs one thread; otherwise a
            new process is started.
        server_module: the module that new process runs (``python -m
            MODULE FD PRELOAD``, calling :func:`serve` with its own entry); by
            default one whose children run the ``elasticps`` command's
            ``main``.

    Raises:
        ElasticPSError: the server process could not be started.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        preload: Sequence[str] = PRELOAD,
        *,
        inline_entry: Entry | None = None,
        server_module: str = _SERVER_MODULE,
    ) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if inline_entry is not None and threading.active_count() == 1:
                self._proc: subprocess.Popen[bytes] | _ForkedServer = _fork_server_here(
                    mine, theirs, env, preload, inline_entry
                )
            else:
                self._proc = subprocess.Popen(
                    [
                        *die_with_parent_prefix(), sys.executable, "-m", server_module,
                        str(theirs.fileno()), ",".join(preload),
                    ],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    env=dict(env),
                    start_new_session=True,
                )  # fmt: skip
        except OSError as exc:
            mine.close()
            raise ElasticPSError(f"could not start the fork server: {exc}") from exc
        finally:
            theirs.close()
        self._sock = mine
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_id = 0
        self._pending: dict[int, tuple[ForkedProcess, Future[None]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def pids(self) -> dict[str, int]:
        """``{"fork-server": pid}``."""
        return {"fork-server": self._proc.pid}

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
        """Fork ``elasticps <args>`` from the server (see :meth:`Spawner.start`).

        Waits for the server to finish its imports, at most :data:`SPAWN_TIMEOUT_S`.

        Raises:
            ElasticPSError: the server is gone, refused, or did not answer in time.
        """
        read_fd, write_fd = os.pipe()
        stdout = open(read_fd, "rb")  # noqa: SIM115 (the handle owns it)
        child = ForkedProcess(args, stdout)
        started: Future[None] = Future()
        request_id: int | None = None
        try:
            try:
                with self._lock:
                    if self._dead is not None:
                        raise ElasticPSError(f"the fork server is gone: {self._dead}")
                    self._next_id += 1
                    request_id = self._next_id
                    self._pending[request_id] = (child, started)
                message = {"op": "spawn", "id": request_id, "args": list(args), "env": dict(env)}
                with self._send_lock:
                    socket.send_fds(self._sock, [json.dumps(message).encode()], [write_fd])
            finally:
                os.close(write_fd)  # the child holds it now; we must see EOF when it exits
            started.result(timeout=SPAWN_TIMEOUT_S)
        except BaseException as exc:
            if request_id is not None:
                with self._lock:
                    self._pending.pop(request_id, None)
            stdout.close()
            if isinstance(exc, TimeoutError):  # before OSError, its base class
                raise ElasticPSError(
                    f"the fork server did not start elasticps {args[0]} in {SPAWN_TIMEOUT_S:g} s"
                ) from exc
            if isinstance(exc, OSError):
                raise ElasticPSError(f"could not reach the fork server: {exc}") from exc
            raise
        return child

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the server (its children, if any are left, get SIGTERM) and wait for it.

        A server never asked to spawn (the job failed before, e.g. on its
        inputs) has no child: it gets SIGTERM at once rather than finishing
        its imports only to exit.
        """
        with self._lock:
            never_used = self._next_id == 0
        if never_used:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=timeout_s)
        self._sock.close()
        if isinstance(self._proc, _ForkedServer):
            self._proc.release()

    def _read(self) -> None:
        why = "it closed its socket"
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
                if not data:
                    break
                self._dispatch(json.loads(data))
        except (OSError, ValueError) as exc:
            why = str(exc)
        code = self._proc.wait()
        why = f"{why} (exit status {code})"
        with self._lock:
            self._dead = why
            pending, self._pending = self._pending, {}
        for _, future in pending.values():
            future.set_exception(ElasticPSError(f"the fork server is gone: {why}"))
        with self._lock:
            orphans, self._children = list(self._children.values()), {}
        if orphans:
            # They got SIGTERM from PR_SET_PDEATHSIG, and their exit statuses
            # died with the server: report each as ended by that signal once
            # it is gone, so that nobody waits forever.
            log.error("the fork server ended while %d children ran: %s", len(orphans), why)
            for child in orphans:
                _wait_gone(child.pid)
                child._exited(-signal.SIGTERM)

    def _dispatch(self, message: dict[str, object]) -> None:
        op = message.get("op")
        if op in ("started", "failed"):
            request_id = message.get("id")
            with self._lock:
                entry = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
            if entry is None:
                return
            child, future = entry
            pid = message.get("pid")
            if op == "started" and isinstance(pid, int):
                child.pid = pid
                with self._lock:
                    self._children[pid] = child
                future.set_result(None)
            else:
                future.set_exception(ElasticPSError(f"fork server: {message.get('error')}"))
        elif op == "exited":
            pid, code = message.get("pid"), message.get("returncode")
            with self._lock:
                ended = self._children.pop(pid, None) if isinstance(pid, int) else None
            if ended is not None and isinstance(code, int):
                ended._exited(code)


class _ForkedServer:
    """What :class:`ForkServer` uses of :class:`subprocess.Popen`, for a server forked
    from this process (:func:`_fork_server_here`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        """The exit status if the server has ended (reaping it), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped already: cannot happen, but not a hang
                    pid, status = self.pid, 0
                if pid:
                    # The pidfd stays open (and readable) for a thread that
                    # waits on it now: closing it would drop it from that
                    # thread's epoll set unseen. release() closes it.
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def release(self) -> None:
        """Close the pidfd, once nobody waits for the server any more. Idempotent."""
        with self._lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the server to end; its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"fork server (pid {self.pid})", timeout or 0.0)
            with selectors.DefaultSelector() as selector:
                with self._lock:
                    if self.returncode is not None:
                        continue
                    selector.register(self._pidfd, selectors.EVENT_READ)
                selector.select(None if left is None else min(left, 1.0))
        return code

    def terminate(self) -> None:
        """SIGTERM the server if it has not ended."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the server if it has not ended."""
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _fork_server_here(
    mine: socket.socket,
    theirs: socket.socket,
    env: Mapping[str, str],
    preload: Sequence[str],
    entry: Entry,
) -> _ForkedServer:
    """Import ``preload`` here, then fork the server from this (single-threaded) process.

    The child becomes what ``python -m elasticps.launcher.fork_server_main``
    would be: a session of its own, SIGTERM when this thread dies
    (``PR_SET_PDEATHSIG``), stdin from ``/dev/null``, ``env`` as its
    environment, unbuffered standard streams (``PYTHONUNBUFFERED``), glibc's
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` of ``env``
    applied with ``mallopt`` (glibc reads the variables only at start-up),
    and no logging handler of ours. Arrow's ``JE_ARROW_MALLOC_CONF`` is read
    when pyarrow is first imported, so it is set here before the import.

    Raises:
        OSError: the fork failed.
    """
    if "JE_ARROW_MALLOC_CONF" in env and "pyarrow" not in sys.modules:
        os.environ["JE_ARROW_MALLOC_CONF"] = env["JE_ARROW_MALLOC_CONF"]
    _import_all(preload)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return _ForkedServer(pid)
    code = 1
    try:
        mine.close()
        os.setsid()
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)  # the launcher died before the signal was armed
        _become_server(env)
        code = serve([str(theirs.fileno()), ""], entry)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_now(code)


def _become_server(env: Mapping[str, str]) -> None:
    """Set up a freshly forked server as a new process would start (see _fork_server_here)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    root = logging.getLogger()
    for logger in [root, *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
    root.setLevel(logging.WARNING)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw,  # type: ignore[arg-type]
            encoding=old.encoding,
            errors=old.errors,
            write_through=True,
        )
        setattr(sys, name, stream)
    if sys.platform.startswith("linux"):
        libc = _libc()
        for option, name in ((_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"),
                             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_")):  # fmt: skip
            value = env.get(name, "")
            if value.isdigit():
                libc.mallopt(option, min(int(value), _INT_MAX))


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1  # mallopt takes a C int


def _import_all(names: Sequence[str]) -> None:
    """Import ``names`` (see :func:`importing`); one that cannot be imported is left to
    the child, which then says what is missing."""
    with importing():
        for name in names:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a block of imports, then freeze what
    they made.

    Importing torch and the role modules makes a few million objects and
    frees almost none, yet every few hundred allocations start a collection
    over what was made so far: about a fifth of the imports' time here
    (benchmarks/README.md). At the end, :func:`gc.freeze` moves every object
    made so far out of the collector's sight before it runs again (else its
    first collection would scan them all), as CPython's documentation advises
    before a fork: forked children neither scan the imported modules nor copy
    their pages by touching the objects' headers. Cycles made in the block
    are never collected; imports make next to none.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _libc() -> ctypes.CDLL:
    """The C library (Linux), for ``prctl`` and ``mallopt``."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _wait_gone(pid: int) -> None:
    """Block until process ``pid`` (not our child) has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            selector.select()
    finally:
        os.close(fd)


@contextlib.contextmanager
def start_spawner(method: str, *, inline_entry: Entry | None = None) -> Iterator[Spawner]:
    """The spawner ``method`` names (``fork`` or ``exec``), closed on exit.

    ``inline_entry``: a fork server forked from this process, whose children
    run it (see :class:`ForkServer`).

    Raises:
        ElasticPSError: the fork server could not be started.
        ValueError: an unknown method.
    """
    if method == "exec":
        yield ExecSpawner()
        return
    if method != "fork":
        raise ValueError(f"unknown spawn method {method!r}")
    server = ForkServer(child_env("fork-server"), inline_entry=inline_entry)
    try:
        yield server
    finally:
        server.close()


def exit_now(code: int) -> NoReturn:
    """Flush logging and the standard streams, then end the process with ``code``.

    Skips tearing down the interpreter, which takes 0.5 s here once torch is
    imported; for processes that have already stopped their children, closed
    their files and joined their threads. A flush that fails (a closed pipe)
    does not stop the exit.
    """
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# --- the server process ----------------------------------------------------------------


#: What a forked child runs: the ``elasticps`` command's ``main`` (its argument list
#: -> exit status), imported by the child after the fork.
Entry = Callable[[list[str]], int]


def _serve(sock: socket.socket, preload: Sequence[str], entry: Entry) -> None:
    """The server's loop: fork on request, report exits; return when the launcher hangs up."""
    _import_all(preload)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    server_fds = (sock.fileno(), wake_r, wake_w, selector.fileno())
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _report_exits(sock)
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
            if not data:
                return
            _spawn(sock, data, fds, server_fds, entry)
        # A SIGCHLD may have raced with the select; reaping is cheap.
        _report_exits(sock)


def _spawn(
    sock: socket.socket, data: bytes, fds: list[int], server_fds: tuple[int, ...], entry: Entry
) -> None:
    request_id: object = None
    try:
        message = json.loads(data)
        request_id = message.get("id")
        args, env = message["args"], message["env"]
        if len(fds) != 1 or not isinstance(args, list) or not isinstance(env, dict):
            raise ValueError("a spawn request needs 'args', 'env' and one file descriptor")
        sys.stdout.flush()
        sys.stderr.flush()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            environment = {str(k): str(v) for k, v in env.items()}
            _child([str(a) for a in args], environment, fds[0], server_fds, ready_w, entry=entry)
        # As Popen does, answer once the child has its session, parent-death
        # signal and file descriptors: it closes ready_w then (or dies).
        os.close(ready_w)
        os.read(ready_r, 1)
        os.close(ready_r)
        _send(sock, {"op": "started", "id": request_id, "pid": pid})
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        _send(sock, {"op": "failed", "id": request_id, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        for fd in fds:
            os.close(fd)


def _child(
    args: list[str],
    env: dict[str, str],
    out_fd: int,
    server_fds: tuple[int, ...],
    ready_fd: int,
    *,
    entry: Entry,
) -> None:
    """Become ``elasticps <args>`` (``entry(args)``), closing ``ready_fd`` once set up;
    never returns."""
    code = 1
    try:
        server_pid = os.getppid()
        os.setsid()
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != server_pid:
            os._exit(1)  # the server died before the signal was armed
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(devnull)
        os.close(out_fd)
        os.close(ready_fd)
        os.environ.clear()
        os.environ.update(env)
        # The process whose death orphans us is the server, not the launcher.
        os.environ["ELASTICPS_PARENT_PID"] = str(server_pid)
        code = entry(args)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives (None: 0, an int: itself, else printed and 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"op": "exited", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: we are about to stop
        sock.send(json.dumps(message).encode())


def _set_parent_death_signal(signum: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, signum)`` on Linux; a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    libc = _libc()
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def serve(argv: Sequence[str], entry: Entry) -> int:
    """Run the fork server until the launcher hangs up; the body of its process.

    :mod:`elasticps.launcher.fork_server_main` calls this with the ``elasticps``
    command's ``main`` as ``entry``. The entry is passed in, not imported here,
    because the launchers import this module and the command imports the
    launchers.

    Args:
        argv: ``[fd, preload]``: the inherited socket's file descriptor, and the
            modules to import before the first fork, comma-separated.
        entry: what each forked child runs with its ``elasticps`` arguments.

    Returns:
        The server's exit status, 0.
    """
    fd, preload = int(argv[0]), [m for m in argv[1].split(",") if m]
    # Ctrl-C and the launcher's SIGTERM handling are the launcher's business;
    # we stop when its socket closes (or by SIGTERM from setpriv if it dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.monotonic()
    sock = socket.socket(fileno=fd)
    try:
        _serve(sock, preload, entry)
    finally:
        sock.close()
    log.debug("fork server ran for %.1f s", time.monotonic() - started)
    return 0


_T = TypeVar("_T")


def run_beside(work: Callable[[], _T], poll: Callable[[], object], every_s: float, name: str) -> _T:
    """Run ``work`` in a helper thread while this thread calls ``poll`` every ``every_s`` s.

    For work that needs the job's processes while one may die and be
    restarted (the final checkpoint, the final pull): the restarts stay in
    the calling thread, the one that started the children, because a child
    started with a parent-death signal is signalled when the *thread* that
    started it exits.

    Args:
        work: what to run; its result is returned.
        poll: called in this thread until ``work`` ends (it may raise).
        every_s: seconds between two calls of ``poll``.
        name: the helper thread's name.

    Returns:
        What ``work`` returned.

    Raises:
        Exception: what ``poll`` or ``work`` raised.
    """
    done = threading.Event()
    outcome: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while not done.wait(every_s):
        poll()
    thread.join()
    if errors:
        raise errors[0]
    return outcome[0]
