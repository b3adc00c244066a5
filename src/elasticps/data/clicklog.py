"""A synthetic click log with power-law ids, written as Parquet in bounded memory.

For benchmarks of large sparse tables: ``rows`` impressions, each a
``user`` and an ``item`` id drawn from a Zipf distribution over ``keys``
ids (10^7 to 10^8 in a benchmark), and a click label. Real click logs are
heavy-tailed: a few ids occur in most rows and most ids occur a handful of
times, which is what makes row-wise pulls, lazy optimizers and eviction pay.

Ids
    The popularity rank ``r`` (1 = most frequent) of each id is drawn from
    the Zipf distribution over ``1..keys`` with exponent ``s`` (P(r) is
    proportional to ``r^-s``; ``s`` > 0, 1.0 to 1.2 is typical of click
    logs), by rejection-inversion (Hörmann and Derflinger 1996,
    "Rejection-inversion to generate variates from monotone discrete
    distributions", ACM TOMACS 6(3); as in Apache Commons RNG's
    ``RejectionInversionZipfSampler``): O(1) per draw with no table of
    ``keys`` entries, so 10^8 keys cost no memory. Ranks then become ids
    through a fixed affine permutation of ``[0, keys)`` (``id = (a (r - 1)
    + b) mod keys``, ``a`` coprime with ``keys``), different for users and
    items, so popular ids are spread over the id space rather than all small.

Labels
    ``label = 1`` with probability ``sigmoid(bias + w(user) + w(item))``,
    where ``w`` is a per-id weight N(0, 1) computed from a hash of the id
    (:func:`elasticps.pserver.sparse.initial_rows` with its own seed, so
    nothing of size ``keys`` is stored) and ``bias = logit(ctr)``: the log
    has a signal an embedding model can learn. The mean click rate is
    above ``ctr`` (0.18 for ``ctr = 0.1``), as the weights spread the logits.

Output: ``train.parquet`` (``rows`` rows) and ``test.parquet``
(``test_rows`` rows, drawn after the training rows from the same
distribution), columns ``user`` (int64), ``item`` (int64), ``label``
(float32), written row group by row group (``row_group_rows``) with
``pyarrow.parquet.ParquetWriter``: memory is a few row groups whatever
``rows`` is. Row group ``g`` is drawn from its own generator (``seed``,
``g``), so the output is identical for identical arguments.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from elasticps.errors import ConfigError, DataError
from elasticps.pserver.sparse import TableSpec, initial_rows

CLICKLOG_SCHEMA: Final = pa.schema(
    [
        pa.field("user", pa.int64(), nullable=False),
        pa.field("item", pa.int64(), nullable=False),
        pa.field("label", pa.float32(), nullable=False),
    ]
)
"""Schema of the click log's Parquet files."""

MAX_KEYS: Final = 2**32
"""Largest ``keys`` (the id permutation is computed exactly in uint64 below it)."""


