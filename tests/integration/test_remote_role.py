"""The host's end of an ssh role (:mod:`elasticps.launcher.remote`), run here without ssh.

A stand-in role (a short Python program) replaces ``python -m elasticps``; the
request arrives on stdin as the ssh launcher sends it. Checked: files and
``@FILES@``, the environment a role gets, control lines, the end of the
session, the launcher's silence, the exit status, bad requests, and the
preflight check.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticps.testing import pid_gone, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# The stand-in role: prints its pid, its environment and its files, then
# sleeps until a signal (and exits 7 on SIGTERM) or exits with argv's status.
ROLE = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
path = sys.argv[1]
print(json.dumps({"pid": os.getpid(), "model": open(path).read() if os.path.exists(path) else None,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("ELASTICPS_")},
                  "cwd": os.getcwd(), "argv": sys.argv[1:]}), flush=True)
if sys.argv[2] == "wait":
    while True:
        time.sleep(0.05)
sys.exit(int(sys.argv[2]))
"""

SERVE = "from elasticps.launcher.remote import exit_with; exit_with({program})"


def start(tmp_path: Path) -> subprocess.Popen[bytes]:
    role = tmp_path / "role.py"
    role.write_text(ROLE)
    program = repr([sys.executable, str(role)])
    return subprocess.Popen(
        [sys.executable, "-c", SERVE.format(program=program)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def run_request(how: str, tmp_path: Path, **extra: object) -> dict[str, object]:
    model = base64.b64encode(b"MODEL = 1\n").decode()
    return {
        "run": ["@FILES@/0-model.py", how],
        "env": {"ELASTICPS_JOB": "j1"},
        "files": {"0-model.py": model},
        "cwd": str(tmp_path),
        "route_to": "127.0.0.1",
        **extra,
    }


def send(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


def first_line(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    assert proc.stdout is not None
    answer: dict[str, object] = json.loads(proc.stdout.readline())
    return answer


def test_a_role_gets_its_files_its_environment_and_its_status_back(tmp_path: Path) -> None:
    proc = start(tmp_path)
    send(proc, json.dumps(run_request("5", tmp_path)))
    seen = first_line(proc)
    assert proc.wait(timeout=20) == 5
    assert seen["model"] == "MODEL = 1\n"
    argv = seen["argv"]
    assert isinstance(argv, list) and "@FILES@" not in argv[0]
    env = seen["env"]
    assert isinstance(env, dict)
    assert env["ELASTICPS_JOB"] == "j1"
    assert env["ELASTICPS_HOST"] == "127.0.0.1"  # its address on the route to the launcher
    assert env["ELASTICPS_PARENT_PID"] == str(proc.pid)
    assert Path(env["ELASTICPS_RUNTIME_DIR"]).name == "run"
    assert seen["cwd"] == str(tmp_path)
    assert not Path(argv[0]).exists()  # its private directory is gone


@pytest.mark.parametrize("how", ["term", "eof", "silence"])
def test_the_role_stops_on_a_term_line_the_end_of_the_session_or_silence(
    tmp_path: Path, how: str
) -> None:
    proc = start(tmp_path)
    extra = {"silence_s": 1.0} if how == "silence" else {}
    send(proc, json.dumps(run_request("wait", tmp_path, **extra)))
    role = int(str(first_line(proc)["pid"]))
    if how == "term":
        send(proc, "PING")
        send(proc, "TERM")
    elif how == "eof":
        assert proc.stdin is not None
        proc.stdin.close()
    assert proc.wait(timeout=20) == 7  # the role's own status on SIGTERM
    wait_for(lambda: pid_gone(role), "the role gone", timeout_s=10)


def test_a_kill_line_kills_the_role_and_reports_the_signal(tmp_path: Path) -> None:
    proc = start(tmp_path)
    send(proc, json.dumps(run_request("wait", tmp_path)))
    role = int(str(first_line(proc)["pid"]))
    send(proc, "KILL")
    assert proc.wait(timeout=20) == 128 + signal.SIGKILL
    wait_for(lambda: pid_gone(role), "the role gone", timeout_s=10)


@pytest.mark.parametrize(
    ("request_line", "why"),
    [
        ("not json", "Expecting value"),
        ("[1, 2]", "a JSON object with 'run' or 'check'"),
        ('{"run": "ps"}', "run must be a list of strings"),
        ('{"run": ["ps"], "files": {"../x": "AA=="}}', "bad file name"),
        ('{"run": ["ps"], "silence_s": -1}', "silence_s must be a number"),
    ],
)
def test_a_bad_request_is_refused_in_one_line(tmp_path: Path, request_line: str, why: str) -> None:
    proc = start(tmp_path)
    send(proc, request_line)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=20) == 2
    assert out.startswith("elasticps: error:") and why in out, out
    assert not (tmp_path.parent / "x").exists()


def test_the_check_names_each_path_and_address_a_host_lacks(tmp_path: Path) -> None:
    readable = tmp_path / "data"
    readable.mkdir()
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    proc = start(tmp_path)
    with socket_listening() as port:
        need = {
            "read": [str(readable), str(tmp_path / "missing")],
            "write": [str(tmp_path / "out"), str(blocked / "under-a-file")],
            "connect": [f"127.0.0.1:{port}"],
        }
        send(proc, json.dumps({"check": need}))
        answer = first_line(proc)
    assert proc.wait(timeout=20) == 0
    problems = answer["problems"]
    assert isinstance(problems, list) and len(problems) == 2, problems
    assert f"{tmp_path / 'missing'} does not exist" in problems
    assert any(p.startswith(f"{blocked / 'under-a-file'} is not writable") for p in problems)
    assert (tmp_path / "out").is_dir()
    assert answer["host"] == os.uname().nodename


class socket_listening:  # noqa: N801 - used as a context manager
    """A TCP listener on a free loopback port, for the connect check."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.create_server(("127.0.0.1", 0))
        return int(self._sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
