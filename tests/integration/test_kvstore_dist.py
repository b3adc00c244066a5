"""The KVStore's ``dist_*`` kinds against real parameter-server processes.

The servers are started with :class:`elasticps.api.servers.LocalServers`
(etcd + PS processes, stopped by PID); workers are :class:`DistKVStore`
instances in this process (threads when a sync step needs two). The last
tests run ``examples/kvstore_mnist.py`` end to end through ``dist_train``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from elasticps import updater
from elasticps.api.servers import LocalServers, ServersConfig
from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import KVStoreError, RemoteError
from elasticps.kvstore import DistKVStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvstore_mnist.py"
SGD_LR1 = updater.SGD(lr=1.0)
# Accuracy threshold of the example on the 1,000 held-out images (it reaches about
# 0.92 in both modes); the servers and workers must start and stop in time.
EXAMPLE_MIN_ACCURACY = 0.85
EXAMPLE_TIMEOUT_S = 200.0

ServersFactory = Callable[..., LocalServers]


@pytest.fixture
def servers() -> Iterator[ServersFactory]:
    """Start servers for one test; every process is stopped by PID at teardown."""
    started: list[LocalServers] = []

    def start(
        mode: UpdateMode,
        optimizer: OptimizerConfig,
        num_ps: int = 1,
        frozen: tuple[str, ...] = (),
    ) -> LocalServers:
        config = ServersConfig(
            num_ps=num_ps, mode=mode, optimizer=optimizer, with_master=False, frozen=frozen
        )
        srv = LocalServers(config)
        started.append(srv)
        srv.start()
        return srv

    yield start
    for srv in started:
        srv.stop()


def store(
    srv: LocalServers, kind: str, rank: int = 0, num_workers: int = 1, **kw: int
) -> DistKVStore:
    kv = DistKVStore(
        kind,
        etcd_endpoint=srv.etcd_endpoint,
        job=srv.job,
        rank=rank,
        num_workers=num_workers,
        connect_timeout_s=60.0,
        **kw,
    )
    return kv


def test_dist_async_without_an_optimizer_raises_a_clear_error(servers: ServersFactory) -> None:
    srv = servers(UpdateMode.ASYNC, SGD_LR1.to_config())
    with store(srv, "dist_async") as kv:
        kv.init("w", torch.zeros(3))
        with pytest.raises(KVStoreError, match="set_optimizer"):
            kv.push("w", torch.ones(3))


def test_dist_sync_averages_the_workers_gradients_in_one_step(servers: ServersFactory) -> None:
    srv = servers(UpdateMode.SYNC, SGD_LR1.to_config())
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            with store(srv, "dist_sync", rank, 2) as kv:
                kv.init(["a", 7], [torch.full((2, 2), 10.0 * (rank + 1)), torch.zeros(3)])
                kv.set_optimizer(SGD_LR1)
                kv.push("a", [torch.full((2, 2), float(rank + 1)), torch.ones(2, 2)])
                kv.push(7, torch.full((3,), float(rank)))
                out = torch.empty(2, 2)
                kv.pull("a", out=out)
                results[rank] = out
                other = torch.empty(3)
                kv.pull(7, out=other)
                results[10 + rank] = other
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    # Rank 0's initial values; rank gradients 2 and 3 (summed per worker), averaged: 2.5.
    for rank in (0, 1):
        assert_close(results[rank], torch.full((2, 2), 10.0 - 2.5))
        assert_close(results[10 + rank], torch.full((3,), -0.5))


def test_values_above_the_big_array_bound_are_sliced_across_servers(
    servers: ServersFactory,
) -> None:
    srv = servers(UpdateMode.ASYNC, updater.SGD(lr=0.5).to_config(), num_ps=2)
    big = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    with store(srv, "dist_async", big_array_bound=16) as kv:
        kv.init(["big", "small"], [big, torch.zeros(4)])
        kv.set_optimizer(updater.SGD(lr=0.5))
        kv.push(["big", "small"], [torch.ones(4, 10), torch.ones(4)])
        out = torch.empty(4, 10)
        kv.pull("big", out=out)

        assert kv.placement is not None
        holders = {p.shard for s in kv.placement.shards for p in s.pieces if p.name == "big"}
        assert holders == {0, 1}
        assert_close(out, big - 0.5)
        with pytest.raises(KVStoreError, match="layout"):
            kv.init("late", torch.zeros(1))


def test_frozen_key_is_refused_by_the_server_and_never_changes(servers: ServersFactory) -> None:
    adam = updater.Adam(lr=0.1, weight_decay=0.5)
    srv = servers(UpdateMode.ASYNC, adam.to_config(), frozen=("D.*",))
    with store(srv, "dist_async") as kv:
        kv.init(["D.w", "G.w"], [torch.full((3,), 2.0), torch.full((3,), 2.0)])
        kv.set_optimizer(adam)
        kv.push(["D.w", "G.w"], [torch.ones(3), torch.ones(3)])
        with pytest.raises(RemoteError, match="frozen parameter") as info:
            kv.pull("G.w", out=torch.empty(3))
        assert info.value.code == "frozen_parameter"

        # The refused push changed nothing; zero gradients for D.* go through.
        kv.push(["D.w", "G.w"], [torch.zeros(3), torch.ones(3)])
        d, g = torch.empty(3), torch.empty(3)
        kv.pull(["D.w", "G.w"], out=[d, g])
        assert torch.equal(d, torch.full((3,), 2.0))
        assert (g < 2.0).all()


@pytest.mark.timeout(2 * EXAMPLE_TIMEOUT_S)
@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_kvstore_mnist_example_reaches_the_accuracy_bar(kind: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICPS_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--kvstore", kind, "--workers", "2", "--ps", "2",
         "--data", str(tmp_path / "mnist"), "--timeout-s", str(EXAMPLE_TIMEOUT_S)],
        capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S + 60, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"^worker-0\| (\{.*\"accuracy\".*\})$", proc.stdout, re.MULTILINE)
    assert match is not None, proc.stdout[-3000:]
    result = json.loads(match.group(1))
    assert result["kvstore"] == kind
    assert result["workers"] == 2
    assert result["accuracy"] >= EXAMPLE_MIN_ACCURACY