class ZipfSampler:
    """Zipf ranks in ``1..n`` with exponent ``s`` by rejection-inversion (vectorised).

    Hörmann and Derflinger 1996; the helper functions follow Apache Commons
    RNG's ``RejectionInversionZipfSampler`` (``H(x)`` integrates ``h(x) =
    x^-s``; ``helper1(x) = log1p(x) / x`` and ``helper2(x) = expm1(x) / x``
    keep the formulas accurate near ``s = 1``).

    Args:
        n: number of ranks, >= 1.
        s: exponent, > 0.

    Raises:
        ConfigError: ``n < 1`` or ``s <= 0``.
    """

    def __init__(self, n: int, s: float) -> None:
        if n < 1:
            raise ConfigError(f"the number of keys must be >= 1, got {n}")
        if not s > 0:
            raise ConfigError(f"the Zipf exponent must be > 0, got {s}")
        self.n = n
        self.s = s
        self._h_x1 = self._hi(np.array([1.5]))[0] - 1.0
        self._h_n = self._hi(np.array([n + 0.5]))[0]
        self._shift = (
            2.0
            - self._hi_inv(np.array([self._hi(np.array([2.5]))[0] - self._h(np.array([2.0]))[0]]))[
                0
            ]
        )

    def _h(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.exp(-self.s * np.log(x))

    def _hi(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        log_x = np.log(x)
        return _helper2((1.0 - self.s) * log_x) * log_x

    def _hi_inv(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        t = np.maximum(x * (1.0 - self.s), -1.0)
        return np.exp(_helper1(t) * x)

    def sample(self, rng: np.random.Generator, size: int) -> npt.NDArray[np.int64]:
        """``size`` ranks, int64 in ``[1, n]``."""
        out = np.empty(size, dtype=np.int64)
        todo = np.arange(size)
        while todo.size:
            u = self._h_n + rng.random(todo.size) * (self._h_x1 - self._h_n)
            x = self._hi_inv(u)
            k = np.clip(np.floor(x + 0.5), 1, self.n)
            ok = (k - x <= self._shift) | (u >= self._hi(k + 0.5) - self._h(k))
            out[todo[ok]] = k[ok].astype(np.int64)
            todo = todo[~ok]
        return out


def _helper1(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    small = np.abs(x) <= 1e-8
    safe = np.where(small, 1.0, x)
    return np.where(small, 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x)), np.log1p(safe) / safe)


def _helper2(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    small = np.abs(x) <= 1e-8
    safe = np.where(small, 1.0, x)
    return np.where(
        small, 1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + 0.25 * x)), np.expm1(safe) / safe
    )


@dataclass(frozen=True)
class ClickLogSpec:
    """What :func:`write_clicklog` generates.

    Attributes:
        rows: training rows, >= 1.
        keys: ids per field (users and items each in ``[0, keys)``), in
            ``[2, MAX_KEYS]``.
        zipf_s: Zipf exponent, > 0.
        seed: seed of everything.
        test_rows: rows of ``test.parquet``, >= 0 (0: no test file).
        row_group_rows: rows per Parquet row group, >= 1.
        ctr: the base click rate, in (0, 1).

    Raises:
        ConfigError: a field out of range.
    """

    rows: int
    keys: int
    zipf_s: float = 1.05
    seed: int = 0
    test_rows: int = 0
    row_group_rows: int = 65_536
    ctr: float = 0.1

    def __post_init__(self) -> None:
        if self.rows < 1 or self.test_rows < 0:
            raise ConfigError(f"--rows must be >= 1 and test rows >= 0, got {self.rows}")
        if not 2 <= self.keys <= MAX_KEYS:
            raise ConfigError(f"--keys must be in [2, {MAX_KEYS}], got {self.keys}")
        if not self.zipf_s > 0:
            raise ConfigError(f"--zipf-s must be > 0, got {self.zipf_s}")
        if self.row_group_rows < 1:
            raise ConfigError(f"row_group_rows must be >= 1, got {self.row_group_rows}")
        if not 0 < self.ctr < 1:
            raise ConfigError(f"ctr must be in (0, 1), got {self.ctr}")


def _multiplier(keys: int, salt: int) -> int:
    """An odd multiplier coprime with ``keys``, near ``keys * golden ratio``."""
    a = int(keys * 0.6180339887498949) + salt
    while math.gcd(a, keys) != 1:
        a += 1
    return a % keys or 1


def _rank_to_id(ranks: npt.NDArray[np.int64], keys: int, salt: int) -> npt.NDArray[np.int64]:
    # keys <= 2^32 (checked by ClickLogSpec), so (rank - 1) * a < 2^64: exact in uint64.
    a = np.uint64(_multiplier(keys, salt))
    k = np.uint64(keys)
    prod = ((ranks - 1).astype(np.uint64) * a) % k
    return ((prod + np.uint64(salt % keys)) % k).astype(np.int64)


def _weights(ids: npt.NDArray[np.int64], name: str, seed: int) -> npt.NDArray[np.float64]:
    return initial_rows(TableSpec(name, 1, seed=seed), ids)[:, 0].astype(np.float64)


def _group(spec: ClickLogSpec, sampler: ZipfSampler, group: int, rows: int) -> pa.Table:
    rng = np.random.default_rng([spec.seed, group])
    user = _rank_to_id(sampler.sample(rng, rows), spec.keys, 1)
    item = _rank_to_id(sampler.sample(rng, rows), spec.keys, 2)
    bias = math.log(spec.ctr / (1 - spec.ctr))
    logit = bias + _weights(user, "user", spec.seed) + _weights(item, "item", spec.seed)
    label = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return pa.Table.from_arrays(
        [pa.array(user), pa.array(item), pa.array(label)], schema=CLICKLOG_SCHEMA
    )


def _write(
    path: Path, spec: ClickLogSpec, sampler: ZipfSampler, first_group: int, rows: int
) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with pq.ParquetWriter(tmp, CLICKLOG_SCHEMA) as writer:
            group = first_group
            for start in range(0, rows, spec.row_group_rows):
                n = min(spec.row_group_rows, rows - start)
                writer.write_table(_group(spec, sampler, group, n), row_group_size=n)
                group += 1
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_clicklog(out_dir: Path, spec: ClickLogSpec) -> list[Path]:
    """Write the click log ``spec`` describes (see the module docstring).

    Args:
        out_dir: directory to write into; created if missing; files replaced atomically.
        spec: sizes, exponent and seed.

    Returns:
        The files written: ``train.parquet``, and ``test.parquet`` if ``test_rows`` > 0.

    Raises:
        DataError: ``out_dir`` cannot be written.
    """
    sampler = ZipfSampler(spec.keys, spec.zipf_s)
    out_dir = Path(out_dir)
    paths = [out_dir / "train.parquet"]
    train_groups = -(-spec.rows // spec.row_group_rows)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write(paths[0], spec, sampler, 0, spec.rows)
        if spec.test_rows:
            paths.append(out_dir / "test.parquet")
            _write(paths[1], spec, sampler, train_groups, spec.test_rows)
    except OSError as exc:
        raise DataError(f"cannot write the click log to {out_dir}: {exc}") from exc
    return paths
