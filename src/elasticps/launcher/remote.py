"""The process the ssh launcher runs on each host: it starts one role and stops it with the session.

``python -m elasticps.launcher.remote`` reads one JSON line from standard
input, the *request* (at most :data:`MAX_REQUEST_BYTES`), then control lines:

- ``{"run": [ARGS...], "env": {...}, "files": {NAME: BASE64}, "cwd": DIR,
  "route_to": ADDRESS}``: write ``files`` into a new private directory (each
  file mode 0600), replace ``@FILES@`` in every argument and ``env`` value with
  that directory, and run
  ``python -m elasticps ARGS`` with the host's own environment plus ``env``.
  ``ELASTICPS_HOST`` becomes this host's source address on its route to
  ``route_to`` (the launching machine), so the role listens where the other
  hosts reach it; ``ELASTICPS_PARENT_PID`` becomes this process, so the
  role stops when it does; ``ELASTICPS_RUNTIME_DIR`` is a private directory.
  The process exits with the role's status (``128 + N`` if signal N killed
  it), which ssh hands back to the launcher.
  With ``"module": NAME`` the role is ``python -m NAME ARGS`` instead; NAME is
  one of :data:`MODULES` (an etcd member runs as
  ``elasticps.coord.etcd_member``).
- ``{"check": {"read": [PATHS], "write": [DIRS], "connect": ["HOST:PORT"]},
  "route_to": ADDRESS}``: print one JSON line ``{"problems": [...], "host":
  HOSTNAME, "address": ADDRESS}`` that names each path this host cannot read
  or write and each address it cannot reach (TCP, 5 s), and gives this host's
  source address on its route to ``route_to`` (empty without it), then exit 0.

After a ``run`` request, a line ``TERM`` or ``INT`` sends that signal to the
role and ``KILL`` kills it; ``PING`` (any line) says the launcher is there. With
``"silence_s": S`` in the request, S seconds without a line (the launcher died,
or this host is cut off from it) stop the role as the end of the session does.
The end of standard input (the ssh session closed: the launcher stopped it,
died, or lost the host) sends SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`
seconds. SIGTERM or SIGHUP to this process is forwarded as SIGTERM. The private
directory is removed at the end.

No pickle, and no secret on a command line: the request travels on stdin.
Nothing here imports torch.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

__all__ = [
    "FILES_TOKEN",
    "MAX_REQUEST_BYTES",
    "MODULES",
    "STOP_GRACE_S",
    "check",
    "exit_with",
    "main",
    "route_address",
]

FILES_TOKEN = "@FILES@"
"""Replaced, in every argument of a ``run`` request, by the directory of its files."""

MAX_REQUEST_BYTES = 64 << 20
"""Largest request line, bytes (the model file travels in it)."""

MODULES = ("elasticps", "elasticps.coord.etcd_member")
"""The modules a ``run`` request may name (``"module"``); the first is the default."""

STOP_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL when the session ends."""

_CONNECT_TIMEOUT_S = 5.0


def route_address(peer: str) -> str:
    """This host's source address on its route to ``peer`` (no packet is sent).

    Raises:
        OSError: there is no route to ``peer``.
    """
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return str(probe.getsockname()[0])


def check(read: Sequence[str], write: Sequence[str], connect: Sequence[str]) -> list[str]:
    """What this host cannot do of a job's needs, one line each (empty: all fine).

    Args:
        read: files or directories that must exist and be readable.
        write: directories that must be writable (created if missing).
        connect: ``HOST:PORT`` addresses that must accept a TCP connection
            (tried for :data:`_CONNECT_TIMEOUT_S` seconds each).
    """
    problems = []
    for path in read:
        if not os.path.exists(path):
            problems.append(f"{path} does not exist")
        elif not os.access(path, os.R_OK):
            problems.append(f"{path} is not readable")
    for path in write:
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".elasticps-check-"):
                pass
        except OSError as exc:
            problems.append(f"{path} is not writable: {exc.strerror or exc}")
    for address in connect:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while True:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    problems.append(f"cannot reach {address}: {exc.strerror or exc}")
                    break
                time.sleep(0.2)
    return problems


