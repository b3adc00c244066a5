"""Locations (paths and storage URLs) and how a dataset's files are found.

Remote storage is exercised against a real S3 server in
``tests/integration/test_object_storage.py``; here the naming rules and the
local file system.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticps.data.parquet import RangeReader, find_split, resolve_dataset_files
from elasticps.errors import ConfigError, DataError
from elasticps.storage import Location, is_url, path_or_url


def test_urls_are_normalised_and_joined_without_folding_the_scheme() -> None:
    loc = Location.of("s3://bucket/runs/x/")
    assert loc.url == "s3://bucket/runs/x" and loc.scheme == "s3" and not loc.is_local
    assert (loc / "snapshot" / "manifest.json").url == "s3://bucket/runs/x/snapshot/manifest.json"
    assert loc.name == "x" and loc.parent.url == "s3://bucket/runs"
    assert Location.of("file:///tmp/a").url == "/tmp/a" and Location.of("file:///tmp/a").is_local
    assert Location.of("runs/x").local_path == Path("runs/x")
    assert is_url("gs://b/p") and is_url("hdfs://nn:8020/p") and not is_url("file:///tmp")
    assert path_or_url("s3://b/p") == "s3://b/p" and path_or_url("a/b") == Path("a/b")
    assert path_or_url("file:///tmp/a") == Path("/tmp/a")


def test_a_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as caught:
        Location.of("s3://AKIAEXAMPLE:SECRET@bucket/x")
    assert "SECRET" not in str(caught.value) and "AKIAEXAMPLE" not in str(caught.value)


def test_a_local_location_reads_writes_lists_copies_and_removes(tmp_path: Path) -> None:
    root = Location.of(str(tmp_path)) / "out"
    (root / "a.bin").write_atomic(b"one")
    (root / "a.bin").write_atomic(b"two")  # replaces
    assert (root / "a.bin").read_bytes() == b"two" and (root / "a.bin").size() == 3
    (root / "a.bin").copy_to(root / "b.bin")
    assert root.listdir() == ["a.bin", "b.bin"] and root.is_dir()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]
    (root / "a.bin").remove()
    (root / "a.bin").remove()  # missing is fine
    assert root.listdir() == ["b.bin"]
    root.remove_tree()
    assert not root.exists() and root.listdir() == []


def _parquet(path: Path, rows: int, first: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": list(range(first, first + rows))}), path, row_group_size=10)


def test_a_dataset_is_a_file_a_split_a_split_directory_a_directory_or_a_glob(
    tmp_path: Path,
) -> None:
    _parquet(tmp_path / "mnist" / "train.parquet", 30)
    _parquet(tmp_path / "mnist" / "test.parquet", 10)
    _parquet(tmp_path / "parts" / "part-1.parquet", 20)
    _parquet(tmp_path / "parts" / "part-0.parquet", 20)
    _parquet(tmp_path / "splits" / "train" / "a.parquet", 5)
    _parquet(tmp_path / "splits" / "test" / "b.parquet", 5)

    def names(files: tuple[Location, ...]) -> list[str]:
        return [Path(f.url).relative_to(tmp_path).as_posix() for f in files]

    assert names(find_split(tmp_path / "mnist", "train")) == ["mnist/train.parquet"]
    assert names(find_split(tmp_path / "mnist", "test")) == ["mnist/test.parquet"]
    assert names(find_split(tmp_path / "parts", "train")) == [
        "parts/part-0.parquet",
        "parts/part-1.parquet",
    ]
    assert find_split(tmp_path / "parts", "test") == ()
    assert names(find_split(tmp_path / "splits", "test")) == ["splits/test/b.parquet"]
    assert names(find_split(str(tmp_path / "parts" / "part-*.parquet"), "train")) == [
        "parts/part-0.parquet",
        "parts/part-1.parquet",
    ]
    with pytest.raises(DataError, match=r"data file not found: .*absent"):
        resolve_dataset_files(tmp_path / "absent", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"not found: .*empty/train\.parquet"):
        resolve_dataset_files(tmp_path / "empty", "train")


def test_row_ranges_read_through_a_file_url(tmp_path: Path) -> None:
    _parquet(tmp_path / "d.parquet", 100)
    with RangeReader() as reader:
        table = reader.read_rows(f"file://{tmp_path / 'd.parquet'}", 35, 47, ["x"])
        assert table.column("x").to_pylist() == list(range(35, 47))
        assert reader.num_rows(Location.of(str(tmp_path / "d.parquet"))) == 100
