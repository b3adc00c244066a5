"""The benchmarks under ``benchmarks/`` run to the end in their ``--smoke`` configuration.

These tests keep the benchmarks' code paths from rotting: each script runs as
a real subprocess (real parameter servers, real ``elasticps train`` jobs, real
torchrun), must exit 0 and print JSON lines with the keys the README
documents, and must leave no process behind. ``--smoke`` is each script's
``--quick`` made as small as still runs every kind of case once (see each
script's ``--help``). No timing is asserted: the figures are only
meaningful from a full run on a quiet machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# --smoke takes about 2-30 s on an idle 2-core machine; this bounds a hung run.
RUN_TIMEOUT_S = 300.0
GONE_DEADLINE_S = 10.0


def run_smoke(script: str) -> list[dict[str, Any]]:
    """Run ``benchmarks/<script> --smoke``; return its stdout's JSON lines.

    On a timeout the script gets SIGTERM (it then stops everything it
    started), then its process group gets SIGKILL.
    """
    proc = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / script), "--smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{script} --smoke ran over {RUN_TIMEOUT_S:.0f} s:\n{err.decode()[-3000:]}")
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{err.decode()[-3000:]}"
    lines = [line for line in out.decode().splitlines() if line.strip()]
    assert lines, f"{script} printed nothing"
    return [json.loads(line) for line in lines]


def processes_matching(needles: list[str]) -> list[str]:
    """Command lines of live processes that contain any of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def wait_until_gone(pids: list[int]) -> list[int]:
    """PIDs from ``pids`` still alive (not zombies) after GONE_DEADLINE_S."""
    deadline = time.monotonic() + GONE_DEADLINE_S
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_tensor_plane_smoke_prints_every_case_and_the_ratios() -> None:
    lines = run_smoke("tensor_plane.py")

    summary = lines[-1]
    assert summary.get("summary") is True
    for key in ("ms_median", "cpu_s_per_gb", "ratios", "targets", "server_pids"):
        assert key in summary, key
    cases = [line for line in lines[:-1] if "ms_median" in line]
    seen = {(line["case"], line["num_ps"]) for line in cases}
    for num_ps in (1, 2):
        for case in (
            "elasticps-tcp",
            "elasticps-tcp-2msg",
            "elasticps-unix",
            "elasticps-shm",
            "elasticps-tcp-auth",
            "elasticps-unix-auth",
            "elasticps-shm-auth",
            "elasticps-tcp-tls",
            "raw-tcp",
            "raw-unix",
            "grpc-stream",
        ):
            assert (case, num_ps) in seen, (case, num_ps)
    assert ("limit", 0) in seen
    for line in cases:
        for key in ("ms_median", "ms_min", "cpu_s_per_gb", "gb_per_s", "verified_round_trips"):
            assert isinstance(line[key], int | float), (line["case"], key)
    for key in ("1", "2"):
        ratios = summary["ratios"][key]
        assert ratios["elasticps_over_raw_tcp"] > 0
        assert ratios["elasticps_unix_over_raw_unix"] > 0
        assert ratios["elasticps_shm_over_unix"] > 0
        assert ratios["auth_over_off_unix"] > 0 and ratios["auth_over_off_shm"] > 0
        assert ratios["elasticps_speedup_vs_grpc"] > 0
    assert wait_until_gone(summary["server_pids"]) == []


def test_master_smoke_measures_every_size_at_the_start_and_the_middle_of_a_pass() -> None:
    lines = run_smoke("master.py")

    start = lines[0]
    assert start.get("start") is True
    sizes = start["sizes"]
    results = [line for line in lines if "ops_per_s" in line and "size" in line]
    assert sorted(line["size"] for line in results) == sorted(sizes)
    for line in results:
        for kind in ("start", "middle"):
            window = line[kind]
            assert window["ops_per_s"] > 0
            assert 0 < window["p50_ms"] <= window["p99_ms"]
            assert window["ops"] == 2 * start["window"] * start["reps"]
        assert line["create_s"] > 0
    summary = lines[-1]
    assert summary.get("summary") is True
    assert summary["ratio_largest_over_smallest"] > 0
    assert set(summary["ops_per_s"]) == {str(n) for n in sizes}
    assert wait_until_gone([summary["etcd_pid"]]) == []
    assert processes_matching([start["workdir"]]) == []


def test_push_options_smoke_compares_client_options_and_compression_accuracy() -> None:
    lines = run_smoke("push_options.py")

    configs = {line["config"]: line for line in lines if "config" in line}
    assert set(configs) == {"blocking", "overlap", "blocking-bf16", "overlap-bf16", "blocking-tcp"}
    for name, line in configs.items():
        assert line["samples_per_s"] > 0, name
        assert line["acknowledged_pushes"] > 0, name
        assert set(line["transports"]) == {"tcp" if name.endswith("tcp") else "unix"}, name
    throughput = next(line for line in lines if line.get("summary") and "over_blocking" in line)
    assert throughput["over_blocking"]["blocking"] == 1.0
    runs = {line["grad_compression"]: line for line in lines if line.get("accuracy_run")}
    assert set(runs) == {"none", "bf16"}
    for line in runs.values():
        assert 0.0 <= line["test_accuracy"] <= 1.0
    assert wait_until_gone(throughput["server_pids"]) == []


