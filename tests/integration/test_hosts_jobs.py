"""Jobs across hosts over ssh (``elasticps train --hosts``), on network-namespace hosts.

Three hosts (:class:`~elasticps.testing.hosts.NamespaceHosts`), each with its
own address, hostname and sshd; etcd and the master run on this machine and
are reached at its address on the hosts' bridge. Checked:

- the main job's CNN trains across the hosts to the accuracy of the same job
  on one machine, with its PS and trainers on different hosts, over TCP;
- the audit model (one counter per record), in sync and async, survives a
  host's death (every process of it SIGKILLed and its link set down) and a
  link cut for longer than the lease: exit 0, every counter exact, and the
  PS cut off is fenced (it loses its lease and exits) when its link is back;
- with ``--etcd-replicas 3``, the death of the host that runs the etcd leader
  costs no update either (the other two members keep a quorum);
- the preflight names a path a host cannot read, before anything starts.

Skipped where network namespaces cannot be made (no root or CAP_NET_ADMIN, or
no sshd).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.coord.client import connect
from elasticps.security import output_etcd_tls
from elasticps.testing import kill_leftovers, wait_for, wait_for_shard_checkpoint
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.testing.hosts import NamespaceHosts, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

WHY_NOT = unavailable()
if WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=WHY_NOT))

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 4000
# Passes of the audit jobs that lose a host: the loss comes once a shard has
# checkpointed (a few passes in), and recovery takes a few seconds, so the job
# goes on for well over half its passes afterwards. A job that ended before
# the loss fails the test (no restart), it does not pass it.
EPOCHS = 30
JOB_TIMEOUT_S = 300.0
_STARTED = re.compile(r"started (ps|trainer) on (h\d+) \(ssh pid (\d+)\)")


@pytest.fixture(scope="module")
def hosts() -> Iterator[NamespaceHosts]:
    with NamespaceHosts(3) as made:
        yield made


@pytest.fixture()
def host_file(hosts: NamespaceHosts, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "hosts.txt"
    path.write_text("# three test hosts\n" + "".join(f"{name} slots=3\n" for name in hosts.hosts))
    yield path
    for name in hosts.hosts:  # every host up again for the next test
        hosts.restore_link(name)
        hosts.revive(name)


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit")
    write_dataset(out, RECORDS)
    return out


def train(args: list[str], out: Path, timeout_s: float = JOB_TIMEOUT_S) -> tuple[int, str, str]:
    """Run ``elasticps train ARGS``; return its status, stdout and stderr."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "elasticps", "train", *args, "--no-progress"],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
    finally:
        kill_leftovers(out / "pids.json")
    return proc.returncode, proc.stdout, proc.stderr


def over_ssh(hosts: NamespaceHosts, host_file: Path) -> list[str]:
    return ["--hosts", str(host_file), "--ssh-config", str(hosts.ssh_config)]


def placements(out: Path) -> list[tuple[str, str]]:
    """``(role kind, host)`` of every role the launcher started on a host, in order."""
    log = (out / "logs" / "launcher.log").read_text()
    return [(m.group(1), m.group(2)) for m in _STARTED.finditer(log)]


