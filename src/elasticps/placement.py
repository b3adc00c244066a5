"""Placement of parameters on parameter-server shards (pure: no I/O).

A parameter with more than ``big_array_bound`` elements is sliced evenly
across all shards, as MXNet's KVStore does above
``MXNET_KVSTORE_BIGARRAY_BOUND`` (default 1e6). Every other parameter goes
whole to one shard, chosen by one of two strategies (:data:`PLACEMENTS`):

- ``balanced`` (the default) balances bytes. Whole parameters go largest
  first (ties by name) to the least-loaded shard (ties to the lowest index).
  While that leaves the most-loaded shard more than
  :data:`BALANCE_TOLERANCE` above the mean, the largest parameter still
  placed whole is sliced evenly over all shards too (if each slice gets at
  least :data:`MIN_SLICE_NUMEL` elements), and the rest placed again. So a
  model with one dominant tensor (an MLP's first layer, a CNN's first fully
  connected layer) has it sliced, while its small tensors stay whole. In
  sync mode the most-loaded shard sets the step time.
- ``hash``: a whole parameter goes to the CRC-32 of its name modulo the
  shard count. It can leave one shard with nearly all the bytes.

Every process of a job must use the same placement (the parameter servers
check the layout's fingerprint). A consistent checkpoint is cut again for
any layout when a job resumes from it, so it works with either.

Both depend only on the parameters' names, shapes and order, the buffers
and the arguments, so every process and every run agrees.

Every trainer keeps all its parameters in one flat float32 buffer, and the
model's parameters are views into it. The flat order is chosen so that each
shard's data is a few contiguous ranges of that buffer. Two layouts:

- *packed* (``hash``, and ``balanced`` for small models)::

    [whole params of shard 0][whole params of shard 1]...[sliced param 0][sliced param 1]...
    [buffers of shard 0][buffers of shard 1]...

  A sliced parameter's ``i``-th slice (:func:`even_split`) belongs to shard ``i``.
- *paged* (``balanced``, when the model has at least
  :data:`MIN_PAGED_SLICE_NUMEL` elements per shard and the layout below can
  be mapped, see :func:`page_runs`): the flat buffer is made of 4 KiB pages
  (:data:`PAGE_NUMEL` elements), each holding one shard's elements only,
  at the same place within the page as in that shard's own buffer. A
  trainer can then map the memory it shares with each server page by page
  into its flat buffers (:mod:`elasticps.trainer.pages`), and copy nothing.
  Slices of at least :data:`MIN_PAGED_SLICE_NUMEL` elements are cut at
  pages (:func:`page_split`) and rotate over the shards (see
  :func:`_paged_layout`); a shard holds its full-page slices, its short
  slice, its whole parameters, its buffers, in that order; the flat buffer
  is padded to whole pages (padding belongs to no parameter).

A sliced parameter is contiguous in the flat buffer (so it can back a model
parameter). On the wire a shard's body is the concatenation of its ranges
in order, which is also the layout of the shard's own flat buffer on the
parameter server. Both sides send and receive straight from these ranges,
without copies.

A model's persistent buffers (BatchNorm statistics, see :mod:`elasticps.buffers`)
come last, each whole on the shard given by the CRC-32 of its name, in its
encoded size (float32 elements). On each shard they follow its parameters,
so a shard's buffers are one contiguous tail of its flat buffer.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from elasticps.errors import ConfigError

if TYPE_CHECKING:  # elasticps.buffers imports torch, which the command line does not need
    from elasticps.buffers import BufferSpec

DEFAULT_BIG_ARRAY_BOUND = 1_000_000

PLACEMENTS: Final = ("balanced", "hash")
"""The placement strategies; the first is the default."""

DEFAULT_PLACEMENT: Final = "balanced"

BALANCE_TOLERANCE: Final = 0.05
"""``balanced`` slices parameters until the most-loaded shard holds at most
this fraction more than the mean (in elements, so in bytes: all float32)."""

MIN_SLICE_NUMEL: Final = 128
"""``balanced`` slices a parameter below ``big_array_bound`` only if every
slice gets at least this many elements (512 bytes): each slice is one more
range to send and apply per step, which costs more than a smaller imbalance."""

PAGE_NUMEL: Final = 1024
"""float32 elements in a 4 KiB memory page: the grain of the ``balanced`` layout."""

MIN_PAGED_SLICE_NUMEL: Final = 16 * PAGE_NUMEL
"""``balanced`` cuts a sliced parameter at page boundaries (:func:`page_split`)
when its slices get at least this many elements (64 KiB), where a page more
or less moves a shard's load by at most about 6 %."""


