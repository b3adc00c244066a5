"""``elasticps submit --dry-run`` prints Kubernetes objects that pass the Kubernetes schemas.

The schemas ship inside the ``kubernetes-validate`` wheel (no network). The
static files in ``deploy/kubernetes/`` are checked the same way.
"""

from __future__ import annotations

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
