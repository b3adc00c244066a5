"""Spawners (elasticps.launcher.spawn): forked and exec'ed role processes behave alike.

Real processes: ``elasticps`` commands run through a ForkServer and an
ExecSpawner. A long-lived role is a spare parameter server waiting for the one slot of a
job, which the test holds (it waits as long as ``--claim-timeout-s``).
Every process a test starts is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.coord.etcd_server import EtcdServer
from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError
from elasticps.launcher.spawn import (
    ExecSpawner,
    ForkServer,
    ProcessHandle,
    Spawner,
    child_env,
    start_spawner,
    terminate,
    wait_or_kill,
)
from elasticps.testing import pid_gone, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DEADLINE_S = 30.0


@pytest.fixture(params=["fork", "exec"])
def spawner(request: pytest.FixtureRequest) -> Iterator[Spawner]:
    with start_spawner(request.param) as made:
        yield made


def _output(proc: ProcessHandle) -> str:
    assert proc.stdout is not None
    return proc.stdout.read().decode(errors="replace")


def _stop(proc: ProcessHandle) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def held_slot(etcd_server: EtcdServer) -> Iterator[str]:
    """A job whose only PS slot the test holds; yields the job name."""
    job_name = f"spawn-{uuid.uuid4().hex[:8]}"  # role commands take at most 63 characters
    with JobStore(etcd_server.endpoint, job_name) as store:
        store.set_ps_desired(1)
        lease = store.grant_lease(60.0)
        store.claim_ps_slot_within("127.0.0.1:9", lease, DEADLINE_S)
        try:
            yield job_name
        finally:
            lease.revoke()


def _waiting_ps(spawner: Spawner, etcd: EtcdServer, job: str) -> ProcessHandle:
    """A parameter server waiting for a slot of ``job`` (the test holds the only one).

    Returns once it says so, with its signal handlers in place.
    """
    args = ["ps", "--job", job, "--etcd", etcd.endpoint, "--claim-timeout-s", "600"]
    proc = spawner.start(args, child_env("ps"))
    assert proc.stdout is not None
    deadline = time.monotonic() + DEADLINE_S
    for line in iter(proc.stdout.readline, b""):  # ends at EOF, if it died
        if b"claiming a slot" in line or time.monotonic() > deadline:
            break
    return proc


def test_output_and_exit_status_come_back_through_the_handle(spawner: Spawner) -> None:
    ok = spawner.start(["--help"], child_env("help"))
    bad = spawner.start(["train", "--no-such-flag"], child_env("train"))

    assert "usage: elasticps" in _output(ok)
    assert ok.wait(timeout=DEADLINE_S) == 0
    assert "elasticps: error:" in _output(bad)
    assert bad.wait(timeout=DEADLINE_S) == 2
    assert bad.poll() == 2


def test_a_role_runs_in_its_own_session_and_its_signals_are_reported(
    spawner: Spawner, etcd_server: EtcdServer, held_slot: str
) -> None:
    ps = _waiting_ps(spawner, etcd_server, held_slot)
    try:
        assert os.getsid(ps.pid) == ps.pid
        with pytest.raises(subprocess.TimeoutExpired):
            ps.wait(timeout=0.2)
        assert ps.poll() is None
        ps.send_signal(signal.SIGKILL)
        assert ps.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    finally:
        _stop(ps)
    wait_for(lambda: pid_gone(ps.pid), "the killed process to be reaped")


def test_sigterm_stops_a_role_cleanly(
    spawner: Spawner, etcd_server: EtcdServer, held_slot: str
) -> None:
    ps = _waiting_ps(spawner, etcd_server, held_slot)
    try:
        ps.send_signal(signal.SIGTERM)
        assert ps.wait(timeout=DEADLINE_S) == 0  # asked to stop while waiting for a slot
    finally:
        _stop(ps)


def test_forked_roles_are_children_of_the_server_and_stop_when_it_closes(
    etcd_server: EtcdServer, held_slot: str
) -> None:
    server = ForkServer(child_env("fork-server"))
    try:
        ps = _waiting_ps(server, etcd_server, held_slot)
        (server_pid,) = server.pids().values()
        with open(f"/proc/{ps.pid}/stat") as stat:
            assert int(stat.read().rsplit(")", 1)[1].split()[1]) == server_pid  # ppid
    finally:
        server.close()
    wait_for(lambda: pid_gone(server_pid), "the fork server to exit")
    # PR_SET_PDEATHSIG: the child got SIGTERM when the server exited.
    wait_for(lambda: pid_gone(ps.pid), "the orphaned child to stop", timeout_s=DEADLINE_S)


def test_the_fork_server_forks_with_no_native_thread_but_openblas_after_preloading() -> None:
    # gRPC, the etcd client and pyarrow are imported before every fork: none
    # may leave a thread running (a fork copies only the calling thread).
    server = ForkServer(child_env("fork-server"))
    try:
        child = server.start(["--version"], child_env("version"))  # answered after the preload
        assert child.wait(timeout=DEADLINE_S) == 0
        (server_pid,) = server.pids().values()
        names = [
            Path(f"/proc/{server_pid}/task/{tid}/comm").read_text().strip()
            for tid in os.listdir(f"/proc/{server_pid}/task")
        ]
    finally:
        server.close()
    assert "jemalloc_bg_thd" not in names
    assert not [n for n in names if n.startswith(("grpc", "default-executor", "resolver"))]
    assert len(names) <= 2, names  # the main thread and numpy's OpenBLAS server


INLINE_SCRIPT = """
import os, sys
from elasticps.cli import main
from elasticps.launcher.spawn import ForkServer, _ForkedServer, child_env
server = ForkServer(child_env("fork-server"), inline_entry=main)
assert isinstance(server._proc, _ForkedServer), "not forked from this process"
(pid,) = server.pids().values()
with open(f"/proc/{pid}/stat") as stat:
    assert int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
