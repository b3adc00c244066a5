"""Master benchmark: ``GetTask`` + ``ReportTask`` rate and latency with the ledger in etcd.

For each queue size (default 1,000, 10,000 and 100,000 tasks) this script
creates a job on one real etcd (started here on free ports), opens the real
:class:`~elasticps.master.ledger.Ledger` (which writes one key per task, in
fenced transactions of up to 100 writes) and serves the real
:class:`~elasticps.master.service.MasterService` over real gRPC on a loopback
port. One client thread, the real :class:`~elasticps.master.client.MasterClient`
a trainer uses, then loops ``get_task`` -> ``report_task(success=True)``; every
call persists the task's record in etcd before it is answered.

Steady-state windows of ``--window`` task round trips (2 operations each) are
timed at two places in the pass:

``start``
    the first tasks of a fresh ledger;
``middle``
    after a fast-forward to the middle of the pass: half the tasks are
    dispatched and completed directly on the in-memory queue (with the service
    stopped) and their records written to etcd in batched fenced transactions,
    exactly what the service would have persisted; then a new service serves
    the same queue and ledger.

The windows of all sizes are interleaved (size order rotated every
repetition), so a noisy machine hurts every size alike. Per size it prints the
ledger creation time, then per window kind the operations/s (median over the
repetitions) and the p50 / p99 latency of single operations in ms (over all
operations of that kind), and finally a summary with
``rate(largest) / rate(smallest)``, whose target is >= 0.8: the cost of a
task operation must not grow with the number of tasks.

Run:

    .venv/bin/python benchmarks/master.py            # 1k, 10k, 100k tasks, ~1-2 min
    .venv/bin/python benchmarks/master.py --quick    # 200 and 2,000 tasks, a few seconds
    .venv/bin/python benchmarks/master.py --smoke    # the test suite's: 100 and 1,000 tasks
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig
from elasticps.coord.store import JobStore, KeptLease
from elasticps.master.client import MasterClient
from elasticps.master.ledger import Ledger, LedgerSpec
from elasticps.master.service import MasterService
from elasticps.master.taskqueue import Dispatch, QueueConfig, TaskEvent, TaskQueue
from elasticps.netutil import LOOPBACK
from elasticps.proto import master_pb2, master_pb2_grpc

RECORDS_PER_TASK = 10
FAST_FORWARD_BATCH = 2000  # tasks per Ledger.persist call while fast-forwarding


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


@dataclass
class Master:
    """One job: its ledger, queue and (while serving) its gRPC service."""

    num_tasks: int
    store: JobStore
    lease: KeptLease
    ledger: Ledger
    queue: TaskQueue
    create_s: float
    server: grpc.Server | None = None
    service: MasterService | None = None
    client: MasterClient | None = None
    rates: dict[str, list[float]] = field(default_factory=dict)
    latencies: dict[str, list[float]] = field(default_factory=dict)

    def serve(self) -> None:
        """Start a MasterService on the queue, over gRPC on a free loopback port."""
        self.service = MasterService(self.queue, self.ledger)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        master_pb2_grpc.add_MasterServicer_to_server(self.service, self.server)  # type: ignore[no-untyped-call]
        port = self.server.add_insecure_port(f"{LOOPBACK}:0")
        self.server.start()
        self.client = MasterClient(f"{LOOPBACK}:{port}")

    def stop_serving(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop(grace=None).wait(5)
        if self.service is not None:
            self.service.stop()
        self.client = self.server = self.service = None

    def window(self, kind: str, pairs: int) -> None:
        """Time ``pairs`` get_task + report_task round trips through gRPC."""
        client = self.client
        assert client is not None
        lat = self.latencies.setdefault(kind, [])
        ops = 0
        t_start = time.perf_counter()
        for _ in range(pairs):
            t0 = time.perf_counter()
            reply = client.get_task("bench")
            t1 = time.perf_counter()
            if reply.WhichOneof("result") != "task":
                raise RuntimeError(f"{self.num_tasks} tasks: no task to hand out: {reply}")
            task = reply.task
            client.report_task(
                master_pb2.ReportTaskRequest(
                    trainer_id="bench",
                    task_id=task.task_id,
                    pass_id=task.pass_id,
                    attempt=task.attempt,
                    success=True,
                    samples=task.end - task.start,
                )
            )
            t2 = time.perf_counter()
            lat.extend((t1 - t0, t2 - t1))
            ops += 2
        self.rates.setdefault(kind, []).append(ops / (time.perf_counter() - t_start))

    def fast_forward(self, to_task: int) -> float:
        """Complete tasks on the in-memory queue (service stopped) up to ``to_task``.

        Returns:
            Seconds spent, including the batched ledger writes.
        """
        assert self.service is None
        t0 = time.perf_counter()
        events: list[TaskEvent] = []
        while self.queue.stats().done < to_task:
            now = time.monotonic()
            result, got = self.queue.get_task("fast-forward", now)
            assert isinstance(result, Dispatch)
            events.extend(got)
            events.extend(
                self.queue.report_task(
                    result.task_id, result.pass_id, result.attempt, success=True, now=now
                )
            )
            if len(events) >= 2 * FAST_FORWARD_BATCH:
                self.ledger.persist(self.queue, events)
                events = []
        self.ledger.persist(self.queue, events)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stop_serving()
        self.lease.revoke()
        self.store.close()


def open_master(endpoint: str, num_tasks: int, num_passes: int) -> Master:
    store = JobStore(endpoint, f"bench-master-{num_tasks}")
    lease = store.grant_lease(30.0)
    if not store.acquire_master_lock(f"{LOOPBACK}:0", lease):
        raise RuntimeError("could not take the master lock of a fresh job")
    ledger = Ledger(store, lease)
    spec = LedgerSpec(
        files=(("/bench/data.parquet", num_tasks * RECORDS_PER_TASK),),
        records_per_task=RECORDS_PER_TASK,
        num_passes=num_passes,
    )
    config = QueueConfig(task_timeout_s=3600.0, max_task_timeouts=3, num_passes=num_passes)
    t0 = time.perf_counter()
    queue, restored = ledger.open(spec, config, time.monotonic())
    create_s = time.perf_counter() - t0
    assert not restored
    return Master(num_tasks, store, lease, ledger, queue, create_s)


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return round(1000.0 * ordered[index], 3)


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="elasticps-bench-master-"))
    etcd = EtcdServer(
        EtcdServerConfig(data_dir=workdir / "etcd", client_port=0), log_path=workdir / "etcd.log"
    )
    etcd.start()
    masters: list[Master] = []
    try:
        emit({"start": True, "sizes": sizes, "window": args.window, "reps": args.reps,
              "etcd_pid": etcd.pid, "workdir": str(workdir)})  # fmt: skip
        # Enough passes that the smallest queue never runs out of tasks.
        needed = args.window * (2 * args.reps + 1)
        for n in sizes:
            m = open_master(etcd.endpoint, n, num_passes=max(2, -(-needed // n) + 1))
            masters.append(m)
            emit({"size": n, "create_s": round(m.create_s, 3),
                  "create_tasks_per_s": round(n / m.create_s)})  # fmt: skip
        for kind in ("start", "middle"):
            for m in masters:
                if kind == "middle":
                    m.stop_serving()
                    target = max(m.queue.stats().done, m.num_tasks // 2)
                    ff_s = m.fast_forward(target)
                    emit({"size": m.num_tasks, "fast_forward_to": target,
                          "fast_forward_s": round(ff_s, 3)})  # fmt: skip
                m.serve()
                m.window(kind, args.warmup)  # untimed: connections, caches
                m.rates.pop(kind)
                m.latencies.pop(kind)
            for rep in range(args.reps):
                order = masters[rep % len(masters) :] + masters[: rep % len(masters)]
                for m in order:
                    m.window(kind, args.window)
        results: dict[int, dict[str, object]] = {}
        for m in masters:
            per_kind: dict[str, object] = {}
            for kind, rates in m.rates.items():
                lat = m.latencies[kind]
                per_kind[kind] = {
                    "ops_per_s": round(statistics.median(rates)),
                    "p50_ms": percentile_ms(lat, 0.5),
                    "p99_ms": percentile_ms(lat, 0.99),
                    "ops": len(lat),
                }
            all_rates = [r for rates in m.rates.values() for r in rates]
            all_lat = [x for lat in m.latencies.values() for x in lat]
            line = {
                "size": m.num_tasks,
                "ops_per_s": round(statistics.median(all_rates)),
                "p50_ms": percentile_ms(all_lat, 0.5),
                "p99_ms": percentile_ms(all_lat, 0.99),
                **per_kind,
                "create_s": round(m.create_s, 3),
            }
            results[m.num_tasks] = line
            emit(line)
        small, large = results[min(sizes)], results[max(sizes)]
        ratio = float(large["ops_per_s"]) / float(small["ops_per_s"])  # type: ignore[arg-type]
        emit(
            {
                "summary": True,
                "ops_per_s": {str(n): r["ops_per_s"] for n, r in results.items()},
                "p99_ms": {str(n): r["p99_ms"] for n, r in results.items()},
                "create_s": {str(n): r["create_s"] for n, r in results.items()},
                "ratio_largest_over_smallest": round(ratio, 3),
                "targets": {"rate_100k_over_1k_ge_0.8": ratio >= 0.8},
                "etcd_pid": etcd.pid,
            }
        )
        return 0
    finally:
        for m in masters:
            m.close()
        etcd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated task counts")
    parser.add_argument("--window", type=int, default=500, help="task round trips per window")
    parser.add_argument("--reps", type=int, default=3, help="windows per size and kind")
    parser.add_argument("--warmup", type=int, default=50, help="untimed round trips per phase")
    parser.add_argument("--quick", action="store_true", help="200 and 2,000 tasks: a smoke run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: 100 and 1,000 tasks, windows of 20, 1 rep (figures mean "
        "nothing)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.window, args.reps, args.warmup = "200,2000", 40, 2, 5
    if args.smoke:
        args.sizes, args.window, args.reps, args.warmup = "100,1000", 20, 1, 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # SIGTERM (e.g. from the smoke test's timeout) unwinds through the finally blocks.
    import signal

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
