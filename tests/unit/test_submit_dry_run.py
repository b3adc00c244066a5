"""``elasticps submit --dry-run`` prints Kubernetes objects that pass the Kubernetes schemas.

The schemas ship inside the ``kubernetes-validate`` wheel (no network). The
static files in ``deploy/kubernetes/`` are checked the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")
pytest.importorskip("kubernetes")

from elasticps import cli  # noqa: E402
from elasticps.launcher.kubernetes import to_manifests  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The oldest Kubernetes release still supported upstream when this was written, and the
# newest release whose schemas the installed kubernetes-validate ships.
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())


def dry_run(*extra: str) -> list[dict[str, Any]]:
    """The objects ``submit --dry-run`` prints for the main job's configuration."""
    out = io.StringIO()
    argv = [
        "submit", "--backend", "kubernetes", "--job", "mnist", "--namespace", "ml",
        "--image", "elasticps:latest", "--image-pull-policy", "Never",
        "--model", str(ROOT / "examples" / "mnist_cnn.py"),
        "--trainers", "2", "--ps", "2", "--mode", "sync", "--epochs", "5",
        "--data", "/data/mnist/train.parquet", "--volume-claim", "elasticps-data",
        "--dry-run", *extra,
    ]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return [doc for doc in yaml.safe_load_all(out.getvalue()) if doc is not None]


@pytest.mark.parametrize("version", VERSIONS)
def test_dry_run_objects_pass_the_kubernetes_schemas(version: str) -> None:
    objects = dry_run()
    kinds = sorted(obj["kind"] for obj in objects)
    # etcd and the masters under controllers; the active master creates the workers.
    assert "Pod" not in kinds
    assert kinds.count("StatefulSet") == 1 and kinds.count("Deployment") == 1
    assert {"ConfigMap", "Service"} <= set(kinds)
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["namespace"] == "ml"


def test_an_invalid_object_is_caught() -> None:
    master = next(obj for obj in dry_run() if obj["kind"] == "Deployment")
    master["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(master, VERSIONS[-1], strict=True)


def test_elastic_range_starts_at_max_in_the_scale_config_map() -> None:
    (scale,) = [
        obj for obj in dry_run("--trainers", "1:3")
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-scale")
    ]  # fmt: skip
    assert "3" in str(scale["data"])


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")))
def test_deploy_files_pass_the_kubernetes_schemas(path: Path) -> None:
    for obj in yaml.safe_load_all(path.read_text()):
        if obj is not None:
            kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)


# --- every option of train: carried into the pods, or refused by name ----------------------

TRAIN = cli.subparser(cli.build_parser(), "train")
# A valid value other than the default, for the options whose values have a form.
SAMPLES: dict[str, list[str]] = {
    "--model": [str(ROOT / "examples" / "mnist_mlp.py")],
    "--model-args": ['{"hidden":64}'],
    "--optimizer-class": ["RMSprop", "--optimizer", "torch"],
    "--optimizer-options": ['{"eps":1e-06}'],
    "--lr-schedule": ['{"kind":"step","every_versions":500,"gamma":0.5}'],
    "--sparse-eviction": ['{"expire_versions":100}'],
    "--trainers": ["3:5"],
    "--initial-trainers": ["3", "--trainers", "1:4"],
    "--momentum": ["0.5"],
    "--job": ["other"],
    "--data": ["/data/other/train.parquet"],
    "--chaos": ["kill:ps@1s"],
    "--until-time": ["0"],
    "--etcd-replicas": ["3"],
}
SKIPPED = {"-h", "--help"}
MINIMAL = [
    "submit",
    "--image",
    "e:1",
    "--model",
    str(ROOT / "examples" / "mnist_cnn.py"),
    "--dry-run",
]


def train_options() -> list[argparse.Action]:
    return [a for a in TRAIN._actions if a.option_strings and a.option_strings[0] not in SKIPPED]


def sample(action: argparse.Action) -> list[str]:
    flag = action.option_strings[0]
    if flag in SAMPLES:
        return SAMPLES[flag]
    if action.nargs == 0:
        return []
    if action.choices:
        return [next(str(c) for c in action.choices if c != action.default)]
    if action.type is int:
        return [str((action.default or 0) + 3)]
    if action.type is float:
        return [str((action.default or 0.0) + 0.25)]
    return ["somewhere"]


DOWNWARD = {"status.podIP": "10.244.0.7", "metadata.name": "pod", "metadata.uid": "u",
            "metadata.namespace": "default"}  # fmt: skip


