"""Parameter servers surviving crashes: shard checkpoints, restarts, consistent
checkpoints and resuming onto another number of servers.

Every parameter server is a real ``python -m elasticps ps`` process against a
real etcd (``tests/conftest.py``); crashes are SIGKILLs and every process is
stopped by PID at teardown. The test talks to the servers as trainers do,
through :class:`~elasticps.trainer.client.ParameterClient`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyetcd
import pytest
import torch
from torch import nn

from elasticps.coord.etcd_server import EtcdServer
from elasticps.coord.store import JobStore, PSSlot
from elasticps.errors import RemoteError
from elasticps.launcher.supervisor import EXIT_TEMPFAIL
from elasticps.netutil import free_port
from elasticps.pserver.checkpoint import ShardFiles
from elasticps.snapshot import ControlClient, load_consistent_checkpoint, take_consistent_checkpoint
from elasticps.testing import wait_for
from elasticps.trainer.client import ParameterClient
from elasticps.trainer.flat import FlatModel, bind_flat_buffers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LEASE_TTL_S = 2
# Every wait for a process, a file or etcd ends after this many seconds.
DEADLINE_S = 30.0
# TinyModel's "embed.weight" (12 elements) is sliced over every server; the rest go whole.
BIG_ARRAY_BOUND = 8
ADAM = ("--optimizer", "adam", "--lr", "0.05")


class TinyModel(nn.Module):
    """4 -> 3 -> 2: 12 + 3 + 6 + 2 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)


