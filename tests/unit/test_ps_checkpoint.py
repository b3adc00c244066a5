"""Tests of shard checkpoints (``elasticps.pserver.checkpoint``) and of consistent
checkpoints on disk (``elasticps.snapshot``), without sockets.

Shards are built from real placements (``elasticps.placement``) of a few named
parameters, so the pieces, offsets and slices are the ones trainers send.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import DataError
from elasticps.placement import ParamSpec, Placement, plan_placement
from elasticps.pserver.checkpoint import (
    SHARD_FILE,
    CheckpointHealth,
    ShardCheckpointer,
    ShardFiles,
    encode_shard,
    load_shard,
    save_shard,
    shard_checkpoint_path,
)
from elasticps.pserver.shard import ParameterShard
from elasticps.snapshot import (
    ConsistentCheckpoint,
    build_manifest,
    load_consistent_checkpoint,
    piece_fits,
    shard_file_name,
    shard_state_for_layout,
    shards_mid_step,
    write_manifest,
)
from elasticps.testing import wait_for

ADAM = OptimizerConfig(name="adam", lr=0.05)
ALL_OPTIMIZERS = [
    OptimizerConfig(name="sgd", lr=0.1),
    OptimizerConfig(name="momentum", lr=0.1, momentum=0.8),
    ADAM,
    OptimizerConfig(name="adagrad", lr=0.3),
]
# "big" (40 elements) is sliced over every shard; the others go whole.
PARAMS = (ParamSpec("embed", (3, 4)), ParamSpec("bias", (5,)), ParamSpec("big", (40,)))
BIG_ARRAY_BOUND = 16
TIMEOUT_S = 5.0


def named_values(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.numel, generator=gen) for p in PARAMS}


def placement(num_shards: int) -> Placement:
    return plan_placement(PARAMS, num_shards, BIG_ARRAY_BOUND)


def shards_for(
    num_shards: int,
    values: dict[str, torch.Tensor],
    optimizer: OptimizerConfig = ADAM,
    mode: UpdateMode = UpdateMode.ASYNC,
) -> list[ParameterShard]:
    """One shard per layout of ``placement(num_shards)``, holding ``values`` by name."""
    shards = []
    for layout in placement(num_shards).shards:
        shard = ParameterShard(layout.describe(), layout.fingerprint, optimizer, mode)
        for piece in layout.pieces:
            shard.values[piece.shard_offset : piece.shard_offset + piece.numel] = values[
                piece.name
            ][piece.param_start : piece.param_end]
        shards.append(shard)
    return shards


def by_name(shards: list[ParameterShard], tensor: str = "values") -> dict[str, torch.Tensor]:
    """Reassemble a tensor of every shard's state by parameter name (the test's own way)."""
    sizes = {p.name: p.numel for p in PARAMS}
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors, _ = shard.state()
        offset = 0
        for name, lo, hi in shard.layout["pieces"]:  # type: ignore[attr-defined]
            whole = out.setdefault(name, torch.full((sizes[name],), float("nan")))
            whole[lo:hi] = tensors[tensor][offset : offset + hi - lo]
            offset += hi - lo
    return out


def train(shards: list[ParameterShard], steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for shard in shards:
            shard.push(0, torch.randn(shard.numel, generator=gen), shard.version, 1)


def write_consistent_checkpoint(out_dir: Path, shards: list[ParameterShard]) -> dict[str, object]:
    """What take_consistent_checkpoint writes, minus the sockets."""
    entries = []
    for shard in shards:
        index = shard.layout["shard"]
        assert isinstance(index, int)
        tensors, meta = shard.state()
        saved = save_shard(out_dir / shard_file_name(index), tensors, meta)
        entries.append(
            {
                "index": index,
                "address": f"127.0.0.1:{9000 + index}",
                "initialized": True,
                "version": saved.version,
                "file": shard_file_name(index),
                "crc32": saved.crc32,
                "bytes": saved.nbytes,
                "numel": shard.numel,
                "pieces": shard.layout["pieces"],
                "mode": shard.mode.value,
                "optimizer": meta["optimizer"],
            }
        )
    manifest = build_manifest(entries, ledger_revision=42, extra={"note": "unit"})
    write_manifest(out_dir, manifest)
    return manifest


# --- one shard file ----------------------------------------------------------------------


def test_saved_shard_loads_back_with_equal_tensors_and_metadata(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    train([shard], 3)
    tensors, meta = shard.state()

    saved = save_shard(tmp_path / "s.safetensors", tensors, meta)
    loaded, loaded_meta = load_shard(saved.path)

    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert {k: loaded_meta[k] for k in meta} == meta
    assert loaded_meta["format"] == "elasticps-shard/1"
    assert isinstance(loaded_meta["created_unix_s"], float)
    data = saved.path.read_bytes()
    assert (saved.crc32, saved.nbytes, saved.version) == (zlib.crc32(data), len(data), 3)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp file left


@pytest.mark.parametrize("config", ALL_OPTIMIZERS, ids=lambda c: c.name)
def test_shard_reloaded_from_its_file_takes_bit_identical_steps(
    tmp_path: Path, config: OptimizerConfig
) -> None:
    (original,) = shards_for(1, named_values(), config)
    train([original], 4)
    save_shard(tmp_path / SHARD_FILE, *original.state())

    restored = ParameterShard.from_state(
        *load_shard(tmp_path / SHARD_FILE), optimizer=config, mode=UpdateMode.ASYNC
    )

    assert restored.version == 4
    train([original], 3, seed=9)
    train([restored], 3, seed=9)
    assert torch.equal(restored.values, original.values)
    assert restored.version == original.version == 7


def test_saving_again_replaces_the_file_atomically(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    path = shard_checkpoint_path(tmp_path, 3)
    save_shard(path, *shard.state())
    train([shard], 2)

    save_shard(path, *shard.state())

    assert path == tmp_path / "ps-3" / "shard.safetensors"
    assert load_shard(path)[1]["version"] == 2
    assert [p.name for p in path.parent.iterdir()] == [SHARD_FILE]


def _corrupt_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _corrupt_header_digit(path: Path) -> None:
    data = path.read_bytes()
    # Change the recorded version inside the metadata JSON (a valid file still).
    path.write_bytes(data.replace(b'\\"version\\":5', b'\\"version\\":6', 1))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_corrupt_last_byte, "corrupt"),
        (_corrupt_header_digit, "corrupt"),
        (lambda p: p.write_bytes(p.read_bytes()[:-10]), "unreadable"),
        (lambda p: p.write_bytes(b"not a safetensors file at all"), "unreadable"),
        (lambda p: p.write_bytes(b""), "unreadable"),
        (lambda p: p.unlink(), "cannot read"),
    ],
    ids=["flipped-data-bit", "edited-metadata", "truncated", "garbage", "empty", "missing"],
)
def test_damaged_shard_file_raises_a_one_line_data_error(
    tmp_path: Path, damage: Callable[[Path], object], expected: str
) -> None:
    (shard,) = shards_for(1, named_values())
    train([shard], 5)
    path = save_shard(tmp_path / "s.safetensors", *shard.state()).path
    assert b'\\"version\\":5' in path.read_bytes()  # the metadata edit below finds its target

    damage(path)

    with pytest.raises(DataError, match=expected) as info:
        load_shard(path)
    assert "\n" not in str(info.value)


def test_shard_file_whose_tensors_do_not_match_its_layout_is_rejected(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    tensors, meta = shard.state()
    meta["layout"] = {**shard.layout, "numel": shard.numel + 1}
    (tmp_path / "s.safetensors").write_bytes(encode_shard(tensors, meta))

    with pytest.raises(DataError, match="expected float32 with"):
        load_shard(tmp_path / "s.safetensors")


@pytest.mark.parametrize("missing", ["layout", "fingerprint"])
def test_shard_file_without_layout_or_fingerprint_is_rejected(tmp_path: Path, missing: str) -> None:
    (shard,) = shards_for(1, named_values())
    tensors, meta = shard.state()
    del meta[missing]
    (tmp_path / "s.safetensors").write_bytes(encode_shard(tensors, meta))

    with pytest.raises(DataError, match="lacks its layout or fingerprint"):
        load_shard(tmp_path / "s.safetensors")


# --- periodic checkpoints ------------------------------------------------------------------


class PollCounter:
    """The checkpointer's ``get_shard``, counting its calls (one per poll of its thread)."""

    def __init__(self, shard: ParameterShard) -> None:
        self._shard = shard
        self._calls = 0
        self._lock = threading.Lock()

    def __call__(self) -> ParameterShard:
        with self._lock:
            self._calls += 1
        return self._shard

    def wait_for_more(self, polls: int) -> None:
        """Wait (10 s at most) until the thread has polled ``polls`` more times."""
        with self._lock:
            target = self._calls + polls
        wait_for(lambda: self._calls >= target)


