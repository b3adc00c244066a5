"""The live dashboard and the report, in a real headless Chromium.

``elasticps dashboard`` serves a running job's page; Selenium drives Debian's
Chromium through Debian's ChromeDriver (the ``browser`` fixture), as a user's
browser would, with no network but 127.0.0.1. ``elasticps report`` writes one
HTML file for a finished and for a failed job, opened from disk in the same
browser. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticps.launcher.spawn import terminate, wait_or_kill
from elasticps.testing import kill_leftovers, run_elasticps, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

PACED = Path(__file__).with_name("paced_mlp.py")
MLP = Path(__file__).resolve().parents[2] / "examples" / "mnist_mlp.py"
COMMAND_TIMEOUT_S = 120.0
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
"""Where the screenshots are kept (ignored by git; CI can collect them)."""


@contextlib.contextmanager
def background(args: list[str | Path], log: Path) -> Iterator[subprocess.Popen[str]]:
    """``python -m elasticps ARGS`` running, its stdout a pipe and its stderr ``log``;
    SIGTERM then SIGKILL by PID after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticps", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    try:
        yield proc
    finally:
        terminate([proc])
        wait_or_kill([proc], 30)


def status_json(output: Path, *, starting_ok: bool = False) -> dict[str, Any]:
    """``elasticps status --output OUTPUT --json`` (``{}`` before the job has a run.json,
    when ``starting_ok``)."""
    done = run_elasticps(["status", "--output", output, "--json"], timeout_s=COMMAND_TIMEOUT_S)
    if starting_ok and done.returncode == 2 and "no run.json" in done.stderr:
        return {}
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def text(browser: Any, element_id: str) -> str:
    text = browser.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : null",
        element_id,
    )
    assert text is not None, f"no #{element_id} in the page"
    return str(text)


def number(browser: Any, element_id: str) -> int | None:
    value = text(browser, element_id)
    return int(value) if value.isdigit() else None


def table_rows(browser: Any, body_id: str) -> list[str]:
    """The text of each row of a table, read in one script: the page replaces the rows
    at each update, so elements found by one call may be gone by the next."""
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), r => r.innerText)",
        f"#{body_id} tr",
    )
    return [str(row) for row in rows]


def page_state(browser: Any) -> str:
    """What the page shows, for a failure's message."""
    shown = {i: text(browser, i) for i in ("state", "updates", "tasks-done", "error", "updated")}
    rows = {t: table_rows(browser, t) for t in ("faults", "trainers", "tests")}
    return f"page: {shown} {rows}"


def plotted(browser: Any, figure_id: str) -> bool:
    """Whether plotly.js drew the figure (its SVG is in the page)."""
    found = browser.execute_script(
        "return document.querySelectorAll(arguments[0]).length", f"#{figure_id} .main-svg"
    )
    return bool(found)


def test_the_dashboard_follows_a_running_job_and_its_faults(
    mnist_dir: Path, tmp_path: Path, browser: Any
) -> None:
    output = tmp_path / "job"
    train = [
        "train", "--model", PACED, "--data", mnist_dir, "--trainers", "3", "--ps", "2",
        "--mode", "async", "--epochs", "60", "--eval-each-pass", "--no-progress",
        "--chaos", "kill:ps-0@6s", "--output", output, "--job", "dashboard-test",
    ]  # fmt: skip
    try:
        with background(train, tmp_path / "train.log") as job:
            wait_for(
                lambda: (
                    job.poll() is None
                    and "tasks_done_all_passes" in status_json(output, starting_ok=True)
                ),
                "the job to train",
                timeout_s=120,
                interval_s=0.5,
            )
            dash_args = ["dashboard", "--output", output, "--interval-s", "1"]
            with background(dash_args, tmp_path / "dashboard.log") as dashboard:
                assert dashboard.stdout is not None
                line = dashboard.stdout.readline()
                match = re.search(r"http://127\.0\.0\.1:\d+/", line)
                assert match, (line, (tmp_path / "dashboard.log").read_text())
                browser.get(match.group(0))
                try:
                    check_the_live_page(browser, output, job)
                except AssertionError as exc:
                    log = (tmp_path / "dashboard.log").read_text()[-2000:]
                    raise AssertionError(f"{exc}\n{page_state(browser)}\n{log}") from exc
    finally:
        kill_leftovers(output / "pids.json")


