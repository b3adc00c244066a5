"""Tests of checkpoint files: safetensors tensors plus a JSON manifest, written atomically."""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elasticps.checkpoint import (
    CHECKPOINT_FORMAT,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from elasticps.errors import DataError


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(4, 3, generator=generator),
        "fc1.bias": torch.randn(4, generator=generator),
        "fc2.weight": torch.randn(3, 4, generator=generator).t(),  # not contiguous
    }


def test_round_trip_restores_tensors_and_manifest(tmp_path: Path) -> None:
    tensors = sample_tensors()
    before = time.time()
    manifest_path = save_checkpoint(
        tmp_path / "v7", tensors, {"model_version": 7, "shard_map": {"fc1.weight": 0}}
    )
    assert manifest_path == tmp_path / "v7" / "manifest.json"

    loaded, manifest = load_checkpoint(tmp_path / "v7")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
        assert loaded[name].dtype == torch.float32
    assert manifest["model_version"] == 7
    assert manifest["shard_map"] == {"fc1.weight": 0}
    assert manifest["format"] == CHECKPOINT_FORMAT
    assert manifest["tensors_file"] == "model.safetensors"
    assert manifest["parameters"] == {
        "fc1.weight": {"shape": [4, 3], "dtype": "float32"},
        "fc1.bias": {"shape": [4], "dtype": "float32"},
        "fc2.weight": {"shape": [4, 3], "dtype": "float32"},
    }
    created = manifest["created_unix_s"]
    assert isinstance(created, float)
    assert before <= created <= time.time()
    assert manifest["crc32"] == zlib.crc32((tmp_path / "v7" / "model.safetensors").read_bytes())
    assert read_manifest(tmp_path / "v7") == manifest


def test_the_files_are_safetensors_and_plain_json(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    save_checkpoint(tmp_path, sample_tensors(), {"note": "x"})
    assert set(load_file(tmp_path / "model.safetensors")) == set(sample_tensors())
    assert json.loads((tmp_path / "manifest.json").read_text())["note"] == "x"


def test_save_leaves_only_the_two_files(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {})
    save_checkpoint(tmp_path, sample_tensors(), {})  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "model.safetensors"]


def test_failed_rename_keeps_the_previous_checkpoint_and_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {"model_version": 1})

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    bigger = {name: tensor * 2 for name, tensor in sample_tensors().items()}
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, bigger, {"model_version": 2})
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "model.safetensors"]
    loaded, manifest = load_checkpoint(tmp_path)
    assert manifest["model_version"] == 1
    assert torch.equal(loaded["fc1.bias"], sample_tensors()["fc1.bias"])


def test_unserialisable_manifest_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path / "c", sample_tensors(), {"bad": object()})
    assert list((tmp_path / "c").iterdir()) == []


def test_caller_cannot_forge_the_reserved_fields(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {"crc32": 1, "format": "other"})
    _, manifest = load_checkpoint(tmp_path)
    assert manifest["format"] == CHECKPOINT_FORMAT


def test_corrupted_tensors_file_is_detected_by_crc(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {})
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # flip one bit of a tensor value
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"is corrupt: CRC-32 \d+ does not match") as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


def test_manifest_listing_other_parameters_is_rejected(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {})
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["parameters"]["fc1.bias"]
    manifest["parameters"]["fc3.weight"] = {"shape": [1], "dtype": "float32"}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        DataError, match=r"missing from file \['fc3.weight'\], not in manifest \['fc1.bias'\]"
    ):
        load_checkpoint(tmp_path)


def test_manifest_with_a_wrong_shape_is_rejected(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {})
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["parameters"]["fc1.bias"]["shape"] = [5]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"tensor 'fc1.bias' is float32 \[4\]"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: None, "checkpoint directory not found"),
        (lambda d: (d / "manifest.json").unlink(), "checkpoint manifest not found"),
        (lambda d: (d / "model.safetensors").unlink(), "cannot read checkpoint tensors"),
        (
            lambda d: (d / "manifest.json").write_text("{not json"),
            "cannot read checkpoint manifest",
        ),
        (lambda d: (d / "manifest.json").write_text("[1, 2]"), "is not a JSON object"),
        (
            lambda d: (d / "manifest.json").write_text('{"format": "v0"}'),
            "has format 'v0'; expected 'elasticps-checkpoint/1'",
        ),
    ],
)
def test_broken_checkpoints_are_one_line_data_errors(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    ckpt = tmp_path / "ckpt"
    if "directory not found" not in message:
        save_checkpoint(ckpt, sample_tensors(), {})
    damage(ckpt)
    with pytest.raises(DataError, match=message) as info:
        load_checkpoint(ckpt)
    assert "\n" not in str(info.value)


def test_tensors_file_outside_the_directory_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c", sample_tensors(), {})
    manifest_path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors_file"] = "../elsewhere.safetensors"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="invalid tensors_file"):
        load_checkpoint(tmp_path / "c")


def test_garbage_with_a_matching_crc_is_a_data_error(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_tensors(), {})
    garbage = b"\xff" * 64
    (tmp_path / "model.safetensors").write_bytes(garbage)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["crc32"] = zlib.crc32(garbage)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="cannot decode checkpoint tensors"):
        load_checkpoint(tmp_path)
