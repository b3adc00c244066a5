"""Prometheus metrics of a running job: every role scraped from the targets file the
launcher writes, parsed with ``prometheus_client``'s own text parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticps.testing import run_train
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.testing.scrape import MetricsScraper, total

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RECORDS = 4000
EPOCHS = 8
RECORDS_PER_TASK = 250
SLOW_MODEL = """

import time as _time


class SlowModel(Model):
    def forward(self, idx):
        _time.sleep(0.02)
        return super().forward(idx)
"""
# The labels a metric of the job may carry: bounded sets only (a histogram's `le`).
ALLOWED_LABELS = {"shard", "result", "reason", "state", "outcome", "le", "role", "action"}


def test_every_role_serves_metrics_that_move_as_the_job_trains(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, RECORDS)
    slow = data / "slow_audit_model.py"
    slow.write_text((data / "audit_model.py").read_text() + SLOW_MODEL)
    out = tmp_path / "run"
    args = train_args(data, out, "async", EPOCHS)
    args[args.index("--model") + 1] = str(slow)
    scraper = MetricsScraper(out)
    extra = ["--model-class", "SlowModel", "--records-per-task", str(RECORDS_PER_TASK)]
    line, _ = run_train(
        [*args, *extra, "--chaos", "kill:trainer@40%"],
        pids_file=out / "pids.json",
        timeout_s=180,
    )
    scraper.result()
    assert line["exactly_once"] is True and check_run(out).exactly_once

    roles = {name.split("-")[0] for name in scraper.scrapes}
    assert roles == {"launcher", "master", "ps", "trainer"}, sorted(scraper.scrapes)
    job = json.loads((out / "run.json").read_text())["job"]
    assert {t["labels"]["job"] for t in scraper.targets} == {job}  # type: ignore[index]
    for name, scrapes in scraper.scrapes.items():
        for samples in scrapes:
            for (sample, labels), _ in samples.items():
                if sample.startswith("elasticps_"):
                    assert {k for k, _ in labels} <= ALLOWED_LABELS, (name, sample, labels)
    for name in (n for n in scraper.scrapes if n.startswith("ps-")):
        first, last = scraper.scrapes[name][0], scraper.scrapes[name][-1]
        shard = name.removeprefix("ps-")
        assert total(last, "elasticps_ps_push_seconds_count", shard=shard) > total(
            first, "elasticps_ps_push_seconds_count", shard=shard
        ), name
        assert total(last, "elasticps_ps_pushes_total", shard=shard, result="applied") > 0
        assert total(last, "elasticps_ps_push_bytes_total", shard=shard) > 0
        assert total(last, "elasticps_ps_staleness_count", shard=shard) > 0  # async-SGD
        assert total(last, "elasticps_ps_model_version", shard=shard) > 0
        assert total(last, "elasticps_ps_slot_epoch", shard=shard) >= 1
        assert (
            "elasticps_ps_checkpoint_seconds_count",
            (("shard", shard),),
        ) in last, name
    trainers = [scrapes for name, scrapes in scraper.scrapes.items() if name.startswith("trainer")]
    assert any(
        total(s[-1], "elasticps_trainer_samples_total")
        > total(s[0], "elasticps_trainer_samples_total")
        for s in trainers
    )
    assert all(total(s[-1], "elasticps_trainer_step_seconds_count") > 0 for s in trainers)
    (master,) = [s for name, s in scraper.scrapes.items() if name.startswith("master")]
    tasks_per_pass = RECORDS // RECORDS_PER_TASK
    for samples in master:  # every scrape a consistent count of one pass's tasks
        states = [total(samples, "elasticps_master_tasks", state=s) for s in
                  ("todo", "pending", "done", "failed")]  # fmt: skip
        assert sum(states) == tasks_per_pass, states
    assert total(master[-1], "elasticps_master_task_reports_total", outcome="succeeded") > 0
    # The counts agree with the ledger: every task done in an earlier pass or this one
    # was reported once (a scrape may fall between a task's update and its count's,
    # once per trainer at most).
    for samples in master:
        done = total(samples, "elasticps_master_pass") * tasks_per_pass + total(
            samples, "elasticps_master_tasks", state="done"
        )
        reported = total(samples, "elasticps_master_task_reports_total", outcome="succeeded")
        assert 0 <= done - reported <= 2, (done, reported)
    assert total(master[-1], "elasticps_master_pass") >= EPOCHS - 1
    passes = [total(s, "elasticps_master_pass") for s in master]
    assert passes == sorted(passes) and passes[-1] > passes[0], passes
    # The launcher counts the supervisor's decisions: the killed trainer was replaced.
    launcher = scraper.scrapes["launcher-0"][-1]
    assert total(launcher, "elasticps_launcher_decisions_total", role="trainer",
                 action="replace") >= 1  # fmt: skip


def test_a_sync_job_with_a_sparse_table_publishes_its_barrier_wait_and_table_rows(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    write_dataset(data, RECORDS)
    slow = data / "slow_audit_model.py"
    slow.write_text(
        (data / "audit_model.py").read_text() + SLOW_MODEL.replace("Model)", "SparseModel)")
    )
    out = tmp_path / "run"
    args = train_args(data, out, "sync", 3)
    args[args.index("--model") + 1] = str(slow)
    scraper = MetricsScraper(out)
    line, _ = run_train(
        [*args, "--model-class", "SlowModel", "--records-per-task", str(RECORDS_PER_TASK)],
        pids_file=out / "pids.json",
        timeout_s=180,
    )
    scraper.result()
    assert line["exactly_once"] is True
    servers = [s for name, s in scraper.scrapes.items() if name.startswith("ps-")]
    assert len(servers) == 2, sorted(scraper.scrapes)
    for scrapes in servers:
        first, last = scrapes[0], scrapes[-1]
        for samples in scrapes:
            for (sample, labels), _ in samples.items():
                if sample.startswith("elasticps_"):
                    assert {k for k, _ in labels} <= ALLOWED_LABELS | {"table"}, labels
        assert total(last, "elasticps_ps_sync_wait_seconds_count") > total(
            first, "elasticps_ps_sync_wait_seconds_count"
        )
        tables = {dict(labels).get("table") for (name, labels) in last if "_table_" in name}
        assert tables and None not in tables, tables
        assert total(last, "elasticps_ps_table_rows") > 0
        assert total(last, "elasticps_ps_table_admitted_rows_total") >= total(
            last, "elasticps_ps_table_rows"
        )
        assert total(last, "elasticps_ps_table_bytes") > 0
