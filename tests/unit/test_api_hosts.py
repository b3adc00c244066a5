"""``elasticps.train(..., cluster=Hosts(...) | Slurm(...))``: validation and the launcher's flags.

No sockets and no processes: the flags :func:`train_argv` gives are parsed by
the command line's own parser into the launcher's :class:`JobConfig`, and the
reading of an ended run (final checkpoint, ``run.json``) runs on files
written here, with the launcher itself replaced.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import elasticps
from elasticps import events, updater
from elasticps.api import launch
from elasticps.api.cluster import Hosts, Local, Parquet, Slurm
from elasticps.checkpoint import save_checkpoint
from elasticps.cli import job_config, parse_args
from elasticps.config import JobConfig, UpdateMode, parse_model_args
from elasticps.errors import ConfigError, JobFailedError, JobUserError
from elasticps.model_file import load_model_file

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mnist_mlp.py"


def hosts(tmp_path: Path, **fields: object) -> Hosts:
    return Hosts(tmp_path / "hosts.txt", output=tmp_path / "run", **fields)  # type: ignore[arg-type]


# --- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"trainers": 0}, "trainers"),
        ({"ps": 0}, "ps"),
        ({"mode": "bulk"}, "mode"),
        ({"push_every": 2}, "push_every"),
        ({"lease_ttl_s": 0.5}, "lease_ttl_s"),
        ({"placement": "round-robin"}, "placement"),
        ({"sync_reduction": "max"}, "sync_reduction"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"checkpoint_every_s": 0}, "checkpoint_every_s"),
        ({"task_timeout_s": 0}, "task_timeout_s"),
        ({"big_array_bound": 0}, "big_array_bound"),
        ({"job": "a/b"}, "job"),
        ({"etcd_replicas": 2}, "etcd_replicas"),
    ],
)
def test_a_value_out_of_range_is_refused_by_its_field_name(
    tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        hosts(tmp_path, **fields)


def test_slurm_checks_the_fields_it_shares_with_hosts() -> None:
    with pytest.raises(ConfigError, match="trainers"):
        Slurm(output="run", trainers=0)
    with pytest.raises(ConfigError, match="output"):
        Slurm(output="")
    assert Slurm(output="run", mode="async").update_mode is UpdateMode.ASYNC


def test_hosts_takes_the_host_file_first_and_the_rest_by_name(tmp_path: Path) -> None:
    cluster = Hosts("hosts.txt", output="run", trainers=3)
    assert (cluster.hostfile, cluster.trainers, cluster.update_mode) == (
        "hosts.txt",
        3,
        UpdateMode.SYNC,
    )
    with pytest.raises(TypeError):
        Hosts("hosts.txt", "run")  # type: ignore[misc]


def test_local_still_checks_its_values() -> None:
    with pytest.raises(ConfigError, match="trainers"):
        Local(trainers=0)
    with pytest.raises(ConfigError, match="batches_per_task"):
        Local(batches_per_task=0)


@pytest.fixture()
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(argv: list[str]) -> tuple[int, list[str]]:
        raise AssertionError(f"the launcher ran: {argv}")

    monkeypatch.setattr(launch, "_run_launcher", refuse)


def _refused(tmp_path: Path, named: str, **kwargs: object) -> None:
    call: dict[str, object] = {"model": MLP, "loss_fn": None, "reader": tmp_path / "data"}
    call.update(kwargs)
    with pytest.raises(ConfigError, match=rf"^{named}: "):
        elasticps.train(**call, cluster=hosts(tmp_path))  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_launcher")
def test_what_cannot_reach_the_hosts_is_refused_by_its_argument_name(tmp_path: Path) -> None:
    spec = load_model_file(MLP)

    def reader() -> object:
        yield torch.zeros(1, 784), torch.zeros(1, dtype=torch.int64)

    _refused(tmp_path, "model", model=nn.Linear(784, 10))
    _refused(tmp_path, "model", model=42)
    _refused(tmp_path, "loss_fn", loss_fn=torch.nn.functional.mse_loss)
    _refused(tmp_path, "reader", reader=reader)
    _refused(tmp_path, "reader", reader=Parquet(tmp_path, spec.batch_to_tensors, ["x"]))
    other = Parquet(tmp_path, lambda t: (torch.zeros(1), torch.zeros(1)), spec.columns)
    _refused(tmp_path, "reader", reader=other)
    two = Parquet.from_model_file([tmp_path / "a", tmp_path / "b"], MLP)
    _refused(tmp_path, "reader", reader=two)
    _refused(tmp_path, "frozen_parameters", frozen_parameters={"fc1.*"})
    _refused(tmp_path, "parameters", parameters={"w": torch.zeros(1)})
    _refused(tmp_path, "test_reader", test_reader=reader)
    _refused(tmp_path, "metrics", metrics=dict)


def test_the_model_files_own_functions_are_accepted(tmp_path: Path) -> None:
    spec = load_model_file(MLP)
    again = load_model_file(MLP)  # loaded twice: other function objects, the same file
    data = Parquet.from_model_file(tmp_path / "data", MLP, batch_size=16)
    request = launch.launch_request(MLP, again.loss, data, cluster=hosts(tmp_path))
    assert request.spec.path == spec.path
    assert (request.data, request.batch_size) == (str((tmp_path / "data").resolve()), 16)


@pytest.mark.usefixtures("no_launcher")
def test_a_local_cluster_still_refuses_what_only_hosts_take(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module"):
        elasticps.train(MLP, None, tmp_path, cluster=Local())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="loss_fn"):
        elasticps.train(nn.Linear(2, 1), None, tmp_path, cluster=Local())  # type: ignore[arg-type]


# --- every field reaches the launcher -----------------------------------------------


def _config(cluster: Hosts | Slurm, request: launch.LaunchRequest) -> JobConfig:
    return job_config(parse_args(["train", *launch.train_argv(cluster, request)]))


def test_every_field_of_hosts_reaches_the_launchers_config(tmp_path: Path) -> None:
    fields: dict[str, object] = {
        "hostfile": tmp_path / "hosts.txt",
        "ssh_config": tmp_path / "ssh_config",
        "etcd_replicas": 3,
        "output": tmp_path / "run",
        "trainers": 3,
        "ps": 4,
        "mode": "async",
        "push_every": 2,
        "pull_every": 3,
        "big_array_bound": 1234,
        "placement": "hash",
        "lease_ttl_s": 7.5,
        "task_timeout_s": 33.0,
        "checkpoint_every_s": 4.5,
        "sync_reduction": "sum",
        "max_restarts": 5,
        "seed": 11,
        "job": "apijob",
        "overwrite": True,
        "resume": tmp_path / "old" / "snapshot",
        "remote_python": "/opt/venv/bin/python",
        "advertise_address": "10.1.2.3",
    }
    # Each field of Hosts, and where the launcher's JobConfig holds it.
    expected: dict[str, tuple[str, object]] = {
        "hostfile": ("hosts_file", tmp_path / "hosts.txt"),
        "ssh_config": ("ssh_config", tmp_path / "ssh_config"),
        "etcd_replicas": ("etcd_replicas", 3),
        "output": ("output", tmp_path / "run"),
        "trainers": ("trainers", 3),
        "ps": ("ps", 4),
        "mode": ("mode", UpdateMode.ASYNC),
        "push_every": ("push_every", 2),
        "pull_every": ("pull_every", 3),
        "big_array_bound": ("big_array_bound", 1234),
        "placement": ("placement", "hash"),
        "lease_ttl_s": ("lease_ttl_s", 7.5),
        "task_timeout_s": ("task_timeout_s", 33.0),
        "checkpoint_every_s": ("checkpoint_every_s", 4.5),
        "sync_reduction": ("sync_reduction", "sum"),
        "max_restarts": ("max_restarts", 5),
        "seed": ("seed", 11),
        "job": ("job", "apijob"),
        "overwrite": ("overwrite", True),
        "resume": ("resume", tmp_path / "old" / "snapshot"),
        "remote_python": ("remote_python", "/opt/venv/bin/python"),
        "advertise_address": ("advertise_address", "10.1.2.3"),
    }
    assert set(expected) == {f.name for f in dataclasses.fields(Hosts)}  # none left out
    cluster = Hosts(**fields)  # type: ignore[arg-type]
    spec = load_model_file(MLP, "Model", {"hidden": 64})
    request = launch.launch_request(
        spec,
        None,
        Parquet.from_model_file(tmp_path / "data", MLP, batch_size=16, records_per_task=256),
        cluster=cluster,
        updater=updater.Momentum(lr=0.05, momentum=0.8, weight_decay=1e-4),
        num_passes=4,
    )
    config = _config(cluster, request)
    for name, (attribute, value) in expected.items():
        assert getattr(config, attribute) == value, name
    assert config.launcher == "local"
    # And what train()'s own arguments say.
    assert config.model_path == MLP
    assert parse_model_args(config.model_args) == {"hidden": 64}
    assert config.data == tmp_path / "data"
    assert config.epochs == 4
    assert config.batch_size == 16
    assert config.records_per_task == 256
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.lr, optimizer.momentum, optimizer.weight_decay) == (
        "momentum",
        0.05,
        0.8,
        1e-4,
    )
    assert config.progress is False


def test_every_field_of_slurm_reaches_the_launchers_config(tmp_path: Path) -> None:
    cluster = Slurm(output=tmp_path / "run", trainers=2, ps=3, remote_python="/p/python")
    request = launch.launch_request(MLP, None, "s3://bucket/mnist", cluster=cluster)
    config = _config(cluster, request)
    assert config.launcher == "slurm"
    assert config.hosts_file is None
    assert (config.ps, config.remote_python) == (3, "/p/python")
    assert config.data == "s3://bucket/mnist"
    assert config.batch_size == 32  # the launcher's own default
    assert config.optimizer.name == "adam"


# --- an ended run: its parameters and its events ------------------------------------


def _fake_launcher(output: Path, status: int = 0, lines: tuple[str, ...] = ()) -> object:
    def run(argv: list[str]) -> tuple[int, list[str]]:
        assert argv[argv.index("--output") + 1] == str(output)
        if status == 0:
            tensors = {"fc1.weight": torch.ones(2, 3), "fc1.bias": torch.zeros(2)}
            save_checkpoint(output, tensors, {"model_versions": [7, 9]})
            record = {
                "state": "finished",
                "samples": 400,
                "wall_s": 3.5,
                "passes": [
                    {"pass_id": 0, "records_trained": 200},
                    {"pass_id": 1, "records_trained": 200},
                ],
                "evaluation": {"accuracy": 0.9, "loss": 0.3, "samples": 100},
            }
            (output / "run.json").write_text(json.dumps(record))
        return status, list(lines)

    return run


def test_the_result_and_the_events_come_from_the_runs_checkpoint_and_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = hosts(tmp_path)
    monkeypatch.setattr(launch, "_run_launcher", _fake_launcher(tmp_path / "run"))
    seen: list[events.TrainingEvent] = []
    result = elasticps.train(MLP, None, tmp_path / "data", cluster=cluster, num_passes=2,
                             event_handler=seen.append)  # fmt: skip
    assert isinstance(result, elasticps.ParameterSet)
    assert torch.equal(result["fc1.weight"], torch.ones(2, 3))
    kinds = [type(e).__name__ for e in seen]
    assert kinds == ["BeginTraining", "EndPass", "EndPass", "Checkpointed", "EndTraining"]
    assert seen[0].metrics == {"num_passes": 2.0, "num_trainers": 2.0}
    assert [e.metrics["samples"] for e in seen[1:3]] == [200.0, 200.0]
    checkpointed = seen[3]
    assert isinstance(checkpointed, events.Checkpointed)
    assert checkpointed.path == tmp_path / "run" and checkpointed.model_version == 9
    end = seen[4]
    assert (end.pass_id, end.model_version) == (1, 9) and math.isnan(end.cost)
    assert end.metrics == {
        "samples": 400.0,
        "wall_s": 3.5,
        "test_accuracy": 0.9,
        "test_loss": 0.3,
        "test_samples": 100.0,
    }


def test_the_launchers_user_error_is_raised_with_its_own_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = (
        "elasticps: error: the hosts cannot run this job:",
        "  h1: /shared/mnist does not exist",
    )
    monkeypatch.setattr(launch, "_run_launcher", _fake_launcher(tmp_path / "run", 2, lines))
    with pytest.raises(JobUserError) as info:
        elasticps.train(MLP, None, tmp_path / "data", cluster=hosts(tmp_path))
    assert str(info.value) == "the hosts cannot run this job:\n  h1: /shared/mnist does not exist"


def test_another_launcher_failure_is_a_failed_job_naming_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = ("elasticps: internal error: boom (see the log)",)
    monkeypatch.setattr(launch, "_run_launcher", _fake_launcher(tmp_path / "run", 1, lines))
    with pytest.raises(JobFailedError, match=r"status 1: .*boom.*launcher\.log"):
        elasticps.train(MLP, None, tmp_path / "data", cluster=hosts(tmp_path))


def test_a_handler_that_raises_at_the_start_stops_the_job_before_the_launcher(
    tmp_path: Path, no_launcher: None
) -> None:
    (tmp_path / "run").mkdir()

    def handler(event: events.TrainingEvent) -> None:
        raise RuntimeError(f"no {type(event).__name__}")

    with pytest.raises(RuntimeError, match="no BeginTraining"):
        elasticps.train(
            MLP, None, tmp_path / "data", cluster=hosts(tmp_path), event_handler=handler
        )
    assert not (tmp_path / "run" / ".stop").exists()  # no request left for a later run


def test_a_handler_that_raises_at_the_end_raises_after_the_parameters_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch, "_run_launcher", _fake_launcher(tmp_path / "run"))

    def handler(event: events.TrainingEvent) -> None:
        if isinstance(event, events.EndTraining):
            raise RuntimeError("no EndTraining")

    with pytest.raises(RuntimeError, match="no EndTraining"):
        elasticps.train(
            MLP, None, tmp_path / "data", cluster=hosts(tmp_path), event_handler=handler
        )
    assert not (tmp_path / "run" / ".stop").exists()
