"""The output directory checks of the local launcher (``elasticps.launcher.output``)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from elasticps.config import OptimizerConfig
from elasticps.errors import ConfigError, OutputInUseError, UserError
from elasticps.launcher.output import (
    CHECKPOINT_COPIES,
    LOCK_FILE,
    SPACE_MARGIN_BYTES,
    OutputLock,
    check_free_space,
    check_output_location,
    checkpoint_bytes_estimate,
    optimizer_state_tensors,
    previous_run_files,
    remove_previous_run,
    table_checkpoint_bytes,
)

pytestmark = pytest.mark.timeout(30)


def test_an_existing_or_creatable_directory_is_accepted(tmp_path: Path) -> None:
    check_output_location(tmp_path)
    check_output_location(tmp_path / "a" / "b" / "c")


def test_an_output_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_output_location(path)


def test_an_output_below_a_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"cannot create --output .*: {blocker} is a file"):
        check_output_location(blocker / "sub" / "out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_in_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            check_output_location(parent / "out")
    finally:
        parent.chmod(0o700)


def test_a_second_lock_on_the_same_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = OutputLock(tmp_path / "out")
    first.acquire()
    try:
        # flock locks belong to an open file description: a second one in
        # this process conflicts exactly as another process's would.
        with pytest.raises(OutputInUseError) as caught:
            OutputLock(tmp_path / "out").acquire()
        message = str(caught.value)
        assert f"pid {os.getpid()}" in message
        assert f"host {socket.gethostname()}" in message
        assert "started 2" in message  # an ISO date
        assert isinstance(caught.value, UserError)
    finally:
        first.release()


def test_a_released_lock_can_be_taken_again_and_records_its_holder(tmp_path: Path) -> None:
    with OutputLock(tmp_path) as lock:
        assert lock.held
    assert not lock.held
    with OutputLock(tmp_path):
        info = json.loads((tmp_path / LOCK_FILE).read_text())
        assert info["pid"] == os.getpid()
        assert info["host"] == socket.gethostname()
        assert info["started_unix_s"] > 0


def test_the_lock_descriptor_is_not_inherited_by_child_processes(tmp_path: Path) -> None:
    lock = OutputLock(tmp_path)
    lock.acquire()
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
        mine = [fd for fd in fds if _target(fd) == str((tmp_path / LOCK_FILE).resolve())]
        assert mine and not any(os.get_inheritable(fd) for fd in mine)
    finally:
        lock.release()


def _target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_previous_run_files_are_found_and_removed_and_nothing_else(tmp_path: Path) -> None:
    for name in ("run.json", "model.safetensors", "pids.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    for name in ("snapshot", "ps-checkpoints/ps-0", "logs"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / LOCK_FILE).write_text("{}")

    assert previous_run_files(tmp_path) == ["run.json", "model.safetensors", "snapshot",
                                            "ps-checkpoints"]  # fmt: skip
    removed = remove_previous_run(tmp_path)

    assert set(removed) == {"run.json", "model.safetensors", "snapshot", "ps-checkpoints",
                            "pids.json", "logs"}  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "notes.txt"]
    assert previous_run_files(tmp_path) == []


def test_removing_a_previous_run_keeps_the_resume_directory(tmp_path: Path) -> None:
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "manifest.json").write_text("{}")
    (tmp_path / "ps-checkpoints").mkdir()

    removed = remove_previous_run(tmp_path, keep=tmp_path / "snapshot")

    assert removed == ["ps-checkpoints"]
    assert (tmp_path / "snapshot" / "manifest.json").exists()


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (OptimizerConfig(name="sgd"), 0),
        (OptimizerConfig(name="sgd", options='{"momentum": 0.9}'), 1),
        (OptimizerConfig(name="momentum"), 1),
        (OptimizerConfig(name="adam"), 2),
        (OptimizerConfig(name="adam", options='{"amsgrad": true}'), 3),
        (OptimizerConfig(name="adagrad"), 1),
        (OptimizerConfig(name="torch", torch_class="RMSprop"), 2),
    ],
)
def test_optimizer_state_tensors_per_parameter(optimizer: OptimizerConfig, expected: int) -> None:
    assert optimizer_state_tensors(optimizer) == expected


def test_the_checkpoint_estimate_counts_values_state_and_copies() -> None:
    # 1000 float32 parameters with Adam's 2 state tensors, in 3 copies.
    assert CHECKPOINT_COPIES == 3
    assert checkpoint_bytes_estimate(1000, 2) == 1000 * 4 * 3 * 3 + SPACE_MARGIN_BYTES


def test_the_checkpoint_estimate_counts_sparse_tables_in_as_many_copies() -> None:
    from elasticps.pserver.sparse import TableSpec

    fixed = TableSpec("user", dim=16, num_embeddings=1000)
    hashed = TableSpec("tags", dim=8)  # no size to count
    # Adam: id, 3 counters, then 16 values and 2 x 16 slots, float32.
    per_row = 8 + 3 * 8 + 4 * 16 * 3
    assert table_checkpoint_bytes([fixed, hashed], 2) == 1000 * per_row
    assert checkpoint_bytes_estimate(10, 2, 1000 * per_row) == (
        (10 * 4 * 3 + 1000 * per_row) * CHECKPOINT_COPIES + SPACE_MARGIN_BYTES
    )


def test_a_table_checkpoint_with_every_row_stored_fits_its_estimate(tmp_path: Path) -> None:
    """Every row of a fixed table updated once with Adam, saved as the servers save
    it: the files take no more than the estimate, and nearly all of it."""
    import numpy as np
    import torch

    from elasticps.pserver.sparse import SparseAdam, SparseTable, TableSpec
    from elasticps.pserver.sparse_checkpoint import save_table

    spec = TableSpec("user", dim=16, num_embeddings=5000)
    table = SparseTable(spec, SparseAdam())
    table.apply(np.arange(5000), torch.ones(5000, 16), lr=0.1)
    save_table(tmp_path, table)
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    estimate = table_checkpoint_bytes([spec], 2)
    assert 0.95 * estimate <= on_disk <= estimate + (64 << 10)  # + headers and the index


def test_too_little_free_space_is_refused_with_both_figures(tmp_path: Path) -> None:
    check_free_space(tmp_path, 10 << 20, free_bytes=lambda path: 11 << 20)
    with pytest.raises(ConfigError, match=r"about 20\.0 MiB of checkpoints, 5\.0 MiB is free"):
        check_free_space(tmp_path, 20 << 20, free_bytes=lambda path: 5 << 20)
