"""``elasticps submit --dry-run`` prints Kubernetes objects that pass the Kubernetes schemas.

The schemas ship inside the ``kubernetes-validate`` wheel (no network). The
static files in ``deploy/kubernetes/`` are checked the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")
pytest.importorskip("kubernetes")

from elasticps import cli  # noqa: E402

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
    assert kinds.count("Pod") == 2  # etcd and the master; the master creates the workers
    assert {"ConfigMap", "Service"} <= set(kinds)
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["namespace"] == "ml"


def test_an_invalid_object_is_caught() -> None:
    pod = next(obj for obj in dry_run() if obj["kind"] == "Pod")
    pod["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, VERSIONS[-1], strict=True)


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


def carried(objects: list[dict[str, Any]], flag: str, value: str) -> bool:
    """Whether the objects hold ``flag``'s ``value``: a pod variable or a master flag."""
    env = next(o for o in objects if o["metadata"]["name"].endswith("-env"))["data"]
    if env.get(cli.env_name(flag)) == value:
        return True
    for obj in objects:
        if obj["kind"] != "Pod":
            continue
        command = obj["spec"]["containers"][0]["command"]
        if any(command[i : i + 2] == [flag, value] for i in range(len(command) - 1)):
            return True
    return False


@pytest.mark.parametrize("action", train_options(), ids=lambda a: a.option_strings[0])
def test_every_train_option_is_carried_into_the_pods_or_refused_by_name(
    action: argparse.Action, capsys: pytest.CaptureFixture[str]
) -> None:
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
    if flag == "--model":
        model = next(o for o in objects if o["metadata"]["name"].endswith("-model"))
        assert model["data"]["model.py"] == Path(value).read_text()
    elif flag == "--job":
        assert all(o["metadata"]["name"].startswith(f"{value}-") for o in objects)
    elif flag == "--initial-trainers":
        scale = next(o for o in objects if o["metadata"]["name"].endswith("-scale"))
        assert scale["data"]["trainers"] == value
    else:
        assert carried(objects, flag, value), (flag, value)


def test_a_kafka_stream_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*MINIMAL, "--data", "kafka://h:9092/t"]) == 2
    assert "--data kafka://h:9092/t: a Kafka stream cannot be submitted" in capsys.readouterr().err
