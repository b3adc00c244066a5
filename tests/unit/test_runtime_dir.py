"""netutil.runtime_dir: a role's private directory goes where the launcher says."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from elasticps.netutil import RUNTIME_DIR_ENV, runtime_dir

pytestmark = pytest.mark.timeout(30)


def test_under_the_launchers_directory_when_it_names_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    made = Path(runtime_dir("elasticps-ps-"))
    assert made.parent == tmp_path and made.name.startswith("elasticps-ps-")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


@pytest.mark.parametrize("value", [None, "", "missing"])
def test_under_the_system_temporary_directory_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    else:
        monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path / value) if value else "")
    made = Path(runtime_dir("elasticps-ps-"))
    try:
        assert made.parent == Path(tempfile.gettempdir())
    finally:
        os.rmdir(made)
