"""elasticps.train on real local servers (etcd, master, PS processes; trainer threads).

Each test runs whole jobs through :class:`elasticps.Local`; train() stops every
process it started by PID before returning, which the tests check by listing
this process's children.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import Tensor, nn

import elasticps
from elasticps import events
from elasticps.api.servers import LocalServers, ServersConfig
from elasticps.coord.store import JobStore
from elasticps.testing import child_pids, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

torch.manual_seed(0)
X = torch.randn(96, 5)
Y = (X @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) > 0).long()


def reader() -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(0, 96, 12):
        yield X[i : i + 12], Y[i : i + 12]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.hidden(x)))


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(outputs, targets)


def no_children_left() -> bool:
    return not child_pids()


@pytest.fixture(autouse=True)
def _check_children() -> Iterator[None]:
    yield
    wait_for(no_children_left, what="every process of the job to be stopped", timeout_s=10)


def test_in_process_and_local_sync_with_one_trainer_give_the_same_parameters() -> None:
    torch.manual_seed(1)
    model = MLP()
    kwargs = {"updater": elasticps.updater.Adam(lr=0.01), "num_passes": 2}
    alone = elasticps.train(model, cross_entropy, reader, cluster=None, **kwargs)  # type: ignore[arg-type]
    served = elasticps.train(
        model,
        cross_entropy,
        reader,
        cluster=elasticps.Local(trainers=1, ps=2, mode="sync", batches_per_task=3),
        **kwargs,  # type: ignore[arg-type]
    )
    assert served.names() == alone.names()
    worst = max(float((served[n] - alone[n]).abs().max()) for n in alone)
    assert worst <= 1e-5
    start = elasticps.parameters.create(model)
    assert not torch.equal(served["out.weight"], start["out.weight"])


def test_two_trainers_report_events_train_every_batch_once_and_checkpoint(
    tmp_path: Path,
) -> None:
    got: list[events.TrainingEvent] = []
    model = MLP()
    start = elasticps.parameters.create(model)
    result = elasticps.train(
        model,
        cross_entropy,
        reader,
        updater=elasticps.updater.SGD(lr=0.1),
        event_handler=got.append,
        frozen_parameters={"hidden.*"},
        num_passes=2,
        cluster=elasticps.Local(
            trainers=2, ps=2, mode="sync", batches_per_task=2, checkpoint_dir=tmp_path / "ck"
        ),
    )
    kinds = [type(e).__name__ for e in got]
    assert kinds[0] == "BeginTraining"
    assert kinds[-1] == "EndTraining"
    assert [e.trainer_id for e in got if isinstance(e, events.TrainerJoined)] in ([0, 1], [1, 0])
    passes = [e.pass_id for e in got if isinstance(e, events.BeginPass | events.EndPass)]
    assert passes == [0, 0, 1, 1]
    for pass_id in (0, 1):
        batches = sorted(
            e.batch_id for e in got if isinstance(e, events.EndIteration) and e.pass_id == pass_id
        )
        assert batches == list(range(8))  # each batch of reader() exactly once per pass
    trainers = {e.trainer_id for e in got if isinstance(e, events.EndIteration)}
    assert trainers <= {0, 1}
    checkpointed = [e for e in got if isinstance(e, events.Checkpointed)]
    assert len(checkpointed) == 1
    manifest = json.loads((checkpointed[0].path / "manifest.json").read_text())
    assert manifest["version"] == checkpointed[0].model_version
    end = got[-1]
    assert isinstance(end, events.EndTraining)
    assert end.metrics["samples"] == 2 * 96
    # Frozen on the PS too: the hidden layer is bit-identical to the model's.
    assert torch.equal(result["hidden.weight"], start["hidden.weight"])
    assert torch.equal(result["hidden.bias"], start["hidden.bias"])
    assert not torch.equal(result["out.weight"], start["out.weight"])


def test_parquet_dataset_with_two_async_trainers(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"x": X.tolist(), "y": Y.tolist()}), path, row_group_size=16)

    def to_tensors(batch: pa.Table) -> tuple[Tensor, Tensor]:
        return (
            torch.tensor(batch.column("x").to_pylist()),
            torch.tensor(batch.column("y").to_pylist()),
        )

    samples: list[float] = []
    result = elasticps.train(
        MLP(),
        cross_entropy,
        elasticps.Parquet(path, to_tensors, ("x", "y"), batch_size=8, records_per_task=24),
        updater=elasticps.updater.Adam(lr=0.01),
        event_handler=lambda e: (
            samples.append(e.metrics["samples"]) if isinstance(e, events.EndPass) else None
        ),
        num_passes=2,
        cluster=elasticps.Local(trainers=2, ps=1, mode="async", push_every=2, pull_every=2),
    )
    assert samples == [96.0, 96.0]
    assert result.shapes()["out.weight"] == (2, 8)


def test_local_servers_start_claim_every_slot_and_stop_by_pid() -> None:
    config = ServersConfig(num_ps=2, virtual_records=10, records_per_task=5)
    with LocalServers(config) as servers:
        pids = servers.pids
        assert set(pids) == {"etcd", "master", "ps-0", "ps-1"}
        assert len(servers.ps_addresses) == 2
        assert servers.master_address is not None
        with JobStore(servers.etcd_endpoint, servers.job) as store:
            assert store.ps_desired() == 2
        servers.check()
        # The environment of every launcher's roles (child_env), allocator tuning included.
        environ = psutil.Process(pids["ps-0"]).environ()
        assert environ["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30)
        assert environ["ELASTICPS_ROLE"] == "ps"
    for pid in pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
