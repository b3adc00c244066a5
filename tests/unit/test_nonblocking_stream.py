"""NonBlockingStream: a terminal that stops reading never blocks the launcher's threads."""

from __future__ import annotations

import io
import threading

import pytest

from elasticps.logs import NonBlockingStream

pytestmark = pytest.mark.timeout(30)


class _StuckTerminal(io.StringIO):
    """A stream whose writes block until ``release`` is set (a full pipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait()
        return super().write(text)


def test_writes_reach_the_target_in_order() -> None:
    target = io.StringIO()
    stream = NonBlockingStream(target)
    for i in range(100):
        print(f"line {i}", file=stream, flush=True)
    assert stream.drain(timeout_s=10)
    assert target.getvalue() == "".join(f"line {i}\n" for i in range(100))


def test_a_stuck_target_does_not_block_the_writer_and_drops_are_reported() -> None:
    target = _StuckTerminal()
    stream = NonBlockingStream(target, max_queued=5)
    for i in range(50):  # would block forever on a plain stuck stream
        stream.write(f"line {i}\n")
    assert stream.dropped >= 50 - 5 - 1  # one may be in the writer's hands
    assert not stream.drain(timeout_s=0.05)
    target.release.set()
    assert stream.drain(timeout_s=10)
    text = target.getvalue()
    assert "line 0\n" in text
    assert f"{stream.dropped} line(s) not shown here" in text
    assert "line 49\n" not in text


def test_max_queued_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        NonBlockingStream(io.StringIO(), max_queued=0)
