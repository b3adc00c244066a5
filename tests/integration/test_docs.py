"""The documentation site builds with ``mkdocs build --strict`` (warnings are errors).

The build runs as a real subprocess (``python -m mkdocs``) from the repository
root into a temporary directory. It imports nothing from a running job; it
fails on a broken link or anchor, a page missing from ``docs/``, or a
docstring that mkdocstrings (griffe, Google style) cannot parse.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 120.0


def _build(site: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    cmd += ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
    )


def test_site_builds_strict_with_every_page_and_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = _build(site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-5000:]}"
    for page in (
        "index.html",
        "quickstart/index.html",
        "model-contract/index.html",
        "python-api/index.html",
        "fault-tolerance/index.html",
        "errors/index.html",
        "trade-offs/index.html",
        "architecture/index.html",
        "reference/index.html",
    ):
        assert (site / page).is_file(), f"{page} was not built"
    reference = (site / "reference" / "index.html").read_text()
    # mkdocstrings rendered the docstrings, not just the ::: lines.
    assert "ElasticPSError" in reference
    assert "Base class of every error raised by elasticps" in reference
    assert ":::" not in reference
