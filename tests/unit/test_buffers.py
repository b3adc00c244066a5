"""Buffers (BatchNorm statistics) as server state: encoding, placement, combining, checkpoints."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import elasticps
from elasticps.buffers import (
    BufferSync,
    buffer_specs,
    decode,
    decode_ints,
    encode,
    encode_ints,
    model_buffers,
    state_from_flat,
)
from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import ModelContractError
from elasticps.model_file import check_model
from elasticps.placement import plan_placement, stable_shard
from elasticps.pserver.checkpoint import encode_shard
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.shard import ParameterShard
from elasticps.snapshot import (
    build_manifest,
    load_consistent_checkpoint,
    shard_file_name,
    shard_state_for_layout,
    write_manifest,
)
from elasticps.trainer.flat import FlatModel, bind_flat_buffers, param_specs
from elasticps.wire.frame import PushStatus

SGD = OptimizerConfig(name="sgd", lr=0.5)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_every_int64_round_trips_exactly_through_float32_limbs(value: int) -> None:
    limbs = encode_ints(torch.tensor([value]))
    assert limbs.dtype == torch.float32
    assert bool((limbs.abs() <= 2**23).all())
    assert bool((limbs == limbs.round()).all())  # whole numbers, never bit patterns
    assert int(decode_ints(limbs)[0]) == value


def test_small_integers_are_one_limb_and_a_mean_of_equal_limbs_decodes_exactly() -> None:
    assert encode_ints(torch.tensor([5, -1])).tolist() == [5.0, 0.0, 0.0, -1.0, 0.0, 0.0]
    limbs = encode_ints(torch.tensor([7]))
    assert int(decode_ints((limbs * 3.0 + limbs * 5.0) / 8.0)[0]) == 7


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor([1.5, -2.25], dtype=torch.float16),
        torch.tensor([1.5, 3.0e38], dtype=torch.bfloat16),
        torch.tensor([[True, False]]),
        torch.tensor([0, 255], dtype=torch.uint8),
        torch.tensor(2**40, dtype=torch.int64),
    ],
)
def test_buffers_of_every_carried_dtype_round_trip_bit_for_bit(value: torch.Tensor) -> None:
    model = nn.Module()
    model.register_buffer("b", value)
    (spec,) = buffer_specs(model)
    back = decode(encode(value, spec), spec)
    assert back.dtype == value.dtype and back.shape == value.shape
    assert torch.equal(back, value)


def test_only_persistent_buffers_travel_and_float64_ones_are_refused() -> None:
    model = nn.Module()
    model.register_buffer("kept", torch.zeros(2))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    model.register_buffer("absent", None)
    model.weight = nn.Parameter(torch.zeros(1))
    assert [name for name, _ in model_buffers(model)] == ["kept"]
    check_model(model)
    model.register_buffer("wide", torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ModelContractError, match=r"buffers must be .*found wide \(float64\)"):
        check_model(model, what="M")


def test_buffers_are_placed_whole_after_each_shards_parameters() -> None:
    model = bn_model()
    specs = buffer_specs(model)
    placement = plan_placement(param_specs(model), 2, big_array_bound=2, buffers=specs)
    for spec in specs:
        shard = placement.shards[stable_shard(spec.name, 2)]
        (piece,) = [p for p in shard.pieces if p.name == spec.name]
        assert (piece.param_start, piece.param_end) == (0, spec.encoded_numel)  # never sliced
        assert piece.flat_offset >= placement.params_numel
        described = shard.describe()
        assert isinstance(described["buffers"], dict)
        assert described["buffers"][spec.name] == spec.dtype
    for shard in placement.shards:
        names = [p.name for p in shard.pieces]
        buffers = [n for n in names if n in {s.name for s in specs}]
        assert names[len(names) - len(buffers) :] == buffers  # the shard's tail
    # A model without buffers keeps the layout (and fingerprints) it always had.
    plain = plan_placement(param_specs(nn.Linear(4, 3)), 2)
    assert all("buffers" not in s.describe() for s in plain.shards)


def mean_and_count() -> tuple[nn.Module, FlatModel, BufferSync, int, int]:
    """A model with a float buffer ``mean`` [2] and an int64 ``count``, bound to flat
    buffers: the model, the bound model, its BufferSync and the buffers' offsets."""
    model = nn.Module()
    model.register_buffer("mean", torch.zeros(2))
    model.register_buffer("count", torch.tensor(0))
    model.weight = nn.Parameter(torch.zeros(1))
    flat = bind_flat_buffers(model, 1)
    sync = flat.buffers
    assert isinstance(sync, BufferSync)
    offsets = flat.placement.flat_offsets
    return model, flat, sync, offsets["mean"], offsets["count"]


