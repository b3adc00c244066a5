"""Fixtures shared by the integration tests that run whole jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MNIST Parquet files, written once per test session by ``elasticps data mnist``.

    Tests only read them. ``test_cli_errors`` defines its own, since the
    command itself is what it checks.
    """
    out = tmp_path_factory.mktemp("mnist")
    done = subprocess.run(
        [sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out
