"""The trainer's wait for work: soon at first, then at the master's pace (pure)."""

from __future__ import annotations

import pytest

from elasticps.trainer.worker import FIRST_IDLE_WAIT_S, idle_wait_s


def test_the_first_wait_is_short_and_each_further_one_doubles() -> None:
    waits = [idle_wait_s(i, 0.25) for i in range(6)]
    assert waits[0] == pytest.approx(FIRST_IDLE_WAIT_S)
    assert waits[:5] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16])
    assert waits[5] == pytest.approx(0.25)


def test_the_master_wait_caps_every_wait_even_after_many() -> None:
    assert idle_wait_s(10_000, 0.25) == pytest.approx(0.25)
    assert idle_wait_s(0, 0.005) == pytest.approx(0.005)
