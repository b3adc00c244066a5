"""The master process: wait for the master lock, restore or create the ledger, serve.

Any number of master processes may run for a job; one is *active* (it holds
``master/lock`` under its lease), the others are *standbys* that watch the lock
and take over when it is released or its lease expires:

1. bind the gRPC port (so the address is known), grant a lease;
2. acquire the lock with that address as its value, or wait as a standby;
3. restore the queue from the task ledger in etcd, or create the ledger;
4. only then register the service and start serving;
5. requeue the pending tasks of trainers that are gone, watch the others.

The address is published in the lock value atomically with acquiring it: the
port is bound before the lock is taken, but nothing is served until the queue
is restored. A trainer that reads the new address early gets UNAVAILABLE (the
port refuses connections until the server starts) and retries, which it does
for any master outage anyway.

When the lease is lost or a ledger write is refused by the fence, the master
steps down: it stops serving, :func:`serve_master` returns
:data:`EXIT_STEPPED_DOWN` and :func:`run_master` (the ``elasticps master``
command) exits with that status, so a supervisor can tell "another master
took over" from a crash (status 1) or a user error (status 2).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from elasticps import metrics
from elasticps.config import MasterConfig, UpdateMode, ledger_only
from elasticps.coord.store import JobStore, KeptLease, Watch, is_transient
from elasticps.data.parquet import count_rows
from elasticps.errors import CoordinationError, DataError, PortInUseError
from elasticps.master.align import SyncAligner
from elasticps.master.auth import TokenInterceptor
from elasticps.master.ledger import Ledger, LedgerSpec
from elasticps.master.service import MasterService
from elasticps.master.shards import PassVerifier, close_quietly
from elasticps.master.taskqueue import QueueConfig
from elasticps.proto import master_pb2_grpc
from elasticps.security import secret_from_env
from elasticps.tls import JobTLS, tls_from_env

if TYPE_CHECKING:
    from elasticps.master.stream import StreamFeeder

__all__ = [
    "EXIT_OK",
    "EXIT_STEPPED_DOWN",
    "VIRTUAL_SOURCE",
    "build_spec",
    "queue_config",
    "run_master",
    "serve_master",
]

log = logging.getLogger(__name__)

OnActive = Callable[[JobStore], Callable[[], None]]
"""Called with the job's store once a master serves; returns its shutdown function."""

EXIT_OK = 0
"""Exit status of a master stopped on request (or a standby stopped before taking over)."""

EXIT_STEPPED_DOWN = 3
"""Exit status of a master that lost its lease or its lock: another master may serve."""

VIRTUAL_SOURCE = "virtual:reader"
"""The file name of the tasks of a virtual source (``MasterConfig.virtual_records``).

A task ``(VIRTUAL_SOURCE, start, end)`` is the records ``[start, end)`` of a
source that the trainers know without files: for the Python API, the batches
``itertools.islice(reader(), start, end)`` of the user's reader function.
"""

#: Longest wait on one watch of the lock before trying to acquire it again, seconds.
_STANDBY_RECHECK_S = 1.0


def build_spec(config: MasterConfig) -> LedgerSpec:
    """The data split of a master configuration (reads the Parquet row counts).

    With ``config.virtual_records`` > 0 the only "file" is
    :data:`VIRTUAL_SOURCE` with that many records, and nothing is read.

    Raises:
        DataError: a data file is missing or unreadable.
    """
    if config.stream:
        # A stream's tasks are cut as records arrive; the spec names the topic.
        files: tuple[tuple[str, int], ...] = ((config.stream, 0),)
    elif config.virtual_records:
        files = ((VIRTUAL_SOURCE, config.virtual_records),)
    else:
        files = tuple((str(path), count_rows(path)) for path in config.data_files)
    return LedgerSpec(
        files=files,
        records_per_task=config.records_per_task,
        num_passes=config.num_passes,
    )


def queue_config(config: MasterConfig) -> QueueConfig:
    """The task queue's settings of a master configuration.

    Raises:
        ConfigError: a value is out of range for the queue.
    """
    return QueueConfig(
        task_timeout_s=config.task_timeout_s,
        max_task_timeouts=config.max_task_timeouts,
        num_passes=config.num_passes,
        verify_passes=not ledger_only(),
        streaming=bool(config.stream),
    )


def run_master(
    config: MasterConfig, stop: threading.Event, on_active: OnActive | None = None
) -> None:
    """The ``elasticps master`` role: :func:`serve_master`, exiting with status 3 on step-down.

    Raises:
        SystemExit: with :data:`EXIT_STEPPED_DOWN`, if the master stepped down.
        Everything :func:`serve_master` raises.
    """
    status = serve_master(config, stop, on_active)
    if status != EXIT_OK:
        raise SystemExit(status)


