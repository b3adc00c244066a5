"""Jobs whose data, checkpoints and outputs are on S3, against a real S3-API server.

The server is ``moto_server`` (from ``moto[server]``, a dev dependency), started
on a free loopback port for this module. Every process of a job finds it the
way a real deployment would: ``AWS_ENDPOINT_URL`` and dummy credentials in the
environment; nothing is mocked inside the processes. Each job is small (a
couple of passes over the 5,000-image MNIST sample, or the audit model).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.storage import Location
from elasticps.testing import run_train, wait_for
from elasticps.testing.audit import check_run, write_dataset

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "elasticps-test"
JOB_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A moto S3 server on a free port, its bucket, and the environment that points at it."""
    pytest.importorskip("s3fs")
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "ELASTICPS_STATE_DIR": str(tmp_path_factory.mktemp("state")),
    }
    try:

        def serving() -> bool:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1.0).close()
            except OSError:
                assert server.poll() is None, log.read_text()
                return False
            return True

        wait_for(serving, "moto_server to start", timeout_s=30.0, interval_s=0.1)
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            yield env
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.kill()
        server.wait(timeout=10)


def _upload(local: Path, url: str) -> None:
    for path in sorted(local.iterdir()):
        if path.is_file():
            Location.of(str(path)).copy_to(Location.of(f"{url}/{path.name}"))


def _train(
    args: list[str], pids: Path | None, env: dict[str, str]
) -> tuple[dict[str, object], str]:
    """Run ``elasticps train``; return its result line and its stderr."""
    return run_train(args, pids_file=pids, timeout_s=JOB_TIMEOUT_S, env=env)


def _local_dir(url: str, job: str, env: dict[str, str]) -> Path:
    """The launcher's local directory for an ``--output`` URL (its pids.json)."""
    from elasticps.jobs import local_dir_for_url

    old = os.environ.get("ELASTICPS_STATE_DIR")
    os.environ["ELASTICPS_STATE_DIR"] = env["ELASTICPS_STATE_DIR"]
    try:
        return local_dir_for_url(url, job)
    finally:
        if old is None:
            del os.environ["ELASTICPS_STATE_DIR"]
        else:
            os.environ["ELASTICPS_STATE_DIR"] = old