@dataclass
class PSProcess:
    """One ``elasticps ps`` process and its log."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"ps pid {self.proc.pid} did not exit; log:\n{self.log()[-3000:]}")


class Processes:
    """Starts parameter servers for one etcd and stops every one of them by PID."""

    def __init__(self, etcd: EtcdServer, log_dir: Path) -> None:
        self._etcd = etcd
        self._log_dir = log_dir
        self._started: list[PSProcess] = []

    def start_ps(self, job: str, *args: str | Path) -> PSProcess:
        log_path = self._log_dir / f"ps-{len(self._started)}.log"
        command = [sys.executable, "-m", "elasticps", "ps", "--job", job]
        command += ["--etcd", self._etcd.endpoint, "--lease-ttl-s", str(LEASE_TTL_S)]
        command += [str(a) for a in args]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        ps = PSProcess(proc, log_path)
        self._started.append(ps)
        return ps

    def stop_all(self) -> None:
        for ps in self._started:
            if ps.proc.poll() is None:
                ps.proc.send_signal(signal.SIGTERM)
        for ps in self._started:
            try:
                ps.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                ps.proc.kill()
                ps.proc.wait()


@pytest.fixture
def processes(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(etcd_server, tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


class Clients:
    """Trainer-side views (a TinyModel bound to flat buffers, and a client); closed at teardown."""

    def __init__(self) -> None:
        self._clients: list[ParameterClient] = []

    def connect(
        self, addresses: Sequence[PSSlot], trainer_id: int, values: float | None = None
    ) -> tuple[FlatModel, ParameterClient]:
        torch.manual_seed(0)
        flat = bind_flat_buffers(TinyModel(), len(addresses), BIG_ARRAY_BOUND)
        if values is not None:
            flat.params.fill_(values)
        client = ParameterClient(
            flat.placement, addresses, flat.params, flat.grads, trainer_id, timeout_s=DEADLINE_S
        )
        self._clients.append(client)
        return flat, client

    def close(self) -> None:
        for client in self._clients:
            client.close()


@pytest.fixture
def clients() -> Iterator[Clients]:
    c = Clients()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[JobStore]:
    """The etcd view of a job unique to this test.

    Not conftest's ``job_name``: a name built from a long test name exceeds
    the 63 characters a job name may have on the command line.
    """
    with JobStore(etcd_server.endpoint, f"recovery-{uuid.uuid4().hex[:12]}") as s:
        yield s


def by_name(flat: FlatModel) -> dict[str, torch.Tensor]:
    """The flat parameter buffer cut into parameters, by name (copies)."""
    out = {}
    for spec in flat.placement.params:
        offset = flat.placement.flat_offsets[spec.name]
        out[spec.name] = flat.params[offset : offset + spec.numel].clone()
    return out


def gradient(flat: FlatModel, seed: int) -> torch.Tensor:
    return torch.randn(flat.placement.total_numel, generator=torch.Generator().manual_seed(seed))


def gradient_by_name(seed: int) -> dict[str, torch.Tensor]:
    """Gradient ``seed`` of the 1-server layout, by name (equal for every layout)."""
    torch.manual_seed(0)
    flat = bind_flat_buffers(TinyModel(), 1, BIG_ARRAY_BOUND)
    flat.grads.copy_(gradient(flat, seed))
    return {
        spec.name: flat.grads[
            flat.placement.flat_offsets[spec.name] : flat.placement.flat_offsets[spec.name]
            + spec.numel
        ].clone()
        for spec in flat.placement.params
    }


def set_gradient(flat: FlatModel, grads: dict[str, torch.Tensor]) -> None:
    for spec in flat.placement.params:
        offset = flat.placement.flat_offsets[spec.name]
        flat.grads[offset : offset + spec.numel] = grads[spec.name]


# --- restart from the server's own checkpoint ------------------------------------------------


def test_restarted_ps_reclaims_its_index_and_serves_its_checkpointed_values_and_version(
    processes: Processes, clients: Clients, store: JobStore, tmp_path: Path
) -> None:
    store.set_ps_desired(1)
    ckpt = tmp_path / "ckpt"
    args = ["--mode", "async", *ADAM, "--checkpoint-dir", ckpt, "--checkpoint-every-s", "60"]
    args += ["--checkpoint-every-versions", "1", "--claim-timeout-s", str(DEADLINE_S)]
    first = processes.start_ps(store.keys.job, *args, "--ps-port", free_port())
    (slot,) = store.wait_ps_slots(DEADLINE_S)
    flat, client = clients.connect([slot], trainer_id=1)
    client.hello(initialize=True)
    for seed in range(3):
        flat.grads.copy_(gradient(flat, seed))
        client.push(1, want_params=True)
    expected = flat.params.clone()
    assert client.versions == [3]
    files = ShardFiles(ckpt, 0, slot.epoch)
    wait_for(lambda: 3 in files.durable_versions(), "the checkpoint of version 3", DEADLINE_S)

    first.proc.send_signal(signal.SIGKILL)  # a crash: its lease is not revoked
    assert first.wait_exit() == -signal.SIGKILL
    # The only slot stays taken until the dead server's lease expires: the new
    # server must wait for it rather than fail.
    second = processes.start_ps(store.keys.job, *args, "--ps-port", free_port())
    wait_for(
        lambda: store.slot_epoch(0) not in (None, slot.epoch), "a new claim of slot 0", DEADLINE_S
    )
    (new_slot,) = store.wait_ps_slots(DEADLINE_S)

    fresh, fresh_client = clients.connect([new_slot], trainer_id=2, values=7.0)
    fresh_client.hello(initialize=True)  # a server that asked for values would get 7s

    assert torch.equal(fresh.params, expected)
    assert fresh_client.versions == [3]
    assert "restored 23 parameters at version 3" in second.log()
    assert second.proc.poll() is None


def test_ps_whose_lease_is_revoked_exits_non_zero(
    processes: Processes, store: JobStore, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    store.set_ps_desired(1)
    ps = processes.start_ps(store.keys.job, "--checkpoint-dir", tmp_path / "ckpt")
    store.ps_addresses(timeout_s=DEADLINE_S)
    etcd = pyetcd.client(host=etcd_server.host, port=etcd_server.port, timeout=5)
    try:
        _, meta = etcd.get(store.keys.ps(0))
        etcd.revoke_lease(meta.lease_id)
    finally:
        etcd.close()

    # 75 (EX_TEMPFAIL): it lost etcd's word, not a bug; its launcher restarts it.
    assert ps.wait_exit() == EXIT_TEMPFAIL
    assert "lease lost" in ps.log()


# --- consistent checkpoints ----------------------------------------------------------------


def test_consistent_checkpoint_during_async_pushes_holds_what_a_client_pulls_while_frozen(
    processes: Processes, clients: Clients, store: JobStore, tmp_path: Path
) -> None:
    store.set_ps_desired(2)
    for _ in range(2):
        processes.start_ps(store.keys.job, "--mode", "async", *ADAM)
    slots = store.wait_ps_slots(DEADLINE_S)
    addresses = [s.address for s in slots]
    flat, pusher = clients.connect(slots, trainer_id=1)
    pusher.hello(initialize=True)
    stop = threading.Event()
    pushed = [0]

    def push_forever() -> None:
        seed = 0
        while not stop.is_set():
            flat.grads.copy_(gradient(flat, seed))
            pusher.push(1, want_params=False)
            pushed[0] += 1
            seed += 1

    thread = threading.Thread(target=push_forever, daemon=True)
    thread.start()
    holds = [ControlClient(a, timeout_s=DEADLINE_S) for a in addresses]
    try:
        wait_for(lambda: pushed[0] >= 5, "a few async pushes", DEADLINE_S)
        # Hold every server still, look at it as a client, then checkpoint it. The
        # checkpoint's own freeze and thaw leave our freeze in place.
        frozen_at = [hold.request({"op": "freeze"})["version"] for hold in holds]
        observer, observer_client = clients.connect(slots, trainer_id=9, values=7.0)
        observer_client.hello(initialize=False)
        manifest = take_consistent_checkpoint(
            addresses, tmp_path / "snap", ledger_revision=11, extra={"job": store.keys.job}
        )
        assert observer_client.stats()[0]["stats"]["frozen"] is True  # type: ignore[index]
        after_checkpoint = pushed[0]
        for hold in holds:
            hold.request({"op": "thaw"})
        wait_for(
            lambda: pushed[0] >= after_checkpoint + 3, "pushes to go on after the thaw", DEADLINE_S
        )
    finally:
        for hold in holds:
            hold.close()  # thaws, if the test failed while frozen
        stop.set()
        thread.join(timeout=DEADLINE_S)
    assert not thread.is_alive()

    assert manifest["versions"] == frozen_at == observer_client.versions
    for entry in manifest["shards"]:  # type: ignore[attr-defined]
        data = (tmp_path / "snap" / entry["file"]).read_bytes()
        assert (zlib.crc32(data), len(data)) == (entry["crc32"], entry["bytes"])
    values, optimizer_state, meta = load_consistent_checkpoint(tmp_path / "snap")
    expected = by_name(observer)
    assert sorted(values) == sorted(expected)
    for name in expected:
        assert torch.equal(values[name], expected[name]), name
    assert sorted(optimizer_state["embed.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert (meta["ledger_revision"], meta["extra"]) == (11, {"job": store.keys.job})


@dataclass(frozen=True)
class SourceCheckpoint:
    """A consistent checkpoint of a 2-server sync job, and what a client saw."""

    path: Path
    values: dict[str, torch.Tensor]
    after_next_step: dict[str, torch.Tensor]
    version: int


NEXT_STEP_SEED = 100


@pytest.fixture(scope="module")
def two_ps_checkpoint(
    etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SourceCheckpoint]:
    """Train a 2-server sync job (Adam) 3 steps, checkpoint it, then take one more step."""
    base = tmp_path_factory.mktemp("source")
    procs = Processes(etcd_server, base)
    c = Clients()
    try:
        with JobStore(etcd_server.endpoint, "resume-source") as store:
            store.set_ps_desired(2)
            for _ in range(2):
                procs.start_ps("resume-source", "--mode", "sync", *ADAM)
            slots = store.wait_ps_slots(DEADLINE_S)
            addresses = [s.address for s in slots]
        flat, client = c.connect(slots, trainer_id=1)
        client.hello(initialize=True)
        for seed in range(3):
            flat.grads.copy_(gradient(flat, seed))
            client.push(1, want_params=True)
        manifest = take_consistent_checkpoint(
            addresses, base / "snap", ledger_revision=None, extra={}
        )
        values = by_name(flat)
        set_gradient(flat, gradient_by_name(NEXT_STEP_SEED))
        client.push(1, want_params=True)
        version = manifest["version"]
        assert isinstance(version, int)
        yield SourceCheckpoint(base / "snap", values, by_name(flat), version)
    finally:
        c.close()
        procs.stop_all()


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_resume_from_a_two_server_checkpoint_serves_the_same_parameters_on_any_server_count(
    processes: Processes,
    clients: Clients,
    store: JobStore,
    two_ps_checkpoint: SourceCheckpoint,
    num_servers: int,
) -> None:
    source = two_ps_checkpoint
    assert source.version == 3
    store.set_ps_desired(num_servers)
    for _ in range(num_servers):
        processes.start_ps(store.keys.job, "--mode", "sync", *ADAM, "--resume", source.path)
    slots = store.wait_ps_slots(DEADLINE_S)
    [s.address for s in slots]
    flat, client = clients.connect(slots, trainer_id=1, values=7.0)

    client.hello(initialize=True)  # a server that asked for values would get 7s

    assert client.versions == [source.version] * num_servers
    resumed = by_name(flat)
    assert sorted(resumed) == sorted(source.values)
    for name, tensor in source.values.items():
        assert torch.equal(resumed[name], tensor), name
    # The optimizer state came along: the next step is the one the source job took.
    set_gradient(flat, gradient_by_name(NEXT_STEP_SEED))
    client.push(1, want_params=True)
    stepped = by_name(flat)
    for name, tensor in source.after_next_step.items():
        torch.testing.assert_close(stepped[name], tensor, rtol=0, atol=0)


def test_control_ops_are_validated_and_a_closed_connection_releases_its_freeze(
    processes: Processes, clients: Clients, store: JobStore, tmp_path: Path
) -> None:
    store.set_ps_desired(1)
    processes.start_ps(store.keys.job, "--mode", "async")
    (slot,) = store.wait_ps_slots(DEADLINE_S)
    address = slot.address
    _, client = clients.connect([slot], trainer_id=1)
    client.hello(initialize=True)
    control = ControlClient(address, timeout_s=DEADLINE_S)
    try:
        refused = {
            "not_frozen": {"op": "snapshot", "dir": str(tmp_path)},
            "bad_control": {"op": "snapshot"},
        }
        for code, body in [*refused.items(), ("bad_control", {"op": "melt"})]:
            with pytest.raises(RemoteError) as info:
                control.request(body)
            assert info.value.code == code, body
        assert control.request({"op": "freeze"})["version"] == 0
        with pytest.raises(RemoteError) as info:
            control.request({"op": "snapshot", "dir": "relative/dir"})
        assert info.value.code == "bad_control"
        answer = control.request({"op": "snapshot", "dir": str(tmp_path)})
        assert answer["file"] == "shard-0.safetensors"
        assert (tmp_path / "shard-0.safetensors").stat().st_size == answer["bytes"]
    finally:
        control.close()  # closing the connection releases its freeze
    client.push(1, want_params=True)  # would wait forever if the shard stayed frozen
    assert client.versions == [1]


def test_freeze_at_a_later_version_lets_pushes_through_until_it(
    processes: Processes, clients: Clients, store: JobStore
) -> None:
    store.set_ps_desired(1)
    processes.start_ps(store.keys.job, "--mode", "async")
    (slot,) = store.wait_ps_slots(DEADLINE_S)
    address = slot.address
    flat, pusher = clients.connect([slot], trainer_id=1)
    pusher.hello(initialize=True)
    _, observer = clients.connect([slot], trainer_id=9)
    observer.hello(initialize=False)
    hold = ControlClient(address, timeout_s=DEADLINE_S)
    other = ControlClient(address, timeout_s=DEADLINE_S)
    pushed = [0]

    def push_five() -> None:
        for seed in range(5):
            flat.grads.copy_(gradient(flat, seed))
            pusher.push(1, want_params=False)
            pushed[0] += 1

    thread = threading.Thread(target=push_five, daemon=True)
    try:
        assert hold.request({"op": "freeze"})["version"] == 0
        thread.start()
        time.sleep(0.2)
        assert pushed[0] == 0  # the first push waits

        answer = hold.request({"op": "freeze", "version": 2, "timeout_s": DEADLINE_S})

        assert answer["version"] == 2
        stats = observer.stats()[0]["stats"]
        assert (stats["version"], stats["frozen"]) == (2, True)  # type: ignore[index]
        # A second client may share the freeze, but not move it.
        assert other.request({"op": "freeze"})["version"] == 2
        with pytest.raises(RemoteError) as info:
            other.request({"op": "freeze", "version": 3})
        assert info.value.code == "busy"
        other.request({"op": "thaw"})
        assert observer.stats()[0]["stats"]["frozen"] is True  # type: ignore[index]

        hold.request({"op": "thaw"})
        thread.join(timeout=DEADLINE_S)
        assert pushed[0] == 5
        assert observer.stats()[0]["stats"]["version"] == 5  # type: ignore[index]
    finally:
        hold.close()
        other.close()
        thread.join(timeout=DEADLINE_S)
