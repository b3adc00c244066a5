"""Recovery benchmark: how fast a job recovers from SIGKILLed processes.

Each scenario runs a real ``elasticps train`` job (MNIST MLP, 3 trainers,
2 PS, lease TTL 2 s) with one ``--chaos`` kill at 40 % of the task
dispatches, and prints one JSON line:

- ``recovery_s``: from the kill to the event that shows the job is moving
  again. For a trainer: its pending tasks re-queued by the master (the log
  line ``trainer N left``). For a PS: the restarted PS (or, with
  ``--standby-ps 1``, the warm spare that took its slot) accepting its first
  gradient. For a master: the new (standby or restarted) master dispatching
  its first task. For etcd: the end of the longest stall of gradient steps.
- ``max_stall_s``: the longest time, from 1 s before the kill to the end of
  the job, in which no parameter server applied a step (PS versions are
  polled every 50 ms through the tensor plane's ``stats`` command).
- ``samples_per_s_before`` / ``samples_per_s_after``: training rate over
  the 5 s before the kill and the 5 s after recovery, from the launcher's
  timeline in ``run.json`` (samples of reported tasks).
- ``target_s`` and ``within_target``: the recovery targets (trainer: tasks
  re-queued within 2 s, and sync never stalls longer than 2 x lease TTL;
  PS: training resumes within 5 s; master failover to a standby: 3 s).
- ``updates_lost`` and ``updates_duplicated``: from a second job with the same
  fault, on the audit model (:mod:`elasticps.testing.audit`: one counter per
  record, +1 per applied gradient): the counters short of, or above, the
  number of passes, summed. Exactly-once is 0 and 0. ``reported_lost``,
  ``reported_exactly_once``: what that job's ``run.json`` says; the
  ``ps-lost`` scenario (a parameter server killed together with its
  checkpoint files, which no recovery can undo) must report its loss.

Usage::

    .venv/bin/python benchmarks/recovery.py            # every scenario, once
    .venv/bin/python benchmarks/recovery.py --repeat 3 # medians over 3 runs
    .venv/bin/python benchmarks/recovery.py --quick    # one small scenario (smoke test)
    .venv/bin/python benchmarks/recovery.py --smoke    # the test suite's: --quick in one job

``--smoke`` runs ``--quick``'s scenario for 1 pass over 2,000 rows, in one
job instead of two: the audit job, measured as the scenario's job is (its
figures mean nothing; the MNIST job is not run).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError
from elasticps.netutil import free_port
from elasticps.snapshot import ControlClient
from elasticps.testing.audit import check_run, write_dataset

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "mnist_mlp.py"
LEASE_TTL_S = 2.0
POLL_S = 0.05


@dataclass(frozen=True)
class Scenario:
    """One kill and how to tell it has been recovered from."""

    name: str
    mode: str
    chaos: str
    recovered_marker: str | None  # a log fragment; None: the end of the longest stall
    target_s: float
    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


SCENARIOS = (
    Scenario("trainer-sync", "sync", "kill:trainer@40%", "left;", 2.0),
    Scenario("trainer-async", "async", "kill:trainer@40%", "left;", 2.0),
    Scenario("ps-restart", "sync", "kill:ps@40%", "first gradient accepted", 5.0),
    Scenario(
        "ps-standby",
        "sync",
        "kill:ps@40%",
        "first gradient accepted",
        5.0,
        ("--standby-ps", "1"),
    ),
    Scenario(
        "master-standby",
        "sync",
        "kill:master@40%",
        "first task dispatched",
        3.0,
        ("--standby-masters", "1"),
    ),
    Scenario("master-restart", "sync", "kill:master@40%", "first task dispatched", 10.0),
    Scenario("etcd-restart", "sync", "kill:etcd@40%", None, 2 * LEASE_TTL_S),
    Scenario("ps-restart-async", "async", "kill:ps@40%", "first gradient accepted", 5.0),
    Scenario(
        "ps-partitioned",
        "sync",
        "pause:ps-0@40%:6s",
        "first gradient accepted",
        5.0,
        ("--standby-ps", "1"),
    ),
    Scenario(
        "trainer-after-ack",
        "async",
        "",
        "left;",
        2.0,
        env=(("ELASTICPS_TEST_KILL_AFTER_ACK", "2:30"),),
    ),
    Scenario("ps-lost", "async", "lose:ps-0@60%", "first gradient accepted", 5.0),
)


class VersionPoller:
    """Polls every PS's model version through the ``stats`` control command."""

    def __init__(self, etcd_endpoint: str, job: str) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (unix time, shard, version)
        self._endpoint = etcd_endpoint
        self._job = job
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        store: JobStore | None = None
        clients: dict[int, ControlClient] = {}
        while not self._stop.wait(POLL_S):
            try:
                if store is None:
                    store = JobStore(self._endpoint, self._job, timeout_s=0.5)
                for index in range(2):  # the job's two shards
                    client = clients.get(index)
                    if client is None:
                        info = store.get_json(store.keys.ps(index))
                        if info is None or not isinstance(info.get("address"), str):
                            continue
                        client = clients[index] = ControlClient(str(info["address"]), timeout_s=1)
                    try:
                        stats = client.request({"op": "stats"})
                    except (ElasticPSError, OSError):
                        clients.pop(index).close()
                        continue
                    inner = stats.get("stats")
                    if isinstance(inner, dict) and isinstance(inner.get("version"), int):
                        self.samples.append((time.time(), index, inner["version"]))
            except (ElasticPSError, OSError):
                continue  # etcd or a PS is down: exactly what we measure
        for client in clients.values():
            client.close()
        if store is not None:
            with contextlib.suppress(ElasticPSError):
                store.close()