def serve_master(
    config: MasterConfig, stop: threading.Event, on_active: OnActive | None = None
) -> int:
    """Run a master (active or standby) until ``stop`` is set or it steps down.

    Args:
        config: master configuration.
        stop: set it to shut the master down; also set when it steps down.
        on_active: called with the job's store once this master serves (e.g.
            to start the Kubernetes worker manager); returns the function to
            call at shutdown.

    Returns:
        :data:`EXIT_OK` when stopped, :data:`EXIT_STEPPED_DOWN` when it lost
        its lease or the master lock.

    Raises:
        DataError: a data file is missing or unreadable.
        ConfigError: the ledger in etcd belongs to another configuration.
        PortInUseError: the gRPC port is taken.
        CoordinationError: etcd is unreachable, or the ledger is malformed.
    """
    spec = build_spec(config)
    qconfig = queue_config(config)
    job = config.common.job
    store = JobStore(config.common.etcd_endpoint, job)
    stepped_down = threading.Event()
    service: MasterService | None = None

    def step_down(reason: str) -> None:
        stepped_down.set()
        stop.set()
        if service is not None:
            service.step_down(reason)
        else:
            log.error("master of job %s stepping down: %s", job, reason)

    secret = secret_from_env()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc"),
        interceptors=[] if secret is None else [TokenInterceptor(secret)],
    )
    lease: KeptLease | None = None
    watch: Watch | None = None
    verifier: PassVerifier | None = None
    aligner: SyncAligner | None = None
    feeder: StreamFeeder | None = None
    health = _add_health(server)
    stop_active: Callable[[], None] | None = None
    try:
        address = _bind(server, config, tls_from_env())
        lease = store.grant_lease(
            config.common.lease_ttl_s, on_lost=lambda: step_down("lease lost")
        )
        if not _wait_for_lock(store, address, lease, stop):
            return EXIT_STEPPED_DOWN if stepped_down.is_set() else EXIT_OK
        log.info("master of job %s holds the lock (lease %x)", job, lease.id)
        ledger = Ledger(store, lease)

        def on_finished() -> None:
            if feeder is not None:
                feeder.publish_final()  # the job's last lag: nothing behind
            store.set_job_state("finished")

        queue, restored = ledger.open(spec, qconfig, time.monotonic())
        service = MasterService(
            queue,
            ledger,
            on_finished=on_finished,
            on_stepped_down=step_down,
            on_pass_ready=lambda pass_id: None if verifier is None else verifier.start(pass_id),
            is_registered=store.trainer_registered,
        )
        active = service
        _publish_metrics(store, lease, service, config.host)
        verifier = PassVerifier(
            store,
            task_records=service.task_records,
            done_tasks=active.done_tasks,
            reopen=active.reopen,
            complete=active.complete_pass,
            failed_tasks_of=lambda p: _failed_tasks_of(store, p),
            stop=stop,
            repair=active.open_repairs,
        )
        ready = service.awaiting_verification()
        if ready is not None:
            verifier.start(ready)
        if config.mode is UpdateMode.SYNC and not ledger_only():
            aligner = SyncAligner(store, config.checkpoint_every_s, stop)
        if stop.is_set():  # the lease was lost while restoring
            return EXIT_STEPPED_DOWN if stepped_down.is_set() else EXIT_OK
        master_pb2_grpc.add_MasterServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        server.start()
        stats = queue.stats()
        store.set_job_state("finished" if stats.finished else "running")
        log.info(
            "master serving on %s (%s ledger, %d tasks)",
            address,
            "restored" if restored else "new",
            stats.total,
        )
        watch = _watch_trainers(store, service)
        if config.stream:
            feeder = _start_feeder(config, service, store, stop, step_down)
        if on_active is not None:
            stop_active = on_active(store)
        stop.wait()
    finally:
        if stop_active is not None:
            stop_active()
        close_quietly(verifier)
        if feeder is not None:
            feeder.join()
        if aligner is not None:
            aligner.close()
        health.enter_graceful_shutdown()  # readiness probes fail from now on
        if watch is not None:
            watch.cancel()
        server.stop(grace=1.0).wait(5)
        if service is not None:
            service.stop()
        if lease is not None and not lease.lost.is_set():
            lease.revoke()  # releases the lock at once, so a standby takes over now
        store.close()
    return EXIT_STEPPED_DOWN if stepped_down.is_set() else EXIT_OK


