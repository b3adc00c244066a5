"""Helpers for testing elasticps jobs and code built on it.

Tests wait on conditions with deadlines, never on fixed sleeps: use
:func:`wait_for` with a predicate over something observable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def wait_for(
    predicate: Callable[[], bool],
    what: str = "the condition",
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
) -> None:
    """Poll ``predicate`` until it returns True.

    Args:
        predicate: the condition; called every ``interval_s`` seconds.
        what: what is awaited, for the failure message.
        timeout_s: deadline, seconds.
        interval_s: time between two polls, seconds.

    Raises:
        AssertionError: the condition did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def pid_gone(pid: int) -> bool:
    """Whether no process has PID ``pid`` any more (a zombie still counts as present)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
