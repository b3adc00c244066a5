"""Checks the launcher makes before launch, each a pure-ish function: nulls from Parquet
metadata, a snapshot's shard files, and a model file's error line."""

from __future__ import annotations

import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticps.data.parquet import check_no_nulls, null_counts
from elasticps.errors import DataError
from elasticps.model_file import describe_model_error, load_model_file
from elasticps.snapshot import build_manifest, verify_snapshot_files, write_manifest

pytestmark = pytest.mark.timeout(30)


# --- nulls, from metadata ------------------------------------------------------------------


def write(path: Path, table: pa.Table, **kwargs: object) -> Path:
    pq.write_table(table, path, row_group_size=2, **kwargs)  # type: ignore[arg-type]
    return path


def test_null_counts_of_flat_columns_come_from_the_row_group_statistics(tmp_path: Path) -> None:
    path = write(
        tmp_path / "d.parquet",
        pa.table({"x": [1.0, None, 3.0, None, None], "label": [0, 1, 2, 3, None], "y": [None] * 5}),
    )
    assert null_counts(path, ["x", "label"]) == {"x": 3, "label": 1}


def test_an_empty_list_is_no_null_but_a_null_list_or_element_is(tmp_path: Path) -> None:
    pixels = pa.array([[1, 2], [], None, [3, None], [4]], type=pa.list_(pa.uint8()))
    fixed = pa.array([[1, 2], [3, 4], None, [5, None], [6, 7]], type=pa.list_(pa.uint8(), 2))
    path = write(tmp_path / "d.parquet", pa.table({"pixels": pixels, "fixed": fixed}))
    assert null_counts(path, ["pixels", "fixed"]) == {"pixels": 2, "fixed": 2}


def test_a_struct_counts_its_own_nulls_and_its_fields_nulls(tmp_path: Path) -> None:
    column = pa.array([{"a": 1, "b": None}, {"a": None, "b": 2}, None])
    path = write(tmp_path / "d.parquet", pa.table({"s": column}))
    assert null_counts(path, ["s"]) == {"s": 3}


def test_row_groups_without_statistics_are_not_counted(tmp_path: Path) -> None:
    path = write(tmp_path / "d.parquet", pa.table({"label": [1, None]}), write_statistics=False)
    assert null_counts(path, ["label"]) == {"label": 0}


def test_check_no_nulls_names_the_file_every_column_and_its_count(tmp_path: Path) -> None:
    path = write(tmp_path / "d.parquet", pa.table({"x": [None, None, 1.0], "label": [None, 1, 2]}))
    with pytest.raises(DataError) as caught:
        check_no_nulls(path, ("x", "label"))
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message
    assert "2 nulls in column 'x'" in message and "1 null in column 'label'" in message
    assert "--bad-records skip" in message
    check_no_nulls(write(tmp_path / "ok.parquet", pa.table({"x": [1.0]})), ("x",))


# --- a snapshot's shard files ---------------------------------------------------------------


def snapshot(tmp_path: Path, contents: list[bytes]) -> Path:
    entries: list[dict[str, object]] = []
    for index, data in enumerate(contents):
        name = f"shard-{index}.safetensors"
        (tmp_path / name).write_bytes(data)
        entries.append({"index": index, "initialized": True, "file": name, "version": 1,
                        "crc32": zlib.crc32(data), "bytes": len(data), "pieces": []})  # fmt: skip
    write_manifest(tmp_path, build_manifest(entries, ledger_revision=None, extra={}))
    return tmp_path


def test_a_snapshot_whose_files_match_the_manifest_passes(tmp_path: Path) -> None:
    manifest = verify_snapshot_files(snapshot(tmp_path, [b"a" * 100, b"b" * 3]), chunk_bytes=7)
    assert manifest["num_ps"] == 2


def test_a_truncated_shard_is_refused_naming_it_and_both_sizes(tmp_path: Path) -> None:
    snapshot(tmp_path, [b"a" * 100, b"b" * 50])
    (tmp_path / "shard-1.safetensors").write_bytes(b"b" * 20)
    with pytest.raises(DataError, match=r"shard-1.safetensors has 20 bytes, the manifest says 50"):
        verify_snapshot_files(tmp_path)


def test_a_corrupted_shard_is_refused_by_its_crc(tmp_path: Path) -> None:
    snapshot(tmp_path, [b"a" * 100])
    (tmp_path / "shard-0.safetensors").write_bytes(b"a" * 99 + b"z")
    with pytest.raises(DataError, match=r"shard-0\.safetensors is corrupt: its CRC-32"):
        verify_snapshot_files(tmp_path)


def test_a_missing_shard_or_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"manifest\.json not found"):
        verify_snapshot_files(tmp_path)
    snapshot(tmp_path, [b"a"])
    (tmp_path / "shard-0.safetensors").unlink()
    with pytest.raises(DataError, match="cannot read shard file"):
        verify_snapshot_files(tmp_path)


# --- the model file's line -------------------------------------------------------------------

MODEL = """\
import torch

COLUMNS = ("x",)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


def loss(outputs, targets):
    return check(targets)


def check(targets):
    raise ValueError("label   out of\\nrange")


def batch_to_tensors(batch):
    return batch, batch
"""


def test_a_model_file_error_is_described_by_its_innermost_line_in_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    with pytest.raises(ValueError) as caught:
        spec.loss(None, None)  # type: ignore[arg-type]
    line = describe_model_error(caught.value, spec.path, "m.py", "loss")
    assert line == "model file m.py, line 17, in check: ValueError: label out of range"


def test_an_error_raised_outside_the_file_names_the_contract_function(tmp_path: Path) -> None:
    try:
        int("x")
    except ValueError as exc:
        line = describe_model_error(exc, tmp_path / "m.py", "m.py", "forward")
    assert line.startswith("model file m.py, in forward: ValueError: invalid literal")
