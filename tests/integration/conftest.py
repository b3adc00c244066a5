"""Fixtures shared by the integration tests that run whole jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """A headless Debian Chromium, driven through Debian's ChromeDriver by Selenium.

    With no network: the flags keep Chromium from calling out (this machine refuses
    it), and a proxy that does not exist fails any page that would fetch from
    anywhere but 127.0.0.1. Skipped where Chromium is not installed, except in CI
    (``CI`` set), where ``scripts/install-system-packages.sh`` installs it.
    """
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("CI"):
            pytest.fail("CI lacks Debian's chromium and chromium-driver")
        pytest.skip("needs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1800",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--proxy-server=http://127.0.0.1:9",
    ):  # fmt: skip
        options.add_argument(flag)
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "driver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