def _strings(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of strings")
    return list(value)


def _mapping(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{what} must be an object of strings")
    return dict(value)


def _run(request: Mapping[str, object], program: Sequence[str]) -> int:
    args = _strings(request["run"], "run")
    extra = _mapping(request.get("env", {}), "env")
    files = _mapping(request.get("files", {}), "files")
    silence_s = request.get("silence_s", 0)
    if not isinstance(silence_s, (int, float)) or silence_s < 0:
        raise ValueError("silence_s must be a number >= 0")
    workdir = Path(tempfile.mkdtemp(prefix="elasticps-role-"))
    try:
        for name, data in files.items():
            if "/" in name or name in ("", ".", ".."):
                print(f"elasticps: error: bad file name {name!r} in the request", flush=True)
                return 2
            fd = os.open(workdir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(base64.b64decode(data))
        args = [a.replace(FILES_TOKEN, str(workdir)) for a in args]
        env = dict(os.environ)
        env.update({k: v.replace(FILES_TOKEN, str(workdir)) for k, v in extra.items()})
        env["ELASTICPS_PARENT_PID"] = str(os.getpid())
        runtime = workdir / "run"
        runtime.mkdir()
        env["ELASTICPS_RUNTIME_DIR"] = str(runtime)
        route_to = str(request.get("route_to") or "")
        if route_to:
            try:
                env["ELASTICPS_HOST"] = route_address(route_to)
            except OSError as exc:
                print(f"elasticps: unavailable: no route to {route_to}: {exc}", flush=True)
                return 1
        cwd = str(request.get("cwd") or "")
        child = subprocess.Popen(
            [*program, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            start_new_session=True,
        )
        return _supervise(child, float(silence_s))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(child: subprocess.Popen[bytes], silence_s: float) -> int:
    """Relay control lines and the session's end to ``child``; return its status.

    With ``silence_s`` > 0, ``child`` is stopped as at the session's end when
    no line arrives for that many seconds (the launcher sends ``PING`` lines).
    """
    heard = [time.monotonic()]

    def send(signum: int) -> None:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    def on_signal(signum: int, frame: object) -> None:
        send(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the launcher's INT line counts
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def relay() -> None:
        for raw in sys.stdin.buffer:
            heard[0] = time.monotonic()
            word = raw.strip()
            if word == b"TERM":
                send(signal.SIGTERM)
            elif word == b"INT":
                send(signal.SIGINT)
            elif word == b"KILL":
                send(signal.SIGKILL)
        stop_child()

    def stop_child() -> None:
        """The session ended: stop the role, then kill it after the grace."""
        send(signal.SIGTERM)
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)

    threading.Thread(target=relay, name="remote-control", daemon=True).start()
    while True:
        try:
            code = child.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            if silence_s and time.monotonic() - heard[0] > silence_s:
                print(
                    f"elasticps: unavailable: nothing from the launcher for {silence_s:g} s; "
                    "stopping",
                    flush=True,
                )
                stop_child()
                silence_s = 0.0
    return code if code >= 0 else 128 - code


def main(program: Sequence[str] | None = None) -> int:
    """Serve one request from standard input (see the module docstring).

    Args:
        program: what a ``run`` request's arguments are given to; by default
            ``python -m elasticps``.

    Returns:
        The exit status: the role's, 0 after a ``check``, 2 for a bad request.
    """
    line = sys.stdin.buffer.readline(MAX_REQUEST_BYTES + 1)
    try:
        if len(line) > MAX_REQUEST_BYTES:
            raise ValueError(f"the request is over {MAX_REQUEST_BYTES} bytes")
        request = json.loads(line)
        if not isinstance(request, dict) or not ("run" in request or "check" in request):
            raise ValueError("the request is not a JSON object with 'run' or 'check'")
        if "check" in request:
            need = request["check"]
            if not isinstance(need, dict):
                raise ValueError("check must be an object")
            problems = check(
                _strings(need.get("read", []), "check.read"),
                _strings(need.get("write", []), "check.write"),
                _strings(need.get("connect", []), "check.connect"),
            )
            route_to = request.get("route_to", "")
            if not isinstance(route_to, str):
                raise ValueError("route_to must be a string")
            address = ""
            if route_to:
                try:
                    address = route_address(route_to)
                except OSError as exc:
                    problems.append(f"no route to {route_to}: {exc.strerror or exc}")
            answer = {"problems": problems, "host": socket.gethostname(), "address": address}
            print(json.dumps(answer), flush=True)
            return 0
        module = request.get("module", MODULES[0])
        if module not in MODULES:
            raise ValueError(f"module must be one of {', '.join(MODULES)}, got {module!r}")
        if program is None:
            program = (sys.executable, "-m", str(module))
        return _run(request, program)
    except ValueError as exc:
        print(f"elasticps: error: bad request from the launcher: {exc}", flush=True)
        return 2


def exit_with(program: Sequence[str] | None = None) -> NoReturn:
    """:func:`main`, then exit with its status at once.

    There is no interpreter shutdown: the control thread may still be
    blocked reading standard input, which Python cannot finalize.
    """
    status = main(program)
    sys.stdout.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_with()
