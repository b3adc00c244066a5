"""The network and disk parsers under mutation fuzzing, on a fixed budget per target.

``benchmarks/fuzz.py`` runs the same targets on a million inputs each.
"""

from __future__ import annotations

import random

import pytest

from elasticps.testing.fuzz import TARGETS, Target, fuzz, mutate

pytestmark = pytest.mark.timeout(120)

BUDGET = {"shard_metadata": 500, "checkpoint_manifest": 500}
"""Inputs per target in CI (a file costs a millisecond to write or build); 1,500 for the others."""


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_no_input_crashes_a_parser(name: str) -> None:
    result = fuzz(TARGETS[name], BUDGET.get(name, 1500), seed=20261203)
    assert result.crash_count == 0, result.as_dict()
    # The seeds are accepted, and the mutations reach the parser's own checks.
    assert result.accepted >= len(TARGETS[name].seeds())
    assert sum(result.rejected.values()) > result.inputs // 4, result.as_dict()


def test_a_crash_is_counted_and_its_input_kept() -> None:
    def fragile(data: bytes) -> object:
        if len(data) > 3:
            raise KeyError("a bug")
        raise ValueError("refused")

    result = fuzz(Target("fragile", lambda: [b"ab"], fragile, (ValueError,)), 200, seed=1)
    assert result.crash_count > 0 and result.crashes[0][0].startswith("KeyError")
    assert result.inputs == 200 and result.rejected["ValueError"] + result.crash_count == 200


def test_mutations_are_reproducible_and_vary() -> None:
    seeds = [b'{"op": "seal", "pass": 2}']
    first = [mutate(random.Random(5), seeds[0], seeds) for _ in range(3)]
    again = [mutate(random.Random(5), seeds[0], seeds) for _ in range(3)]
    assert first == again
    rng = random.Random(6)
    assert len({mutate(rng, seeds[0], seeds) for _ in range(200)}) > 150
