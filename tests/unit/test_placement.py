"""Tests of parameter placement on parameter-server shards (``elasticps.placement``)."""

from __future__ import annotations

import itertools
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticps.errors import ConfigError
from elasticps.placement import (
    PAGE_NUMEL,
    PLACEMENTS,
    ParamSpec,
    Piece,
    Placement,
    ShardLayout,
    even_split,
    page_runs,
    plan_placement,
)

NAMES = ("embed.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.bias")


def specs(*shapes: tuple[int, ...]) -> list[ParamSpec]:
    """One ParamSpec per shape, named ``p0``, ``p1``, ..."""
    return [ParamSpec(f"p{i}", shape) for i, shape in enumerate(shapes)]


def pieces_of(placement: Placement, name: str) -> list[Piece]:
    """Every piece of parameter ``name``, over all shards, by position in the parameter."""
    found = [p for shard in placement.shards for p in shard.pieces if p.name == name]
    return sorted(found, key=lambda p: p.param_start)


def expand(ranges: list[tuple[int, int]]) -> list[int]:
    """The element indices covered by ``ranges``, in order."""
    return [i for lo, hi in ranges for i in range(lo, hi)]


# --- whole parameters ----------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_whole_parameter_goes_to_crc32_of_its_name_modulo_shard_count(num_shards: int) -> None:
    params = [ParamSpec(name, (4, 3)) for name in NAMES]

    placement = plan_placement(params, num_shards, big_array_bound=100, strategy="hash")

    for name in NAMES:
        [piece] = pieces_of(placement, name)
        assert piece.shard == zlib.crc32(name.encode("utf-8")) % num_shards
        assert (piece.param_start, piece.param_end) == (0, 12)
        assert piece in placement.shards[piece.shard].pieces


def test_placement_is_identical_across_calls() -> None:
    params = [ParamSpec(name, (7, i + 1)) for i, name in enumerate(NAMES)]

    first = plan_placement(params, 3, big_array_bound=20)
    second = plan_placement([ParamSpec(p.name, p.shape) for p in params], 3, big_array_bound=20)

    assert first == second
    assert first.flat_offsets == second.flat_offsets


# --- big (sliced) parameters -----------------------------------------------------


def test_parameter_above_bound_is_sliced_evenly_over_all_shards() -> None:
    placement = plan_placement([ParamSpec("big", (2, 5))], 3, big_array_bound=9)

    pieces = pieces_of(placement, "big")

    # Slice i lives on shard i; 10 elements over 3 shards are 4, 3, 3.
    assert [p.shard for p in pieces] == [0, 1, 2]
    assert [(p.param_start, p.param_end) for p in pieces] == [(0, 4), (4, 7), (7, 10)]
    assert [s.numel for s in placement.shards] == [4, 3, 3]


def test_parameter_at_exactly_the_bound_is_not_sliced_by_hash_placement() -> None:
    placement = plan_placement([ParamSpec("edge", (3, 3))], 3, big_array_bound=9, strategy="hash")

    [piece] = pieces_of(placement, "edge")

    assert (piece.param_start, piece.param_end) == (0, 9)
    assert piece.shard == zlib.crc32(b"edge") % 3


def test_nothing_is_sliced_with_one_shard() -> None:
    placement = plan_placement([ParamSpec("big", (1000,)), ParamSpec("b", (3,))], 1, 10)

    [shard] = placement.shards
    assert [(p.name, p.param_start, p.param_end) for p in shard.pieces] == [
        ("big", 0, 1000),
        ("b", 0, 3),
    ]
    assert shard.ranges == ((0, 1003),)


@given(n=st.integers(min_value=0, max_value=500), parts=st.integers(min_value=1, max_value=9))
@settings(max_examples=100, deadline=None)
def test_even_split_tiles_the_range_with_sizes_differing_by_at_most_one(n: int, parts: int) -> None:
    split = even_split(n, parts)

    assert len(split) == parts
    assert expand(split) == list(range(n))
    sizes = [hi - lo for lo, hi in split]
    assert max(sizes) - min(sizes) <= 1


def test_big_parameter_is_contiguous_in_the_flat_buffer() -> None:
    placement = plan_placement(specs((3,), (50,), (2,), (41,)), 4, big_array_bound=10)

    for name in ("p1", "p3"):
        pieces = pieces_of(placement, name)
        assert len(pieces) == 4
        base = placement.flat_offsets[name]
        for piece in pieces:
            assert piece.flat_offset == base + piece.param_start


# --- invariants over random models -------------------------------------------------

shapes_strategy = st.lists(
    st.lists(st.integers(min_value=1, max_value=6), min_size=0, max_size=3).map(tuple),
    min_size=1,
    max_size=8,
)