def test_a_trainer_sends_increments_and_keeps_unpushed_ones_across_a_pull() -> None:
    model, flat, sync, mean_at, count_at = mean_and_count()

    model.mean += 1.0  # what a forward in train mode does, in place
    model.count += 1
    # A pull brings the server's values (others' increments): ours stay pending.
    flat.params[mean_at : mean_at + 2] = torch.tensor([10.0, 20.0])
    flat.params[count_at : count_at + 3] = encode_ints(torch.tensor([5]))
    assert sync.adopt(flat.params)
    assert model.mean.tolist() == [10.0, 20.0] and int(model.count) == 5
    assert not sync.adopt(flat.params)  # nothing new pulled: nothing happens
    model.count += 2
    sync.write_push(flat.grads)
    assert flat.grads[mean_at : mean_at + 2].tolist() == [1.0, 1.0]
    assert int(decode_ints(flat.grads[count_at : count_at + 3])[0]) == 3
    flat.grads.zero_()
    sync.write_push(flat.grads)  # the account starts again after a push
    assert not bool(flat.grads.any())


def test_an_async_push_carries_float_values_and_integer_increments() -> None:
    model, flat, sync, mean_at, count_at = mean_and_count()
    model.mean += 1.0
    model.count += 1
    flat.params[mean_at : mean_at + 2] = torch.tensor([10.0, 20.0])
    flat.params[count_at : count_at + 3] = encode_ints(torch.tensor([5]))
    assert sync.adopt(flat.params)
    model.mean += 0.5
    model.count += 2
    sync.write_push(flat.grads, float_values=True)
    # Floats: the values now (the pulled ones and what ran since; what ran before
    # the pull is not re-added on top of values that may already hold it).
    assert flat.grads[mean_at : mean_at + 2].tolist() == [10.5, 20.5]
    assert int(decode_ints(flat.grads[count_at : count_at + 3])[0]) == 3


def bn_shards(mode: UpdateMode, optimizer: OptimizerConfig = SGD) -> list[ParameterShard]:
    flat = bind_flat_buffers(bn_model(), 2)
    shards = []
    for layout in flat.placement.shards:
        shard = ParameterShard(layout.describe(), layout.fingerprint, optimizer, mode)
        shard.values.copy_(torch.cat([flat.params[lo:hi] for lo, hi in layout.ranges]))
        shards.append(shard)
    return shards


def buffer_range(shard: ParameterShard, name: str) -> tuple[int, int]:
    offset = 0
    for piece_name, lo, hi in shard.layout["pieces"]:  # type: ignore[union-attr]
        if piece_name == name:
            return offset, offset + hi - lo
        offset += hi - lo
    raise KeyError(name)


def test_sync_step_adds_the_sample_weighted_mean_of_floats_and_the_largest_integer() -> None:
    shard = next(
        s for s in bn_shards(UpdateMode.SYNC, OptimizerConfig(name="adam", lr=0.1,
                                                               weight_decay=0.5))
        if "1.num_batches_tracked" in s.layout["buffers"]  # type: ignore[operator]
    )  # fmt: skip
    count = buffer_range(shard, "1.num_batches_tracked")
    floats = [buffer_range(shard, n) for n in ("1.running_mean", "1.running_var")
              if n in shard.layout["buffers"]]  # type: ignore[operator]  # fmt: skip
    before = shard.values.clone()
    shard.set_live_trainers({0, 1})
    grads = [torch.ones(shard.numel), torch.ones(shard.numel)]
    for i, (inc, ticks) in enumerate([(1.0, 1), (5.0, 3)]):
        for lo, hi in floats:
            grads[i][lo:hi] = inc
        grads[i][count[0] : count[1]] = encode_ints(torch.tensor([ticks]))
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda i=i, n=n: results.append(shard.push(i, grads[i], 0, n)))
        for i, n in ((0, 30), (1, 10))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert shard.version == 1 and len(results) == 2
    for lo, hi in floats:  # (30 * 1 + 10 * 5) / 40 = 2, exactly; not touched by Adam
        assert torch.equal(shard.values[lo:hi], before[lo:hi] + 2.0)
    assert int(decode_ints(shard.values[count[0] : count[1]])[0]) == 3
    assert torch.equal(grads[1][count[0] : count[1]], encode_ints(torch.tensor([3])))  # kept
    shard.close()