def test_the_cnn_job_trains_across_hosts_as_on_one_machine(
    hosts: NamespaceHosts, host_file: Path, tmp_path: Path
) -> None:
    data = tmp_path / "mnist"
    subprocess.run([sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(data)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    job = ["--model", str(ROOT / "examples" / "mnist_cnn.py"), "--data", str(data),
           "--trainers", "2", "--ps", "2", "--mode", "sync", "--epochs", "3"]  # fmt: skip
    rc, one_out, err = train([*job, "--output", str(tmp_path / "one")], tmp_path / "one")
    assert rc == 0, err[-3000:]
    out = tmp_path / "hosts"
    rc, many_out, err = train([*job, "--output", str(out), *over_ssh(hosts, host_file)], out)
    assert rc == 0, err[-3000:]
    one, many = json.loads(one_out.splitlines()[-1]), json.loads(many_out.splitlines()[-1])
    assert many["exactly_once"] is True
    assert many["samples_trained"] == one["samples_trained"]
    assert many["accuracy"] >= one["accuracy"] - 0.02, (one, many)

    placed = placements(out)
    ps_hosts = {h for kind, h in placed if kind == "ps"}
    trainer_hosts = {h for kind, h in placed if kind == "trainer"}
    assert len(ps_hosts) == 2, placed  # one PS a host
    assert trainer_hosts - ps_hosts, placed  # a trainer on a host with no PS
    # The PS listen on their hosts' addresses; that trainer reaches both over TCP.
    addresses = {hosts.hosts[h].address for h in ps_hosts}
    serving = re.findall(r"serving on ([\d.]+):\d+", (out / "logs" / "ps-0.log").read_text())
    serving += re.findall(r"serving on ([\d.]+):\d+", (out / "logs" / "ps-1.log").read_text())
    assert set(serving) == addresses, serving
    trainer_logs = "".join(p.read_text() for p in (out / "logs").glob("trainer-*.log"))
    assert len(re.findall(r"parameter server \d: TCP to", trainer_logs)) >= 2
    # etcd and the master ran here, at this machine's address on the bridge.
    assert json.loads((out / "run.json").read_text())["etcd"].startswith(hosts.gateway)


def start_job(args: list[str], out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elasticps", "train", *args, "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def first_ps_host(out: Path) -> str:
    """The host of the first PS, once the job has checkpointed a shard."""
    wait_for_shard_checkpoint(out)
    return next(h for kind, h in placements(out) if kind == "ps")


def finish(proc: subprocess.Popen[str], out: Path) -> tuple[str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(out / "pids.json")
    assert proc.returncode == 0, stderr[-4000:]
    return stdout, stderr


def assert_exact(out: Path, stdout: str, epochs: int) -> None:
    line = json.loads(stdout.strip().splitlines()[-1])
    assert line["exactly_once"] is True, line
    assert line["samples_trained"] == RECORDS * epochs, line
    audit = check_run(out)
    assert audit.exactly_once, audit.as_dict()
    assert audit.exact == RECORDS


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_dead_host_costs_no_update(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path, mode: str
) -> None:
    epochs = EPOCHS
    out = tmp_path / "run"
    proc = start_job([*train_args(audit_dir, out, mode, epochs), *over_ssh(hosts, host_file)], out)
    victim = first_ps_host(out)
    hosts.cut_link(victim)  # the machine dies: off the network, every process killed
    killed = hosts.kill_host(victim)
    assert killed
    stdout, stderr = finish(proc, out)
    assert_exact(out, stdout, epochs)
    later = placements(out)[5:]  # after the first two PS and three trainers
    assert ("ps", victim) not in later and any(kind == "ps" for kind, _ in later), later
    assert "restarting it" in stderr


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_host_cut_off_past_its_lease_is_fenced_when_it_returns(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path, mode: str
) -> None:
    epochs = EPOCHS
    out = tmp_path / "run"
    proc = start_job([*train_args(audit_dir, out, mode, epochs), *over_ssh(hosts, host_file)], out)
    victim = first_ps_host(out)
    hosts.cut_link(victim)
    # Its PS is re-placed on another host: the lease (2 s) expired long before.
    wait_for(
        lambda: (
            ("ps", victim) not in placements(out)[5:]
            and any(kind == "ps" for kind, _ in placements(out)[5:])
        ),
        "the cut-off PS re-placed on another host",
        timeout_s=60,
        interval_s=0.2,
    )
    hosts.restore_link(victim)
    stdout, _ = finish(proc, out)
    assert_exact(out, stdout, epochs)
    # Fenced: once its successor served, the PS that came back wrote no checkpoint.
    old, successor = served(out, hosts.hosts[victim].address)
    for path in (out / "ps-checkpoints").glob(f"ps-*/shard-e{old:012d}-*"):
        assert path.stat().st_mtime < successor, path
    wait_for(
        lambda: not [pid for pid in hosts.pids(victim) if _is_role(pid)],
        "no role process left on the host that came back",
        timeout_s=40,
        interval_s=0.2,
    )


_SERVING = re.compile(
    r"^(\S+ \S+) INFO ps \S+: parameter server (\d+) \(epoch (\d+)\) serving on ([\d.]+):",
    re.MULTILINE,
)


def served(out: Path, address: str) -> tuple[int, float]:
    """The epoch of the PS that served at ``address``, and when (unix time, s) the PS
    that took its shard over started to serve."""
    lines = []
    for log in (out / "logs").glob("ps-*.log"):
        lines += _SERVING.findall(log.read_text())
    lines.sort()
    stamp, shard, epoch, _ = next(line for line in lines if line[3] == address)
    later = [line for line in lines if line[1] == shard and line[3] != address and line[0] > stamp]
    assert later, lines
    when = datetime.datetime.strptime(later[0][0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return int(epoch), when


def _cmdline(pid: int) -> list[bytes]:
    """The arguments of process ``pid`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _is_role(pid: int) -> bool:
    cmdline = _cmdline(pid)
    return b"elasticps" in cmdline or b"elasticps.launcher.remote" in cmdline


def _leader_host(endpoints: str, hosts: NamespaceHosts, out: Path) -> str | None:
    """The test host whose etcd member leads, or None while there is no leader (asked with
    the root certificate of the job whose output is ``out``)."""
    try:
        client = connect(endpoints, timeout_s=3.0, tls=output_etcd_tls(out))
    except Exception:
        return None
    try:
        leader = client.status().leader
        url = leader.client_urls[0] if leader is not None else ""
    except Exception:
        return None
    finally:
        client.close()
    return next((n for n, h in hosts.hosts.items() if f"//{h.address}:" in url), None)


def test_losing_the_etcd_leader_host_costs_no_update(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path
) -> None:
    """``--etcd-replicas 3``: the host of the etcd leader dies; the other two members keep a
    quorum and every client of the job fails over to them. In sync mode, whose barriers
    wait on etcd's failover; the mode changes nothing in how clients fail over."""
    mode = "sync"
    epochs = EPOCHS + 10  # a leader is found after the first checkpoint
    out = tmp_path / "run"
    args = [*train_args(audit_dir, out, mode, epochs), *over_ssh(hosts, host_file)]
    proc = start_job([*args, "--etcd-replicas", "3"], out)
    try:
        wait_for_shard_checkpoint(out)
        endpoints = json.loads((out / "run.json").read_text())["etcd"]
        assert endpoints.count(",") == 2, endpoints  # three members
        found: list[str] = []
        wait_for(
            lambda: bool(found.append(_leader_host(endpoints, hosts, out) or "") or found[-1]),
            "an etcd leader",
            timeout_s=30,
        )
        victim = found[-1]
        hosts.cut_link(victim)
        assert hosts.kill_host(victim)
    except BaseException:
        proc.kill()
        proc.communicate()
        kill_leftovers(out / "pids.json")
        raise
    stdout, _ = finish(proc, out)
    assert_exact(out, stdout, epochs)
    security = json.loads((out / "run.json").read_text())["security"]
    assert security["etcd"] == "tls, one user per role" and not security["warnings"], security
    # The members were stopped, and their data removed, on the hosts left.
    for name in hosts.hosts:
        if name != victim:
            wait_for(
                lambda name=name: (
                    not any(b"etcd" in b" ".join(_cmdline(pid)) for pid in hosts.pids(name))
                ),
                f"no etcd member left on {name}",
                timeout_s=30,
            )


def test_the_preflight_names_what_a_host_cannot_read(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = [*train_args(audit_dir, out, "sync", 1), *over_ssh(hosts, host_file)]
    args += ["--remote-python", "/nonexistent/python"]
    rc, _, err = train(args, out, timeout_s=120)
    assert rc == 2, err[-2000:]
    assert "the hosts cannot run this job" in err and "h0:" in err, err[-2000:]
    assert "--remote-python" in err
    assert not (out / "pids.json").exists() or not json.loads((out / "pids.json").read_text())


def test_a_host_file_naming_an_unknown_host_is_refused_before_anything_starts(
    hosts: NamespaceHosts, tmp_path: Path, audit_dir: Path
) -> None:
    bad = tmp_path / "hosts.txt"
    bad.write_text("nosuchhost.invalid slots=2\n")
    out = tmp_path / "run"
    args = [*train_args(audit_dir, out, "sync", 1), "--hosts", str(bad),
            "--ssh-config", str(hosts.ssh_config)]  # fmt: skip
    rc, _, err = train(args, out, timeout_s=60)
    assert rc == 2, err[-2000:]
    assert "nosuchhost.invalid" in err.splitlines()[-1]
    assert os.path.exists(bad)


# --- the Python API: elasticps.train(..., cluster=Hosts(...)) -----------------------

MLP = ROOT / "examples" / "mnist_mlp.py"


def test_the_python_api_trains_the_mlp_across_hosts(
    hosts: NamespaceHosts, host_file: Path, tmp_path: Path
) -> None:
    import elasticps
    from elasticps import events, updater
    from elasticps.data.mnist import prepare_mnist
    from elasticps.model_file import load_model_file

    data = tmp_path / "mnist"
    prepare_mnist(data, seed=0)
    out = tmp_path / "run"
    cluster = elasticps.Hosts(host_file, ssh_config=hosts.ssh_config, output=out, trainers=2, ps=2)
    seen: list[events.TrainingEvent] = []
    try:
        params = elasticps.train(
            MLP, None, elasticps.Parquet.from_model_file(data, MLP, batch_size=64),
            updater=updater.Adam(lr=1e-3), num_passes=2, event_handler=seen.append,
            cluster=cluster,
        )  # fmt: skip
    finally:
        kill_leftovers(out / "pids.json")
    # The launcher's own placement: one PS a host, the trainers in the slots left.
    placed = placements(out)
    assert len({h for kind, h in placed if kind == "ps"}) == 2, placed
    assert {kind for kind, _ in placed} == {"ps", "trainer"}, placed
    kinds = [type(e).__name__ for e in seen]
    # The trainers' comings and goings, and the pass ends, come from the job's etcd.
    joined = {e.trainer_id for e in seen if isinstance(e, events.TrainerJoined)}
    assert len(joined) >= 2 and -1 not in joined, kinds
    job = [k for k in kinds if k not in ("TrainerJoined", "TrainerLost")]
    assert job == ["BeginTraining", "EndPass", "EndPass", "Checkpointed", "EndTraining"], kinds
    passes = [e for e in seen if isinstance(e, events.EndPass)]
    assert [e.pass_id for e in passes] == [0, 1]
    end = seen[-1]
    assert end.metrics["samples"] == 2 * passes[0].metrics["samples"] > 0
    assert end.model_version > 0
    # The set returned is the model's, with the trained values: evaluated here
    # it scores what the launcher scored at the end of the job.
    spec = load_model_file(MLP)
    model = spec.build()
    assert set(params) == set(model.state_dict())
    test = elasticps.Parquet.from_model_file(data / "test.parquet", MLP, batch_size=500)
    here = elasticps.evaluate_model(model, params, test, spec.loss)
    assert here["accuracy"] == pytest.approx(end.metrics["test_accuracy"], abs=1e-6)
    assert here["accuracy"] > 0.8, here


def test_the_python_api_raises_what_the_hosts_preflight_names(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path
) -> None:
    import elasticps
    from elasticps.errors import JobUserError

    out = tmp_path / "run"
    model = audit_dir / "audit_model.py"
    cluster = elasticps.Hosts(host_file, ssh_config=hosts.ssh_config, output=out,
                              remote_python="/nonexistent/python")  # fmt: skip
    try:
        with pytest.raises(JobUserError) as info:
            elasticps.train(model, None, audit_dir, cluster=cluster)
    finally:
        kill_leftovers(out / "pids.json")
    assert "the hosts cannot run this job" in str(info.value)
    assert "h0:" in str(info.value) and "--remote-python" in str(info.value)


def test_ctrl_c_in_the_caller_stops_every_role_of_an_api_job(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path
) -> None:
    import signal
    import threading

    import elasticps
    from elasticps import updater

    out = tmp_path / "run"
    model = audit_dir / "audit_model.py"
    cluster = elasticps.Hosts(host_file, ssh_config=hosts.ssh_config, output=out, trainers=3,
                              ps=2, lease_ttl_s=2, checkpoint_every_s=1)  # fmt: skip
    main = threading.main_thread().ident
    assert main is not None

    def press_ctrl_c() -> None:
        wait_for_shard_checkpoint(out)  # the job is training
        signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            elasticps.train(model, None, audit_dir, updater=updater.SGD(lr=1.0),
                            num_passes=100_000, cluster=cluster)  # fmt: skip
        presser.join(timeout=10)
        launched = [int(p) for p in json.loads((out / "pids.json").read_text()).values() if p]
        assert launched
        # The launcher stopped every process it started here (etcd, the master,
        # the ssh sessions), and with them the roles on the hosts.
        wait_for(
            lambda: not any(_is_role(pid) for name in hosts.hosts for pid in hosts.pids(name)),
            "the roles on the hosts to stop",
            timeout_s=30.0,
        )
        assert not [pid for pid in launched if _cmdline(pid) not in ([], [b""])]
        assert json.loads((out / "run.json").read_text())["state"] == "interrupted"
    finally:
        kill_leftovers(out / "pids.json")


def test_an_event_handler_that_raises_stops_an_api_job_cleanly(
    hosts: NamespaceHosts, host_file: Path, audit_dir: Path, tmp_path: Path
) -> None:
    import elasticps
    from elasticps import events, updater

    out = tmp_path / "run"
    model = audit_dir / "audit_model.py"
    cluster = elasticps.Hosts(host_file, ssh_config=hosts.ssh_config, output=out, trainers=3,
                              ps=2, lease_ttl_s=2, checkpoint_every_s=1)  # fmt: skip

    class EnoughError(Exception):
        pass

    def handler(event: events.TrainingEvent) -> None:
        if isinstance(event, events.EndPass):
            raise EnoughError(f"pass {event.pass_id} is enough")

    try:
        with pytest.raises(EnoughError, match="pass 0 is enough"):
            elasticps.train(model, None, audit_dir, updater=updater.SGD(lr=1.0),
                            num_passes=100_000, event_handler=handler, cluster=cluster)  # fmt: skip
    finally:
        kill_leftovers(out / "pids.json")
    # The first pass's end arrived while the job ran: it stopped as `elasticps
    # stop` stops a job, with its final checkpoint, long before its last pass.
    record = json.loads((out / "run.json").read_text())
    assert record["state"] == "stopped", record.get("state")
    assert (out / "model.safetensors").exists()
    assert record["progress"]["pass"] < 100_000