@given(
    shapes=shapes_strategy,
    num_shards=st.integers(min_value=1, max_value=5),
    bound=st.integers(min_value=1, max_value=60),
    strategy=st.sampled_from(PLACEMENTS),
)
@settings(max_examples=150, deadline=None)
def test_placement_invariants_hold_for_any_model(
    shapes: list[tuple[int, ...]], num_shards: int, bound: int, strategy: str
) -> None:
    params = specs(*shapes)

    placement = plan_placement(params, num_shards, bound, strategy=strategy)

    total = sum(p.numel for p in params)
    # A paged layout pads the flat buffer to whole pages (see test_placement_pages.py).
    padded = page_runs(placement) is not None and placement.total_numel != total
    if padded:
        assert placement.total_numel % PAGE_NUMEL == 0
        assert total <= placement.total_numel <= total + (len(params) + num_shards) * PAGE_NUMEL
    else:
        assert placement.total_numel == total
    assert len(placement.shards) == num_shards
    all_pieces = [p for shard in placement.shards for p in shard.pieces]

    # Every element of every parameter is owned by exactly one piece.
    for spec in params:
        pieces = pieces_of(placement, spec.name)
        assert expand([(p.param_start, p.param_end) for p in pieces]) == list(range(spec.numel))
        sliced = spec.numel > bound and num_shards > 1
        # (balanced slices below the bound only parameters far larger than these.)
        assert len(pieces) == (min(spec.numel, num_shards) if sliced else 1)
        for piece in pieces:
            # A parameter (sliced or not) is contiguous in the flat buffer.
            assert piece.flat_offset == placement.flat_offsets[spec.name] + piece.param_start

    # The pieces' flat ranges cover no element twice, and [0, total_numel) if not padded.
    flat = sorted(i for p in all_pieces for i in range(p.flat_offset, p.flat_offset + p.numel))
    assert len(flat) == total and len(set(flat)) == total
    assert flat[-1] < placement.total_numel
    if not padded:
        assert flat == list(range(total))

    for index, shard in enumerate(placement.shards):
        assert shard.index == index
        assert all(p.shard == index for p in shard.pieces)
        assert_shard_buffer_is_contiguous(shard)
        assert_ranges_are_coalesced_pieces(shard)


def assert_shard_buffer_is_contiguous(shard: ShardLayout) -> None:
    offset = 0
    for piece in shard.pieces:
        assert piece.shard_offset == offset
        offset += piece.numel
    assert shard.numel == offset


def assert_ranges_are_coalesced_pieces(shard: ShardLayout) -> None:
    ranges = list(shard.ranges)
    piece_ranges = [(p.flat_offset, p.flat_offset + p.numel) for p in shard.pieces]
    # Same elements in the same (shard-buffer) order as the pieces ...
    assert expand(ranges) == expand(piece_ranges)
    assert sum(hi - lo for lo, hi in ranges) == shard.numel
    # ... with no empty range and no two adjacent ranges that could be merged.
    assert all(hi > lo for lo, hi in ranges)
    assert all(a[1] != b[0] for a, b in itertools.pairwise(ranges))


def test_adjacent_pieces_of_a_shard_are_coalesced_into_one_range() -> None:
    names = [n for n in NAMES if zlib.crc32(n.encode()) % 2 == 0]
    assert len(names) >= 2  # precondition of this test: two params on shard 0

    placement = plan_placement(
        [ParamSpec(n, (2,)) for n in names], 2, big_array_bound=100, strategy="hash"
    )

    assert placement.shards[0].ranges == ((0, 2 * len(names)),)


# --- fingerprints --------------------------------------------------------------------


def test_equal_layouts_have_equal_fingerprints() -> None:
    a = plan_placement(specs((4, 4), (30,), (5,)), 2, big_array_bound=20)
    b = plan_placement(specs((4, 4), (30,), (5,)), 2, big_array_bound=20)

    assert [s.fingerprint for s in a.shards] == [s.fingerprint for s in b.shards]


def test_fingerprint_changes_when_a_parameter_shape_changes() -> None:
    before = plan_placement(specs((4, 4), (5,)), 1)
    after = plan_placement(specs((4, 5), (5,)), 1)

    assert before.shards[0].fingerprint != after.shards[0].fingerprint


def test_fingerprint_changes_when_a_parameter_is_reshaped_to_the_same_numel() -> None:
    before = plan_placement(specs((3, 4), (5,)), 1)
    after = plan_placement(specs((4, 3), (5,)), 1)

    assert before.shards[0].fingerprint != after.shards[0].fingerprint


def test_fingerprint_changes_with_the_shard_count() -> None:
    params = specs((100,))

    two = plan_placement(params, 2, big_array_bound=10)
    three = plan_placement(params, 3, big_array_bound=10)

    assert two.shards[0].fingerprint != three.shards[0].fingerprint


# --- validation and edge cases ---------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "num_shards", "bound"),
    [
        (specs((3,)), 0, 10),
        (specs((3,)), -1, 10),
        (specs((3,)), 2, 0),
        ([ParamSpec("w", (3,)), ParamSpec("w", (4,))], 2, 10),
        ([], 2, 10),
    ],
    ids=["zero-shards", "negative-shards", "zero-bound", "duplicate-names", "no-params"],
)
def test_invalid_arguments_raise_config_error(
    params: list[ParamSpec], num_shards: int, bound: int
) -> None:
    with pytest.raises(ConfigError):
        plan_placement(params, num_shards, bound)


def test_shard_with_no_parameters_is_allowed_and_empty() -> None:
    placement = plan_placement([ParamSpec("only", (6,))], 3, big_array_bound=100, strategy="hash")

    home = zlib.crc32(b"only") % 3
    for shard in placement.shards:
        if shard.index == home:
            assert shard.numel == 6
        else:
            assert shard.numel == 0
            assert shard.pieces == ()
            assert shard.ranges == ()


def test_unknown_placement_strategy_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="balanced, hash"):
        plan_placement(specs((3,)), 2, strategy="round-robin")
