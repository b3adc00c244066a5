"""The host file and the placement of roles on hosts (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticps.errors import ConfigError
from elasticps.launcher.hostfile import HOST_ROLES, HostSpec, parse_hostfile, place

pytestmark = pytest.mark.timeout(60)


def test_a_host_file_takes_plain_addresses_ports_slots_roles_and_comments() -> None:
    text = """
    # the cluster
    10.0.0.5
    node-1:2222 slots=4        # a bigger one
    [fe80::1]:22 roles=trainer slots=2
    cpu.example.org roles=ps
    """
    assert parse_hostfile(text) == (
        HostSpec("10.0.0.5"),
        HostSpec("node-1", 2222, 4),
        HostSpec("[fe80::1]", 22, 2, ("trainer",)),
        HostSpec("cpu.example.org", None, 1, ("ps",)),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no host"),
        ("# only a comment\n", "names no host"),
        ("a\nb\na\n", "line 3: host a is named again (first on line 1)"),
        ("a slots=0\n", "line 1: host a: slots must be >= 1"),
        ("a slots=two\n", "line 1: slots must be a whole number"),
        ("a roles=ps,master\n", "roles must be some of ps, trainer, got ps,master"),
        ("a colour=blue\n", "'colour=blue' is not slots=N or roles=ROLE,ROLE..."),
        ("a slots=1 slots=2\n", "slots is given twice"),
        ("a:99999\n", "ssh port 99999 is out of range"),
        ("user@a\n", "'user@a' is not HOST or HOST:SSHPORT"),
    ],
)
def test_a_bad_line_is_one_error_naming_file_and_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"hosts\.txt") as caught:
        parse_hostfile(text, "hosts.txt")
    assert message in str(caught.value)


def test_ps_are_spread_first_then_trainers_fill_the_slots() -> None:
    hosts = (HostSpec("h0", slots=2), HostSpec("h1", slots=2), HostSpec("h2", slots=2))
    roles = ["trainer-0", "trainer-1", "trainer-2", "trainer-3", "ps-0", "ps-1"]
    assert place(hosts, roles) == {
        "ps-0": "h0",
        "ps-1": "h1",
        "trainer-0": "h2",
        "trainer-1": "h0",
        "trainer-2": "h1",
        "trainer-3": "h2",
    }


def test_roles_go_only_where_the_file_allows_them() -> None:
    hosts = (HostSpec("big", slots=8, roles=("trainer",)), HostSpec("p", slots=2, roles=("ps",)))
    placed = place(hosts, ["ps-0", "ps-1", "trainer-0"])
    assert placed == {"ps-0": "p", "ps-1": "p", "trainer-0": "big"}
    with pytest.raises(ConfigError, match=r"no host has a free slot for ps-2: .* 2 slot"):
        place(hosts, ["ps-0", "ps-1", "ps-2"])


def test_a_lost_hosts_roles_are_re_placed_on_the_hosts_left() -> None:
    hosts = (HostSpec("h0", slots=2), HostSpec("h1", slots=2), HostSpec("h2", slots=2))
    first = place(hosts, ["ps-0", "ps-1", "trainer-0", "trainer-1"])
    lost = first["ps-1"]
    left = tuple(h for h in hosts if h.name != lost)
    kept = {role: host for role, host in first.items() if host != lost}
    again = place(left, [role for role, host in first.items() if host == lost], placed=kept)
    assert {role: host for role, host in again.items() if role in kept} == kept
    assert set(again) == set(first) and lost not in again.values()
    with pytest.raises(ConfigError, match="not among the hosts"):
        place(left, ["trainer-9"], placed={"ps-1": lost})
    with pytest.raises(ConfigError, match="placed twice"):
        place(hosts, ["ps-0", "ps-0"])


@settings(max_examples=200, deadline=None)
@given(
    slots=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    allow=st.lists(st.sampled_from([HOST_ROLES, ("ps",), ("trainer",)]), min_size=6, max_size=6),
    ps=st.integers(0, 6),
    trainers=st.integers(0, 12),
)
def test_placement_fits_whenever_the_slots_allow_and_spreads_ps_while_hosts_remain(
    slots: list[int], allow: list[tuple[str, ...]], ps: int, trainers: int
) -> None:
    hosts = tuple(HostSpec(f"h{i}", slots=n, roles=allow[i]) for i, n in enumerate(slots))
    roles = [f"ps-{i}" for i in range(ps)] + [f"trainer-{i}" for i in range(trainers)]
    try:
        placed = place(hosts, roles)
    except ConfigError:
        # Only when some kind truly has too few slots.
        ps_slots = sum(h.slots for h in hosts if "ps" in h.roles)
        any_slots = sum(h.slots for h in hosts)
        trainer_only = sum(h.slots for h in hosts if h.roles == ("trainer",))
        shared = any_slots - trainer_only - sum(h.slots for h in hosts if h.roles == ("ps",))
        trainer_room = trainer_only + shared - max(0, ps - (ps_slots - shared))
        assert ps > ps_slots or trainers > trainer_room
        return
    assert set(placed) == set(roles)
    for host in hosts:
        on = [r for r, h in placed.items() if h == host.name]
        assert len(on) <= host.slots
        assert all(r.split("-")[0] in host.roles for r in on)
    ps_hosts = [h for h in hosts if "ps" in h.roles]
    if ps <= len(ps_hosts) and trainers == 0:
        # Spread while hosts remain (trainers may need the slots of some).
        assert len({placed[f"ps-{i}"] for i in range(ps)}) == ps  # one PS a host
