"""Prometheus metrics: what each role of a job publishes, and where to scrape it.

Every master, parameter server and trainer serves its metrics in the
Prometheus text format, through :mod:`prometheus_client`'s own HTTP server,
on a free port of the address it serves on (127.0.0.1 on one machine), and
registers ``host:port`` in etcd under ``metrics/<role>-<id>``, under its lease
(:func:`register`): a role that dies leaves no target behind. The launcher
turns those keys into ``OUTPUT/prometheus-targets.json``, a Prometheus
file-based service-discovery file (:func:`targets_file`).

Names follow Prometheus' conventions (``elasticps_<role>_<what>_<unit>``, a
counter's ``_total``), and labels are bounded: ``shard`` (a PS index), and
``result``, ``reason`` or ``state`` from fixed sets. A trainer's or a PS's
identity is the target's own labels (``role``, ``id``), never a metric
label, so replaced trainers do not grow any metric's label set.

The metrics are module-level objects in :mod:`prometheus_client`'s default
registry: one process is one role. Observing one costs about a microsecond
(a lock and an add), far below a push (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from elasticps.coord.store import JobStore, KeptLease

__all__ = [
    "LAUNCHER_DECISIONS",
    "MASTER_PASS",
    "MASTER_STREAM_AGE_SECONDS",
    "MASTER_STREAM_LAG_RECORDS",
    "MASTER_TASKS",
    "MASTER_TASK_REPORTS",
    "METRICS_OFF_ENV",
    "METRICS_PORT_ENV",
    "PS_CHECKPOINT_BYTES",
    "PS_CHECKPOINT_SECONDS",
    "PS_MODEL_VERSION",
    "PS_PULL_SECONDS",
    "PS_PUSHES",
    "PS_PUSH_BYTES",
    "PS_PUSH_SECONDS",
    "PS_REFUSED",
    "PS_SLOT_EPOCH",
    "PS_STALENESS",
    "PS_SYNC_WAIT_SECONDS",
    "PS_TABLE_ADMITTED",
    "PS_TABLE_BYTES",
    "PS_TABLE_EVICTED",
    "PS_TABLE_ROWS",
    "STRAGGLER_FACTOR",
    "TRAINER_PUSH_SECONDS",
    "TRAINER_SAMPLES",
    "TRAINER_STEP_SECONDS",
    "enabled",
    "job_metrics",
    "mean_step_s",
    "register",
    "serve",
    "shard_load",
    "staleness_since",
    "stragglers",
    "targets_file",
]

log = logging.getLogger(__name__)

METRICS_OFF_ENV: Final = "ELASTICPS_METRICS_OFF"
"""Set (to ``1``) in every process of a job run with ``--metrics off``: no role serves
metrics."""

# Latencies from 100 us to 30 s: a push of a small model on one host to a sync step
# that waits for a straggler.
_SECONDS: Final = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # fmt: skip

# --- parameter servers ---------------------------------------------------------------

PS_PUSH_SECONDS: Final = Histogram(
    "elasticps_ps_push_seconds",
    "Time a parameter server spends on one PUSH, from its header to its reply "
    "(in sync-SGD, the wait for the step's other trainers included), seconds.",
    ["shard"],
    buckets=_SECONDS,
)
PS_PULL_SECONDS: Final = Histogram(
    "elasticps_ps_pull_seconds",
    "Time a parameter server spends on one PULL, seconds.",
    ["shard"],
    buckets=_SECONDS,
)
PS_PUSH_BYTES: Final = Counter(
    "elasticps_ps_push_bytes",
    "Bytes of gradients received, in PUSH bodies or in shared memory (float32 there).",
    ["shard"],
)
PS_PUSHES: Final = Counter(
    "elasticps_ps_pushes",
    "PUSH requests handled, by result: applied, duplicate (its records were held "
    "already: acknowledged, not applied again) or stale (not applied).",
    ["shard", "result"],
)
PS_REFUSED: Final = Counter(
    "elasticps_ps_requests_refused",
    "Requests answered with ERROR, by its code (wrong_epoch, fenced, no_hello, ...).",
    ["shard", "reason"],
)
PS_STALENESS: Final = Histogram(
    "elasticps_ps_staleness",
    "Model versions between the one a pushed gradient was computed on and the shard's "
    "(async-SGD and SSP; 0 in sync-SGD).",
    ["shard"],
    buckets=(0, 1, 2, 3, 4, 8, 16, 32, 64, 128),
)
PS_MODEL_VERSION: Final = Gauge(
    "elasticps_ps_model_version", "The shard's model version.", ["shard"]
)
PS_SYNC_WAIT_SECONDS: Final = Histogram(
    "elasticps_ps_sync_wait_seconds",
    "In sync-SGD, time a PUSH waits at the step's barrier for the other trainers' pushes "
    "(part of elasticps_ps_push_seconds), seconds.",
    ["shard"],
    buckets=_SECONDS,
)
PS_SLOT_EPOCH: Final = Gauge(
    "elasticps_ps_slot_epoch",
    "The epoch of the slot this server holds: each server that takes the slot over "
    "(after a restart or a fencing) holds a higher one.",
    ["shard"],
)
PS_TABLE_ROWS: Final = Gauge(
    "elasticps_ps_table_rows", "Rows a sparse table holds on this shard.", ["shard", "table"]
)
PS_TABLE_BYTES: Final = Gauge(
    "elasticps_ps_table_bytes",
    "Bytes a sparse table's storage takes on this shard (chunks and id index, read every "
    "64 steps).",
    ["shard", "table"],
)
PS_TABLE_ADMITTED: Final = Counter(
    "elasticps_ps_table_admitted_rows",
    "Rows a sparse table added on this shard (ids updated for the first time, or again "
    "after an eviction).",
    ["shard", "table"],
)
PS_TABLE_EVICTED: Final = Counter(
    "elasticps_ps_table_evicted_rows",
    "Rows a sparse table's eviction policy removed on this shard.",
    ["shard", "table"],
)
PS_CHECKPOINT_SECONDS: Final = Histogram(
    "elasticps_ps_checkpoint_seconds",
    "Time to write one shard checkpoint, seconds.",
    ["shard"],
    buckets=_SECONDS,
)
PS_CHECKPOINT_BYTES: Final = Gauge(
    "elasticps_ps_checkpoint_bytes", "Size of the last shard checkpoint written, bytes.", ["shard"]
)

# --- trainers ------------------------------------------------------------------------

TRAINER_SAMPLES: Final = Counter(
    "elasticps_trainer_samples", "Samples this trainer trained on (its rate is samples/s)."
)
TRAINER_STEP_SECONDS: Final = Histogram(
    "elasticps_trainer_step_seconds",
    "Time of one mini-batch: forward, backward, and the push and pull of that step, seconds.",
    buckets=_SECONDS,
)
TRAINER_PUSH_SECONDS: Final = Histogram(
    "elasticps_trainer_push_seconds",
    "Time of one push to every parameter server (with the pull it asks for), as this "
    "trainer sees it, seconds.",
    buckets=_SECONDS,
)

# --- the master ----------------------------------------------------------------------

MASTER_TASKS: Final = Gauge(
    "elasticps_master_tasks",
    "Tasks of the current pass, by state: todo, pending, done, failed.",
    ["state"],
)
MASTER_PASS: Final = Gauge("elasticps_master_pass", "The current pass (0-based).")
MASTER_STREAM_LAG_RECORDS: Final = Gauge(
    "elasticps_master_stream_lag_records",
    "Records of a Kafka stream not trained yet (behind the head, over all partitions).",
)
MASTER_STREAM_AGE_SECONDS: Final = Gauge(
    "elasticps_master_stream_oldest_untrained_age_seconds",
    "Age of a Kafka stream's oldest untrained record, seconds (0 when none is known).",
)
MASTER_TASK_REPORTS: Final = Counter(
    "elasticps_master_task_reports",
    "Task reports received, by outcome: succeeded, failed, timed_out.",
    ["outcome"],
)

# --- the launcher --------------------------------------------------------------------

LAUNCHER_DECISIONS: Final = Counter(
    "elasticps_launcher_decisions",
    "The supervisor's decisions on processes that ended, by role and action: restart "
    "(etcd, a master, a PS: restarted under its name), replace (a trainer), fail (the "
    "job), ignore (a clean exit, or an end the job does not need).",
    ["role", "action"],
)


@contextlib.contextmanager
def job_metrics(on: bool) -> Iterator[None]:
    """Tell the roles a launcher starts in the block whether to serve metrics
    (:data:`METRICS_OFF_ENV`, restored at the end; one job at a time per process)."""
    saved = os.environ.get(METRICS_OFF_ENV)
    if on:
        os.environ.pop(METRICS_OFF_ENV, None)
    else:
        os.environ[METRICS_OFF_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(METRICS_OFF_ENV, None)
        else:
            os.environ[METRICS_OFF_ENV] = saved


def enabled() -> bool:
    """Whether this process serves metrics (:data:`METRICS_OFF_ENV` not set)."""
    return not os.environ.get(METRICS_OFF_ENV)


_SERVED: dict[str, str] = {}
_SERVED_LOCK: Final = threading.Lock()


METRICS_PORT_ENV: Final = "ELASTICPS_METRICS_PORT"
"""The port :func:`serve` binds when set (the Kubernetes backend's pods: a fixed port
that their scrape annotations name); unset or 0, a free one."""


def serve(host: str) -> str:
    """Serve this process's metrics on a port of ``host``; return ``host:port``.

    The port is ``ELASTICPS_METRICS_PORT`` if set, else a free one.

    The server runs on a daemon thread for the life of the process; a second
    call for the same host returns the first one's address (a process that
    runs several jobs' trainers in turn, through the Python API, serves one).

    Raises:
        OSError: the port cannot be bound.
    """
    with _SERVED_LOCK:
        if host not in _SERVED:
            port = int(os.environ.get(METRICS_PORT_ENV) or 0)
            server, _ = start_http_server(port, addr=host)
            netloc = f"[{host}]" if ":" in host else host
            _SERVED[host] = f"{netloc}:{int(server.server_port)}"
        return _SERVED[host]


def register(store: JobStore, lease: KeptLease, role: str, role_id: str, address: str) -> bool:
    """Publish ``address`` as the metrics target of ``role`` ``role_id``, under ``lease``.

    A failed write is logged, not raised: a role runs on without its target
    listed (its metrics are still served). If the write failed because the
    lease is gone, the role's own lease watch ends it, as it would anyway.

    Returns:
        Whether the target was written.
    """
    from elasticps.errors import CoordinationError

    try:
        store.put_json(
            store.keys.metrics(f"{role}-{role_id}"),
            {"address": address, "role": role, "id": role_id},
            lease,
        )
    except CoordinationError as exc:
        log.warning("%s %s: metrics target %s not published: %s", role, role_id, address, exc)
        return False
    return True


STRAGGLER_FACTOR: Final = 2.0
"""A trainer whose mean step time is this many times the median of all trainers'
is a straggler."""


def stragglers(step_s: Mapping[str, float], factor: float = STRAGGLER_FACTOR) -> list[str]:
    """The trainers whose mean step time is above ``factor`` times the median. Pure.

    Args:
        step_s: each trainer's mean step time, seconds, by trainer id.
        factor: how far above the median, > 1.

    Returns:
        The stragglers' ids, sorted; none with fewer than 3 trainers (no median
        to stand out from).
    """
    if len(step_s) < 3:
        return []
    values = sorted(step_s.values())
    middle = len(values) // 2
    median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    return sorted(t for t, v in step_s.items() if median > 0 and v > factor * median)


def mean_step_s(text: str) -> float | None:
    """A trainer's mean step time from its metrics (Prometheus text), or None before its
    first step.

    Raises:
        ValueError: ``text`` is not the Prometheus text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "elasticps_trainer_step_seconds_sum":
                total = sample.value
            elif sample.name == "elasticps_trainer_step_seconds_count":
                count = sample.value
    return total / count if count else None