def test_training_smoke_runs_every_kind_of_case_and_time_to_accuracy() -> None:
    lines = run_smoke("training.py")

    start = lines[0]
    assert start.get("start") is True
    runs = [line for line in lines if "rep" in line and "case" in line]
    assert {line["case"] for line in runs} == {"elasticps-sync-2ps", "ddp", "compute-limit"}
    for line in runs:
        for key in ("config", "model", "samples_per_s", "window_s", "samples", "wall_s"):
            assert key in line, (line["case"], key)
        assert line["samples"] > 0
    assert {line["config"] for line in runs} == {"sgd64"}
    elasticps = next(line for line in runs if line["case"] == "elasticps-sync-2ps")
    assert 0.0 <= elasticps["accuracy"] <= 1.0
    tta = next(line for line in lines if line.get("tta"))
    for key in (
        "elasticps_time_to_target_s",
        "ddp_time_to_target_s",
        "elasticps_over_ddp",
        "elasticps_job_wall_s",
        "ddp_wall_s",
    ):
        assert tta[key] is not None, key
    assert tta["elasticps_runs"][0]["accuracy_per_epoch"], tta
    assert tta["elasticps_job_training_s"] is not None, tta
    verdicts = [line for line in lines if line.get("verdict")]
    assert verdicts and all(v["config"] == "sgd64" and "met" in v for v in verdicts), verdicts
    summary = lines[-1]
    assert summary.get("summary") is True
    for key in ("samples_per_s", "ratios", "time_to_accuracy", "targets"):
        assert key in summary, key
    leftovers = processes_matching([start["workdir"], start["job_prefix"]])
    assert leftovers == [], leftovers


def test_recovery_smoke_kills_a_trainer_and_reports_its_recovery() -> None:
    lines = run_smoke("recovery.py")

    runs = [line for line in lines if "scenario" in line]
    assert runs, lines
    for run in runs:
        assert "error" not in run, run
        for key in ("recovery_s", "max_stall_s", "samples_per_s_before", "samples_per_s_after"):
            assert key in run, key
        assert run["exactly_once"] is True
    assert "summary" in lines[-1]


def test_sparse_smoke_compares_traffic_ddp_and_trainer_memory() -> None:
    lines = run_smoke("sparse.py")
    traffic = [line for line in lines if line.get("part") == "traffic"]
    assert {line["case"] for line in traffic} == {"dense", "sparse"}
    assert all(line["bytes_per_step"] > 0 and line["samples_per_s"] > 0 for line in traffic)
    large = [line for line in lines if line.get("part") == "large"]
    assert len(large) == 2 and all(line["trainer_peak_rss_bytes"] for line in large)
    summary = lines[-1]
    assert summary["summary"] is True
    assert summary["traffic_ratio"] > 1  # rows only: fewer bytes than whole tables
    assert {"trainer_rss_growth", "large_keys"} <= set(summary)
    if not any(line.get("skipped") for line in lines):
        assert {"elasticps_samples_per_s", "ddp_samples_per_s", "vs_ddp"} <= set(summary)
    # One verdict per target, each with what was measured against it.
    verdicts = {line["verdict"]: line for line in lines if "verdict" in line}
    assert {"traffic", "trainer_rss"} <= set(verdicts), verdicts
    assert all({"target", "measured", "met"} <= set(v) for v in verdicts.values())
    assert 0.005 <= summary["touch"] <= 0.02  # the tables are sized for ~1 % of rows a step


def test_control_plane_smoke_measures_each_phase_and_projects_to_many_trainers() -> None:
    lines = run_smoke("control_plane.py")

    start = lines[0]
    assert start.get("start") is True
    phases = [line for line in lines if "phase" in line]
    assert [line["task_s"] for line in phases] == start["task_s"]
    for line in phases:
        assert line["tasks"] > 0, line
        assert 0 < line["get_task_p50_ms"] <= line["get_task_p99_ms"]
        assert line["etcd_writes_per_task"] > 0
        assert line["master_cpu_cores"] > 0 and line["master_rss_mib"] > 0
        assert line["errors"] == 0 and line["ran_out_of_tasks"] is False
    summary = lines[-1]
    assert summary.get("summary") is True
    projection = summary["projection"]
    assert projection["trainers"] == 10_000
    assert projection["capacity_tasks_per_s"] > 0 and projection["min_task_s"] > 0
    assert projection["bottleneck"]
    assert wait_until_gone([summary["master_pid"], summary["etcd_pid"]]) == []
    assert processes_matching([start["workdir"], "control_plane.py --client"]) == []
