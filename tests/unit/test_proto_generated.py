"""The committed control-plane modules match proto/ (run scripts/gen_proto.sh after edits)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("master_pb2.py", "master_pb2_grpc.py", "master_pb2.pyi")


@pytest.mark.timeout(60)
def test_generated_protobuf_modules_are_up_to_date(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
    )
    for name in GENERATED:
        committed = (ROOT / "src" / "elasticps" / "proto" / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"{name} is stale: run scripts/gen_proto.sh"
        )
