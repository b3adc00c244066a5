"""The master's shard controller trusts an answer only from the slot's current claim."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from elasticps.coord.slots import PSSlot
from elasticps.errors import RemoteError
from elasticps.master import shards
from elasticps.master.shards import PassVerifier, ShardController, ShardsChangedError


class _Store:
    """The two reads ShardController makes, from a dict the test changes."""

    def __init__(self, slots: dict[int, PSSlot]) -> None:
        self.slots = slots

    def ps_slots(self) -> dict[int, PSSlot]:
        return dict(self.slots)

    def wait_ps_slots(self, timeout_s: float) -> list[PSSlot]:
        return [self.slots[i] for i in sorted(self.slots)]


class _Client:
    """A control connection whose answer may come after a successor claimed the slot."""

    on_request: Any = None

    def __init__(self, address: str, *, timeout_s: float, epoch: int) -> None:
        self.epoch = epoch

    def request(self, body: object, *, timeout_s: float | None = None) -> dict[str, object]:
        self.body: dict[str, object] = dict(body)  # type: ignore[call-overload]
        if _Client.on_request is not None:
            _Client.on_request(self)
        # A coverage answer of a sealed shard holds the pass whole.
        return {"epoch": self.epoch, "version": 7, "durable": True, "sealed": True}

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> _Store:
    monkeypatch.setattr(shards, "ControlClient", _Client)
    monkeypatch.setattr(_Client, "on_request", None)
    return _Store({0: PSSlot(0, "127.0.0.1:1", 8), 1: PSSlot(1, "127.0.0.1:2", 9)})


def test_answers_of_the_current_claims_are_returned(store: _Store) -> None:
    controller = ShardController(store)  # type: ignore[arg-type]
    assert controller.request_one(0, {"op": "seal", "pass": 1})["epoch"] == 8
    assert sorted(controller.request_all({"op": "coverage", "pass": 1})) == [0, 1]


def test_an_answer_that_came_after_the_slot_was_claimed_anew_is_not_trusted(
    store: _Store,
) -> None:
    """A server paused past its lease answers on resuming; its successor restored an
    older checkpoint meanwhile, so sealing on that answer would lose records."""

    def successor_claims(client: _Client) -> None:
        store.slots[0] = PSSlot(0, "127.0.0.1:3", 234)

    _Client.on_request = successor_claims
    controller = ShardController(store)  # type: ignore[arg-type]
    with pytest.raises(ShardsChangedError, match=r"claimed anew \(epoch 8 -> 234\)"):
        controller.request_one(0, {"op": "seal", "pass": 1})
    store.slots[0] = PSSlot(0, "127.0.0.1:1", 8)
    with pytest.raises(ShardsChangedError, match="claimed anew"):
        controller.request_all({"op": "coverage", "pass": 1})


def test_a_fenced_refusal_means_the_slot_is_changing(store: _Store) -> None:
    def refuse(client: _Client) -> None:
        raise RemoteError("fenced", "may no longer hold its slot")

    _Client.on_request = refuse
    controller = ShardController(store)  # type: ignore[arg-type]
    with pytest.raises(ShardsChangedError, match="may no longer hold"):
        controller.request_one(0, {"op": "seal", "pass": 1})
    with pytest.raises(ShardsChangedError, match="may no longer hold"):
        controller.request_all({"op": "coverage", "pass": 1})


def test_every_server_is_asked_at_once(store: _Store) -> None:
    """A pass's end waits for the slowest server, not for the sum of them."""
    both = threading.Barrier(2, timeout=5.0)  # broken if the requests went one by one
    _Client.on_request = lambda client: both.wait()
    controller = ShardController(store)  # type: ignore[arg-type]
    try:
        assert sorted(controller.request_all({"op": "coverage", "pass": 1})) == [0, 1]
    finally:
        controller.close()


def verifier_of(
    store: _Store,
    completed: list[tuple[int, int]],
    *,
    failed_tasks_of: Any = lambda pass_id: [],
    repair: Any = None,
) -> PassVerifier:
    return PassVerifier(
        store,  # type: ignore[arg-type]
        task_records=lambda: {0: 10},
        done_tasks=lambda: [0],
        reopen=lambda rewinds: None,
        complete=lambda pass_id, lost, passes: completed.append((pass_id, lost)),
        failed_tasks_of=failed_tasks_of,
        stop=threading.Event(),
        repair=repair,
    )


