"""The master process: split the data into tasks and serve them over gRPC."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc

from elasticps.config import MasterConfig
from elasticps.coord.store import JobStore
from elasticps.data.parquet import count_rows
from elasticps.errors import CoordinationError, PortInUseError
from elasticps.master.service import MasterService
from elasticps.master.taskqueue import QueueConfig, TaskQueue, split_into_tasks
from elasticps.proto import master_pb2_grpc

log = logging.getLogger(__name__)


def build_queue(config: MasterConfig) -> TaskQueue:
    """Split the configured Parquet files into tasks.

    Raises:
        DataError: a data file is missing or unreadable.
    """
    files = [(str(path), count_rows(path)) for path in config.data_files]
    ranges = split_into_tasks(files, config.records_per_task)
    return TaskQueue(
        ranges,
        QueueConfig(
            task_timeout_s=config.task_timeout_s,
            max_task_timeouts=config.max_task_timeouts,
            num_passes=config.num_passes,
        ),
    )


def run_master(config: MasterConfig, stop: threading.Event) -> None:
    """Run the master until ``stop`` is set or its etcd lease is lost.

    Args:
        config: master configuration.
        stop: set it to shut the master down.

    Raises:
        PortInUseError: the gRPC port is taken.
        CoordinationError: etcd is unreachable, or another master holds the lock.
    """
    queue = build_queue(config)
    log.info("%d tasks of up to %d records", queue.stats().total, config.records_per_task)
    store = JobStore(config.common.etcd_endpoint, config.common.job)
    lost = threading.Event()

    def on_lease_lost() -> None:
        log.error("master lease lost: stepping down")
        lost.set()
        stop.set()

    lease = store.grant_lease(config.common.lease_ttl_s, on_lost=on_lease_lost)
    service = MasterService(
        queue,
        config.task_timeout_s,
        on_finished=lambda: store.set_job_state("finished"),
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc"))
    master_pb2_grpc.add_MasterServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        raise PortInUseError(
            f"--master-port {config.host}:{config.port} is already in use"
        ) from exc
    if port == 0:
        raise PortInUseError(f"--master-port {config.host}:{config.port} is already in use")
    server.start()
    address = f"{config.host}:{port}"
    watch = None
    try:
        if not store.acquire_master_lock(address, lease):
            raise CoordinationError(f"another master holds the lock of job {config.common.job}")
        store.set_job_state("running")
        log.info("master serving on %s", address)
        live, revision = store.live_trainers()
        known = set(live)
        known_lock = threading.Lock()

        def on_trainers(current: dict[str, dict[str, object]]) -> None:
            nonlocal known
            with known_lock:
                previous, known = known, set(current)
            service.trainers_changed(set(current), previous)

        watch = store.watch_trainers(on_trainers, revision + 1)
        stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        server.stop(grace=1.0).wait(5)
        service.stop()
        if not lost.is_set():
            lease.revoke()
        store.close()
