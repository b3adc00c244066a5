"""The ssh launcher's pure parts (:mod:`elasticps.launcher.ssh`): ssh's argv, the role's
request, re-placement after a lost host, and the host file's errors. No ssh runs."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from elasticps.config import JobConfig
from elasticps.errors import ConfigError, UnschedulableError
from elasticps.launcher import ssh
from elasticps.launcher.hostfile import HostSpec
from elasticps.launcher.spawn import ProcessHandle

pytestmark = pytest.mark.timeout(30)


class _Ended:
    """A session handle that has ended with ``code`` (None: still running)."""

    def __init__(self, code: int | None) -> None:
        self.code = code
        self.pid = 1

    def poll(self) -> int | None:
        return self.code


class _NoLocal:
    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        raise AssertionError("nothing runs locally here")

    def pids(self) -> dict[str, int]:
        return {}


def spawner(hosts: Sequence[HostSpec], up: set[str]) -> ssh.SshSpawner:
    made = ssh.SshSpawner(hosts, ssh.SshOptions(), _NoLocal(), "10.0.0.254")
    probes: list[str] = []
    made._probe = lambda name: probes.append(name) or name in up  # type: ignore[method-assign]
    made.probes = probes  # type: ignore[attr-defined]
    return made


def running(made: ssh.SshSpawner, kind: str, host: str, code: int | None = None) -> None:
    made._live[made._next_id] = ssh._Live(kind, host, _Ended(code))  # type: ignore[arg-type]
    made._next_id += 1


def test_ssh_runs_in_batch_mode_with_keepalives_and_the_host_files_port() -> None:
    options = ssh.SshOptions(config=Path("/etc/eps/ssh_config"), alive_interval_s=2)
    argv = options.argv(HostSpec("node-1", ssh_port=2222), "true")
    assert argv[:3] == ["ssh", "-F", "/etc/eps/ssh_config"]
    assert "BatchMode=yes" in argv and "ServerAliveInterval=2" in argv
    assert "StrictHostKeyChecking=no" not in " ".join(argv)
    assert argv[-4:] == ["-p", "2222", "node-1", "true"]
    assert ssh.SshOptions().argv(HostSpec("[fd00::5]"))[-1] == "fd00::5"


def test_the_request_carries_the_model_file_and_only_the_roles_environment(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model.py"
    model.write_text("class Model: ...\n")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\nb\n")
    made = spawner([HostSpec("h0")], {"h0"})
    env = {
        "ELASTICPS_JOB": "j",
        "ELASTICPS_PARENT_PID": "1",
        "ELASTICPS_HOST": "127.0.0.1",
        "AWS_REGION": "eu-west-1",
        "HOME": "/root",
        "SSH_AUTH_SOCK": "/tmp/agent",
    }
    args = ["trainer", "--model", str(model),
            "--model-args", json.dumps({"vocab": str(vocab), "dim": 8})]  # fmt: skip
    request = json.loads(made._request(args, env))
    assert request["env"] == {"ELASTICPS_JOB": "j", "AWS_REGION": "eu-west-1"}
    assert request["route_to"] == "10.0.0.254"
    assert request["silence_s"] == ssh.SshOptions().silence_s
    run = request["run"]
    assert run[2].startswith("@FILES@/") and str(tmp_path) not in " ".join(run)
    files = {name: base64.b64decode(data) for name, data in request["files"].items()}
    assert files[run[2].split("/", 1)[1]] == b"class Model: ...\n"
    model_args = json.loads(run[4])
    assert model_args["dim"] == 8
    assert files[model_args["vocab"].split("/", 1)[1]] == b"a\nb\n"


def test_a_lost_session_makes_its_host_suspect_and_a_dead_host_is_left_out() -> None:
    hosts = [HostSpec(f"h{i}", slots=2) for i in range(3)]
    made = spawner(hosts, up={"h1", "h2"})
    running(made, "ps", "h0", code=255)  # ssh lost h0
    running(made, "ps", "h1")
    running(made, "trainer", "h2")
    assert made._choose("ps") == "h2"  # h0 probed and left out; h1 has a PS
    assert made.probes == ["h0"]  # type: ignore[attr-defined]
    assert made._choose("trainer") in ("h1", "h2")
    assert made.probes == ["h0"]  # type: ignore[attr-defined]  # down for DOWN_RETRY_S


def test_a_role_that_exits_by_itself_does_not_make_its_host_suspect() -> None:
    made = spawner([HostSpec("h0", slots=2)], up=set())
    running(made, "trainer", "h0", code=1)
    assert made._choose("trainer") == "h0"
    assert made.probes == []  # type: ignore[attr-defined]


def test_a_ps_shares_a_full_host_but_a_trainer_waits_for_a_slot() -> None:
    made = spawner([HostSpec("h0"), HostSpec("h1")], up={"h0", "h1"})
    running(made, "ps", "h0")
    running(made, "trainer", "h1")
    assert made._choose("ps") in ("h0", "h1")
    with pytest.raises(UnschedulableError, match="no host has a free slot"):
        made._choose("trainer")


def test_no_host_up_for_a_ps_fails_in_one_line() -> None:
    made = spawner([HostSpec("h0")], up=set())
    running(made, "ps", "h0", code=255)
    with pytest.raises(ssh.ElasticPSError, match="no host that may run a PS answers ssh"):
        made._choose("ps")


def job(tmp_path: Path, **kw: object) -> JobConfig:
    return JobConfig(job="j", model_path=tmp_path / "m.py", data=tmp_path, output=tmp_path / "o",
                     **kw)  # type: ignore[arg-type]  # fmt: skip


def test_host_options_without_a_host_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="need --hosts"):
        job(tmp_path, remote_python="/opt/py/bin/python")


def test_a_missing_or_bad_host_file_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--hosts .*missing\.txt"):
        ssh.JobHosts.of(job(tmp_path, hosts_file=tmp_path / "missing.txt"))
    bad = tmp_path / "hosts.txt"
    bad.write_text("h0 slots=0\n")
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        ssh.JobHosts.of(job(tmp_path, hosts_file=bad, advertise_address="10.0.0.1"))


def test_chaos_is_refused_with_hosts(tmp_path: Path) -> None:
    from elasticps.launcher.chaos import parse_chaos

    with pytest.raises(ConfigError, match="kill hosts instead"):
        job(tmp_path, hosts_file=tmp_path / "h.txt", chaos=parse_chaos("kill:ps@50%"))


def test_the_preflight_reads_the_root_of_a_glob() -> None:
    assert ssh._glob_root(Path("/data/day=*/part-*.parquet")) == Path("/data")
    assert ssh._glob_root(Path("/data/train.parquet")) == Path("/data/train.parquet")
