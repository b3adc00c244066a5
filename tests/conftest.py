"""Shared fixtures: real etcd servers on free loopback ports, stopped by PID."""

from __future__ import annotations

import compileall
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import elasticps
from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig


def pytest_configure(config: pytest.Config) -> None:
    """Compile the package's modules to bytecode once.

    The tests start hundreds of Python processes (jobs, commands). Where the
    environment stops Python from writing bytecode (``PYTHONDONTWRITEBYTECODE``),
    each of them would compile every module of the package again: about 0.5 s
    of CPU per process. Writing is atomic, so xdist workers may race here.
    """
    compileall.compile_dir(Path(elasticps.__file__).parent, quiet=1)


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
