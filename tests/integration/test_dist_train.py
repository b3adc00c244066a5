"""``elasticps.dist.dist_train``: launcher outside a job, role dispatch inside one.

The launcher tests run dist_train in this process with ``argv`` naming a small
worker script; it starts etcd and one PS (``LocalServers``) and two copies of
the script, and must stop every process it started by PID.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elasticps import updater
from elasticps.config import UpdateMode
from elasticps.dist import LaunchResult, dist_train, worker_env
from elasticps.errors import ConfigError, JobFailedError
from elasticps.kvstore import ENV_OPTIMIZER, env_optimizer_config
from elasticps.testing import pid_gone, wait_for

# Records its environment, then exits with the status given for its rank (or
# waits for SIGTERM with status "wait"), as the user's train function.
WORKER = """
import json, os, sys, threading
from elasticps.dist import dist_train

def work():
    rank = os.environ["ELASTICPS_RANK"]
    out = sys.argv[1]
    env = {k: v for k, v in os.environ.items() if k.startswith(("ELASTICPS_", "MALLOC_"))}
    env["pid"] = os.getpid()
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(env, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    behaviour = dict(a.split("=") for a in sys.argv[2:]).get(rank, "0")
    if behaviour == "wait":
        threading.Event().wait()
    return int(behaviour)

status = dist_train(work)
sys.exit(status if isinstance(status, int) else 0)
"""


@pytest.fixture
def outside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("ELASTICPS_"):
            monkeypatch.delenv(key)


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("outside_a_job")
def test_launcher_runs_every_worker_with_the_job_environment(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    sgd = updater.SGD(lr=0.3, schedule=updater.StepDecay(every_versions=5, gamma=0.5))

    result = dist_train(
        lambda: None,
        workers=2,
        ps=1,
        mode="async",
        updater=sgd,
        argv=[str(script), str(tmp_path)],
        timeout_s=150,
    )

    assert isinstance(result, LaunchResult)
    assert result.exit_codes == (0, 0)
    envs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["ELASTICPS_ROLE"] == "trainer"
        assert env["ELASTICPS_RANK"] == str(rank)
        assert env["ELASTICPS_NUM_WORKERS"] == "2"
        assert env["ELASTICPS_MODE"] == "async"
        assert env["ELASTICPS_PS"] == "1"
        assert env["ELASTICPS_JOB"] == result.job
        assert ":" in env["ELASTICPS_ETCD"]
        assert json.loads(env[ENV_OPTIMIZER])["schedule"] == sgd.to_config().schedule
        # The environment of every launcher's roles (child_env), allocator tuning included.
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30)
        assert env["ELASTICPS_PARENT_PID"] == str(os.getpid())


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("outside_a_job")
def test_failing_worker_fails_the_launch_and_the_others_are_stopped(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    with pytest.raises(JobFailedError, match="rank 1 exited with status 3"):
        dist_train(
            lambda: None,
            workers=2,
            ps=1,
            mode="sync",
            updater=updater.SGD(lr=0.1),
            argv=[str(script), str(tmp_path), "0=wait", "1=3"],
            timeout_s=150,
        )

    waiting = json.loads((tmp_path / "rank0.json").read_text())
    wait_for(lambda: pid_gone(waiting["pid"]), "the waiting worker to be stopped", 15)


@pytest.mark.usefixtures("outside_a_job")
def test_kubernetes_backend_is_a_clear_config_error_for_now() -> None:
    with pytest.raises(ConfigError, match="no kubernetes backend"):
        dist_train(lambda: None, backend="kubernetes")
    with pytest.raises(ConfigError, match="backend"):
        dist_train(lambda: None, backend="slurm")


def test_inside_a_job_a_trainer_calls_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICPS_ROLE", "trainer")
    assert dist_train(lambda: 42, workers=0) == 42  # launcher arguments are ignored


def test_inside_a_job_an_unknown_role_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICPS_ROLE", "janitor")
    with pytest.raises(ConfigError, match="janitor"):
        dist_train(lambda: None)


def test_worker_env_carries_the_optimizer_the_kvstore_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = updater.Adam(lr=0.01).to_config()
    env = worker_env(
        rank=1,
        workers=3,
        job="j",
        etcd_endpoint="127.0.0.1:2379",
        mode=UpdateMode.SYNC,
        ps=2,
        optimizer=config,
        lease_ttl_s=5.0,
    )
    assert env["ELASTICPS_RANK"] == env["ELASTICPS_TRAINER_ID"] == "1"
    monkeypatch.setenv(ENV_OPTIMIZER, env[ENV_OPTIMIZER])
    assert env_optimizer_config() == config


@pytest.mark.parametrize("role", ["ps", "master"])
def test_inside_a_job_a_server_role_runs_the_cli_role_and_exits(
    monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    for key in list(os.environ):
        if key.startswith("ELASTICPS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ELASTICPS_ROLE", role)
    # Without ELASTICPS_ETCD the role's CLI refuses at once, with status 2.
    with pytest.raises(SystemExit) as info:
        dist_train(lambda: None)
    assert info.value.code == 2