def _parse_pod(
    container: dict[str, Any], env_map: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """``elasticps <role> ...`` of a container, parsed with the environment the pod gets."""
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("ELASTICPS_")]:
            m.delenv(key)
        for key, value in env_map.items():
            m.setenv(key, value)
        for var in container.get("env") or []:  # env wins over envFrom, as in Kubernetes
            value = var.get("value") or DOWNWARD[var["valueFrom"]["fieldRef"]["fieldPath"]]
            m.setenv(var["name"], value)
        return cli.parse_args(container["command"][1:])


def role_args(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> dict[str, argparse.Namespace]:
    """What each role of the job parses: the master from its Deployment's template, and a PS
    and a trainer as the master's worker manager would create their pods."""
    from elasticps.launcher.kubernetes import ps_specs, trainer_spec, worker_pod

    env_map = next(o for o in objects if o["metadata"]["name"].endswith("-env"))["data"]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    master = _parse_pod(
        deployment["spec"]["template"]["spec"]["containers"][0], env_map, monkeypatch
    )
    config = cli.manager_kubernetes_config(master)
    parsed = {"master": master}
    for role, spec in (("ps", ps_specs(1)[0]), ("trainer", trainer_spec(5))):
        pod = to_manifests([worker_pod(master.job, spec, config)])[0]
        parsed[role] = _parse_pod(pod["spec"]["containers"][0], env_map, monkeypatch)
    return parsed


def _same(expected: object, got: object) -> bool:
    if isinstance(got, list) and not isinstance(expected, list):
        got = got[0] if len(got) == 1 else got  # master --data takes several
    if isinstance(expected, Path) or isinstance(got, Path):
        return str(expected) == str(got)
    return expected == got or str(expected) == str(got)


@pytest.mark.parametrize("action", train_options(), ids=lambda a: a.option_strings[0])
def test_every_train_option_reaches_the_roles_in_the_pods_or_is_refused_by_name(
    action: argparse.Action,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every option of ``train``, now and added later: submit refuses it by name, or the roles
    parse its value from the objects submit renders (their command lines and environment)."""
    flag = action.option_strings[0]
    values = sample(action)
    refused = flag in cli.NOT_SUBMITTABLE or flag == "--master-port"
    argv_extra = [flag, *values]
    if refused:
        assert cli.main([*MINIMAL, "--data", "/data/mnist/train.parquet", *argv_extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("elasticps: error: elasticps submit: "), err
        assert flag in err[0], err
        return
    objects = dry_run(*argv_extra)
    value = values[0] if values else ""
    named = {o["metadata"]["name"]: o for o in objects}
    if flag == "--model":  # the pods read the file from the <job>-model ConfigMap
        assert named["mnist-model"]["data"]["model.py"] == Path(value).read_text()
        return
    if flag == "--auth":  # the Secret, and the variables that name it or say there is none
        env = named["mnist-env"]["data"]
        assert ("mnist-secret" in named) == (value == "on")
        assert ("ELASTICPS_JOB_SECRET_FILE" in env) == (value == "on")
        assert (env.get("ELASTICPS_AUTH_OFF") == "1") == (value == "off")
        return
    if flag == "--job":
        assert all(o["metadata"]["name"].startswith(f"{value}-") for o in objects)
    elif flag == "--initial-trainers":  # the wanted count, which the master's manager reads
        assert named["mnist-scale"]["data"]["trainers"] == value
        return
    elif flag == "--standby-masters":
        assert named["mnist-master"]["spec"]["replicas"] == 1 + int(value)
        return
    elif flag == "--etcd-replicas":  # members of etcd's StatefulSet
        assert named["mnist-etcd"]["spec"]["replicas"] == int(value)
        return
    expected = getattr(cli.parse_args(["train", "--model", "m.py", "--data", "/d", *argv_extra]),
                       action.dest)  # fmt: skip
    if flag == "--model-args":
        from elasticps.config import model_args_text, parse_model_args

        expected = model_args_text(parse_model_args(str(expected)))
    roles = role_args(objects, monkeypatch)
    reached = {role: getattr(ns, action.dest) for role, ns in roles.items() if action.dest in ns}
    assert reached, f"{flag}: no role takes it"
    assert any(_same(expected, got) for got in reached.values()), (flag, expected, reached)


def test_a_kafka_stream_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*MINIMAL, "--data", "kafka://h:9092/t"]) == 2
    assert "--data kafka://h:9092/t: a Kafka stream cannot be submitted" in capsys.readouterr().err
