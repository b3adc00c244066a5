"""Mistakes that need neither torch nor the network are refused before torch is imported.

``tests/integration/test_cli_errors.py`` checks the messages; this checks that
``elasticps train`` gives them without importing torch, gRPC or pandas, the
imports that take about 3.5 s of CPU.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elasticps import netutil
from elasticps.netutil import LOOPBACK

pytestmark = pytest.mark.timeout(60)

MLP = Path(__file__).resolve().parents[2] / "examples" / "mnist_mlp.py"

SCRIPT = """
import json, sys
from elasticps.cli import main
code = main(sys.argv[1:])
heavy = [m for m in ("torch", "grpc", "pandas") if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}))
"""


def train_refused(*args: str | Path) -> tuple[str, list[str]]:
    """Run ``elasticps train ARGS`` in a fresh interpreter: its error line and its heavy imports."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "train", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] == 2, done
    (line,) = done.stderr.splitlines()
    return line, result["heavy"]


def test_a_missing_model_file_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    line, heavy = train_refused(
        "--model", tmp_path / "missing.py", "--data", tmp_path, "--output", tmp_path / "out"
    )
    assert line == f"elasticps: error: model file not found: {tmp_path / 'missing.py'}"
    assert heavy == []


def test_a_data_directory_without_training_files_is_refused_before_torch_is_imported(
    tmp_path: Path,
) -> None:
    line, heavy = train_refused("--model", MLP, "--data", tmp_path, "--output", tmp_path / "out")
    assert "data file not found" in line and str(tmp_path / "train.parquet") in line
    assert heavy == []


def test_a_port_in_use_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"")  # only its name is checked here
    with socket.socket() as held:
        held.bind((LOOPBACK, 0))
        held.listen()
        port = held.getsockname()[1]
        line, heavy = train_refused(
            "--model", MLP, "--data", tmp_path / "data", "--output", tmp_path / "out",
            "--etcd-port", str(port),
        )  # fmt: skip
    assert "--etcd-port" in line and str(port) in line
    assert heavy == []


def test_a_jobs_output_directory_as_resume_is_refused_before_torch_is_imported(
    tmp_path: Path,
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"")
    run = tmp_path / "run"
    (run / "snapshot").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    line, heavy = train_refused(
        "--model", MLP, "--data", tmp_path / "data", "--output", tmp_path / "out",
        "--resume", run,
    )  # fmt: skip
    assert f"its consistent checkpoint is {run / 'snapshot'}" in line
    assert heavy == []


def test_a_free_port_is_below_the_ephemeral_range_so_no_connection_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    low, _ = netutil.ephemeral_ports()
    ports = {netutil.free_port() for _ in range(20)}
    assert all(netutil.PORT_FLOOR <= p < low for p in ports), ports
    # A range that leaves no room below it: the kernel picks.
    squeezed = tmp_path / "range"
    squeezed.write_text(f"{netutil.PORT_FLOOR}\t65000\n")
    monkeypatch.setattr(netutil, "_EPHEMERAL_RANGE_FILE", str(squeezed))
    assert netutil.ephemeral_ports() == (netutil.PORT_FLOOR, 65000)
    assert 0 < netutil.free_port() <= 65535
    monkeypatch.setattr(netutil, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert netutil.ephemeral_ports() == (49152, 65535)