def test_async_pushes_take_float_values_and_add_integer_increments_once() -> None:
    shards = bn_shards(UpdateMode.ASYNC)
    shard = next(s for s in shards if "1.num_batches_tracked" in s.layout["buffers"])  # type: ignore[operator]
    count = buffer_range(shard, "1.num_batches_tracked")
    floats = [buffer_range(shard, n) for n in ("1.running_mean", "1.running_var")
              if n in shard.layout["buffers"]]  # type: ignore[operator]  # fmt: skip
    assert floats
    grad = torch.zeros(shard.numel)
    grad[count[0] : count[1]] = encode_ints(torch.tensor([2]))
    for lo, hi in floats:
        grad[lo:hi] = 0.25
    key = PushKey(0, 1, 0, 32)
    assert shard.push(0, grad, 0, 32, key=key).status is PushStatus.APPLIED
    for lo, hi in floats:
        grad[lo:hi] = 0.75
    assert shard.push(1, grad, 0, 32, key=key).status is PushStatus.DUPLICATE
    for lo, hi in floats:
        assert torch.equal(shard.values[lo:hi], torch.full((hi - lo,), 0.25))
    assert shard.push(1, grad, 1, 32).accepted
    assert int(decode_ints(shard.values[count[0] : count[1]])[0]) == 4
    for lo, hi in floats:  # the last push's values, not a sum of anything
        assert torch.equal(shard.values[lo:hi], torch.full((hi - lo,), 0.75))
    for s in shards:
        s.close()


def test_frozen_patterns_never_match_buffers() -> None:
    flat = bind_flat_buffers(bn_model(), 1)
    layout = flat.placement.shards[0]
    shard = ParameterShard(
        layout.describe(), layout.fingerprint, SGD, UpdateMode.ASYNC, frozen=["1.*"]
    )
    frozen = {name for name, _, _ in shard.frozen_ranges}
    assert frozen == {"1.weight", "1.bias"}
    grad = torch.zeros(shard.numel)
    lo, hi = buffer_range(shard, "1.running_mean")
    grad[lo:hi] = 1.0  # an increment, not a gradient: accepted
    assert shard.push(0, grad, 0, 4).accepted
    shard.close()


def test_buffers_survive_a_consistent_checkpoint_and_a_resume_onto_three_servers(
    tmp_path: Path,
) -> None:
    model = bn_model()
    model(torch.randn(16, 4))  # train mode: statistics move, the counter is 1
    model.get_submodule("1").num_batches_tracked += 2**40  # far beyond float32's integers
    flat = bind_flat_buffers(model, 2)
    entries = []
    for layout in flat.placement.shards:
        shard = ParameterShard(layout.describe(), layout.fingerprint, SGD, UpdateMode.SYNC)
        shard.values.copy_(torch.cat([flat.params[lo:hi] for lo, hi in layout.ranges]))
        tensors, meta = ParameterShard.from_state(
            *shard.state(), optimizer=SGD, mode=UpdateMode.SYNC
        ).state()
        data = encode_shard(tensors, meta)
        (tmp_path / shard_file_name(layout.index)).write_bytes(data)
        entries.append({
            "index": layout.index, "address": "", "initialized": True, "version": 0,
            "file": shard_file_name(layout.index), "crc32": zlib.crc32(data), "bytes": len(data),
            "numel": layout.numel, "pieces": layout.describe()["pieces"], "mode": "sync",
            "optimizer": None,
        })  # fmt: skip
        shard.close()
    write_manifest(tmp_path, build_manifest(entries, ledger_revision=None, extra={}))
    checkpoint = load_consistent_checkpoint(tmp_path)

    state = state_from_flat(bn_model(), checkpoint.values)
    for name, value in model.state_dict().items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    # Resume onto 3 servers: each takes its pieces by name, buffers included.
    three = bind_flat_buffers(bn_model(), 3)
    for layout in three.placement.shards:
        tensors, _ = shard_state_for_layout(layout.describe(), checkpoint)
        offset = 0
        for piece in layout.pieces:
            three.params[piece.flat_offset : piece.flat_offset + piece.numel] = tensors["values"][
                offset : offset + piece.numel
            ]
            offset += piece.numel
    assert three.buffers is not None
    three.buffers.adopt(three.params, force=True)
    for name, value in model.state_dict().items():
        assert torch.equal(three.model.state_dict()[name], value), name