@dataclass(frozen=True)
class ParamSpec:
    """A named parameter: its name and shape (float32 elements)."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Piece:
    """A contiguous part of one parameter that lives on one shard.

    Attributes:
        name: parameter name.
        param_start: first element of the piece, in the flattened parameter.
        param_end: one past the last element.
        shard: index of the shard holding it.
        shard_offset: element offset of the piece in the shard's flat buffer.
        flat_offset: element offset of the piece in the trainer's flat buffer.
    """

    name: str
    param_start: int
    param_end: int
    shard: int
    shard_offset: int
    flat_offset: int

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.param_end - self.param_start


@dataclass(frozen=True)
class ShardLayout:
    """What one shard holds.

    Attributes:
        index: shard index, ``0 <= index < num_shards``.
        pieces: pieces in shard-buffer order.
        numel: total float32 elements on the shard.
        ranges: coalesced ``(flat_start, flat_end)`` element ranges of the
            trainer's flat buffer, in shard-buffer order.
        shapes: ``(name, shape)`` of every parameter with a piece here, so that
            a reshape that keeps the element count changes the fingerprint.
        buffers: ``(name, dtype)`` of every buffer here (its piece holds its
            encoded values, see :mod:`elasticps.buffers`).
    """

    index: int
    pieces: tuple[Piece, ...]
    numel: int
    ranges: tuple[tuple[int, int], ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    buffers: tuple[BufferSpec, ...] = ()

    def describe(self) -> dict[str, object]:
        """The layout as sent in a HELLO frame: JSON-ready, order-preserving.

        ``pieces`` lists ``[name, param_start, param_end]`` in shard-buffer
        order; ``shapes`` maps each parameter (and buffer) name to its full
        shape; ``buffers``, present only if the shard holds buffers, maps
        each buffer name to its dtype.
        """
        described: dict[str, object] = {
            "shard": self.index,
            "numel": self.numel,
            "pieces": [[p.name, p.param_start, p.param_end] for p in self.pieces],
            "shapes": {name: list(shape) for name, shape in self.shapes},
        }
        if self.buffers:
            from elasticps.buffers import describe_buffers

            described["buffers"] = describe_buffers(self.buffers)
        return described

    @property
    def fingerprint(self) -> str:
        """SHA-256 of :meth:`describe`; equal layouts have equal fingerprints."""
        text = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Placement:
    """Where every parameter lives, for ``num_shards`` parameter servers.

    Attributes:
        params: the parameters, in model order.
        num_shards: number of parameter-server shards.
        big_array_bound: element count above which a parameter is sliced
            (``balanced`` may slice smaller ones too).
        shards: one layout per shard.
        flat_offsets: parameter (and buffer) name -> element offset in the
            flat buffer.
        total_numel: size of the flat buffer, in elements.
        buffers: the model's persistent buffers, after the parameters.
    """

    params: tuple[ParamSpec, ...]
    num_shards: int
    big_array_bound: int
    shards: tuple[ShardLayout, ...]
    flat_offsets: dict[str, int] = field(hash=False)
    total_numel: int
    buffers: tuple[BufferSpec, ...] = ()
    strategy: str = DEFAULT_PLACEMENT

    @property
    def params_numel(self) -> int:
        """Elements of the flat buffer that hold parameters (the buffers follow them)."""
        return sum(p.numel for p in self.params)

    def param(self, name: str) -> ParamSpec:
        """Look up a parameter by name; KeyError if absent."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def stable_shard(name: str, num_shards: int) -> int:
    """The shard of a buffer (and of a whole parameter under ``hash``): ``crc32(name) % n``."""
    return zlib.crc32(name.encode("utf-8")) % num_shards


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ranges whose sizes differ by at most 1."""
    base, extra = divmod(n, parts)
    out = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def plan_placement(
    params: Sequence[ParamSpec],
    num_shards: int,
    big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND,
    buffers: Sequence[BufferSpec] = (),
    strategy: str = DEFAULT_PLACEMENT,
) -> Placement:
    """Place parameters (and buffers) on shards.

    Args:
        params: parameters in model order; names must be unique.
        num_shards: number of parameter servers, >= 1.
        big_array_bound: parameters with more elements than this are sliced
            evenly across all shards; >= 1. Under ``balanced``, smaller ones
            (of at least :data:`MIN_SLICE_NUMEL` elements per shard) are
            sliced too where placing them whole would leave a shard more
            than :data:`BALANCE_TOLERANCE` above the mean.
        buffers: the model's persistent buffers; each goes whole to
            ``stable_shard(name)``, never sliced (``balanced`` counts their
            elements when it places the parameters).
        strategy: one of :data:`PLACEMENTS` (see the module docstring).

    Returns:
        The placement, identical for identical arguments in any process.

    Raises:
        ConfigError: ``num_shards`` or ``big_array_bound`` < 1, duplicate
            names, an empty parameter list, or an unknown ``strategy``.
    """
    if num_shards < 1:
        raise ConfigError(f"number of parameter servers must be >= 1, got {num_shards}")
    if big_array_bound < 1:
        raise ConfigError(f"big_array_bound must be >= 1, got {big_array_bound}")
    if strategy not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {', '.join(PLACEMENTS)}, got {strategy!r}")
    if not params:
        raise ConfigError("the model has no parameters to place")
    names = [p.name for p in params] + [b.name for b in buffers]
    if len(set(names)) != len(names):
        raise ConfigError("parameter and buffer names must be unique")

    shard_buffers: list[list[BufferSpec]] = [[] for _ in range(num_shards)]
    for b in buffers:
        shard_buffers[stable_shard(b.name, num_shards)].append(b)
    if num_shards == 1:
        homes = dict.fromkeys((p.name for p in params), 0)
    elif strategy == "hash":
        homes = {
            p.name: stable_shard(p.name, num_shards) for p in params if p.numel <= big_array_bound
        }
    else:
        buffer_load = [sum(b.encoded_numel for b in bs) for bs in shard_buffers]
        homes = _balanced_homes(params, num_shards, big_array_bound, buffer_load)
    whole: list[list[ParamSpec]] = [[] for _ in range(num_shards)]
    big: list[ParamSpec] = []
    for p in params:
        if p.name in homes:
            whole[homes[p.name]].append(p)
        else:
            big.append(p)

    shapes = {p.name: p.shape for p in params}
    shapes.update({b.name: b.shape for b in buffers})

    def assemble(layout: _Layout) -> Placement:
        flat_offsets, pieces, shard_fill, total = layout
        shards = []
        for s in range(num_shards):
            # A shard may hold nothing (a few parameters hashed to the same PS);
            # trainers still push their (empty) bodies to it, for the push keys.
            shards.append(
                ShardLayout(
                    index=s,
                    pieces=tuple(pieces[s]),
                    numel=shard_fill[s],
                    ranges=_coalesce(
                        (p.flat_offset, p.flat_offset + p.numel) for p in pieces[s] if p.numel
                    ),
                    shapes=tuple((p.name, shapes[p.name]) for p in pieces[s]),
                    buffers=tuple(shard_buffers[s]),
                )
            )
        return Placement(
            params=tuple(params),
            num_shards=num_shards,
            big_array_bound=big_array_bound,
            shards=tuple(shards),
            flat_offsets=flat_offsets,
            total_numel=total,
            buffers=tuple(buffers),
            strategy=strategy,
        )

    numel = sum(p.numel for p in params) + sum(b.encoded_numel for b in buffers)
    if strategy == "balanced" and numel >= MIN_PAGED_SLICE_NUMEL * num_shards:
        paged = assemble(_paged_layout(whole, big, shard_buffers))
        if page_runs(paged) is not None:
            return paged
    return assemble(_packed_layout(whole, big, shard_buffers))


_Layout = tuple[dict[str, int], list[list[Piece]], list[int], int]


def _packed_layout(
    whole: list[list[ParamSpec]], big: list[ParamSpec], shard_buffers: list[list[BufferSpec]]
) -> _Layout:
    """The packed layout: every piece right after the last, sliced parameters cut by
    :func:`even_split`, slice ``i`` on shard ``i`` (see the module docstring).

    Returns:
        ``(flat_offsets, pieces by shard, elements by shard, total_numel)``.
    """
    num_shards = len(whole)
    flat_offsets: dict[str, int] = {}
    pieces: list[list[Piece]] = [[] for _ in range(num_shards)]
    shard_fill = [0] * num_shards
    flat = 0
    for s in range(num_shards):
        for p in whole[s]:
            flat_offsets[p.name] = flat
            pieces[s].append(Piece(p.name, 0, p.numel, s, shard_fill[s], flat))
            shard_fill[s] += p.numel
            flat += p.numel
    for p in big:
        flat_offsets[p.name] = flat
        for s, (lo, hi) in enumerate(even_split(p.numel, num_shards)):
            if hi > lo:
                pieces[s].append(Piece(p.name, lo, hi, s, shard_fill[s], flat + lo))
                shard_fill[s] += hi - lo
        flat += p.numel
    for s in range(num_shards):
        for b in shard_buffers[s]:
            flat_offsets[b.name] = flat
            pieces[s].append(Piece(b.name, 0, b.encoded_numel, s, shard_fill[s], flat))
            shard_fill[s] += b.encoded_numel
            flat += b.encoded_numel
    return flat_offsets, pieces, shard_fill, flat


def page_split(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ranges cut at multiples of
    :data:`PAGE_NUMEL`: the whole pages go as :func:`even_split` splits them, and
    the last range also gets the ``n % PAGE_NUMEL`` elements after them."""
    pages = even_split(n // PAGE_NUMEL, parts)
    out = [(lo * PAGE_NUMEL, hi * PAGE_NUMEL) for lo, hi in pages]
    out[-1] = (out[-1][0], n)
    return out


def _round_up(n: int) -> int:
    return -(-n // PAGE_NUMEL) * PAGE_NUMEL


def _paged_layout(
    whole: list[list[ParamSpec]], big: list[ParamSpec], shard_buffers: list[list[BufferSpec]]
) -> _Layout:
    """The paged layout: laid out so that each shard's pages can be mapped into
    the flat buffer (see :func:`page_runs`).

    A parameter sliced into slices of at least :data:`MIN_PAGED_SLICE_NUMEL`
    elements is cut by :func:`page_split`, and the ``j``-th largest such
    parameter (ties by name) has its slice ``i`` on shard ``(i + j) % n``, so
    that the short last slices fall on different shards. Smaller ones are
    cut by :func:`even_split`, slice ``i`` on shard ``i`` (the layout is then
    not mappable, but their copies are cheap). A shard holds, in order: its
    page-sized slices, its short slices, its whole parameters, its buffers.
    In the flat buffer every sliced parameter starts on a page; a shard's
    whole parameters and buffers follow its short slice's parameter, or start
    on a page if it has none, so that a page of the flat buffer never holds
    two shards' elements.

    Returns:
        ``(flat_offsets, pieces by shard, elements by shard, total_numel)``.
    """
    num_shards = len(whole)
    paged = sorted(
        (p for p in big if p.numel // num_shards >= MIN_PAGED_SLICE_NUMEL),
        key=lambda p: (-p.numel, p.name),
    )
    turn = {p.name: j for j, p in enumerate(paged)}
    # Each sliced parameter's slices: (param_start, param_end, shard).
    cuts: list[list[tuple[int, int, int]]] = []
    for p in big:
        if p.name in turn:
            bounds = page_split(p.numel, num_shards)
            j = turn[p.name]
            cuts.append([(lo, hi, (i + j) % num_shards) for i, (lo, hi) in enumerate(bounds)])
        else:
            cuts.append([(lo, hi, i) for i, (lo, hi) in enumerate(even_split(p.numel, num_shards))])
    # Shard-buffer order: page-sized slices first, then the short ones.
    full: list[list[tuple[int, int, int]]] = [[] for _ in range(num_shards)]  # (param, lo, hi)
    short: list[list[tuple[int, int, int]]] = [[] for _ in range(num_shards)]
    for k, slices in enumerate(cuts):
        for lo, hi, s in slices:
            if hi > lo:
                (short if (hi - lo) % PAGE_NUMEL else full)[s].append((k, lo, hi))
    # Where each shard's whole parameters and buffers go in the flat buffer:
    # right behind the parameter of its last short slice.
    tail_after = {s: short[s][-1][0] for s in range(num_shards) if short[s]}
    # Each shard's whole parameters and buffers: (name, numel), in order.
    wholes = [
        [(q.name, q.numel) for q in params] + [(b.name, b.encoded_numel) for b in bufs]
        for params, bufs in zip(whole, shard_buffers, strict=True)
    ]
    tails = [sum(n for _, n in items) for items in wholes]
    flat_offsets: dict[str, int] = {}
    tail_at: dict[int, int] = {}
    flat = 0
    for k, p in enumerate(big):
        flat = _round_up(flat)
        flat_offsets[p.name] = flat
        flat += p.numel
        for s in range(num_shards):
            if tail_after.get(s) == k:
                tail_at[s] = flat
                flat += tails[s]
    for s in range(num_shards):
        if s not in tail_at:
            flat = _round_up(flat)
            tail_at[s] = flat
            flat += tails[s]
    pieces: list[list[Piece]] = [[] for _ in range(num_shards)]
    shard_fill = [0] * num_shards
    for s in range(num_shards):
        for k, lo, hi in full[s] + short[s]:
            name = big[k].name
            pieces[s].append(Piece(name, lo, hi, s, shard_fill[s], flat_offsets[name] + lo))
            shard_fill[s] += hi - lo
        at = tail_at[s]
        for name, numel in wholes[s]:
            flat_offsets[name] = at
            pieces[s].append(Piece(name, 0, numel, s, shard_fill[s], at))
            shard_fill[s] += numel
            at += numel
    return flat_offsets, pieces, shard_fill, _round_up(flat)


def page_runs(placement: Placement) -> tuple[tuple[tuple[int, int, int], ...], ...] | None:
    """How to map each shard's pages into the flat buffer, if the layout allows it.

    A trainer can then make its flat buffers out of the pages of the memory it
    shares with each server (see :mod:`elasticps.trainer.client`), so that
    nothing is copied between them. That needs every page of the flat buffer
    that holds a shard's elements to be one page of that shard's buffer, at
    the same place within the page, holding no other shard's elements, and
    each page of a shard's buffer to appear once.

    Returns:
        Per shard, ``(flat_page, shard_page, pages)`` runs (pages of
        :data:`PAGE_NUMEL` elements); None if the layout cannot be mapped
        (``hash`` placements with several shards, mostly).
    """
    if placement.total_numel % PAGE_NUMEL:
        return None
    owner: dict[int, tuple[int, int]] = {}  # flat page -> (shard, shard page)
    out = []
    for shard in placement.shards:
        seen: dict[int, int] = {}  # shard page -> flat page
        offset = 0
        for lo, hi in shard.ranges:
            if (lo - offset) % PAGE_NUMEL:
                return None
            delta = lo // PAGE_NUMEL - offset // PAGE_NUMEL
            for page in range(lo // PAGE_NUMEL, -(-hi // PAGE_NUMEL)):
                mine = (shard.index, page - delta)
                if owner.setdefault(page, mine) != mine or seen.setdefault(mine[1], page) != page:
                    return None
            offset += hi - lo
        runs: list[tuple[int, int, int]] = []
        for shard_page, page in sorted(seen.items()):
            last = runs[-1] if runs else None
            if last and last[0] + last[2] == page and last[1] + last[2] == shard_page:
                runs[-1] = (last[0], last[1], last[2] + 1)
            else:
                runs.append((page, shard_page, 1))
        out.append(tuple(runs))
    return tuple(out)


def _balanced_homes(
    params: Sequence[ParamSpec], num_shards: int, big_array_bound: int, buffer_load: list[int]
) -> dict[str, int]:
    """The shard of every parameter ``balanced`` keeps whole (the others are sliced).

    Greedy largest-first onto the least-loaded shard (the LPT rule, whose
    excess over the mean is at most the largest whole item), then slicing the
    largest whole parameter while the excess is above :data:`BALANCE_TOLERANCE`
    and its slices would get at least :data:`MIN_SLICE_NUMEL` elements. Each
    round slices one more parameter, so at most ``len(params)`` rounds.
    """
    total = sum(p.numel for p in params) + sum(buffer_load)
    limit = total / num_shards * (1.0 + BALANCE_TOLERANCE)
    by_size = sorted(
        (p for p in params if p.numel <= big_array_bound), key=lambda p: (-p.numel, p.name)
    )
    sliced_numel = sum(p.numel for p in params if p.numel > big_array_bound)
    sliceable = sum(1 for p in by_size if p.numel >= MIN_SLICE_NUMEL * num_shards)
    for first_whole in range(sliceable + 1):
        # A sliced parameter adds numel / num_shards to every shard, plus at most 1.
        loads = [load + sliced_numel // num_shards for load in buffer_load]
        homes: dict[str, int] = {}
        for p in by_size[first_whole:]:
            s = loads.index(min(loads))
            homes[p.name] = s
            loads[s] += p.numel
        if max(loads) <= limit:
            break
        if first_whole < sliceable:
            sliced_numel += by_size[first_whole].numel
    return homes


def _coalesce(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)
