"""A core-only install (``pip install elasticps``, no extras) imports, and says what is missing.

The packages of the extras are made unimportable in a child interpreter by
``tests/core_only/sitecustomize.py`` (see there); the whole job on such an
install is run by ``tests/integration/test_job_commands.py`` (the job-file test).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CORE_ONLY = Path(__file__).resolve().parents[1] / "core_only"
MLP = Path(__file__).resolve().parents[2] / "examples" / "mnist_mlp.py"


def core_only_env() -> dict[str, str]:
    """The environment of a child process that runs as a core-only install would."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(CORE_ONLY), path) if p))


def run_core_only(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=core_only_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(180)
def test_every_module_imports_without_the_extras() -> None:
    script = """
import importlib, pkgutil, sys
import elasticps
try:
    import kubernetes
except ImportError:
    pass
else:
    sys.exit("the blocker is not active")
failed = []
for info in pkgutil.walk_packages(elasticps.__path__, "elasticps."):
    if info.name.endswith(("__main__", "fork_server_main")):
        continue  # entry points: importing them runs them
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        failed.append(f"{info.name}: {exc}")
print("\\n".join(failed))
"""
    done = run_core_only("-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"modules that need an extra:\n{done.stdout}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["data", "mnist", "--output", "data"], "examples"),
        (
            ["submit", "--image", "i", "--model", "m.py", "--data", "/d", "--dry-run"],
            "kubernetes",
        ),
        (["status", "j", "--backend", "kubernetes"], "kubernetes"),
        (["train", "--model", str(MLP), "--data", "s3://bucket/mnist"], "storage"),
        (["train", "--model", str(MLP), "--data", "kafka://127.0.0.1:9/topic"], "kafka"),
    ],
    ids=["data-mnist", "submit", "status-kubernetes", "train-s3", "train-kafka"],
)
def test_a_command_that_needs_a_missing_extra_says_what_to_install(
    tmp_path: Path, argv: list[str], extra: str
) -> None:
    (tmp_path / "m.py").write_text("")
    done = run_core_only("-m", "elasticps", *argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("elasticps: error: ")
    assert f"pip install 'elasticps[{extra}]'" in lines[0]
    assert not (tmp_path / "data").exists()


@pytest.mark.timeout(90)
def test_the_command_line_imports_no_torch() -> None:
    """``elasticps --help``, ``list`` and ``stop`` never need torch, and ``train``
    starts its fork server (which imports torch) before the launcher imports it
    itself: importing the command line must not import torch (about 2 s of CPU)."""
    code = "import sys, elasticps.cli\nprint('torch' in sys.modules)\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
