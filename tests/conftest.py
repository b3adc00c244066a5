"""Shared fixtures: real etcd servers on free loopback ports, stopped by PID."""

from __future__ import annotations

import compileall
import importlib.util
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import elasticps
from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig


def pytest_configure(config: pytest.Config) -> None:
    """Let the processes the tests start keep their bytecode; one compute thread each.

    The tests start hundreds of Python processes (jobs, commands), and the
    install command skips compiling to bytecode (``pip install --no-compile``).
    Where the environment stops Python from writing bytecode
    (``PYTHONDONTWRITEBYTECODE``), each process would compile every module it
    imports again: about 11 s of CPU for torch, pyarrow, pandas and gRPC, and
    0.5 s for this package. So the variable is dropped here, before xdist
    starts its workers, whose environment every test's process inherits, and
    the package is compiled once. Writing bytecode is atomic, so processes may
    race to write the same file.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    # The suite runs several jobs at once on few cores: every process computes on
    # one thread (as the roles do), so that OpenMP threads do not spin against
    # each other. A multi-threaded evaluation beside two other jobs took 10x longer.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    compileall.compile_dir(Path(elasticps.__file__).parent, quiet=1)
    if "PYTEST_XDIST_WORKER" not in os.environ and not _has_bytecode("torch"):
        # Fresh install: compile what every worker imports once, here, before the
        # workers start, rather than in each of them at once (about 11 s of CPU each).
        subprocess.run([sys.executable, "-c", f"import {', '.join(WARM_IMPORTS)}"], check=False)


WARM_IMPORTS = ("torch", "pyarrow.parquet", "pandas", "grpc", "pyetcd", "hypothesis")
"""What the test modules and every job import: compiled before xdist starts its workers."""


def _has_bytecode(module: str) -> bool:
    """Whether ``module``'s own source has been compiled to bytecode (it is not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return True
    return Path(importlib.util.cache_from_source(spec.origin)).is_file()


@pytest.fixture(autouse=True, scope="session")
def _forked_commands() -> Iterator[None]:
    """Jobs run by ``elasticps.testing.run_elasticps`` and ``run_train`` are forked
    from one process per test worker that has imported torch (about 3.5 s of
    CPU less per job). Tests of how the command starts run it the usual way."""
    from elasticps.testing import fork_commands

    fork_commands(True)
    yield
    fork_commands(False)


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Jobs started by tests register their runs here, not in the user's state directory."""
    from elasticps.jobs import STATE_DIR_ENV

    previous = os.environ.get(STATE_DIR_ENV)
    os.environ[STATE_DIR_ENV] = str(tmp_path_factory.mktemp("elasticps-state"))
    yield
    if previous is None:
        os.environ.pop(STATE_DIR_ENV, None)
    else:
        os.environ[STATE_DIR_ENV] = previous


def _start_etcd(base: Path) -> EtcdServer:
    server = EtcdServer(
        EtcdServerConfig(data_dir=base / "data", client_port=0), log_path=base / "etcd.log"
    )
    server.start()
    return server


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One running etcd per test module, on a free port; stopped by PID afterwards.

    Tests sharing it must use distinct job names (see ``job_name``) and must not
    stop, kill or restart it; use ``etcd_server_factory`` for that.
    """
    server = _start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_server_factory(tmp_path: Path) -> Iterator[Callable[[], EtcdServer]]:
    """Start private etcd servers (each on fresh ports and data dir) for one test.

    Every server started through the factory is stopped by PID at teardown, even
    if the test killed or restarted it.
    """
    servers: list[EtcdServer] = []

    def start() -> EtcdServer:
        server = _start_etcd(tmp_path / f"etcd{len(servers)}")
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def job_name(request: pytest.FixtureRequest) -> str:
    """A job name unique to this test, so tests can share one etcd."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"