def _mnist_args(data: str, output: str, *, job: str, ps: int = 2) -> list[str]:
    return [
        "--job", job, "--model", str(ROOT / "examples" / "mnist_cnn.py"),
        "--data", data, "--output", output, "--trainers", "2", "--ps", str(ps),
        "--mode", "sync", "--epochs", "2", "--checkpoint-every-s", "2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def s3_mnist_run(s3: dict[str, str], mnist_dir: Path) -> tuple[dict[str, object], str]:
    """The MNIST CNN trained from ``s3://.../mnist`` into ``s3://.../runs/mnist``."""
    data = f"s3://{BUCKET}/mnist"
    _upload(mnist_dir, data)
    output = f"s3://{BUCKET}/runs/mnist"
    line, _ = _train(
        _mnist_args(data, output, job="s3mnist"),
        _local_dir(output, "s3mnist", s3) / "pids.json",
        s3,
    )
    return line, output


def test_a_job_trains_from_s3_into_s3_as_well_as_from_local_files(
    s3: dict[str, str], s3_mnist_run: tuple[dict[str, object], str], mnist_dir: Path, tmp_path: Path
) -> None:
    line, output = s3_mnist_run
    assert line["checkpoint"] == output
    assert line["exactly_once"] is True
    assert line["samples_trained"] == 2 * 4000  # 2 passes over the 4,000 training images

    out = Location.of(output)
    for name in ("model.safetensors", "manifest.json", "run.json", "config.toml"):
        assert (out / name).is_file(), name
    snapshot = json.loads((out / "snapshot" / "manifest.json").read_text())
    listed = sorted(e["file"] for e in snapshot["shards"])
    # Shard objects named by version; nothing else left beside the manifest.
    assert listed == [f"shard-{i}-v{snapshot['version']:012d}.safetensors" for i in (0, 1)]
    assert (out / "snapshot").listdir() == sorted([*listed, "manifest.json"])
    for index in (0, 1):
        kept = (out / "ps-checkpoints" / f"ps-{index}").listdir()
        assert 1 <= len(kept) <= 3, kept  # the newest three are kept
    assert "launcher.log" in (out / "logs").listdir()
    record = json.loads((out / "run.json").read_text())
    assert record["state"] == "finished" and record["output_url"] == output

    local, _ = _train(
        _mnist_args(str(mnist_dir), str(tmp_path / "local"), job="localmnist"),
        tmp_path / "local" / "pids.json",
        s3,
    )
    s3_accuracy, local_accuracy = float(str(line["accuracy"])), float(str(local["accuracy"]))
    # Sync-SGD over 2 trainers: which trainer takes which task, so which mini-batches
    # are averaged in one step, follows timing. Ten runs of this job alone here:
    # 0.925-0.935; ten beside two busy loops: 0.900-0.931. A job that misread its
    # records would be far below (an untrained model scores about 0.1).
    assert min(s3_accuracy, local_accuracy) >= 0.88, (line, local)
    assert abs(s3_accuracy - local_accuracy) <= 0.05, (line, local)


def test_resume_from_s3_onto_another_number_of_parameter_servers(
    s3: dict[str, str], s3_mnist_run: tuple[dict[str, object], str]
) -> None:
    first, output = s3_mnist_run
    again = f"s3://{BUCKET}/runs/mnist-3ps"
    args = [*_mnist_args(f"s3://{BUCKET}/mnist", again, job="s3resume", ps=3)]
    args += ["--resume", f"{output}/snapshot"]
    line, _ = _train(
        args,
        _local_dir(again, "s3resume", s3) / "pids.json",
        s3,
    )
    assert line["exactly_once"] is True
    manifest = json.loads(Location.of(f"{again}/snapshot/manifest.json").read_text())
    assert len(manifest["shards"]) == 3
    # Two more passes from the trained parameters: no worse than where it started.
    assert float(str(line["accuracy"])) >= float(str(first["accuracy"])) - 0.02


def test_a_killed_parameter_server_restores_from_s3_and_loses_no_update(
    s3: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "audit"
    write_dataset(local, 2000)
    data = f"s3://{BUCKET}/audit"
    _upload(local, data)
    output = f"s3://{BUCKET}/runs/audit"
    epochs = 3
    args = [
            "--job", "s3audit", "--model", str(local / "audit_model.py"), "--data", data,
        "--model-args", '{"records": 2000}',
            "--output", output, "--optimizer", "sgd", "--lr", "1", "--sync-reduction", "sum",
            "--push-every", "1", "--big-array-bound", "500", "--trainers", "2", "--ps", "2",
            "--mode", "sync", "--epochs", str(epochs), "--records-per-task", "200",
            "--lease-ttl-s", "2", "--checkpoint-every-s", "1", "--chaos", "kill:ps@40%",
    ]  # fmt: skip
    line, _ = _train(
        args,
        _local_dir(output, "s3audit", s3) / "pids.json",
        s3,
    )
    assert line["exactly_once"] is True
    audit = check_run(output)
    assert audit.exactly_once, audit.as_dict()
    record = json.loads(Location.of(f"{output}/run.json").read_text())
    assert record["records_lost"] == 0 and record["samples"] == 2000 * epochs
    assert any(r["action"] == "kill" for r in record["chaos"]), record["chaos"]
    logs = Location.of(f"{output}/logs")
    restored = [
        name
        for name in logs.listdir()
        if name.startswith("ps-") and "restored" in (logs / name).read_text()
    ]
    assert restored, "no parameter server restored its shard from S3"