def _start_feeder(
    config: MasterConfig,
    service: MasterService,
    store: JobStore,
    stop: threading.Event,
    step_down: Callable[[str], None],
) -> StreamFeeder:
    """Start cutting the stream into tasks (a stream's master only)."""
    from elasticps.data.kafka import KafkaSource, load_client_config
    from elasticps.master.stream import StreamFeeder, offsets_of, resume_point
    from elasticps.snapshot import read_snapshot_manifest

    resume = None
    if config.stream_resume is not None:
        partitions = offsets_of(read_snapshot_manifest(config.stream_resume))
        if not isinstance(partitions, dict):
            raise DataError(f"{config.stream_resume} records no stream offsets to resume from")
        resume = resume_point(partitions)

    feeder = StreamFeeder(
        KafkaSource.parse(config.stream),
        load_client_config(config.kafka_config),
        config.stream_limits(),
        service,
        store,
        stop,
        on_error=lambda exc: step_down(f"reading the stream failed: {exc}"),
        resume=resume,
    )
    feeder.start()
    return feeder


def _failed_tasks_of(store: JobStore, pass_id: int) -> list[int] | None:
    """The failed tasks of a completed pass, from its summary in etcd (None: no summary)."""
    summary = store.get_json(store.keys.pass_summary(pass_id))
    failed = summary.get("failed_tasks") if isinstance(summary, dict) else None
    if not isinstance(failed, list):
        return None
    return [t for t in failed if isinstance(t, int)]


def _publish_metrics(store: JobStore, lease: KeptLease, service: MasterService, host: str) -> None:
    """Serve the active master's metrics and register them under its lease
    (:mod:`elasticps.metrics`); the task counts are read from the queue at each scrape."""
    if not metrics.enabled():
        return

    def count(state: str) -> Callable[[], float]:
        return lambda: float(getattr(service.queue_stats(), state))

    for state in ("todo", "pending", "done", "failed"):
        metrics.MASTER_TASKS.labels(state).set_function(count(state))
    metrics.MASTER_PASS.set_function(lambda: float(service.queue_stats().pass_id))
    address = metrics.serve(host)
    metrics.register(store, lease, "master", str(os.getpid()), address)
    log.info("master metrics on http://%s/metrics", address)


def _add_health(server: grpc.Server) -> Any:
    """Add the standard gRPC health service (``grpc.health.v1``), SERVING.

    The Kubernetes ``grpc`` readiness probe calls it. It answers only once the
    server starts, that is on the active master: a standby is not ready, so
    the master's Service routes to the active master only.
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", "elasticps.v1.Master"):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def _bind(server: grpc.Server, config: MasterConfig, tls: JobTLS | None) -> str:
    """Bind the gRPC port (without serving yet) and return ``host:port``.

    With ``tls``, the port speaks TLS and requires a client certificate from
    the job's CA (:mod:`elasticps.tls`).
    """
    address = f"{config.host}:{config.port}"
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.grpc_server_credentials())
    except RuntimeError as exc:
        raise PortInUseError(
            f"--master-port {config.host}:{config.port} is already in use"
        ) from exc
    if port == 0:
        raise PortInUseError(f"--master-port {config.host}:{config.port} is already in use")
    return f"{config.host}:{port}"


def _wait_for_lock(store: JobStore, address: str, lease: KeptLease, stop: threading.Event) -> bool:
    """Acquire the master lock, waiting as a standby while another master holds it.

    The lock's value is ``{"address", "pid"}``. Watches the lock key, so the
    takeover starts as soon as etcd deletes it (released, or its lease
    expired). Rides out an etcd restart. Returns False if ``stop`` was set
    first (it is also set when the lease is lost).
    """
    announced = False
    value = {"address": address, "pid": os.getpid()}
    while not stop.is_set():
        try:
            if store.acquire_master_lock_with(value, lease):
                return True
            if not announced:
                log.info(
                    "standby: another master holds the lock of job %s; waiting", store.keys.job
                )
                announced = True
            store.wait_for_deletion(store.keys.master_lock, _STANDBY_RECHECK_S, cancel=stop)
        except CoordinationError as exc:
            # etcd restarting: wait for it, as the lease does (until it is lost).
            if not is_transient(exc):
                raise
            log.warning("standby: etcd unreachable (%s); retrying", exc)
            stop.wait(_STANDBY_RECHECK_S)
    return False


def _watch_trainers(store: JobStore, service: MasterService) -> Watch:
    """Requeue the tasks of trainers that are gone now, then of those that leave."""
    live, revision = store.live_trainers()
    known = set(live)
    known_lock = threading.Lock()
    # After a restore, pending attempts may belong to trainers that died with
    # the old master: they registered before their dispatch was persisted, so
    # if they are not live at this later revision, they are gone.
    service.trainers_changed(known, service.pending_trainers() | known)

    def on_trainers(current: dict[str, dict[str, object]]) -> None:
        nonlocal known
        with known_lock:
            previous, known = known, set(current)
        # Also every trainer holding a task: one that registered and died while
        # the watch was down (etcd restarting) was never seen, but its dispatch
        # is in the ledger; without this its task would wait for its timeout.
        service.trainers_changed(set(current), previous | service.pending_trainers())

    return store.watch_trainers(on_trainers, revision + 1)