def test_python_api_returns_buffers_and_infer_uses_them() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    batches = [(torch.randn(16, 4) * 3 + 1, torch.randint(0, 2, (16,))) for _ in range(5)]
    params = elasticps.train(
        model, nn.functional.cross_entropy, lambda: iter(batches), num_passes=2, cluster=None
    )
    assert int(params["1.num_batches_tracked"]) == 10
    assert params["1.num_batches_tracked"].dtype == torch.int64
    assert float(params["1.running_var"].mean()) > 1.5  # moved from 1 toward the data's
    trained = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    params.copy_into(trained)
    assert torch.equal(trained.get_submodule("1").running_mean, params["1.running_mean"])
    inputs = batches[0][0]
    expected = trained.eval()(inputs)
    assert torch.allclose(elasticps.infer(model, params, inputs), expected)  # type: ignore[arg-type]


def test_python_api_evaluates_every_pass_into_end_pass_events_with_its_metrics() -> None:
    from torchmetrics.classification import MulticlassF1Score

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    batches = [(torch.randn(12, 4), torch.randint(0, 3, (12,))) for _ in range(3)]
    ends: list[elasticps.events.EndPass] = []

    def on_event(event: object) -> None:
        if isinstance(event, elasticps.events.EndPass):
            ends.append(event)

    def metrics() -> dict[str, object]:
        return {"f1": MulticlassF1Score(num_classes=3)}

    params = elasticps.train(
        model, nn.functional.cross_entropy, lambda: iter(batches), num_passes=2, cluster=None,
        event_handler=on_event, test_reader=lambda: iter(batches[:2]), metrics=metrics,
    )  # fmt: skip
    assert [e.pass_id for e in ends] == [0, 1]
    for e in ends:
        assert set(e.metrics) == {
            "samples",
            "test_accuracy",
            "test_f1",
            "test_loss",
            "test_samples",
        }
    final = elasticps.evaluate_model(
        model, params, lambda: iter(batches[:2]), nn.functional.cross_entropy, metrics=metrics
    )
    assert final["loss"] == pytest.approx(ends[-1].metrics["test_loss"], rel=1e-6)
    assert final["f1"] == ends[-1].metrics["test_f1"]


def test_resume_rebuilds_the_checkpoints_model_args_and_refuses_others(tmp_path: Path) -> None:
    from elasticps.config import JobConfig
    from elasticps.errors import ConfigError
    from elasticps.launcher.local import LocalLauncher

    manifest = build_manifest([], ledger_revision=None, extra={"model_args": {"width": 8}})
    write_manifest(tmp_path, manifest)

    def launcher(model_args: str) -> LocalLauncher:
        config = JobConfig(
            job="j", model_path=tmp_path / "m.py", data=tmp_path, output=tmp_path / "out",
            resume=tmp_path, model_args=model_args,
        )  # fmt: skip
        return LocalLauncher(config)

    assert launcher("").model_args() == {"width": 8}
    assert launcher('{"width": 8}').model_args() == {"width": 8}
    with pytest.raises(ConfigError, match=r"differ from the checkpoint's \{\"width\":8\}"):
        launcher('{"width": 16}').model_args()
