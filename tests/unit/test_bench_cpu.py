"""The training benchmark's CPU accounting (benchmarks/training.py), on made-up samples."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


def _training() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_training", ROOT / "benchmarks" / "training.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


training = _training()


def test_groups_drop_a_numeric_suffix_only() -> None:
    assert training.cpu_group("trainer-0") == "trainer"
    assert training.cpu_group("ps-12") == "ps"
    assert training.cpu_group("fork-server") == "fork-server"
    assert training.cpu_group("etcd") == "etcd"


def test_breakdown_is_cpu_per_1k_samples_over_the_window() -> None:
    # 1,000 samples/s; trainers use 0.5 core each, one PS 0.2; etcd appears late.
    samples = [
        (10.0 + i, 5.0 + 1.5 * i, {"trainer-0": 0.5 * i, "trainer-1": 1 + 0.5 * i, "ps-0": 0.2 * i})
        for i in range(5)
    ]
    samples[3][2]["etcd"] = 7.0
    samples[4][2]["etcd"] = 7.1
    out = training.cpu_breakdown(samples, 10.5, 14.0, 1000.0)
    # Sampled from 11 to 14 s: 3 s, 3,000 samples.
    assert out["cpu_ms_per_1k_samples"] == {
        "etcd": pytest.approx(0.1 / 3 * 1000, abs=0.1),
        "ps": 200.0,
        "trainer": 1000.0,
        "total": pytest.approx(1233.3, abs=0.1),
    }
    assert out["cores_busy"] == pytest.approx(1.23, abs=0.01)
    assert out["machine_cores_busy"] == 1.5


def test_a_restarted_process_counts_from_its_new_start() -> None:
    samples = [(0.0, 0.0, {"ps-0": 5.0}), (1.0, 1.0, {"ps-0": 6.0}), (2.0, 2.0, {"ps-0": 0.5})]
    out = training.cpu_breakdown(samples, 0.0, 2.0, 1000.0)
    assert out["cpu_ms_per_1k_samples"]["ps"] == 750.0  # 1.0 + 0.5 s over 2,000 samples


def test_too_few_samples_in_the_window_give_nothing() -> None:
    assert training.cpu_breakdown([(0.0, 0.0, {})], 0.0, 1.0, 100.0) == {}
    assert training.cpu_breakdown([], 0.0, 1.0, 100.0) == {}


def test_the_sampler_reads_this_process() -> None:
    with training.CpuSampler(lambda: {"me": os.getpid(), "gone": 2**22 + 1}) as sampler:
        sum(i * i for i in range(300_000))
    assert sampler.samples, "no sample taken"
    assert all("gone" not in cpu and "me" in cpu for _, _, cpu in sampler.samples)
