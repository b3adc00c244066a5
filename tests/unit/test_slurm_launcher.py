"""The Slurm launcher's pure parts (:mod:`elasticps.launcher.slurm`,
:mod:`elasticps.launcher.slurm_jobs`): the allocation's node list and slots, srun's argv,
the node watch, the sbatch script, the job records and states, and the options refused.
No Slurm runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from elasticps import cli
from elasticps.config import JobConfig
from elasticps.errors import ConfigError, ElasticPSError
from elasticps.launcher import slurm, slurm_jobs, ssh
from elasticps.launcher.hostfile import HostSpec
from elasticps.launcher.spawn import ProcessHandle

pytestmark = pytest.mark.timeout(30)


def test_cpus_per_node_expands_repeats() -> None:
    assert slurm.parse_cpus_per_node("4(x2),2", 3) == [4, 4, 2]
    assert slurm.parse_cpus_per_node("8", 1) == [8]
    assert slurm.parse_cpus_per_node("", 2) == [1, 1]
    with pytest.raises(ConfigError, match="counts 2 node"):
        slurm.parse_cpus_per_node("4(x2)", 3)
    with pytest.raises(ConfigError, match="is not N or N"):
        slurm.parse_cpus_per_node("4(y2)", 2)


def test_slurmd_port_and_node_addresses_from_scontrol() -> None:
    config = "Configuration data as of ...\nSlurmctldPort = 6817\nSlurmdPort              = 7001\n"
    assert slurm.parse_slurmd_port(config) == 7001
    assert slurm.parse_slurmd_port("SlurmctldPort = 6817\n") == slurm.DEFAULT_SLURMD_PORT
    with pytest.raises(ConfigError, match="no port"):
        slurm.parse_slurmd_port("SlurmdPort = x\n")
    nodes = slurm.parse_nodes(
        "NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.1 State=IDLE Reason=none\n"
        "NodeName=n2 NodeAddr=10.0.0.2 State=DOWN* Reason=Not responding [slurm@t]\n"
    )
    assert nodes["n1"]["NodeAddr"] == "10.0.0.1" and nodes["n2"]["State"] == "DOWN*"


def test_the_allocation_needs_slurms_variables() -> None:
    with pytest.raises(ConfigError, match="inside a Slurm allocation"):
        slurm.allocation({})


def test_the_allocation_reads_nodes_slots_and_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {
        ("show", "hostnames", "n[1-2]"): "n1\nn2\n",
        ("show", "config"): "SlurmdPort = 7001\n",
        ("show", "node", "-o", "n[1-2]"): "NodeName=n1 NodeAddr=10.0.0.1\nNodeName=n2\n",
    }
    monkeypatch.setattr(slurm, "_scontrol", lambda *args: answers[args])
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_CPUS_PER_NODE": "3(x2)"}  # fmt: skip
    alloc = slurm.allocation(env)
    assert alloc.nodes == ("n1", "n2") and alloc.slurmd_port == 7001
    assert alloc.addresses == {"n1": "10.0.0.1", "n2": "n2"}
    assert alloc.hosts() == (HostSpec("n1", None, 3), HostSpec("n2", None, 3))


def test_srun_runs_one_overlapping_task_on_the_node() -> None:
    transport = slurm.SlurmTransport("42", (("n1", "10.0.0.1"),))
    argv = transport.argv(HostSpec("n1"), "python -m elasticps.launcher.remote")
    assert argv[0] == "srun" and "--overlap" in argv and "--unbuffered" in argv
    assert argv[argv.index("-w") + 1] == "n1" and argv[argv.index("--jobid") + 1] == "42"
    assert argv[-3:] == ["/bin/sh", "-c", "python -m elasticps.launcher.remote"]
    bounded = transport.argv(HostSpec("n1"), "true", connect_timeout_s=3)
    assert bounded[:4] == ["timeout", "--kill-after=5", "3", "srun"]
    assert transport.lost(1) and not transport.lost(0) and transport.watch_s == 1.0
    with pytest.raises(ConfigError, match="not a Slurm job id"):
        slurm.SlurmTransport("x; rm", ())


def test_the_probe_is_a_tcp_connect_to_slurmd() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        transport = slurm.SlurmTransport("1", (("n1", "127.0.0.1"),), port)
        assert transport.probe(HostSpec("n1"))
    assert not transport.probe(HostSpec("n1"))  # closed now


class _NoLocal:
    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        raise AssertionError("nothing runs locally here")

    def pids(self) -> dict[str, int]:
        return {}


def test_the_watch_ends_a_lost_nodes_sessions_and_leaves_it_out() -> None:
    hosts = [HostSpec("n1", None, 2), HostSpec("n2", None, 2)]
    made = ssh.SshSpawner(hosts, slurm.SlurmTransport("1", ()), _NoLocal(), "10.0.0.254")
    made._probe = lambda name: name != "n2"  # type: ignore[method-assign]
    procs = {}
    for host in ("n1", "n2"):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                stdin=subprocess.PIPE)  # fmt: skip
        procs[host] = proc
        made._live[made._next_id] = ssh._Live("trainer", host, ssh.SshProcess(proc, host))
        made._next_id += 1
    try:
        assert made.watch_once() == ["n2"]
        assert procs["n2"].wait(timeout=10) != 0
        assert procs["n1"].poll() is None
        assert not made.host_up("n2") and made.host_up("n1")
        assert made._choose("trainer") == "n1"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def config(tmp_path: Path, **changes: object) -> JobConfig:
    base: dict[str, object] = {"job": "j", "model_path": tmp_path / "m.py", "data": tmp_path,
                               "output": tmp_path / "out", "launcher": "slurm"}  # fmt: skip
    base.update(changes)
    return JobConfig(**base)  # type: ignore[arg-type]


def test_options_slurm_cannot_take_are_refused_by_name(tmp_path: Path) -> None:
    config(tmp_path, remote_python="/opt/py", advertise_address="10.0.0.9")  # allowed
    with pytest.raises(ConfigError, match="--launcher slurm and --hosts"):
        config(tmp_path, hosts_file=tmp_path / "hosts.txt")
    with pytest.raises(ConfigError, match="--launcher slurm and --etcd-replicas 3"):
        config(tmp_path, etcd_replicas=3)
    with pytest.raises(ConfigError, match="--launcher slurm and --ssh-config"):
        config(tmp_path, ssh_config=tmp_path / "ssh_config")
    with pytest.raises(ConfigError, match="--launcher must be local or slurm"):
        config(tmp_path, launcher="mpi")


def test_train_refuses_slurm_with_hosts_in_one_line(tmp_path: Path) -> None:
    model = tmp_path / "m.py"
    model.write_text("class Model: ...\n")
    done = subprocess.run(
        [sys.executable, "-m", "elasticps", "train", "--launcher", "slurm", "--hosts",
         str(tmp_path / "h.txt"), "--model", str(model), "--data", str(tmp_path),
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("elasticps: error: --launcher slurm")


def test_kubernetes_submit_refuses_the_launcher_option() -> None:
    assert "--launcher" in cli.NOT_SUBMITTABLE


def request(tmp_path: Path, **changes: object) -> slurm_jobs.SubmitRequest:
    base: dict[str, object] = {
        "job": "mnist", "nodes": 3, "train_args": ("--model", "m.py", "--data", "d d"),
        "output": tmp_path / "out", "log": tmp_path / "mnist-%j.out", "workdir": tmp_path,
        "python": "/opt/py/bin/python",
    }  # fmt: skip
    base.update(changes)
    return slurm_jobs.SubmitRequest(**base)  # type: ignore[arg-type]


def test_the_sbatch_script_keeps_the_allocation_past_a_lost_node(tmp_path: Path) -> None:
    script = slurm_jobs.batch_script(request(tmp_path, time_limit="1:00:00",
                                             sbatch_options=("--exclusive",)))  # fmt: skip
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    for wanted in (
        "#SBATCH --nodes=3",
        "#SBATCH --no-kill",
        "#SBATCH --job-name=mnist",
        f"#SBATCH --output={tmp_path / 'mnist-%j.out'}",
        "#SBATCH --time=1:00:00",
    ):
        assert wanted in lines, script  # fmt: skip
    assert lines[-1] == (
        "exec /opt/py/bin/python -m elasticps train --launcher slurm --model m.py "
        "--data 'd d' --job mnist --no-progress"
    )
    with pytest.raises(ConfigError, match="one sbatch option"):
        request(tmp_path, sbatch_options=("--x\n#SBATCH --y",))
    with pytest.raises(ConfigError, match="--job"):
        request(tmp_path, job="a b")


def test_submit_dry_run_prints_the_script_and_checks_trains_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICPS_STATE_DIR", str(tmp_path / "state"))
    model = tmp_path / "m.py"
    model.write_text("class Model: ...\n")
    train = ["--model", str(model), "--data", str(tmp_path), "--output", str(tmp_path / "o")]
    argv = ["submit", "--backend", "slurm", "--nodes", "2", "--job", "j1", "--dry-run", *train]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in out and "--launcher slurm" in out
    assert not (tmp_path / "state" / "slurm").exists()  # nothing recorded
    assert cli.main([*argv, "--etcd-replicas", "3"]) == 2
    assert "--etcd-replicas 3" in capsys.readouterr().err
    assert cli.main([*argv, "--launcher", "local"]) == 2
    assert "--launcher is set by submit" in capsys.readouterr().err


def test_sbatch_ids_and_states() -> None:
    assert slurm_jobs.parse_sbatch_id("123\n") == "123"
    assert slurm_jobs.parse_sbatch_id("123;cluster\n") == "123"
    with pytest.raises(ElasticPSError):
        slurm_jobs.parse_sbatch_id("sbatch: error: nope")
    state = slurm_jobs.combined_state
    assert state("PENDING", "") == "pending"
    assert state("RUNNING", "") == "starting"
    assert state("RUNNING", "running") == "running"
    assert state("RUNNING", "finished") == "stopping"  # the launcher's last lines
    assert state("COMPLETED", "finished") == "finished"
    assert state("", "stopped") == "stopped"  # Slurm forgot it; run.json did not
    assert state("CANCELLED", "running") == "cancelled"
    assert state("NODE_FAIL", "") == "failed"


def test_records_round_trip_and_name_unknown_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICPS_STATE_DIR", str(tmp_path))
    record = slurm_jobs.SlurmJob("j1", "7", "/o", "/o/j1-%j.out", 2, "2026-01-01T00:00:00+00:00")
    slurm_jobs._write_record(record)
    assert slurm_jobs.read_record("j1") == record
    assert json.loads((tmp_path / "slurm" / "j1.json").read_text())["slurm_job_id"] == "7"
    with pytest.raises(ConfigError, match="no Slurm job 'j2'"):
        slurm_jobs.read_record("j2")
    with pytest.raises(ConfigError, match="not a job name"):
        slurm_jobs.read_record("../x")
    (tmp_path / "slurm" / "bad.json").write_text("{")
    assert slurm_jobs._records() == [record]