def test_checkpointer_saves_once_the_version_moved_far_enough(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    files = ShardFiles(tmp_path, 0, epoch=5)
    polls = PollCounter(shard)
    checkpointer = ShardCheckpointer(files, polls, every_s=3600.0, every_versions=3)
    checkpointer.start()
    try:
        train([shard], 2)
        polls.wait_for_more(4)  # several polls: 2 versions are not enough
        assert files.durable_versions() == []
        train([shard], 1)
        wait_for(lambda: checkpointer.saved_version == 3)
        assert files.durable_versions() == [3]
        assert files.load_version(3)[1]["version"] == 3
    finally:
        checkpointer.stop()


def test_checkpointer_saves_on_time_only_when_the_version_moved(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    train([shard], 1)
    files = ShardFiles(tmp_path, 0, epoch=5)
    polls = PollCounter(shard)
    checkpointer = ShardCheckpointer(files, polls, every_s=0.05, saved_version=0)
    checkpointer.start()
    try:
        wait_for(lambda: checkpointer.saved_version == 1)
        polls.wait_for_more(4)  # several periods without a step: nothing to write
        assert files.durable_versions() == [1]
    finally:
        checkpointer.stop()


def test_checkpointer_never_writes_once_writing_is_not_allowed(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    train([shard], 2)
    files = ShardFiles(tmp_path, 0, epoch=5, may_write=lambda: False)
    polls = PollCounter(shard)
    checkpointer = ShardCheckpointer(files, polls, every_s=0.01, every_versions=1)
    checkpointer.start()
    polls.wait_for_more(4)
    checkpointer.stop()

    assert checkpointer.save_now() is None
    assert files.durable_versions() == []


def test_checkpointer_waits_for_the_shard_to_exist(tmp_path: Path) -> None:
    holder: list[ParameterShard] = []
    checkpointer = ShardCheckpointer(
        ShardFiles(tmp_path, 0, epoch=5), lambda: holder[0] if holder else None, every_s=0.01
    )

    assert checkpointer.save_now() is None
    holder.extend(shards_for(1, named_values()))
    saved = checkpointer.save_now()
    assert saved is not None and saved.version == 0


def test_a_failing_write_is_reported_in_the_health_until_one_succeeds(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    blocker = tmp_path / "ck"
    blocker.write_text("a file where the directory should be")
    reports: list[CheckpointHealth] = []
    checkpointer = ShardCheckpointer(
        ShardFiles(blocker, 0, epoch=5), lambda: shard, every_s=1.0, on_health=reports.append
    )
    for _ in range(2):
        with pytest.raises(OSError):
            checkpointer.save_now()
    health = checkpointer.health
    assert not health.ok and health.failures == 2 and health.failing_since_unix_s is not None
    assert "ck" in health.error
    assert [r.failures for r in reports] == [1, 2]
    blocker.unlink()
    assert checkpointer.save_now() is not None
    assert checkpointer.health.ok and reports[-1].ok


# --- a slot's own files: lineage and fencing -----------------------------------------------


def test_files_are_named_by_epoch_and_version_and_pruned(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    files = ShardFiles(tmp_path, 0, epoch=7, keep=2)
    for _ in range(4):
        files.save(*shard.state())
        train([shard], 1)
    assert files.durable_versions() == [3, 2]
    assert files.directory.listdir() == [
        "shard-e000000000007-v000000000002.safetensors",
        "shard-e000000000007-v000000000003.safetensors",
    ]


def test_a_save_can_leave_the_pruning_for_later(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    files = ShardFiles(tmp_path, 0, epoch=7, keep=2)
    for _ in range(4):
        files.save(*shard.state(), prune=False)
        train([shard], 1)
    assert files.durable_versions() == [3, 2, 1, 0]
    files.prune()
    assert files.durable_versions() == [3, 2]


def test_a_restarted_server_adopts_the_newest_file_of_earlier_epochs(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    old = ShardFiles(tmp_path, 0, epoch=7)
    old.save(*shard.state())
    train([shard], 2)
    old.save(*shard.state())

    new = ShardFiles(tmp_path, 0, epoch=9)
    found = new.restore()
    assert found is not None
    assert found[1]["version"] == 2
    # Linked under the new epoch: our own lineage is complete on disk.
    assert new.durable_versions() == [2]


def test_a_deposed_server_cannot_outrank_its_successor(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    ShardFiles(tmp_path, 0, epoch=7).save(*shard.state())
    successor = ShardFiles(tmp_path, 0, epoch=9)
    assert successor.restore() is not None
    successor.save(*shard.state())
    # The deposed server (epoch 7) goes on writing newer versions...
    train([shard], 5)
    ShardFiles(tmp_path, 0, epoch=7).save(*shard.state())
    # ...but the next restart (epoch 11) follows epoch 9's lineage.
    found = ShardFiles(tmp_path, 0, epoch=11).restore()
    assert found is not None and found[1]["version"] == 0 and found[1]["epoch"] == 9


def test_files_of_another_run_are_never_loaded(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    ShardFiles(tmp_path, 0, epoch=7, run_id="run-a").save(*shard.state())
    files = ShardFiles(tmp_path, 0, epoch=9, run_id="run-b")
    assert files.restore() is None
    assert "belongs to job run 'run-a'" in files.skipped_files()[0]


def test_a_corrupt_newest_file_falls_back_to_the_one_before(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    files = ShardFiles(tmp_path, 0, epoch=7)
    files.save(*shard.state())
    train([shard], 1)
    saved = files.save(*shard.state())
    assert saved is not None
    saved.path.write_bytes(saved.path.read_bytes()[:-10])
    again = ShardFiles(tmp_path, 0, epoch=9)
    found = again.restore()
    assert found is not None and found[1]["version"] == 0
    assert len(again.skipped_files()) == 1


# --- consistent checkpoints on disk -------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_consistent_checkpoint_reassembles_parameters_and_optimizer_state_by_name(
    tmp_path: Path, num_shards: int
) -> None:
    shards = shards_for(num_shards, named_values())
    train(shards, 3)
    manifest = write_consistent_checkpoint(tmp_path, shards)

    values, optimizer_state, meta = load_consistent_checkpoint(tmp_path)

    expected = by_name(shards)
    assert sorted(values) == sorted(expected)
    for name in expected:
        assert torch.equal(values[name], expected[name])
    exp_avg = by_name(shards, "optim.exp_avg")
    for name in expected:
        assert torch.equal(optimizer_state[name]["exp_avg"], exp_avg[name])
        assert optimizer_state[name]["step"].item() == 3.0
    assert meta == manifest
    assert meta["parameters"] == {"embed": 12, "bias": 5, "big": 40}
    assert meta["version"] == 3
    assert meta["ledger_revision"] == 42
    assert meta["extra"] == {"note": "unit"}
    assert json.loads((tmp_path / "manifest.json").read_text())["format"] == (
        "elasticps-snapshot/1"
    )


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (2, 3), (3, 2), (1, 3)])
def test_resumed_shards_hold_the_checkpointed_values_for_any_number_of_servers(
    tmp_path: Path, saved_on: int, resumed_on: int
) -> None:
    original = shards_for(saved_on, named_values())
    train(original, 2)
    write_consistent_checkpoint(tmp_path, original)
    checkpoint = load_consistent_checkpoint(tmp_path)

    resumed = []
    for layout in placement(resumed_on).shards:
        shard = ParameterShard(layout.describe(), layout.fingerprint, ADAM, UpdateMode.ASYNC)
        assert shard.load_state(*shard_state_for_layout(layout.describe(), checkpoint))
        resumed.append(shard)

    before, after = by_name(original), by_name(resumed)
    assert all(torch.equal(after[name], before[name]) for name in before)
    exp_avg_sq = by_name(original, "optim.exp_avg_sq")
    assert all(
        torch.equal(by_name(resumed, "optim.exp_avg_sq")[n], exp_avg_sq[n]) for n in exp_avg_sq
    )
    assert [s.version for s in resumed] == [2] * resumed_on


def test_resume_onto_the_same_layout_takes_bit_identical_steps(tmp_path: Path) -> None:
    original = shards_for(2, named_values())
    train(original, 3)
    write_consistent_checkpoint(tmp_path, original)
    checkpoint = load_consistent_checkpoint(tmp_path)

    resumed = []
    for layout in placement(2).shards:
        shard = ParameterShard(layout.describe(), layout.fingerprint, ADAM, UpdateMode.ASYNC)
        shard.load_state(*shard_state_for_layout(layout.describe(), checkpoint))
        resumed.append(shard)

    train(original, 2, seed=5)
    train(resumed, 2, seed=5)
    assert all(torch.equal(a.values, b.values) for a, b in zip(original, resumed, strict=True))


def test_resume_of_a_model_with_a_parameter_not_in_the_checkpoint_is_refused(
    tmp_path: Path,
) -> None:
    write_consistent_checkpoint(tmp_path, shards_for(1, named_values()))
    checkpoint = load_consistent_checkpoint(tmp_path)
    layout = plan_placement([*PARAMS, ParamSpec("head", (2,))], 1, BIG_ARRAY_BOUND).shards[0]

    with pytest.raises(DataError, match="'head' of the model is not in the checkpoint"):
        shard_state_for_layout(layout.describe(), checkpoint)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_resume_of_a_model_whose_parameter_changed_size_is_refused(
    tmp_path: Path, num_shards: int
) -> None:
    write_consistent_checkpoint(tmp_path, shards_for(1, named_values()))
    checkpoint = load_consistent_checkpoint(tmp_path)
    resized = [ParamSpec("embed", (3, 4)), ParamSpec("bias", (6,)), ParamSpec("big", (44,))]
    layout = plan_placement(resized, num_shards, BIG_ARRAY_BOUND).shards[0]

    with pytest.raises(DataError, match="elements in the checkpoint"):
        shard_state_for_layout(layout.describe(), checkpoint)


def test_optimizer_state_of_shards_that_ran_different_optimizers_is_dropped(
    tmp_path: Path,
) -> None:
    shards = shards_for(2, named_values())
    shards[1] = shards_for(2, named_values(), OptimizerConfig(name="adagrad", lr=0.1))[1]
    train(shards, 1)
    write_consistent_checkpoint(tmp_path, shards)

    checkpoint = load_consistent_checkpoint(tmp_path)

    assert checkpoint.optimizer_state == {}
    assert checkpoint.meta["optimizer"] is None
    assert sorted(checkpoint.values) == ["bias", "big", "embed"]


def test_consistent_checkpoint_with_a_corrupt_shard_file_is_rejected(tmp_path: Path) -> None:
    write_consistent_checkpoint(tmp_path, shards_for(2, named_values()))
    _corrupt_last_byte(tmp_path / shard_file_name(1))

    with pytest.raises(DataError, match=r"shard-1\.safetensors is corrupt"):
        load_consistent_checkpoint(tmp_path)


def test_consistent_checkpoint_whose_manifest_lists_other_pieces_is_rejected(
    tmp_path: Path,
) -> None:
    manifest = write_consistent_checkpoint(tmp_path, shards_for(2, named_values()))
    shards = manifest["shards"]
    assert isinstance(shards, list)
    shards[0]["pieces"], shards[1]["pieces"] = shards[1]["pieces"], shards[0]["pieces"]
    write_manifest(tmp_path, manifest)

    with pytest.raises(DataError, match="other pieces than the manifest lists"):
        load_consistent_checkpoint(tmp_path)


def test_consistent_checkpoint_missing_a_slice_of_a_parameter_is_rejected(
    tmp_path: Path,
) -> None:
    shards = shards_for(2, named_values())
    manifest = write_consistent_checkpoint(tmp_path, shards)
    entries = manifest["shards"]
    assert isinstance(entries, list)

    # Without shard 0, parameter "big" lacks its first slice.
    with pytest.raises(DataError, match=r"'big'.*gap or overlap at 0"):
        build_manifest(entries[1:], ledger_revision=None, extra={})


@pytest.mark.parametrize(
    "write",
    [
        lambda d: None,
        lambda d: (d / "manifest.json").write_text("{not json"),
        lambda d: (d / "manifest.json").write_text('{"format": "elasticps-checkpoint/1"}'),
    ],
    ids=["missing", "not-json", "other-format"],
)
def test_directory_without_a_valid_snapshot_manifest_is_rejected(
    tmp_path: Path, write: Callable[[Path], object]
) -> None:
    write(tmp_path)

    with pytest.raises(DataError):
        load_consistent_checkpoint(tmp_path)


def test_uninitialized_servers_are_recorded_but_hold_nothing(tmp_path: Path) -> None:
    (shard,) = shards_for(1, named_values())
    entry = write_consistent_checkpoint(tmp_path, [shard])["shards"]
    assert isinstance(entry, list)
    idle = {"index": 1, "address": "x:1", "initialized": False, "version": None,
            "file": None, "crc32": None, "bytes": 0, "numel": 0, "pieces": [],
            "mode": "async", "optimizer": None}  # fmt: skip
    write_manifest(tmp_path, build_manifest([entry[0], idle], ledger_revision=None, extra={}))

    checkpoint = load_consistent_checkpoint(tmp_path)

    assert isinstance(checkpoint, ConsistentCheckpoint)
    assert checkpoint.meta["versions"] == [0, None]
    assert sorted(checkpoint.values) == ["bias", "big", "embed"]


# --- piece sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 7, 40, 1000, 1_000_003])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
def test_every_slice_placement_makes_fits_its_parameter(numel: int, num_shards: int) -> None:
    layout = plan_placement([ParamSpec("w", (numel,))], num_shards, big_array_bound=1)
    for shard in layout.shards:
        for piece in shard.pieces:
            assert piece_fits(piece.param_start, piece.param_end, numel, shard.index)


@pytest.mark.parametrize(
    ("piece", "numel", "shard_index"),
    [((0, 20), 44, 0), ((20, 40), 44, 1), ((13, 26), 40, 1), ((0, 40), 80, 2)],
)
def test_a_slice_does_not_fit_a_parameter_of_another_size(
    piece: tuple[int, int], numel: int, shard_index: int
) -> None:
    assert not piece_fits(*piece, numel, shard_index)


def test_a_whole_parameter_fits_only_its_own_size() -> None:
    assert piece_fits(0, 12, 12, 0)
    assert not piece_fits(0, 12, 13, 0)
    assert not piece_fits(0, 12, 11, 0)


# --- bringing sync shards to one version -------------------------------------------------


def _freeze(version: int | None, mode: str = "sync", open_round: int = 0) -> dict[str, object]:
    return {
        "initialized": version is not None,
        "version": version,
        "mode": mode,
        "open_round": open_round,
    }


def test_sync_shards_frozen_mid_step_finish_that_step_first() -> None:
    freezes = [
        _freeze(7),
        _freeze(6, open_round=1),
        _freeze(None),
        _freeze(7),
        _freeze(5, open_round=2),
    ]

    assert shards_mid_step(freezes) == [1, 4]


def test_sync_shards_with_different_version_counts_but_no_open_step_stay_as_they_are() -> None:
    # A shard restored from its periodic checkpoint counts versions from there.
    freezes = [_freeze(40), _freeze(37)]

    assert shards_mid_step(freezes) == []


@pytest.mark.parametrize(
    "freezes",
    [
        [_freeze(3), _freeze(3)],
        [_freeze(3, "async", open_round=1), _freeze(9, "async")],
        [_freeze(None), _freeze(None)],
    ],
    ids=["sync-aligned", "async", "uninitialized"],
)
def test_shards_already_aligned_or_async_do_not_catch_up(freezes: list[dict[str, object]]) -> None:
    assert shards_mid_step(freezes) == []


@pytest.mark.parametrize("how", ["damage", "drop"])
def test_spoiling_the_newest_files_makes_a_restart_fall_back_and_say_why(
    tmp_path: Path, how: str
) -> None:
    (shard,) = shards_for(1, named_values())
    old = ShardFiles(tmp_path, 0, epoch=7)
    for _ in range(3):
        old.save(*shard.state())
        train([shard], 1)
    spoiled = ShardFiles(tmp_path, 0, epoch=0).spoil_newest(2, how)
    assert spoiled == [old.path_of(2).name, old.path_of(1).name]

    new = ShardFiles(tmp_path, 0, epoch=9)
    found = new.restore()
    assert found is not None and found[1]["version"] == 0
    assert new.restored_from == old.path_of(0).name
    if how == "damage":
        # Small files: the flipped bytes fall in the header here, not the body.
        skipped = new.skipped_files()
        assert len(skipped) == 2
        assert all(name in line for name, line in zip(spoiled, skipped, strict=True))
    else:
        assert new.skipped_files() == []
        assert not old.path_of(2).exists()


def test_spoil_newest_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    files = ShardFiles(tmp_path, 0, epoch=0)
    with pytest.raises(ValueError, match="damage or drop"):
        files.spoil_newest(1, "burn")
    with pytest.raises(ValueError, match="count >= 1"):
        files.spoil_newest(0, "drop")
    assert files.spoil_newest(1, "drop") == []  # no file: nothing to spoil