def shard_load(text: str) -> dict[str, dict[str, float]]:
    """Each shard's load in a parameter server's metrics (Prometheus text). Pure.

    Returns:
        By shard index: ``pushes`` (applied, duplicate and stale), ``push_bytes``
        (bytes), ``push_mean_s`` and ``pull_mean_s`` (mean seconds, 0.0 before
        the first), ``staleness_mean`` (model versions; with its histogram's
        ``staleness_sum`` and ``staleness_count``), ``refused`` (requests
        answered with ERROR), ``version`` (the shard's model version).

    Raises:
        ValueError: ``text`` is not the Prometheus text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            shard = sample.labels.get("shard")
            if shard is not None and sample.name.startswith("elasticps_ps_"):
                key = (shard, sample.name.removeprefix("elasticps_ps_"))
                sums[key] = sums.get(key, 0.0) + sample.value

    def mean(shard: str, name: str) -> float:
        count = sums.get((shard, f"{name}_count"), 0.0)
        return sums.get((shard, f"{name}_sum"), 0.0) / count if count else 0.0

    return {
        shard: {
            "pushes": sums.get((shard, "pushes_total"), 0.0),
            "push_bytes": sums.get((shard, "push_bytes_total"), 0.0),
            "push_mean_s": mean(shard, "push_seconds"),
            "pull_mean_s": mean(shard, "pull_seconds"),
            "staleness_mean": mean(shard, "staleness"),
            "staleness_sum": sums.get((shard, "staleness_sum"), 0.0),
            "staleness_count": sums.get((shard, "staleness_count"), 0.0),
            "refused": sums.get((shard, "requests_refused_total"), 0.0),
            "version": sums.get((shard, "model_version"), 0.0),
        }
        for shard in sorted({shard for shard, _ in sums}, key=int)
    }


def staleness_since(
    before: Mapping[str, Mapping[str, float]], now: Mapping[str, Mapping[str, float]]
) -> float | None:
    """The mean staleness of the pushes between two readings of every shard's load
    (:func:`shard_load`), model versions; None when no push was counted. Pure.

    A shard whose count or sum went down (its server restarted and counts from 0)
    counts from 0; a shard missing from ``before`` too.
    """
    total = count = 0.0
    for shard, load in now.items():
        old = before.get(shard, {})
        d_count = load.get("staleness_count", 0.0) - old.get("staleness_count", 0.0)
        d_sum = load.get("staleness_sum", 0.0) - old.get("staleness_sum", 0.0)
        if d_count < 0 or d_sum < 0:  # neither goes down but by a restart
            d_count, d_sum = load.get("staleness_count", 0.0), load.get("staleness_sum", 0.0)
        total, count = total + d_sum, count + d_count
    return total / count if count > 0 else None


def targets_file(records: Mapping[str, Any], job: str) -> str:
    """The Prometheus file-based service-discovery file of the ``metrics/`` records.

    Returns:
        JSON text: ``[{"targets": ["host:port"], "labels": {"job", "role", "id"}}, ...]``,
        sorted by role and id, skipping malformed records. Pure.
    """
    found: list[tuple[str, str, str]] = []
    for record in records.values():
        if not isinstance(record, dict):
            continue
        fields = (record.get("role"), record.get("id"), record.get("address"))
        if all(isinstance(v, str) and v for v in fields):
            found.append((str(fields[0]), str(fields[1]), str(fields[2])))
    groups = [
        {"targets": [address], "labels": {"job": job, "role": role, "id": role_id}}
        for role, role_id, address in sorted(found)
    ]
    return json.dumps(groups, indent=1) + "\n"
