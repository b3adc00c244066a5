"""Tests of one parameter-server shard (``elasticps.pserver.shard``): update rules,
the sync-SGD barrier and async staleness.

Sync tests run blocking pushes on daemon threads. A push is known to be waiting at
the barrier once ``stats().pushes`` counts it: the shard counts a push and joins it
to the step under one lock, which it releases only by waiting.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait

import pytest
import torch
from torch.testing import assert_close

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import FrozenParameterError, LayoutMismatchError
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.shard import (
    FreezeTimeoutError,
    MisalignedPushError,
    ParameterShard,
    PushResult,
    ShardClosedError,
    frozen_pieces,
)
from elasticps.testing import wait_for
from elasticps.wire.frame import PushStatus

NUMEL = 6
FINGERPRINT = "f" * 64
TIMEOUT_S = 5.0
SGD_LR1 = OptimizerConfig(name="sgd", lr=1.0)

ShardFactory = Callable[..., ParameterShard]


@pytest.fixture
def make_shard() -> Iterator[ShardFactory]:
    """Build shards; every one is closed at teardown, so no pusher thread is left waiting."""
    shards: list[ParameterShard] = []

    def make(
        mode: UpdateMode = UpdateMode.SYNC,
        optimizer: OptimizerConfig = SGD_LR1,
        numel: int = NUMEL,
    ) -> ParameterShard:
        shard = ParameterShard({"shard": 0, "numel": numel}, FINGERPRINT, optimizer, mode)
        shards.append(shard)
        return shard

    yield make
    for shard in shards:
        shard.close()


def push_in_thread(
    shard: ParameterShard,
    trainer_id: int,
    grad: torch.Tensor | None,
    *,
    model_version: int = 0,
    num_samples: int = 1,
    key: PushKey | None = None,
) -> Future[PushResult]:
    """Run ``shard.push`` on a daemon thread (a push stuck by a bug cannot hang the run)."""
    future: Future[PushResult] = Future()

    def target() -> None:
        try:
            future.set_result(shard.push(trainer_id, grad, model_version, num_samples, key=key))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return future


def full(value: float) -> torch.Tensor:
    return torch.full((NUMEL,), value, dtype=torch.float32)


# --- update rules --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "reference"),
    [
        (
            OptimizerConfig(name="sgd", lr=0.1),
            lambda p: torch.optim.SGD([p], lr=0.1),
        ),
        (
            OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
            lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=0.01),
        ),
        (
            OptimizerConfig(name="momentum", lr=0.1, momentum=0.8),
            lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.8),
        ),
        (
            OptimizerConfig(name="adam", lr=0.05),
            lambda p: torch.optim.Adam([p], lr=0.05),
        ),
        (
            OptimizerConfig(name="adam", lr=0.05, weight_decay=0.1),
            lambda p: torch.optim.Adam([p], lr=0.05, weight_decay=0.1),
        ),
        (
            OptimizerConfig(name="adagrad", lr=0.3),
            lambda p: torch.optim.Adagrad([p], lr=0.3),
        ),
    ],
    ids=["sgd", "sgd-weight-decay", "momentum", "adam", "adam-weight-decay", "adagrad"],
)
@pytest.mark.parametrize("mode", [UpdateMode.ASYNC, UpdateMode.SYNC])
def test_updates_equal_torch_optim_on_the_same_gradients(
    make_shard: ShardFactory,
    config: OptimizerConfig,
    reference: Callable[[torch.Tensor], torch.optim.Optimizer],
    mode: UpdateMode,
) -> None:
    gen = torch.Generator().manual_seed(7)
    init = torch.randn(NUMEL, generator=gen)
    grads = [torch.randn(NUMEL, generator=gen) for _ in range(4)]
    shard = make_shard(mode, config)
    shard.values.copy_(init)
    ref_param = torch.nn.Parameter(init.clone())
    ref_opt = reference(ref_param)

    for grad in grads:
        # One live trainer: a sync step completes with its own push.
        result = shard.push(0, grad.clone(), shard.version, num_samples=3)
        ref_param.grad = grad.clone()
        ref_opt.step()

        assert result.accepted
        assert_close(shard.values, ref_param.detach())
    assert shard.version == len(grads)


# --- async -------------------------------------------------------------------------


def test_async_push_applies_at_once_and_bumps_the_version(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)

    first = shard.push(0, full(2.0), 0, 1)
    assert first == PushResult(accepted=True, version=1)
    assert_close(shard.values, full(-2.0))

    # A second trainer needs no barrier in async mode, and an old version is fine.
    second = shard.push(1, full(1.0), 0, 5)
    assert second == PushResult(accepted=True, version=2)
    assert_close(shard.values, full(-3.0))
    stats = shard.stats()
    assert (stats.version, stats.pushes, stats.steps, stats.stale_pushes) == (2, 2, 2, 0)


def test_async_empty_push_changes_nothing(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)

    result = shard.push(0, None, 0, 0)

    assert result == PushResult(accepted=False, version=0)
    assert_close(shard.values, full(0.0))


def test_async_gradient_more_than_max_staleness_behind_is_dropped(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    for v in range(3):
        shard.push(0, full(1.0), v, 1, max_staleness=1)
    assert shard.version == 3
    before = shard.values.clone()

    too_old = shard.push(1, full(100.0), 1, 1, max_staleness=1)

    assert too_old == PushResult(accepted=False, version=3, status=PushStatus.STALE)
    assert_close(shard.values, before)
    assert shard.stats().stale_pushes == 1

    # Exactly max_staleness versions behind is still accepted.
    just_in_time = shard.push(1, full(1.0), 2, 1, max_staleness=1)
    assert just_in_time == PushResult(accepted=True, version=4)
    assert_close(shard.values, before - 1.0)


def test_async_without_max_staleness_accepts_any_old_gradient(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    for v in range(5):
        shard.push(0, full(1.0), v, 1)

    result = shard.push(1, full(1.0), 0, 1)

    assert result == PushResult(accepted=True, version=6)


# --- sync barrier ----------------------------------------------------------------------


def test_sync_push_waits_for_every_live_trainer(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})

    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    # Trainer 0's push is in, but no step happened and the pusher is still waiting.
    assert shard.stats().steps == 0
    assert shard.version == 0
    assert_close(shard.values, full(0.0))
    done, _ = wait([first], timeout=0.2)  # expected to time out
    assert not done

    second = push_in_thread(shard, 1, full(3.0))

    assert first.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert second.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    # What the barrier cost each (the metric elasticps_ps_sync_wait_seconds): the
    # first waited past the 0.2 s above, for the second.
    assert first.result().waited_s >= 0.2 > second.result().waited_s >= 0.0


def test_sync_step_applies_the_sample_weighted_mean_gradient(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()  # SGD, lr=1: values move by exactly minus the applied gradient
    shard.set_live_trainers({0, 1})
    g0, n0 = torch.arange(NUMEL, dtype=torch.float32), 1
    g1, n1 = full(5.0), 3

    pushes = [
        push_in_thread(shard, 0, g0, num_samples=n0),
        push_in_thread(shard, 1, g1, num_samples=n1),
    ]
    for push in pushes:
        assert push.result(TIMEOUT_S).accepted

    # (g0*1 + g1*3) / 4, not the unweighted (g0 + g1) / 2.
    assert_close(shard.values, -(g0 * n0 + g1 * n1) / (n0 + n1))


def test_sync_version_bumps_once_per_step(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1, 2})

    for step in range(2):
        pushes = [push_in_thread(shard, t, full(1.0), model_version=step) for t in range(3)]
        results = [p.result(TIMEOUT_S) for p in pushes]
        assert all(r == PushResult(accepted=True, version=step + 1) for r in results)

    stats = shard.stats()
    assert (stats.version, stats.steps, stats.pushes, stats.stale_pushes) == (2, 2, 6, 0)
    assert stats.live_trainers == 3
    assert_close(shard.values, full(-2.0))


def test_sync_push_computed_on_an_older_version_is_dropped(make_shard: ShardFactory) -> None:
    shard = make_shard()
    shard.set_live_trainers({0})
    assert shard.push(0, full(1.0), 0, 1) == PushResult(accepted=True, version=1)
    before = shard.values.clone()

    late = shard.push(1, full(100.0), 0, 1)

    assert late == PushResult(accepted=False, version=1, status=PushStatus.STALE)
    assert_close(shard.values, before)
    stats = shard.stats()
    assert (stats.version, stats.stale_pushes) == (1, 1)


def test_sync_second_push_by_the_same_trainer_in_one_step_is_dropped(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    # Returns at once, without joining (or holding up) the step.
    duplicate = push_in_thread(shard, 0, full(100.0)).result(TIMEOUT_S)
    assert duplicate == PushResult(accepted=False, version=0, status=PushStatus.STALE)
    assert shard.stats().stale_pushes == 1

    other = push_in_thread(shard, 1, full(3.0))
    assert first.result(TIMEOUT_S).accepted
    assert other.result(TIMEOUT_S).accepted
    assert_close(shard.values, full(-2.0))  # mean of 1 and 3; the 100 never counted


def test_sync_step_completes_without_a_live_trainer_that_left(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    waiting = push_in_thread(shard, 0, full(2.0))
    wait_for(lambda: shard.stats().pushes == 1)

    shard.set_live_trainers({0})

    assert waiting.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert_close(shard.values, full(-2.0))
    assert shard.stats().live_trainers == 1


def test_a_late_push_of_a_trainer_that_left_does_not_make_it_live_again(
    make_shard: ShardFactory,
) -> None:
    """Trainer 1 pushed, died, and etcd said so before its push was taken: if that
    push counted, every later step would wait for a dead trainer."""
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    shard.set_live_trainers({0})
    late = shard.push(1, full(100.0), 0, 1)
    assert late == PushResult(accepted=False, version=0, status=PushStatus.STALE)
    for step in range(2):  # trainer 0 alone completes every step
        assert shard.push(0, full(1.0), step, 1) == PushResult(accepted=True, version=step + 1)
    assert shard.stats().live_trainers == 1
    shard.set_live_trainers({0, 1})  # it came back (a new lease): waited for again
    first = push_in_thread(shard, 0, full(1.0), model_version=2)
    wait_for(lambda: shard.stats().pushes == 4)
    assert shard.push(1, full(3.0), 2, 1).accepted
    assert first.result(TIMEOUT_S).accepted


def test_sync_trainer_that_joins_is_waited_for_from_the_next_step_on(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    shard.set_live_trainers({0, 1, 2})
    # The open step does not wait for trainer 2, but a push it makes on time counts.
    joiner = push_in_thread(shard, 2, full(2.0))
    wait_for(lambda: shard.stats().pushes == 2)
    assert shard.version == 0
    last = push_in_thread(shard, 1, full(6.0))
    for push in (first, joiner, last):
        assert push.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert_close(shard.values, full(-3.0))

    # The next step waits for all three.
    early = [push_in_thread(shard, t, full(1.0), model_version=1) for t in (0, 1)]
    wait_for(lambda: shard.stats().pushes == 5)
    done, _ = wait(early, timeout=0.2)  # expected to time out
    assert not done
    late = push_in_thread(shard, 2, full(1.0), model_version=1)
    for push in [*early, late]:
        assert push.result(TIMEOUT_S) == PushResult(accepted=True, version=2)


def test_sync_step_opened_without_a_trainer_that_joins_completes_without_it(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    shard.set_live_trainers({0, 1, 2})
    last = push_in_thread(shard, 1, full(3.0))

    assert first.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert last.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert_close(shard.values, full(-2.0))


def test_pushing_trainer_counts_as_live_before_it_is_reported(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0})  # etcd has not told the shard about trainer 1 yet

    early = push_in_thread(shard, 1, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)
    assert shard.stats().live_trainers == 2
    assert push_in_thread(shard, 0, full(3.0)).result(TIMEOUT_S) == PushResult(
        accepted=True, version=1
    )
    assert early.result(TIMEOUT_S) == PushResult(accepted=True, version=1)

    # From now on trainer 0 waits for trainer 1 too.
    waiting = push_in_thread(shard, 0, full(1.0), model_version=1)
    done, _ = wait([waiting], timeout=0.2)  # expected to time out
    assert not done
    late = push_in_thread(shard, 1, full(1.0), model_version=1)
    assert late.result(TIMEOUT_S) == PushResult(accepted=True, version=2)
    assert waiting.result(TIMEOUT_S) == PushResult(accepted=True, version=2)


def test_sync_round_of_only_empty_pushes_changes_nothing(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})

    empties = [push_in_thread(shard, t, None, num_samples=0) for t in (0, 1)]

    assert [e.result(TIMEOUT_S) for e in empties] == [PushResult(False, 0)] * 2
    assert shard.version == 0
    assert shard.stats().steps == 0
    assert_close(shard.values, full(0.0))

    # The round did finish: both trainers can take part in the next one.
    nexts = [push_in_thread(shard, t, full(1.0)) for t in (0, 1)]
    assert [n.result(TIMEOUT_S) for n in nexts] == [PushResult(True, 1)] * 2


def test_sync_empty_push_joins_the_step_without_weighting_it(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})

    idle = push_in_thread(shard, 0, None, num_samples=0)
    busy = push_in_thread(shard, 1, full(4.0), num_samples=2)

    assert idle.result(TIMEOUT_S) == PushResult(accepted=False, version=1)
    assert busy.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert_close(shard.values, full(-4.0))


def test_close_releases_a_waiting_push_with_shard_closed_error(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    waiting = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    shard.close()

    assert isinstance(waiting.exception(TIMEOUT_S), ShardClosedError)
    assert shard.version == 0
    assert_close(shard.values, full(0.0))


# --- layout checks -----------------------------------------------------------------------


def test_check_fingerprint_accepts_the_same_layout_and_rejects_another(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()

    shard.check_fingerprint(FINGERPRINT)
    with pytest.raises(LayoutMismatchError):
        shard.check_fingerprint("0" * 64)


@pytest.mark.parametrize("mode", [UpdateMode.SYNC, UpdateMode.ASYNC])
@pytest.mark.parametrize("size", [NUMEL - 1, NUMEL + 1])
def test_gradient_of_the_wrong_size_raises_layout_mismatch(
    make_shard: ShardFactory, mode: UpdateMode, size: int
) -> None:
    shard = make_shard(mode)

    with pytest.raises(LayoutMismatchError):
        shard.push(0, torch.ones(size), 0, 1)

    assert shard.version == 0
    assert shard.stats().pushes == 0


@pytest.mark.parametrize("numel", [None, -1, "6"])
def test_layout_without_a_valid_numel_is_rejected(numel: object) -> None:
    with pytest.raises(LayoutMismatchError):
        ParameterShard({"numel": numel}, FINGERPRINT, SGD_LR1, UpdateMode.SYNC)


def test_shard_holding_no_parameters_is_allowed(make_shard: ShardFactory) -> None:
    shard = make_shard(numel=0)

    assert shard.values.shape == (0,)
    assert shard.stats().version == 0


# --- churn: who an open round waits for --------------------------------------------------


def test_sync_trainer_that_leaves_and_rejoins_during_a_step_is_not_waited_for_in_it(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1, 2})
    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    shard.set_live_trainers({0, 1})  # trainer 2's lease expired...
    shard.set_live_trainers({0, 1, 2})  # ...and it registered again
    last = push_in_thread(shard, 1, full(3.0))

    assert first.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert last.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert_close(shard.values, full(-2.0))


def test_sync_step_waits_for_the_remaining_trainers_after_one_leaves(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1, 2})
    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().pushes == 1)

    shard.set_live_trainers({0, 1})

    done, _ = wait([first], timeout=0.2)  # trainer 1 is still expected
    assert not done
    last = push_in_thread(shard, 1, full(3.0))
    assert first.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert last.result(TIMEOUT_S) == PushResult(accepted=True, version=1)


# --- freeze and thaw ------------------------------------------------------------------------


def test_frozen_async_shard_holds_pushes_until_thawed(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.push(0, full(1.0), 0, 1)

    assert shard.freeze() == 1
    waiting = push_in_thread(shard, 0, full(1.0), model_version=1)
    done, _ = wait([waiting], timeout=0.2)  # expected to time out
    assert not done
    assert shard.version == 1
    assert_close(shard.values, full(-1.0))
    assert shard.stats().frozen

    shard.thaw()

    assert waiting.result(TIMEOUT_S) == PushResult(accepted=True, version=2)
    assert_close(shard.values, full(-2.0))
    assert not shard.stats().frozen


def test_frozen_sync_shard_completes_no_step_until_thawed(make_shard: ShardFactory) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    first = push_in_thread(shard, 0, full(2.0))
    wait_for(lambda: shard.stats().pushes == 1)

    assert shard.freeze() == 0
    # Neither a late push nor a trainer leaving completes the step while frozen.
    second = push_in_thread(shard, 1, full(4.0))
    shard.set_live_trainers({0})
    done, _ = wait([first, second], timeout=0.2)  # expected to time out
    assert not done
    assert shard.version == 0
    assert_close(shard.values, full(0.0))

    shard.thaw()

    # The step completed with trainer 0 only: trainer 1 left before its push got in,
    # so that push, computed on version 0, is now stale.
    assert first.result(TIMEOUT_S) == PushResult(accepted=True, version=1)
    assert second.result(TIMEOUT_S) == PushResult(
        accepted=False, version=1, status=PushStatus.STALE
    )
    assert_close(shard.values, full(-2.0))


def test_freeze_and_thaw_are_idempotent(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)

    shard.thaw()  # thawing a shard that is not frozen does nothing
    assert shard.freeze() == 0
    assert shard.freeze() == 0
    assert shard.frozen
    shard.thaw()
    shard.thaw()

    assert not shard.frozen
    assert shard.push(0, full(1.0), 0, 1) == PushResult(accepted=True, version=1)


def test_freeze_at_a_later_version_lets_steps_run_until_it_then_holds_pushes(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.freeze()
    freezing: Future[int] = Future()
    threading.Thread(
        target=lambda: freezing.set_result(shard.freeze(at_version=2, timeout_s=TIMEOUT_S)),
        daemon=True,
    ).start()

    # The shard was thawed to reach version 2: two pushes go through, the third waits.
    pushes = [push_in_thread(shard, 0, full(1.0)) for _ in range(3)]
    assert freezing.result(TIMEOUT_S) == 2
    done, pending = wait(pushes, timeout=0.2)
    assert sorted(f.result().version for f in done) == [1, 2]
    assert len(pending) == 1
    assert shard.version == 2
    assert_close(shard.values, full(-2.0))

    shard.thaw()
    assert pending.pop().result(TIMEOUT_S) == PushResult(accepted=True, version=3)


def test_freeze_at_a_version_already_reached_freezes_at_once(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.push(0, full(1.0), 0, 1)

    assert shard.freeze(at_version=1, timeout_s=0.01) == 1
    assert shard.frozen


def test_freeze_at_a_version_not_reached_in_time_raises_and_leaves_the_shard_thawed(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.freeze()

    with pytest.raises(FreezeTimeoutError):
        shard.freeze(at_version=1, timeout_s=0.05)

    assert not shard.frozen
    assert shard.push(0, full(1.0), 0, 1) == PushResult(accepted=True, version=1)
    assert shard.push(0, full(1.0), 1, 1) == PushResult(accepted=True, version=2)


def test_freeze_to_finish_the_open_round_waits_for_its_step(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.SYNC)
    shard.set_live_trainers({0, 1})
    first = push_in_thread(shard, 0, full(1.0))
    wait_for(lambda: shard.stats().open_round == 1)
    shard.freeze()
    freezing: Future[int] = Future()
    threading.Thread(
        target=lambda: freezing.set_result(shard.freeze(finish_round=True, timeout_s=TIMEOUT_S)),
        daemon=True,
    ).start()

    second = push_in_thread(shard, 1, full(3.0))
    assert freezing.result(TIMEOUT_S) == 1
    assert first.result(TIMEOUT_S).version == second.result(TIMEOUT_S).version == 1
    assert shard.frozen


def test_freeze_to_finish_a_round_that_closes_without_a_step_does_not_wait_for_a_version(
    make_shard: ShardFactory,
) -> None:
    # An idle trainer's empty push opens the round; the other trainer leaves
    # (job over), so the round closes without a step and the version stays.
    shard = make_shard(UpdateMode.SYNC)
    shard.set_live_trainers({0, 1})
    idle = push_in_thread(shard, 1, None)
    wait_for(lambda: shard.stats().open_round == 1)
    shard.freeze()
    freezing: Future[int] = Future()
    threading.Thread(
        target=lambda: freezing.set_result(shard.freeze(finish_round=True, timeout_s=TIMEOUT_S)),
        daemon=True,
    ).start()

    shard.set_live_trainers({1})
    assert freezing.result(TIMEOUT_S) == 0
    assert idle.result(TIMEOUT_S) == PushResult(accepted=False, version=0)
    assert shard.frozen


def test_freeze_to_finish_a_round_with_none_open_freezes_at_once(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.SYNC)
    assert shard.freeze(finish_round=True, timeout_s=0.01) == 0
    assert shard.frozen


def test_close_releases_a_push_waiting_on_a_freeze(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.freeze()
    waiting = push_in_thread(shard, 0, full(1.0))
    done, _ = wait([waiting], timeout=0.05)
    assert not done

    shard.close()

    assert isinstance(waiting.exception(TIMEOUT_S), ShardClosedError)
    assert shard.version == 0


@pytest.mark.parametrize("mode", [UpdateMode.SYNC, UpdateMode.ASYNC])
def test_push_to_a_closed_shard_is_refused(make_shard: ShardFactory, mode: UpdateMode) -> None:
    shard = make_shard(mode)
    shard.close()

    with pytest.raises(ShardClosedError):
        shard.push(0, full(1.0), 0, 1)
    assert shard.version == 0


# --- checkpoint state --------------------------------------------------------------------------

ALL_OPTIMIZERS = [
    OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
    OptimizerConfig(name="momentum", lr=0.1, momentum=0.8),
    OptimizerConfig(name="adam", lr=0.05, weight_decay=0.1),
    OptimizerConfig(name="adagrad", lr=0.3),
]


@pytest.mark.parametrize("config", ALL_OPTIMIZERS, ids=lambda c: c.name)
@pytest.mark.parametrize("mode", [UpdateMode.ASYNC, UpdateMode.SYNC])
def test_shard_restored_from_its_state_takes_bit_identical_steps(
    make_shard: ShardFactory, config: OptimizerConfig, mode: UpdateMode
) -> None:
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(NUMEL, generator=gen) for _ in range(6)]
    original = make_shard(mode, config)
    original.values.copy_(torch.randn(NUMEL, generator=gen))
    for grad in grads[:3]:
        original.push(0, grad.clone(), original.version, 2)

    tensors, meta = original.state()
    restored = ParameterShard.from_state(tensors, meta, optimizer=config, mode=mode)

    assert restored.version == original.version == 3
    assert restored.fingerprint == FINGERPRINT
    assert restored.layout == original.layout
    assert torch.equal(restored.values, original.values)
    for grad in grads[3:]:
        a = original.push(0, grad.clone(), original.version, 2)
        b = restored.push(0, grad.clone(), restored.version, 2)
        assert a == b
        assert torch.equal(restored.values, original.values)


def test_state_exports_the_optimizer_state_as_flat_tensors_and_scalars(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(UpdateMode.ASYNC, OptimizerConfig(name="adam", lr=0.1))
    shard.push(0, full(1.0), 0, 1)
    shard.push(0, full(2.0), 1, 1)

    tensors, meta = shard.state()

    assert sorted(tensors) == ["coverage", "optim.exp_avg", "optim.exp_avg_sq", "values"]
    coverage = tensors.pop("coverage")
    assert coverage.dtype == torch.int64 and coverage.shape == (0, 4)
    assert all(t.dtype == torch.float32 and t.shape == (NUMEL,) for t in tensors.values())
    assert meta["optimizer_scalars"] == {"step": {"value": 2.0, "dtype": "float32"}}
    assert meta["version"] == 2
    assert meta["sealed_through"] == -1
    assert meta["mode"] == "async"
    assert meta["optimizer"] == {
        "name": "adam",
        "lr": 0.1,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "torch_class": "",
        "options": "",
        "schedule": "",
    }


def test_state_is_a_copy_that_later_steps_do_not_change(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    tensors, _ = shard.state()

    shard.push(0, full(1.0), 0, 1)

    assert_close(tensors["values"], full(0.0))
    assert_close(shard.values, full(-1.0))


def test_state_saved_for_another_optimizer_restores_values_and_version_only(
    make_shard: ShardFactory,
) -> None:
    adam = make_shard(UpdateMode.ASYNC, OptimizerConfig(name="adam", lr=0.1))
    adam.push(0, full(1.0), 0, 1)
    tensors, meta = adam.state()
    sgd = make_shard(UpdateMode.ASYNC, SGD_LR1)

    assert sgd.load_state(tensors, meta) is False

    assert torch.equal(sgd.values, adam.values)
    assert sgd.version == 1
    before = sgd.values.clone()
    sgd.push(0, full(1.0), 1, 1)
    assert_close(sgd.values, before - 1.0)  # plain SGD, no Adam state carried over


def test_load_state_of_another_size_raises_layout_mismatch(make_shard: ShardFactory) -> None:
    tensors, meta = make_shard(numel=NUMEL + 1).state()
    shard = make_shard()

    with pytest.raises(LayoutMismatchError):
        shard.load_state(tensors, meta)
    assert shard.version == 0


# --- learning-rate schedules, torch.optim classes -----------------------------------


def test_step_decay_schedule_sets_the_lr_of_each_step_by_model_version(
    make_shard: ShardFactory,
) -> None:
    schedule = json.dumps({"kind": "step", "every_versions": 2, "gamma": 0.5})
    shard = make_shard(UpdateMode.ASYNC, OptimizerConfig(name="sgd", lr=1.0, schedule=schedule))

    moves = []
    for version in range(5):
        before = shard.values.clone()
        shard.push(0, full(1.0), version, 1)
        moves.append(float((before - shard.values)[0]))

    assert moves == [1.0, 1.0, 0.5, 0.5, 0.25]


def test_sync_step_uses_the_scheduled_lr_of_the_version_it_starts_from(
    make_shard: ShardFactory,
) -> None:
    schedule = json.dumps({"kind": "warmup", "versions": 4})
    shard = make_shard(UpdateMode.SYNC, OptimizerConfig(name="sgd", lr=1.0, schedule=schedule))

    shard.push(0, full(1.0), 0, 1)
    shard.push(0, full(1.0), 1, 1)

    assert_close(shard.values, full(-(0.25 + 0.5)))


def test_torch_optim_class_by_name_equals_torch_optim_on_the_same_gradients(
    make_shard: ShardFactory,
) -> None:
    config = OptimizerConfig(
        name="torch", lr=0.01, torch_class="RMSprop", options=json.dumps({"alpha": 0.9})
    )
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(NUMEL, generator=gen) for _ in range(3)]
    shard = make_shard(UpdateMode.ASYNC, config)
    ref = torch.nn.Parameter(torch.zeros(NUMEL))
    ref_opt = torch.optim.RMSprop([ref], lr=0.01, alpha=0.9)

    for version, grad in enumerate(grads):
        shard.push(0, grad.clone(), version, 1)
        ref.grad = grad.clone()
        ref_opt.step()

    assert_close(shard.values, ref.detach())
    tensors, _ = shard.state()
    assert "optim.square_avg" in tensors


# --- frozen parameters -----------------------------------------------------------------

# Shard buffer: a.w [0, 2) | D.w [2, 4) | b.w [4, 5) | D.b [5, 6)
FROZEN_LAYOUT: dict[str, object] = {
    "shard": 0,
    "numel": NUMEL,
    "pieces": [["a.w", 0, 2], ["D.w", 0, 2], ["b.w", 3, 4], ["D.b", 0, 1]],
}


@pytest.fixture
def make_frozen_shard() -> Iterator[Callable[..., ParameterShard]]:
    shards: list[ParameterShard] = []

    def make(
        mode: UpdateMode = UpdateMode.ASYNC,
        optimizer: OptimizerConfig = SGD_LR1,
        frozen: tuple[str, ...] = ("D.*",),
    ) -> ParameterShard:
        shard = ParameterShard(FROZEN_LAYOUT, FINGERPRINT, optimizer, mode, frozen=frozen)
        shards.append(shard)
        return shard

    yield make
    for shard in shards:
        shard.close()


def test_frozen_ranges_follow_the_layout_pieces_in_order() -> None:
    assert frozen_pieces(FROZEN_LAYOUT, ["D.*"]) == (("D.w", 2, 4), ("D.b", 5, 6))
    assert frozen_pieces(FROZEN_LAYOUT, ["?.w"]) == (("a.w", 0, 2), ("D.w", 2, 4), ("b.w", 4, 5))
    assert frozen_pieces(FROZEN_LAYOUT, ["nothing*"]) == ()


@pytest.mark.parametrize(
    "layout",
    [
        {"shard": 0, "numel": 2},
        {"shard": 0, "numel": 2, "pieces": [["a", 0]]},
        {"shard": 0, "numel": 2, "pieces": [["a", 2, 0]]},
        {"shard": 0, "numel": 2, "pieces": [[1, 0, 2]]},
        {"shard": 0, "numel": 3, "pieces": [["a", 0, 2]]},
    ],
    ids=["no-pieces", "short-piece", "negative-size", "name-not-str", "size-mismatch"],
)
def test_malformed_layout_with_frozen_patterns_is_rejected(layout: dict[str, object]) -> None:
    with pytest.raises(LayoutMismatchError):
        ParameterShard(layout, FINGERPRINT, SGD_LR1, UpdateMode.ASYNC, frozen=("a",))


@pytest.mark.parametrize("mode", [UpdateMode.ASYNC, UpdateMode.SYNC])
def test_push_with_a_nonzero_gradient_for_a_frozen_parameter_is_refused_and_not_applied(
    make_frozen_shard: Callable[..., ParameterShard], mode: UpdateMode
) -> None:
    shard = make_frozen_shard(mode)
    grad = full(1.0)

    with pytest.raises(FrozenParameterError, match=r"D\.b, D\.w"):
        shard.push(0, grad, 0, 1)

    assert torch.equal(shard.values, full(0.0))
    assert shard.version == 0
    assert shard.stats().open_round == 0
    # Nothing is lost: the same push with the frozen gradients zeroed goes through.
    grad[2:4] = 0
    grad[5] = 0
    assert shard.push(0, grad, 0, 1).accepted
    assert_close(shard.values, torch.tensor([-1.0, -1.0, 0.0, 0.0, -1.0, 0.0]))


@pytest.mark.parametrize(
    "optimizer",
    [
        OptimizerConfig(name="adam", lr=0.1, weight_decay=0.5),
        OptimizerConfig(name="momentum", lr=0.1, momentum=0.9, weight_decay=0.5),
        OptimizerConfig(name="adagrad", lr=0.1, weight_decay=0.5),
    ],
    ids=["adam", "momentum", "adagrad"],
)
def test_frozen_values_stay_bit_identical_under_stateful_optimizers(
    make_frozen_shard: Callable[..., ParameterShard], optimizer: OptimizerConfig
) -> None:
    unfrozen = ParameterShard(FROZEN_LAYOUT, FINGERPRINT, optimizer, UpdateMode.ASYNC)
    gen = torch.Generator().manual_seed(11)
    init = torch.randn(NUMEL, generator=gen)
    grads = [torch.randn(NUMEL, generator=gen) for _ in range(4)]
    # First train everything, so momentum / Adam state exists for the later-frozen part.
    unfrozen.values.copy_(init)
    for version, grad in enumerate(grads[:2]):
        unfrozen.push(0, grad.clone(), version, 1)
    tensors, meta = unfrozen.state()
    shard = ParameterShard.from_state(
        tensors, meta, optimizer=optimizer, mode=UpdateMode.ASYNC, frozen=("D.*",)
    )
    before = shard.values.clone()

    for version, raw in enumerate(grads[2:], start=2):
        grad = raw.clone()
        grad[2:4] = 0
        grad[5] = 0
        shard.push(0, grad, version, 1)

    after = shard.values
    assert torch.equal(after[2:4], before[2:4])
    assert torch.equal(after[5:6], before[5:6])
    assert not torch.equal(after[0:2], before[0:2])


def test_zero_gradient_push_without_frozen_patterns_is_never_refused(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    assert shard.push(0, full(1.0), 0, 1).accepted
    assert shard.frozen_ranges == ()


def test_shard_max_staleness_is_the_default_bound_of_async_pushes() -> None:
    shard = ParameterShard(
        {"shard": 0, "numel": NUMEL}, FINGERPRINT, SGD_LR1, UpdateMode.ASYNC, max_staleness=1
    )
    for version in range(3):
        shard.push(0, full(1.0), version, 1)

    assert not shard.push(0, full(1.0), 1, 1).accepted  # 2 versions behind
    assert shard.push(0, full(1.0), 2, 1).accepted
    assert shard.push(0, full(1.0), 0, 1, max_staleness=10).accepted  # per-call bound wins


# --- push keys: exactly once --------------------------------------------------------


def test_async_push_with_a_held_key_is_a_duplicate_and_not_applied(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    k = PushKey(0, 3, 0, 32)
    assert shard.push(0, full(1.0), 0, 32, key=k) == PushResult(True, 1)
    again = shard.push(1, full(1.0), 0, 32, key=k)
    assert again == PushResult(False, 1, PushStatus.DUPLICATE)
    assert_close(shard.values, full(-1.0))
    assert shard.stats().duplicate_pushes == 1
    assert shard.coverage_of(0) == (False, [(3, 0, 32)])


def test_a_misaligned_key_is_refused_and_nothing_applied(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.push(0, full(1.0), 0, 32, key=PushKey(0, 3, 0, 32))
    with pytest.raises(MisalignedPushError, match="batch-size"):
        shard.push(0, full(1.0), 1, 32, key=PushKey(0, 3, 16, 48))
    assert shard.version == 1
    assert_close(shard.values, full(-1.0))


def test_sync_duplicate_joins_the_step_like_an_empty_push(make_shard: ShardFactory) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    k = PushKey(0, 0, 0, 10)
    first = push_in_thread(shard, 0, full(2.0), key=k)
    wait_for(lambda: shard.stats().pushes == 1)
    # Another attempt of the same records joins the same round: a duplicate.
    second = push_in_thread(shard, 1, full(100.0), key=k)
    assert first.result(TIMEOUT_S) == PushResult(True, 1)
    assert second.result(TIMEOUT_S) == PushResult(False, 1, PushStatus.DUPLICATE)
    assert_close(shard.values, full(-2.0))
    assert shard.coverage_of(0) == (False, [(0, 0, 10)])


def test_sync_round_of_duplicates_only_moves_the_version_without_a_step(
    make_shard: ShardFactory,
) -> None:
    shard = make_shard(optimizer=OptimizerConfig(name="momentum", lr=1.0, momentum=0.5))
    shard.set_live_trainers({0})
    k = PushKey(0, 0, 0, 10)
    assert shard.push(0, full(1.0), 0, 10, key=k).accepted
    before = shard.values.clone()
    result = shard.push(0, full(1.0), 1, 10, key=k)
    assert result == PushResult(False, 2, PushStatus.DUPLICATE)
    assert torch.equal(shard.values, before)  # momentum did not move it either
    assert shard.stats().steps == 1


def test_sealed_pass_pushes_are_duplicates(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.push(0, full(1.0), 0, 10, key=PushKey(0, 0, 0, 10))
    shard.seal(0)
    assert shard.coverage_of(0) == (True, [])
    late = shard.push(0, full(1.0), 1, 10, key=PushKey(0, 5, 0, 10))
    assert late.status is PushStatus.DUPLICATE
    assert shard.version == 1


def test_coverage_survives_state_and_load_state(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.push(0, full(1.0), 0, 10, key=PushKey(0, 0, 0, 10))
    shard.push(0, full(1.0), 1, 10, key=PushKey(1, 2, 10, 20))
    shard.seal(0)
    tensors, meta = shard.state()
    restored = make_shard(UpdateMode.ASYNC)
    restored.load_state(tensors, meta)
    assert restored.coverage_of(0) == (True, [])
    assert restored.coverage_of(1) == (False, [(2, 10, 20)])
    assert restored.push(0, full(1.0), 2, 10, key=PushKey(1, 2, 10, 20)).status is (
        PushStatus.DUPLICATE
    )


def test_discarded_round_answers_its_pushes_stale(make_shard: ShardFactory) -> None:
    shard = make_shard()
    shard.set_live_trainers({0, 1})
    waiting = push_in_thread(shard, 0, full(2.0), key=PushKey(0, 0, 0, 10))
    wait_for(lambda: shard.stats().pushes == 1)
    assert shard.discard_round() == 1
    assert waiting.result(TIMEOUT_S) == PushResult(False, 0, PushStatus.STALE)
    assert shard.coverage_of(0) == (False, [])
    assert_close(shard.values, full(0.0))
    # The next round starts clean, and the same key can be applied in it.
    shard.set_live_trainers({0})
    assert shard.push(0, full(2.0), 0, 10, key=PushKey(0, 0, 0, 10)).accepted


def test_sync_push_of_another_generation_is_stale(make_shard: ShardFactory) -> None:
    shard = make_shard()
    shard.set_live_trainers({0})
    shard.set_generation(7)
    assert shard.push(0, full(1.0), 0, 1, generation=6).status is PushStatus.STALE
    assert shard.push(0, full(1.0), 0, 1, generation=7).accepted


def test_a_shard_that_is_not_serving_holds_pushes(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    shard.set_serving(False)
    held = push_in_thread(shard, 0, full(1.0))
    done, _ = wait([held], timeout=0.2)  # expected to time out
    assert not done
    assert not shard.wait_serving(timeout_s=0.01)
    shard.set_serving(True)
    assert held.result(TIMEOUT_S).accepted
    assert shard.wait_serving(timeout_s=0.01)


def test_a_step_waits_for_readers_of_the_values(make_shard: ShardFactory) -> None:
    shard = make_shard(UpdateMode.ASYNC)
    with shard.reading() as version:
        assert version == 0
        pushed = push_in_thread(shard, 0, full(1.0))
        done, _ = wait([pushed], timeout=0.2)  # expected to time out
        assert not done
        assert_close(shard.values, full(0.0))
    assert pushed.result(TIMEOUT_S).accepted
    assert_close(shard.values, full(-1.0))


def test_an_empty_push_with_a_key_holds_its_records_without_a_step(
    make_shard: ShardFactory,
) -> None:
    """Records skipped as bad have no gradient; an empty keyed push accounts for them."""
    for mode in (UpdateMode.ASYNC, UpdateMode.SYNC):
        shard = make_shard(mode)
        shard.set_live_trainers({0})
        k = PushKey(0, 4, 0, 16)
        assert shard.push(0, None, 0, 0, key=k).status is PushStatus.APPLIED
        assert shard.coverage_of(0) == (False, [(4, 0, 16)])
        assert shard.stats().steps == 0 and shard.version == 0
        again = shard.push(0, None, 0, 0, key=k)
        assert again.status is PushStatus.DUPLICATE


def test_values_set_from_a_trainer_are_opaque_until_the_next_seal(
    make_shard: ShardFactory,
) -> None:
    """The master repairs sealed passes only onto a shard whose keys describe its values."""
    shard = make_shard(UpdateMode.ASYNC)
    assert not shard.opaque and shard.state()[1]["opaque"] is False
    shard.mark_opaque()
    tensors, meta = shard.state()
    assert meta["opaque"] is True
    restored = ParameterShard.from_state(tensors, meta, optimizer=SGD_LR1, mode=UpdateMode.ASYNC)
    try:
        assert restored.opaque
        restored.seal(0)
        assert not restored.opaque
    finally:
        restored.close()
    meta["opaque"] = "yes"
    with pytest.raises(ValueError, match="opaque"):
        ParameterShard.from_state(tensors, meta, optimizer=SGD_LR1, mode=UpdateMode.ASYNC)
