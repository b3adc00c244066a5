"""The --chaos schedule: its items, their checks, and the random soak (pure)."""

from __future__ import annotations

import pytest

from elasticps.errors import ConfigError
from elasticps.launcher.chaos import ChaosEvent, RandomChaos, parse_chaos, parse_random_chaos

pytestmark = pytest.mark.timeout(30)


def test_every_action_parses_with_its_time_and_its_parameter() -> None:
    spec = (
        "kill:trainer@20s,pause:ps-1@40%:6s,lose:ps-0@50%,damage:ps-0@60%,drop:ps-1@70.5%:2,"
        "kill:etcd@3.5s"
    )
    assert parse_chaos(spec) == (
        ChaosEvent("trainer", 20.0, None),
        ChaosEvent("ps-1", None, 0.4, "pause", 6.0),
        ChaosEvent("ps-0", None, 0.5, "lose"),
        ChaosEvent("ps-0", None, 0.6, "damage"),
        ChaosEvent("ps-1", None, 0.705, "drop", count=2),
        ChaosEvent("etcd", 3.5, None),
    )
    assert parse_chaos("") == ()


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("kill:ps", "is not of the form"),
        ("pause:ps@10%", "is not of the form"),  # a pause needs its length
        ("kill:ps@10%:2", "is not of the form"),  # a file count is for damage and drop
        ("damage:ps-0@10%:0", "is not of the form"),
        ("damage:ps@10%", "needs a parameter server by index"),
        ("drop:trainer-1@10%", "needs a parameter server by index"),
        ("lose:trainer@10%", "only a parameter server can be lost"),
        ("kill:master-1@10%", "must be trainer"),
        ("kill:scheduler@10%", "must be trainer"),
        ("kill:ps@101%", "must be <= 100"),
    ],
)
def test_a_malformed_item_is_refused_by_name(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_chaos(item)


def test_events_fall_due_by_time_or_by_the_share_of_dispatches() -> None:
    by_time, by_share = parse_chaos("kill:ps@2s,kill:ps@50%")
    assert not by_time.due(1.9, 1.0) and by_time.due(2.0, 0.0)
    assert not by_share.due(100.0, 0.49) and by_share.due(0.0, 0.5)
    assert by_time.role == "ps" and ChaosEvent("trainer-3").role == "trainer"


def test_the_random_item_parses_beside_scheduled_ones() -> None:
    spec = "kill:ps@10%,random:every=0.5-2s,roles=trainer+ps,seed=3,kills=7,after=1s"
    assert parse_chaos(spec) == (ChaosEvent("ps", None, 0.1),)
    assert parse_random_chaos(spec) == RandomChaos((0.5, 2.0), ("trainer", "ps"), 3, 7, 1.0)
    assert parse_random_chaos("kill:ps@10%") is None
    with pytest.raises(ConfigError, match="unknown parameter"):
        parse_random_chaos("random:often=1")
    with pytest.raises(ConfigError, match="roles must be some of"):
        parse_random_chaos("random:roles=scheduler")


def test_random_damage_is_drawn_for_parameter_servers_only() -> None:
    import random

    chaos = parse_random_chaos("random:every=1s,roles=ps+trainer,damage=0.5,seed=1")
    assert chaos is not None and chaos.damage == 0.5
    rng = random.Random(0)
    drawn = [chaos.damages(rng, "ps") for _ in range(200)]
    assert 60 < sum(drawn) < 140
    state = rng.getstate()
    assert not chaos.damages(rng, "trainer") and rng.getstate() == state
    assert not RandomChaos().damages(rng, "ps") and rng.getstate() == state  # no draw at 0
    for bad in ("damage=1.5", "damage=lots", "damage=nan"):
        with pytest.raises(ConfigError, match="damage must"):
            parse_random_chaos(f"random:{bad}")