def check_the_live_page(browser: Any, output: Path, job: subprocess.Popen[str]) -> None:
    """The page of a running job: it updates, follows status --json, shows the chaos kill
    and the plots; then, the job stopped, it ends on exactly what status --json says."""
    loaded_at = browser.execute_script("return window.dashboardLoadedAt")
    # It updates without a reload, and its numbers follow the job's.
    wait_for(lambda: (number(browser, "updates") or 0) >= 1, "a first update", 30)
    first = number(browser, "tasks-done")
    assert first is not None
    wait_for(
        lambda: (
            (number(browser, "updates") or 0) >= 3 and (number(browser, "tasks-done") or 0) > first
        ),
        "two more updates, with progress",
        timeout_s=60,
        interval_s=0.2,
    )
    assert browser.execute_script("return window.dashboardLoadedAt") == loaded_at
    shown = number(browser, "tasks-done")
    status = status_json(output)
    assert shown is not None and shown <= status["tasks_done_all_passes"]
    assert number(browser, "tasks-total") == status["tasks_all_passes"]
    assert number(browser, "passes") == status["passes"]
    assert number(browser, "wanted") == status["wanted_trainers"] == 3
    assert text(browser, "state") == "running"

    # The chaos kill on the fault timeline, with what the supervisor did. The kill
    # names the slot (ps-0), the decision the process that held it: the launcher's
    # ps-0 or ps-1, whichever claimed slot 0.
    def killed_and_restarted() -> bool:
        rows = [r.split("\t") for r in table_rows(browser, "faults")]
        return any(r[1:3] == ["ps-0", "kill"] for r in rows) and any(
            r[1].startswith("ps-") and r[2] == "signal 9" and r[3].startswith("restart")
            for r in rows
        )

    wait_for(killed_and_restarted, "the kill on the fault timeline", 90, 0.5)
    # Per-shard load and latency, the trainers' step times, the test metrics.
    wait_for(lambda: plotted(browser, "fig-ps_latency"), "the PS plots", 60, 0.5)
    three = lambda: len(table_rows(browser, "trainers")) == 3  # noqa: E731
    wait_for(three, "three trainers' step times", timeout_s=60, interval_s=0.5)
    wait_for(lambda: table_rows(browser, "tests") != [], "a pass's test metrics", 90)
    assert plotted(browser, "fig-throughput")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    # Stopped: the page ends on exactly what status --json says.
    stop = run_elasticps(["stop", "--output", output, "--timeout-s", "120"], timeout_s=180)
    assert stop.returncode == 0, stop.stderr
    assert job.wait(timeout=60) == 0
    wait_for(lambda: text(browser, "state") == "stopped", "the stopped state", 30)
    status = status_json(output)
    assert status["state"] == "stopped"
    for key, element in (
        ("tasks_done_all_passes", "tasks-done"),
        ("tasks_all_passes", "tasks-total"),
        ("pass", "pass"),
        ("passes", "passes"),
        ("samples", "samples"),
    ):
        assert number(browser, element) == status[key], (key, status)


def report_in_browser(browser: Any, output: Path, name: str) -> Path:
    """``elasticps report OUTPUT``, checked to need no network, opened in the browser."""
    done = run_elasticps(["report", output], timeout_s=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    report = Path(done.stdout.strip())
    assert report == output.resolve() / "report.html"
    browser.get(report.as_uri())
    wait_for(lambda: plotted(browser, "fig-throughput"), "the throughput plot", 30, 0.2)
    # Everything it loaded came from the file itself (the browser has no network).
    fetched = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert all(str(url).startswith(("file:", "data:", "blob:")) for url in fetched), fetched
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))
    return report


def test_the_report_of_a_finished_and_of_a_failed_job_opens_offline(
    mnist_dir: Path, tmp_path: Path, browser: Any
) -> None:
    finished = tmp_path / "finished"
    failed = tmp_path / "failed"
    common = ["--data", mnist_dir, "--ps", "1", "--no-progress", "--model", MLP]
    try:
        done = run_elasticps(
            ["train", *common, "--trainers", "2", "--epochs", "3", "--eval-each-pass",
             "--chaos", "kill:ps-0@40%", "--output", finished],
            timeout_s=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        gone = run_elasticps(
            ["train", *common, "--trainers", "1", "--epochs", "3", "--max-restarts", "0",
             "--chaos", "kill:ps@30%", "--output", failed],
            timeout_s=240,
        )  # fmt: skip
        assert gone.returncode == 1, gone.stderr[-4000:]
    finally:
        kill_leftovers(finished / "pids.json")
        kill_leftovers(failed / "pids.json")

    report_in_browser(browser, finished, "report-finished")
    assert text(browser, "state") == "finished"
    assert "did not fail" in text(browser, "root-cause")
    assert plotted(browser, "fig-tests")
    assert any("ps-0" in row and "signal 9" in row for row in table_rows(browser, "faults"))

    report_in_browser(browser, failed, "report-failed")
    assert text(browser, "state") == "failed"
    cause = text(browser, "root-cause")
    assert "ps-0" in cause and "signal 9" in cause and "fail" in cause, cause
    assert "no restarts left" in text(browser, "error")
