"""Tests of the in-process KVStore (``elasticps.kvstore``, kind ``local``) and its errors."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from elasticps import kvstore, updater
from elasticps.errors import ConfigError, KVStoreError


def pulled(kv: kvstore.KVStore, key: kvstore.Key, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape)
    kv.pull(key, out=out)
    return out


def test_local_store_is_rank_0_of_1_and_its_barrier_returns() -> None:
    kv = kvstore.create("local")
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
    kv.barrier()


def test_local_push_without_optimizer_stores_the_sum_of_the_values_like_mxnet() -> None:
    kv = kvstore.create("local")
    kv.init(3, torch.ones(2, 3))

    kv.push(3, [torch.ones(2, 3), torch.full((2, 3), 2.0)])

    assert_close(pulled(kv, 3, (2, 3)), torch.full((2, 3), 3.0))


def test_local_push_with_an_optimizer_applies_one_update_per_push() -> None:
    kv = kvstore.create("local")
    kv.init("w", torch.zeros(4))
    kv.set_optimizer(updater.SGD(lr=0.5))

    kv.push("w", [torch.ones(4), torch.ones(4)])  # summed: gradient 2
    kv.push("w", torch.ones(4))

    assert_close(pulled(kv, "w", (4,)), torch.full((4,), -1.5))


def test_local_updates_follow_the_updater_and_its_schedule_per_key() -> None:
    kv = kvstore.create("local")
    kv.init(["a", "b"], [torch.zeros(3), torch.zeros(3)])
    u = updater.Adam(lr=0.1, schedule=updater.StepDecay(every_versions=2, gamma=0.5))
    kv.set_optimizer(u)
    ref = torch.nn.Parameter(torch.zeros(3))
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    gen = torch.Generator().manual_seed(0)

    for step in range(4):
        grad = torch.randn(3, generator=gen)
        kv.push(["a", "b"], [grad, torch.zeros(3)])
        for group in ref_opt.param_groups:
            group["lr"] = u.lr_at(step)
        ref.grad = grad.clone()
        ref_opt.step()

    assert_close(pulled(kv, "a", (3,)), ref.detach())
    assert_close(pulled(kv, "b", (3,)), torch.zeros(3))  # Adam on zero gradients: no move


def test_local_pull_into_several_outputs_and_keys() -> None:
    kv = kvstore.create("local")
    kv.init([0, 1], [torch.full((2,), 5.0), torch.full((1,), 7.0)])
    outs = [torch.empty(2), torch.empty(2)]
    other = torch.empty(1)

    kv.pull([0, 1], out=[outs, other])

    assert_close(outs[0], torch.full((2,), 5.0))
    assert_close(outs[1], torch.full((2,), 5.0))
    assert_close(other, torch.full((1,), 7.0))


def test_init_copies_the_value() -> None:
    kv = kvstore.create("local")
    value = torch.zeros(2)
    kv.init("x", value)
    value += 1
    assert_close(pulled(kv, "x", (2,)), torch.zeros(2))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda kv: kv.init("x", torch.zeros(1)), "already initialized"),
        (lambda kv: kv.push("y", torch.zeros(2)), "not initialized"),
        (lambda kv: kv.push("x", torch.zeros(3)), "shape"),
        (lambda kv: kv.pull("x", out=torch.zeros(3)), "shape"),
        (lambda kv: kv.push(["x"], [torch.zeros(2), torch.zeros(2)]), "one value"),
        (lambda kv: kv.push(1.5, torch.zeros(2)), "ints or strings"),
        (lambda kv: kv.push("x", "not a tensor"), "torch tensors"),
        (lambda kv: kv.push("x", torch.zeros(2, dtype=torch.int64)), "floating point"),
    ],
    ids=[
        "double-init",
        "unknown",
        "push-shape",
        "pull-shape",
        "lengths",
        "key-type",
        "value",
        "dtype",
    ],
)
def test_invalid_local_calls_raise_kvstore_errors(call: object, match: str) -> None:
    kv = kvstore.create("local")
    kv.init("x", torch.zeros(2))
    with pytest.raises(KVStoreError, match=match):
        call(kv)  # type: ignore[operator]


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dist_sync"):
        kvstore.create("device")


def test_dist_kind_outside_a_launched_job_explains_dist_train(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ELASTICPS_ETCD", raising=False)
    monkeypatch.delenv("ELASTICPS_JOB", raising=False)
    with pytest.raises(ConfigError, match="dist_train"):
        kvstore.create("dist_async")


def test_dist_kind_in_a_job_of_the_other_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICPS_ETCD", "127.0.0.1:1")
    monkeypatch.setenv("ELASTICPS_JOB", "j")
    monkeypatch.setenv("ELASTICPS_MODE", "sync")
    with pytest.raises(ConfigError, match="sync mode"):
        kvstore.create("dist_async")


def test_optimizer_config_round_trips_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = updater.Optimizer(
        torch.optim.RMSprop, lr=0.01, schedule=updater.Warmup(versions=2), alpha=0.8
    ).to_config()
    monkeypatch.setenv(kvstore.ENV_OPTIMIZER, kvstore.optimizer_env(config))
    assert kvstore.env_optimizer_config() == config
    monkeypatch.setenv(kvstore.ENV_OPTIMIZER, '{"name": "nope"}')
    with pytest.raises(ConfigError):
        kvstore.env_optimizer_config()
