"""Log files (``elasticps.logs``) and the exit statuses of ``elasticps.cli.main``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps import cli
from elasticps.errors import DataError, JobFailedError
from elasticps.logs import LOG_FILE_ENV, OneLineFormatter, active_log_file, file_only, log_to_file

pytestmark = pytest.mark.timeout(30)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler on whatever ``sys.stderr`` is when it writes (capsys swaps it)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    """The root logger with one handler on stderr; its handlers are restored afterwards."""
    root = logging.getLogger()
    saved = [(h, h.formatter) for h in root.handlers]
    saved_level = root.level
    for handler, _ in saved:
        root.removeHandler(handler)
    stream = _Stderr()
    stream.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(stream)
    root.setLevel(logging.INFO)
    try:
        yield root
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            if handler is not stream:
                handler.close()
        for handler, formatter in saved:
            handler.setFormatter(formatter)
            root.addHandler(handler)
        root.setLevel(saved_level)


def raised() -> BaseException:
    try:
        raise ValueError("bad\nvalue")
    except ValueError as exc:
        return exc


def test_one_line_formatter_drops_the_traceback_and_names_the_file(tmp_path: Path) -> None:
    exc = raised()
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "it failed", None,
                               (type(exc), exc, exc.__traceback__))  # fmt: skip
    text = OneLineFormatter("%(levelname)s %(message)s", tmp_path / "t.log").format(record)
    assert text == f"ERROR it failed (traceback in {tmp_path / 't.log'})"
    # The full formatter still sees the traceback (the record was not changed).
    assert "Traceback" in logging.Formatter("%(message)s").format(record)


def test_log_to_file_keeps_tracebacks_in_the_file_and_one_line_on_stderr(
    root_logging: logging.Logger, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "logs" / "trainer-0.log"
    assert log_to_file(path) == path
    assert active_log_file() == path
    exc = raised()
    logging.getLogger("elasticps.test").error("it failed", exc_info=exc)
    file_only(logging.INFO, "only in the file")

    err = capsys.readouterr().err
    assert err.splitlines() == [f"ERROR elasticps.test: it failed (traceback in {path})"]
    text = path.read_text()
    assert "it failed" in text and "Traceback" in text and "ValueError: bad" in text
    assert "only in the file" in text


def test_a_user_error_is_one_line_and_status_2(
    root_logging: logging.Logger,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fail(args: argparse.Namespace) -> int:
        raise DataError("data file x.parquet has 1 null in column 'label'")

    monkeypatch.setitem(cli.COMMANDS, "evaluate", fail)
    code = cli.main(["evaluate", "--model", "m.py", "--output", "c", "--data", "d"])

    assert code == 2
    assert capsys.readouterr().err == (
        "elasticps: error: data file x.parquet has 1 null in column 'label'\n"
    )


def test_an_internal_failure_without_a_log_shows_the_traceback_and_status_1(
    root_logging: logging.Logger,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def crash(args: argparse.Namespace) -> int:
        raise KeyError("oops")

    monkeypatch.setitem(cli.COMMANDS, "evaluate", crash)
    code = cli.main(["evaluate", "--model", "m.py", "--output", "c", "--data", "d"])

    assert code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err
    last = err.splitlines()[-1]
    assert last.startswith("elasticps: internal error: KeyError: 'oops'. Unless this is an")
    assert last.endswith("please report it with the traceback above")


def test_an_internal_failure_with_a_log_file_is_one_line_naming_it(
    root_logging: logging.Logger,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    path = tmp_path / "master-0.log"
    monkeypatch.setenv(LOG_FILE_ENV, str(path))

    def crash(args: argparse.Namespace) -> int:
        raise JobFailedError("ps-0 (pid 7) exited with status -9")

    monkeypatch.setitem(cli.COMMANDS, "master", crash)
    code = cli.main(["master", "--etcd", "127.0.0.1:1"])

    assert code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == [
        "elasticps: internal error: ps-0 (pid 7) exited with status -9. Unless this is an "
        "infrastructure failure (a killed process, etcd gone), it is a bug: please report it "
        f"with the log {path}"
    ]
    assert "Traceback" in path.read_text()
