"""Control-plane benchmark: one master and one etcd serving many simulated trainers.

The script starts one real etcd (free ports) and one real master process
(``elasticps master``, a virtual source of ``--tasks`` tasks per pass and
``--passes`` passes, so the trainers never run out of work), then
``--trainers`` light simulated trainers spread over ``--processes`` client
processes (asyncio, one gRPC channel per trainer, as real trainers have).
A simulated trainer has no model and no parameter servers: it loops

    GetTask -> (sleep, ReportProgress) x --progress-per-task -> sleep -> ReportTask

where the sleeps add up to ``--task-s`` seconds, the time a real trainer
would spend training the task. A reply that says "wait" is obeyed.

Each value of ``--task-s`` (default ``0,1,5``) is one phase with fresh
trainers: ``--warmup-s`` seconds to ramp up, then a ``--seconds`` window in
which the script measures

- ``tasks_per_s``: tasks reported done by the simulated trainers;
- ``get_task_p50_ms`` / ``get_task_p99_ms``: latency of ``GetTask`` as the
  trainers see it (gRPC included); ``rpc_p50_ms`` / ``rpc_p99_ms`` over all
  three calls;
- ``etcd_writes_per_task``: raft proposals etcd committed per task
  (``etcd_server_proposals_committed_total``), and ``etcd_keys_put_per_task``
  (``etcd_mvcc_put_total``), both from etcd's ``/metrics``, with etcd's WAL
  fsyncs per second and their mean duration;
- ``master_cpu_cores``: the master process's CPU seconds per wall second
  (``/proc/<pid>/stat``), ``master_cpu_ms_per_task``, and ``master_rss_mib``
  (``VmRSS`` at the end of the window);
- ``clients_cpu_cores``: the same for the client processes, to show that
  they were not what limited the rate (on a machine with few cores they
  compete with the master for the CPU).

``--task-s 0`` saturates the master: its ``tasks_per_s`` is the capacity.
The summary line's ``projection`` turns that capacity into the shortest task
that ``--project-trainers`` (10,000) trainers may run for the master to keep
up (``min_task_s = trainers / capacity``), and gives the etcd write rate and
master CPU at that point. It also says what bounded the capacity: the
master's CPU (``master_cpu_cores`` near 1: one Python process, the GIL) or
its serial critical section (one lock held across a synchronous etcd
transaction per call: ``master_cpu_cores`` well below 1 while saturated).

Run:

    .venv/bin/python benchmarks/control_plane.py                  # 1,000 trainers, ~3 min
    .venv/bin/python benchmarks/control_plane.py --task-s 0,2 --trainers 2000
    .venv/bin/python benchmarks/control_plane.py --quick          # 40 trainers, one phase
    .venv/bin/python benchmarks/control_plane.py --smoke          # the test suite's, shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_TRAINERS = 10_000


JOB = "bench-control"


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


# --- the simulated trainers (client processes) ------------------------------------


@dataclass
class ClientStats:
    """What one client process saw inside the measuring window."""

    tasks: int = 0
    get_task: list[float] | None = None
    rpc: list[float] | None = None
    waits: int = 0
    errors: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.get_task = []
        self.rpc = []


async def _trainer(index: int, spec: dict[str, Any], stats: ClientStats) -> None:
    import grpc

    from elasticps.proto import master_pb2, master_pb2_grpc

    trainer_id = f"{spec['prefix']}-{index}"
    t_start, t_end = spec["t_start"], spec["t_end"]
    task_s, reports = spec["task_s"], spec["progress_per_task"]
    async with grpc.aio.insecure_channel(spec["address"]) as channel:
        stub = master_pb2_grpc.MasterStub(channel)  # type: ignore[no-untyped-call]

        async def call(method: str, request: object, is_get: bool = False) -> Any:
            t0 = time.monotonic()
            reply = await getattr(stub, method)(request, timeout=60.0)
            t1 = time.monotonic()
            if t_start <= t0 and t1 <= t_end:
                assert stats.rpc is not None and stats.get_task is not None
                stats.rpc.append(t1 - t0)
                if is_get:
                    stats.get_task.append(t1 - t0)
            return reply

        # Spread the first calls over the ramp-up, as trainers start at different times.
        await asyncio.sleep(spec["stagger_s"] * (index % spec["count"]) / spec["count"])
        while time.monotonic() < t_end:
            try:
                reply = await call(
                    "GetTask", master_pb2.GetTaskRequest(trainer_id=trainer_id), is_get=True
                )
                kind = reply.WhichOneof("result")
                if kind == "finished":
                    stats.finished = True
                    return
                if kind != "task":
                    stats.waits += 1
                    await asyncio.sleep(max(reply.wait_s, 0.01))
                    continue
                task = reply.task
                rows = task.end - task.start
                for k in range(1, reports + 1):
                    await asyncio.sleep(task_s / (reports + 1))
                    await call(
                        "ReportProgress",
                        master_pb2.ReportProgressRequest(
                            trainer_id=trainer_id,
                            task_id=task.task_id,
                            pass_id=task.pass_id,
                            attempt=task.attempt,
                            offset=rows * k // (reports + 1),
                        ),
                    )
                await asyncio.sleep(task_s / (reports + 1))
                await call(
                    "ReportTask",
                    master_pb2.ReportTaskRequest(
                        trainer_id=trainer_id,
                        task_id=task.task_id,
                        pass_id=task.pass_id,
                        attempt=task.attempt,
                        success=True,
                        samples=rows,
                    ),
                )
                if t_start <= time.monotonic() <= t_end:
                    stats.tasks += 1
            except grpc.aio.AioRpcError:
                stats.errors += 1
                await asyncio.sleep(0.1)


async def _client_main(spec: dict[str, Any]) -> ClientStats:
    stats = ClientStats()
    ids = range(spec["first_id"], spec["first_id"] + spec["count"])
    await asyncio.gather(*(_trainer(i, spec, stats) for i in ids))
    return stats


def client(spec_json: str) -> int:
    """A client process: register its simulated trainers in etcd (under one lease, as the
    master answers only registered trainers), run them, print one JSON line of what it saw."""
    from elasticps.coord.store import JobStore

    spec = json.loads(spec_json)
    with JobStore(spec["etcd"], JOB) as store:
        lease = store.grant_lease(60.0)
        for i in range(spec["first_id"], spec["first_id"] + spec["count"]):
            store.register_trainer(f"{spec['prefix']}-{i}", {}, lease)
        stats = asyncio.run(_client_main(spec))
        lease.revoke()
    cpu = time.process_time()
    print(
        json.dumps(
            {
                "tasks": stats.tasks,
                "get_task": [round(x, 6) for x in stats.get_task or []],
                "rpc": [round(x, 6) for x in stats.rpc or []],
                "waits": stats.waits,
                "errors": stats.errors,
                "finished": stats.finished,
                "cpu_s": cpu,
            }
        ),
        flush=True,
    )
    return 0


# --- the parent: etcd, master, phases -------------------------------------------------


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024.0, 1)
    return math.nan


def etcd_counters(endpoint: str) -> dict[str, float]:
    """The write counters of etcd's Prometheus endpoint."""
    wanted = {
        "etcd_server_proposals_committed_total": "proposals",
        "etcd_mvcc_put_total": "puts",
        "etcd_mvcc_range_total": "ranges",
        "etcd_disk_wal_fsync_duration_seconds_sum": "fsync_s",
        "etcd_disk_wal_fsync_duration_seconds_count": "fsyncs",
    }
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return round(1000.0 * ordered[index], 2)


def sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


@dataclass
class Servers:
    """The master and etcd under test, and the client processes running now."""

    address: str
    master_pid: int
    etcd_endpoint: str
    children: list[subprocess.Popen[bytes]]


def run_phase(
    args: argparse.Namespace, phase: int, task_s: float, servers: Servers
) -> dict[str, Any]:
    """One phase: fresh simulated trainers with tasks of ``task_s`` seconds; its result line."""
    from elasticps.testing import process_cpu_s

    address, master_pid = servers.address, servers.master_pid
    etcd_endpoint, children = servers.etcd_endpoint, servers.children
    per_process = -(-args.trainers // args.processes)
    spawn_s = 2.0 + args.trainers / 500.0  # imports and channels of the client processes
    t_start = time.monotonic() + spawn_s + args.warmup_s
    t_end = t_start + args.seconds
    procs: list[subprocess.Popen[bytes]] = []
    first = 0
    while first < args.trainers:
        count = min(per_process, args.trainers - first)
        spec = {
            "address": address,
            "etcd": etcd_endpoint,
            "prefix": f"sim{phase}",
            "first_id": first,
            "count": count,
            "t_start": t_start,
            "t_end": t_end,
            "task_s": task_s,
            "progress_per_task": args.progress_per_task,
            "stagger_s": min(args.warmup_s / 2.0, max(task_s, 1.0)),
        }
        proc = subprocess.Popen(
            [sys.executable, __file__, "--client", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        procs.append(proc)
        children.append(proc)
        first += count
    sleep_until(t_start)
    cpu0, etcd0 = process_cpu_s(master_pid), etcd_counters(etcd_endpoint)
    clients0 = sum(_cpu_or_zero(p.pid) for p in procs)
    sleep_until(t_end)
    cpu1, etcd1 = process_cpu_s(master_pid), etcd_counters(etcd_endpoint)
    clients1 = sum(_cpu_or_zero(p.pid) for p in procs)
    rss = proc_rss_mib(master_pid)
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120.0 + 2 * task_s)
        children.remove(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"a client process exited {proc.returncode}")
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    tasks = sum(r["tasks"] for r in results)
    get_lat = [x for r in results for x in r["get_task"]]
    rpc_lat = [x for r in results for x in r["rpc"]]
    per_task = 1.0 / tasks if tasks else math.nan
    master_cpu = cpu1 - cpu0
    return {
        "phase": phase,
        "task_s": task_s,
        "trainers": args.trainers,
        "progress_per_task": args.progress_per_task,
        "window_s": args.seconds,
        "tasks": tasks,
        "tasks_per_s": round(tasks / args.seconds, 1),
        "offered_tasks_per_s": round(args.trainers / task_s, 1) if task_s > 0 else None,
        # Calls that started and ended inside the window (long waits straddle its ends).
        "rpcs_per_s": round(len(rpc_lat) / args.seconds, 1),
        "get_task_p50_ms": percentile_ms(get_lat, 0.5),
        "get_task_p99_ms": percentile_ms(get_lat, 0.99),
        "rpc_p50_ms": percentile_ms(rpc_lat, 0.5),
        "rpc_p99_ms": percentile_ms(rpc_lat, 0.99),
        "etcd_writes_per_task": round((etcd1["proposals"] - etcd0["proposals"]) * per_task, 3),
        "etcd_keys_put_per_task": round((etcd1["puts"] - etcd0["puts"]) * per_task, 3),
        "etcd_fsyncs_per_s": round((etcd1["fsyncs"] - etcd0["fsyncs"]) / args.seconds, 1),
        "etcd_fsync_ms_mean": round(
            1000.0
            * (etcd1["fsync_s"] - etcd0["fsync_s"])
            / max(1.0, etcd1["fsyncs"] - etcd0["fsyncs"]),
            3,
        ),
        "master_cpu_cores": round(master_cpu / args.seconds, 3),
        "master_cpu_ms_per_task": round(1000.0 * master_cpu * per_task, 3),
        "master_rss_mib": rss,
        "clients_cpu_cores": round((clients1 - clients0) / args.seconds, 3),
        "waits": sum(r["waits"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "ran_out_of_tasks": any(r["finished"] for r in results),
    }


def _cpu_or_zero(pid: int) -> float:
    from elasticps.testing import process_cpu_s

    try:
        return process_cpu_s(pid)
    except OSError:
        return 0.0


def projection(phases: list[dict[str, Any]], trainers: int) -> dict[str, Any]:
    """The shortest task ``trainers`` trainers may run, from the saturated phase's rate."""
    saturated = [p for p in phases if p["task_s"] == 0 and p["tasks"]]
    if not saturated:
        # No saturation phase: the master's CPU per task bounds it from above
        # (one Python process: at most one core for the service).
        best = min((p for p in phases if p["tasks"]), key=lambda p: p["master_cpu_ms_per_task"])
        capacity = 1000.0 / best["master_cpu_ms_per_task"]
        basis = "cpu_bound_estimate"
    else:
        best = saturated[0]
        capacity = best["tasks_per_s"]
        basis = "measured_saturation"
    cores = best["master_cpu_cores"]
    bottleneck = (
        "master CPU (one Python process)"
        if cores >= 0.8
        else "master critical section (lock held across a synchronous etcd transaction per call)"
    )
    return {
        "trainers": trainers,
        "capacity_tasks_per_s": round(capacity, 1),
        "basis": basis,
        "min_task_s": round(trainers / capacity, 2) if capacity else None,
        "etcd_writes_per_s_at_capacity": round(capacity * best["etcd_writes_per_task"], 1),
        "master_cpu_cores_at_capacity": cores,
        "bottleneck": bottleneck,
    }


def run(args: argparse.Namespace) -> int:
    from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig
    from elasticps.coord.store import JobStore

    task_values = [float(v) for v in args.task_s.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="elasticps-bench-control-"))
    etcd = EtcdServer(
        EtcdServerConfig(data_dir=workdir / "etcd", client_port=0), log_path=workdir / "etcd.log"
    )
    children: list[subprocess.Popen[bytes]] = []
    master: subprocess.Popen[bytes] | None = None
    store = None
    try:
        etcd.start()
        job = JOB
        env = {**os.environ, "ELASTICPS_LEDGER_ONLY": "1"}  # no parameter servers to verify
        with (workdir / "master.log").open("wb") as log:
            master = subprocess.Popen(
                [sys.executable, "-m", "elasticps", "--log-level", "WARNING", "master",
                 "--job", job, "--etcd", etcd.endpoint, "--mode", "async",
                 "--virtual-records", str(args.tasks * args.records_per_task),
                 "--records-per-task", str(args.records_per_task),
                 "--epochs", str(args.passes), "--task-timeout-s", "600"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        store = JobStore(etcd.endpoint, job)
        t0 = time.monotonic()
        address = store.master_address(timeout_s=300.0)
        emit({"start": True, "trainers": args.trainers, "processes": args.processes,
              "task_s": task_values, "tasks_per_pass": args.tasks,
              "master_ready_s": round(time.monotonic() - t0, 2), "master_pid": master.pid,
              "etcd_pid": etcd.pid, "workdir": str(workdir)})  # fmt: skip
        phases = []
        for i, task_s in enumerate(task_values):
            line = run_phase(args, i, task_s, Servers(address, master.pid, etcd.endpoint, children))
            phases.append(line)
            emit(line)
            if master.poll() is not None:
                raise RuntimeError(f"the master exited {master.returncode}; see {workdir}")
        emit(
            {
                "summary": True,
                "tasks_per_s": {str(p["task_s"]): p["tasks_per_s"] for p in phases},
                "get_task_p99_ms": {str(p["task_s"]): p["get_task_p99_ms"] for p in phases},
                "etcd_writes_per_task": statistics.median(
                    p["etcd_writes_per_task"] for p in phases
                ),
                "master_rss_mib": max(p["master_rss_mib"] for p in phases),
                "projection": projection(phases, args.project_trainers),
                "master_pid": master.pid,
                "etcd_pid": etcd.pid,
            }
        )
        return 0
    finally:
        for proc in children:
            proc.kill()
            proc.wait()
        if master is not None and master.poll() is None:
            master.send_signal(signal.SIGTERM)
            try:
                master.wait(timeout=15)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
        if store is not None:
            store.close()
        etcd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=1000, help="simulated trainers")
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    parser.add_argument(
        "--task-s", default="0,1,5", help="comma-separated seconds per task, one phase each"
    )
    parser.add_argument("--progress-per-task", type=int, default=1, help="ReportProgress calls")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="ramp-up before a window")
    parser.add_argument("--seconds", type=float, default=30.0, help="measuring window")
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks per pass")
    parser.add_argument("--passes", type=int, default=1000, help="passes (never runs out)")
    parser.add_argument("--records-per-task", type=int, default=100)
    parser.add_argument("--project-trainers", type=int, default=PROJECT_TRAINERS)
    parser.add_argument(
        "--quick", action="store_true", help="40 trainers, one short phase: a smoke run"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: --quick with 20 trainers, a 0.5 s ramp and a 1.5 s window "
        "(figures mean nothing)",
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client(args.client)
    if args.quick or args.smoke:
        args.trainers, args.processes, args.task_s = 40, 2, "0"
        args.warmup_s, args.seconds, args.tasks = 1.0, 3.0, 400
    if args.smoke:
        args.trainers, args.warmup_s, args.seconds, args.tasks = 20, 0.5, 1.5, 200
    if args.records_per_task < args.progress_per_task + 1:
        parser.error("--records-per-task must exceed --progress-per-task")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
