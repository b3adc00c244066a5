"""``elasticps.testing.command_server``: commands forked from a server behave as new processes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.testing import child_pids, pid_gone, wait_for
from elasticps.testing.command_server import CommandServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server() -> Iterator[CommandServer]:
    with CommandServer() as commands:
        yield commands


def test_output_exit_status_directory_and_environment_are_the_commands_own(
    server: CommandServer, tmp_path: Path
) -> None:
    helped = server.run(["--help"], timeout_s=60)
    assert (helped.returncode, helped.stderr) == (0, "")
    assert helped.stdout.startswith("usage: elasticps")

    # The model file is found in the working directory given, not the server's.
    (tmp_path / "model.py").write_text("")
    args = ["train", "--model", "model.py", "--data", "nodata", "--output", "out"]
    here = server.run(args, timeout_s=60, cwd=tmp_path)
    assert (here.returncode, here.stdout) == (2, "")
    assert here.stderr == "elasticps: error: data file not found: nodata\n"
    elsewhere = server.run(args, timeout_s=60, cwd=tmp_path / "..")
    assert elsewhere.stderr == "elasticps: error: model file not found: model.py\n"

    # The environment given is the command's whole environment.
    env = dict(os.environ, ELASTICPS_SPAWN="bogus")
    bogus = server.run(args, timeout_s=60, cwd=tmp_path, env=env)
    assert bogus.returncode == 2
    assert "--spawn must be one of fork, exec, got 'bogus'" in bogus.stderr
    assert server.run(args, timeout_s=60, cwd=tmp_path).stderr == here.stderr


def test_a_command_past_its_timeout_is_killed(server: CommandServer, tmp_path: Path) -> None:
    # Its import never returns: it waits on an event nothing sets.
    (tmp_path / "model.py").write_text("import threading\n\nthreading.Event().wait()\n")
    (tmp_path / "train.parquet").write_bytes(b"")  # not read: the model never loads
    before = set(child_pids(server.pid))
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(
            ["train", "--model", "model.py", "--data", "train.parquet", "--output", "out"],
            timeout_s=3,
            cwd=tmp_path,
        )
    wait_for(
        lambda: all(pid_gone(p) for p in set(child_pids(server.pid)) - before),
        "the command to be killed",
        timeout_s=10,
    )