child = server.start(["--version"], child_env("version"))
assert child.wait(timeout=60) == 0
out = child.stdout.read().decode()
server.close()
assert server._proc.returncode == 0, server._proc.returncode
print(pid, out.strip())
"""


def test_an_inline_fork_server_is_forked_from_the_launcher_and_serves_alike() -> None:
    # The launcher's way (elasticps train): one import of torch, shared by the
    # launcher and the server forked from it. (A pytest worker runs threads,
    # so ForkServer(inline_entry=...) would start a process here: a script does it.)
    done = subprocess.run(
        [sys.executable, "-c", INLINE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S * 4,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    server_pid, _, version = done.stdout.strip().partition(" ")
    assert version.startswith("elasticps "), done.stdout
    wait_for(lambda: pid_gone(int(server_pid)), "the inline fork server to exit")


def test_a_spawn_after_the_server_is_gone_is_a_clear_error(tmp_path: Path) -> None:
    server = ForkServer(child_env("fork-server"))
    server.close()
    with pytest.raises(ElasticPSError, match="fork server is gone"):
        server.start(["--help"], child_env("help"))


def test_the_exec_spawner_has_no_process_of_its_own() -> None:
    assert ExecSpawner().pids() == {}


def test_the_stop_sequence_terms_then_kills_what_outlives_the_deadline(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    stubborn = subprocess.Popen(  # ignores SIGTERM once its trap is set
        ["sh", "-c", f"trap '' TERM; touch {ready}; while :; do sleep 0.05; done"]
    )
    polite = subprocess.Popen(["sleep", "60"])
    done = subprocess.Popen(["true"])
    try:
        wait_for(ready.exists, "the trap to be set", DEADLINE_S)
        done.wait(timeout=DEADLINE_S)
        terminate([stubborn, polite, done])
        wait_or_kill([stubborn, polite, done], timeout_s=0.5)
        assert polite.returncode == -signal.SIGTERM
        assert stubborn.returncode == -signal.SIGKILL
        assert done.returncode == 0
    finally:
        for proc in (stubborn, polite):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
