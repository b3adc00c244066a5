"""The launcher's final consistent checkpoint goes on through an etcd restart.

Pure: a fake job store whose etcd is unreachable for a while, and a fake
``take_consistent_checkpoint``; no sockets, no processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyetcd import exceptions as etcd_exceptions

from elasticps.errors import CoordinationError
from elasticps.launcher import local

pytestmark = pytest.mark.timeout(30)


def _unreachable() -> CoordinationError:
    error = CoordinationError("etcd 127.0.0.1:1: listing PS slots failed: etcd connection failed")
    error.__cause__ = etcd_exceptions.ConnectionFailedError()
    return error


class _Keys:
    tasks_prefix = "/job/tasks/"

    @staticmethod
    def checkpoint(version: int) -> str:
        return f"/job/checkpoints/{version}"


class _Store:
    """Fails every call ``failures`` times in all (transient: etcd restarting), then answers."""

    keys = _Keys()

    def __init__(self, failures: int, *, transient: bool = True) -> None:
        self.failures = failures
        self.transient = transient
        self.published: dict[str, object] = {}

    def _maybe_fail(self) -> None:
        if self.failures:
            self.failures -= 1
            raise _unreachable() if self.transient else CoordinationError("malformed slot")

    def ps_addresses(self, timeout_s: float) -> list[str]:
        self._maybe_fail()
        return ["127.0.0.1:1", "127.0.0.1:2"]

    def get_prefix_json(self, prefix: str) -> tuple[dict[str, object], int]:
        self._maybe_fail()
        return {}, 42

    def put_json(self, key: str, value: object) -> None:
        self._maybe_fail()
        self.published[key] = value


@pytest.fixture
def snapshots(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    taken: list[list[str]] = []

    def take(addresses: list[str], out: Any, **kwargs: Any) -> dict[str, object]:
        taken.append(addresses)
        return {"version": 7, "ledger_revision": kwargs["ledger_revision"]}

    monkeypatch.setattr(local, "take_consistent_checkpoint", take)
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    return taken


def test_an_unreachable_etcd_is_waited_for_and_the_checkpoint_published(
    snapshots: list[list[str]], tmp_path: Path
) -> None:
    store = _Store(failures=3)
    manifest = local.checkpoint_job(store, tmp_path, {}, retry_s=60)  # type: ignore[arg-type]
    assert manifest == {"version": 7, "ledger_revision": 42}
    assert snapshots == [["127.0.0.1:1", "127.0.0.1:2"]]
    assert store.published["/job/checkpoints/7"] == {
        "dir": str(tmp_path.resolve()), "version": 7, "ledger_revision": 42,
    }  # fmt: skip


def test_a_lasting_or_non_transient_etcd_error_is_raised(
    snapshots: list[list[str]], tmp_path: Path
) -> None:
    with pytest.raises(CoordinationError, match="malformed"):
        local.checkpoint_job(_Store(1, transient=False), tmp_path, {})  # type: ignore[arg-type]
    with pytest.raises(CoordinationError, match="connection failed"):
        local.checkpoint_job(_Store(10**6), tmp_path, {}, retry_s=0)  # type: ignore[arg-type]
    assert snapshots == []
