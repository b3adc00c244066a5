"""The README's main-job command, run as written, prints the result line the README shows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def readme_blocks(language: str) -> list[str]:
    text = README.read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def main_job_command() -> str:
    """The README's step 2: the line after the comment that starts with ``# 2.``."""
    for block in readme_blocks("bash"):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# 2."):
                return lines[i + 1]
    raise AssertionError("README.md has no '# 2.' step")


def readme_result_line() -> dict[str, object]:
    (block,) = [b for b in readme_blocks("json") if '"checkpoint"' in b]
    line: dict[str, object] = json.loads(block)
    return line


def test_the_main_job_prints_the_result_line_the_readme_shows(tmp_path: Path) -> None:
    command = main_job_command()
    assert command.startswith(".venv/bin/elasticps data mnist"), command
    # Run it as written, from a directory where `.venv` is the environment running
    # the tests and `examples` the repository's.
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    command += " --no-progress"
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    result = lines[-1]
    shown = readme_result_line()
    assert list(result) == list(shown), (result, shown)
    for key, value in shown.items():
        assert type(result[key]) is type(value), (key, result[key], value)
    assert result["exactly_once"] is True
    assert float(str(result["accuracy"])) >= 0.93
    assert (tmp_path / "runs" / "mnist" / "model.safetensors").is_file()