def _log_time(line: str) -> float | None:
    """Unix time of a child log line ``[role] 2026-11-22 00:10:15,439 ...``."""
    try:
        stamp = line.split("] ", 1)[1][:23]
        return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except (IndexError, ValueError):
        return None


def _rate(timeline: list[list[float]], start: float, end: float) -> float | None:
    points = [(t, s) for t, _, s in timeline if start <= t <= end]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _max_stall(samples: list[tuple[float, int, int]], start: float, end: float) -> float:
    """Longest time between two increases of any shard's version within [start, end]."""
    last: dict[int, int] = {}
    moves = [start]
    for t, shard, version in sorted(samples):
        if shard in last and version > last[shard] and start <= t <= end:
            moves.append(t)
        last[shard] = version
    moves.append(end)
    return max(b - a for a, b in itertools.pairwise(moves))


def _job(
    scenario: Scenario, cmd: list[str], out: Path, poller: VersionPoller | None
) -> tuple[int, str, str]:
    env = {**os.environ, **dict(scenario.env)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if poller is not None:
            poller.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            for pid in json.loads((out / "pids.json").read_text()).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return proc.returncode, stdout, stderr


def _train_cmd(scenario: Scenario, epochs: int, out: Path, *model: str) -> list[str]:
    """``elasticps train`` of ``scenario``'s job shape and fault; ``model``: the model's flags."""
    return [
        sys.executable, "-m", "elasticps", "train", *model, "--output", str(out),
        "--trainers", "3", "--ps", "2", "--mode", scenario.mode,
        "--epochs", str(epochs), "--records-per-task", "200",
        "--lease-ttl-s", str(LEASE_TTL_S), "--checkpoint-every-s", "1", "--no-progress",
        *(["--chaos", scenario.chaos] if scenario.chaos else []), *scenario.extra,
    ]  # fmt: skip


def audit_cmd(scenario: Scenario, audit: Path, epochs: int, out: Path) -> list[str]:
    """The ``elasticps train`` command of ``scenario``'s fault on the audit model."""
    records = json.loads((audit / "audit.json").read_text())["records"]
    return _train_cmd(
        scenario, epochs, out,
        "--model", str(audit / "audit_model.py"), "--data", str(audit),
        "--model-args", json.dumps({"records": records}), "--optimizer", "sgd", "--lr", "1",
        "--sync-reduction", "sum", "--push-every", "1", "--big-array-bound", "500",
    )  # fmt: skip


def run_audit(scenario: Scenario, audit: Path, epochs: int) -> dict[str, object]:
    """The same fault on the audit model: the updates lost and duplicated, measured."""
    with tempfile.TemporaryDirectory(prefix="elasticps-recovery-audit-") as tmp:
        out = Path(tmp) / "out"
        code, _, stderr = _job(scenario, audit_cmd(scenario, audit, epochs, out), out, None)
        if code != 0:
            return {"audit_error": stderr[-2000:]}
        return audit_result(out)


def audit_result(out: Path) -> dict[str, object]:
    """What the audit job that wrote ``out`` lost and duplicated, and what it reported."""
    record = json.loads((out / "run.json").read_text())
    result = check_run(out)
    return {
        "updates_lost": result.updates_lost,
        "updates_duplicated": result.updates_duplicated,
        "updates_expected": result.records * result.passes,
        "reported_exactly_once": record.get("exactly_once"),
        "reported_lost": record.get("records_lost"),
        "reported_passes_lost": record.get("passes_lost"),
        "records_reopened": record.get("records_reopened"),
    }


def run_scenario(
    scenario: Scenario, data: Path, audit: Path, epochs: int, *, one_job: bool = False
) -> dict[str, object]:
    """Run ``scenario``'s job and measure its recovery, then its audit job.

    ``one_job`` (``--smoke``): the measured job is the audit job itself (the
    audit model instead of the MNIST MLP): one job instead of two.
    """
    port = free_port()
    job = "recovery"
    with tempfile.TemporaryDirectory(prefix="elasticps-recovery-") as tmp:
        out = Path(tmp) / "out"
        if one_job:
            cmd = audit_cmd(scenario, audit, epochs, out)
        else:
            cmd = _train_cmd(scenario, epochs, out, "--model", str(MLP), "--data", str(data))
        cmd += ["--etcd-port", str(port), "--job", job]
        poller = VersionPoller(f"127.0.0.1:{port}", job)
        code, stdout, stderr = _job(scenario, cmd, out, poller)
        if code != 0:
            return {"scenario": scenario.name, "error": stderr[-2000:]}
        record = json.loads((out / "run.json").read_text())
        audited = audit_result(out) if one_job else None
    if record["chaos"]:
        kill_t = float(record["chaos"][0]["wall_clock_s"])
        killed = record["chaos"][0]["target"]
    else:  # a trainer killed by the test hook: the launcher's notice of it
        notices = [
            t for line in stderr.splitlines()
            if "test hook: SIGKILL" in line and (t := _log_time(line)) is not None
        ]  # fmt: skip
        kill_t = min(notices) if notices else float("nan")
        killed = "trainer (after an acknowledged push)"
    timeline = record["timeline"]
    end_t = float(timeline[-1][0]) if timeline else kill_t + 30
    stall = _max_stall(poller.samples, kill_t - 1.0, end_t)
    if scenario.recovered_marker is None:
        recovered_t = kill_t + stall
    else:
        times = [
            t
            for line in stderr.splitlines()
            if scenario.recovered_marker in line
            and (t := _log_time(line)) is not None
            and t >= kill_t
        ]
        recovered_t = min(times) if times else float("nan")
    recovery_s = recovered_t - kill_t
    result: dict[str, object] = {
        "scenario": scenario.name,
        "mode": scenario.mode,
        "killed": killed,
        "recovery_s": round(recovery_s, 3),
        "max_stall_s": round(stall, 3),
        "samples_per_s_before": _round(_rate(timeline, kill_t - 5, kill_t)),
        "samples_per_s_after": _round(_rate(timeline, recovered_t, recovered_t + 5)),
        "target_s": scenario.target_s,
        "within_target": recovery_s <= scenario.target_s,
        "accuracy": json.loads(stdout.strip().splitlines()[-1]).get("accuracy"),
        "exactly_once": record.get("exactly_once"),
    }
    if scenario.name == "trainer-sync":
        result["sync_stall_target_s"] = 2 * LEASE_TTL_S
        result["sync_stall_within_target"] = stall <= 2 * LEASE_TTL_S
    result.update(audited if audited is not None else run_audit(scenario, audit, epochs))
    return result


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario (medians)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one trainer-kill run, 2 epochs")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: --quick with 1 pass over 2,000 rows (10 tasks), in one job: "
        "the audit job, measured as the scenario's job (no MNIST job)",
    )
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    scenarios = SCENARIOS[:1] if args.quick else SCENARIOS
    if args.only:
        scenarios = tuple(s for s in SCENARIOS if s.name in args.only.split(","))
    epochs = 1 if args.smoke else 2 if args.quick else args.epochs
    rows = 2000 if args.smoke else 4000
    with (
        tempfile.TemporaryDirectory(prefix="elasticps-mnist-") as data,
        tempfile.TemporaryDirectory(prefix="elasticps-audit-") as audit,
    ):
        if not args.smoke:  # --smoke trains the audit model only
            from elasticps.data.mnist import prepare_mnist

            # What `elasticps data mnist` writes (its first `rows` training rows).
            prepare_mnist(Path(data))
            if rows < 4000:
                import pyarrow.parquet as pq

                train = Path(data) / "train.parquet"
                pq.write_table(pq.read_table(train).slice(0, rows), train, row_group_size=256)
        write_dataset(Path(audit), rows)
        summary = []
        for scenario in scenarios:
            runs = []
            for _ in range(args.repeat):
                result = run_scenario(scenario, Path(data), Path(audit), epochs, one_job=args.smoke)
                print(json.dumps(result), flush=True)
                runs.append(result)
            good = [r for r in runs if "error" not in r]
            if good:
                summary.append(
                    {
                        "scenario": scenario.name,
                        "median_recovery_s": statistics.median(
                            float(str(r["recovery_s"])) for r in good
                        ),
                        "target_s": scenario.target_s,
                        "runs": len(good),
                        "updates_lost": [r.get("updates_lost") for r in good],
                        "updates_duplicated": [r.get("updates_duplicated") for r in good],
                    }
                )
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
