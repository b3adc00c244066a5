"""The paged layout of ``balanced`` placements, and mapping pages into flat buffers."""

from __future__ import annotations

import fcntl
import itertools
import os

import pytest
import torch

from elasticps.placement import (
    MIN_PAGED_SLICE_NUMEL,
    PAGE_NUMEL,
    ParamSpec,
    Placement,
    page_runs,
    page_split,
    plan_placement,
)
from elasticps.trainer import pages

MLP_SMALL = [("l0.weight", (512, 784)), ("l0.bias", (512,)), ("l1.weight", (512, 512)),
             ("l1.bias", (512,)), ("l2.weight", (10, 512)), ("l2.bias", (10,))]  # fmt: skip
MLP_20M = [("l0.weight", (4096, 784)), ("l0.bias", (4096,)), ("l1.weight", (4096, 4096)),
           ("l1.bias", (4096,)), ("l2.weight", (10, 4096)), ("l2.bias", (10,))]  # fmt: skip


def place(model: list[tuple[str, tuple[int, ...]]], num_shards: int, **kw: object) -> Placement:
    return plan_placement([ParamSpec(n, s) for n, s in model], num_shards, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [7, 1024, 1025, 40_000, 1_000_003])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_page_split_cuts_on_pages_and_tiles_the_range(n: int, parts: int) -> None:
    cuts = page_split(n, parts)
    assert len(cuts) == parts and cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
    assert all(lo % PAGE_NUMEL == 0 for lo, _ in cuts)
    sizes = [(hi - lo) // PAGE_NUMEL for lo, hi in cuts[:-1]]
    assert not sizes or max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("model", "num_shards"), [(MLP_SMALL, 1), (MLP_SMALL, 2),
                         (MLP_SMALL, 3), (MLP_SMALL, 4), (MLP_20M, 2), (MLP_20M, 8)])  # fmt: skip
def test_models_of_many_pages_get_a_mappable_balanced_layout(
    model: list[tuple[str, tuple[int, ...]]], num_shards: int
) -> None:
    placement = place(model, num_shards)

    runs = page_runs(placement)

    assert runs is not None and placement.total_numel % PAGE_NUMEL == 0
    # Every page of every shard appears once, and the flat pages of two shards never meet.
    flat_pages: set[int] = set()
    for shard, shard_runs in zip(placement.shards, runs, strict=True):
        covered = sorted(p for _, first, n in shard_runs for p in range(first, first + n))
        assert covered == list(range(-(-shard.numel // PAGE_NUMEL)))
        mine = {p for first, _, n in shard_runs for p in range(first, first + n)}
        assert not mine & flat_pages
        flat_pages |= mine
    loads = [s.numel for s in placement.shards]
    assert max(loads) <= 1.1 * sum(loads) / len(loads)


def test_short_slices_of_several_sliced_parameters_fall_on_different_shards() -> None:
    placement = place(MLP_20M, 2)
    ends = {p.name: p for s in placement.shards for p in s.pieces if p.param_start > 0}
    # Both weights are sliced; the slice holding each one's end is on another shard.
    assert {ends["l0.weight"].shard, ends["l1.weight"].shard} == {0, 1}


def test_the_layout_is_the_same_in_any_model_order() -> None:
    forward, backward = place(MLP_20M, 4), place(MLP_20M[::-1], 4)
    homes = lambda pl: sorted((p.name, p.param_start, p.param_end, p.shard)  # noqa: E731
                              for s in pl.shards for p in s.pieces)  # fmt: skip
    assert homes(forward) == homes(backward)


def test_small_models_and_hash_placements_keep_the_packed_layout() -> None:
    tiny = [("w", (MIN_PAGED_SLICE_NUMEL - 10,)), ("b", (3,))]  # under 16 pages a shard
    small = place(tiny, 1)
    assert small.total_numel == MIN_PAGED_SLICE_NUMEL - 7 and page_runs(small) is None
    hashed = place(MLP_SMALL, 2, strategy="hash")
    assert hashed.total_numel == sum(p.numel for p in hashed.params)
    assert page_runs(hashed) is None


@pytest.mark.skipif(not pages.supported(), reason="needs Linux with 4 KiB pages")
def test_mapped_pages_are_shared_with_the_file_and_unmapping_keeps_the_contents() -> None:
    buf = pages.page_aligned_zeros(4 * PAGE_NUMEL)
    assert pages.is_page_aligned(buf)
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32))
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 2 * pages.PAGE_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        os.pwrite(fd, torch.full((2 * PAGE_NUMEL,), 5.0).numpy().tobytes(), 0)

        pages.map_file_pages(buf, 1, 2, fd, 0)  # pages 1-2 of buf <- the file

        assert float(buf[PAGE_NUMEL]) == 5.0 and float(buf[0]) == 0.0
        buf[PAGE_NUMEL] = 7.0  # writes reach the file, and the file's writes reach buf
        assert os.pread(fd, 4, 0) == torch.tensor([7.0]).numpy().tobytes()
        os.pwrite(fd, torch.tensor([9.0]).numpy().tobytes(), 4)
        assert float(buf[PAGE_NUMEL + 1]) == 9.0

        pages.unmap_pages(buf, 1, 2)

        assert float(buf[PAGE_NUMEL]) == 7.0 and float(buf[PAGE_NUMEL + 1]) == 9.0
        os.pwrite(fd, torch.tensor([1.0]).numpy().tobytes(), 0)
        assert float(buf[PAGE_NUMEL]) == 7.0  # private again
        assert float(buf[3 * PAGE_NUMEL]) == 3 * PAGE_NUMEL  # untouched pages kept theirs
    finally:
        os.close(fd)