def test_a_pass_completes_only_if_the_claims_held_from_the_check_through_the_seal(
    store: _Store,
) -> None:
    """The claims are read once before the coverage round and confirmed after the
    seals: a successor claiming a slot in between stops the completion."""
    asked: list[str] = []

    def successor_claims_during_the_seal(client: _Client) -> None:
        asked.append(f"{client.body['op']}@{client.epoch}")
        if client.body["op"] == "seal" and client.epoch == 9:
            store.slots[1] = PSSlot(1, "127.0.0.1:4", 10)

    completed: list[tuple[int, int]] = []
    verifier = verifier_of(store, completed)
    _Client.on_request = successor_claims_during_the_seal
    try:
        with pytest.raises(ShardsChangedError, match=r"claimed anew \(epoch 9 -> 10\)"):
            verifier._verify(0)
        assert completed == []
        assert sorted(asked) == ["coverage@8", "coverage@9", "seal@8", "seal@9"]
        # Checked again on the new claim: complete.
        asked.clear()
        verifier._verify(0)
        assert completed == [(0, 0)]
        assert sorted(asked) == ["coverage@10", "coverage@8", "seal@10", "seal@8"]
    finally:
        verifier.close()


def _restored_shard_answers(opaque: bool) -> Any:
    """Shard 0 sealed every pass; shard 1 was restored from a checkpoint taken during
    pass 1 (sealed through 0): it holds 4 records of pass 1, none of pass 2, all of 3."""

    def request(self: _Client, body: object, *, timeout_s: float | None = None) -> dict[str, Any]:
        self.body = dict(body)  # type: ignore[call-overload]
        answer: dict[str, Any] = {"epoch": self.epoch, "version": 7, "durable": True}
        if self.epoch == 8 or self.body["op"] != "coverage":
            return {**answer, "sealed": True, "sealed_through": 2}
        held = {1: [[0, 0, 4]], 2: [], 3: [[0, 0, 10]]}[int(self.body["pass"])]
        return {**answer, "sealed": False, "intervals": held, "sealed_through": 0,
                "opaque": opaque}  # fmt: skip

    return request


@pytest.mark.parametrize("repairs_succeed", [True, False])
def test_a_shard_restored_before_a_seal_gets_repairs_of_the_oldest_pass_first(
    store: _Store, monkeypatch: pytest.MonkeyPatch, repairs_succeed: bool
) -> None:
    monkeypatch.setattr(_Client, "request", _restored_shard_answers(opaque=False))
    completed: list[tuple[int, int]] = []
    asked: list[tuple[int, dict[int, int]]] = []
    verifier = verifier_of(
        store,
        completed,
        repair=lambda pass_id, rewinds: (
            asked.append((pass_id, rewinds)) is None and repairs_succeed
        ),
    )
    try:
        verifier._verify(3)
    finally:
        verifier.close()
    if repairs_succeed:
        assert asked == [(1, {0: 4})]
        assert completed == []  # checked again once the repairs are done
    else:  # every repair had failed before: what shard 1 lacks is lost
        assert asked == [(1, {0: 4}), (2, {0: 0})]
        assert completed == [(3, 6 + 10)]


@pytest.mark.parametrize(("opaque", "summary_kept"), [(True, True), (False, False)])
def test_an_opaque_shard_or_a_pass_without_summary_is_not_repaired(
    store: _Store, monkeypatch: pytest.MonkeyPatch, opaque: bool, summary_kept: bool
) -> None:
    """An opaque shard's values came from a trainer: they may hold records that its
    coverage does not name. A pass without summary has unknown failed tasks."""
    monkeypatch.setattr(_Client, "request", _restored_shard_answers(opaque=opaque))
    completed: list[tuple[int, int]] = []
    asked: list[int] = []
    verifier = verifier_of(
        store,
        completed,
        failed_tasks_of=lambda pass_id: [] if summary_kept else None,
        repair=lambda pass_id, rewinds: asked.append(pass_id) is None,
    )
    try:
        verifier._verify(3)
    finally:
        verifier.close()
    assert asked == []
    assert completed == [(3, 16)]
