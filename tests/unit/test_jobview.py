"""The dashboard's and the report's view of a job: pure functions, the event log, the HTML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticps import jobview
from elasticps.errors import ConfigError
from elasticps.launcher.job_events import EVENTS_FILE, JobEvents, read_events
from elasticps.report import build_report

pytestmark = pytest.mark.timeout(60)


def test_throughput_counts_again_from_a_new_masters_zero() -> None:
    history = [(0.0, 0, 0), (1.0, 2, 100), (2.0, 4, 300), (2.0, 4, 300), (3.0, 5, 50)]
    assert jobview.throughput(history) == [(1.0, 100.0), (2.0, 200.0), (3.0, 50.0)]


def test_eta_extrapolates_the_recent_task_rate() -> None:
    assert jobview.eta_s([], 10) is None
    assert jobview.eta_s([(0.0, 0, 0)], 10) is None
    assert jobview.eta_s([(0.0, 0, 0), (10.0, 5, 0)], 10) == pytest.approx(10.0)
    # Only the last ETA_WINDOW_S count: slow at first, then 1 task/s.
    history = [(0.0, 0, 0), (100.0, 1, 0), (110.0, 11, 0), (130.0, 31, 0)]
    assert jobview.eta_s(history, 41) == pytest.approx(10.0)
    assert jobview.eta_s([(0.0, 0, 0), (1.0, 10, 0)], 10) == 0.0


EVENTS = [
    {"at": 5.0, "kind": "decision", "role": "ps", "worker": "ps-0", "happened": "signal 9",
     "decided": "restart 1/3"},
    {"at": 4.9, "kind": "chaos", "action": "kill", "target": "ps-0", "pid": 42},
    {"at": 9.0, "kind": "decision", "role": "job", "worker": "job", "happened": "finished",
     "decided": "ignore: done"},
    {"at": 6.0, "kind": "evaluation", "pass": 0, "metrics": {"accuracy": 0.5, "loss": 1.0}},
    {"at": 7.0, "kind": "evaluation", "pass": 1, "metrics": {"accuracy": 0.75, "note": "x"}},
]  # fmt: skip


def test_the_fault_timeline_has_kills_and_decisions_in_order_not_the_job_end() -> None:
    rows = jobview.fault_rows(EVENTS)
    assert [(r["worker"], r["what"], r["then"]) for r in rows] == [
        ("ps-0", "kill", "pid 42"),
        ("ps-0", "signal 9", "restart 1/3"),
    ]


def test_test_rows_are_by_pass_numbers_only() -> None:
    assert jobview.test_rows(EVENTS) == [
        {"pass": 1, "metrics": {"accuracy": 0.5, "loss": 1.0}},
        {"pass": 2, "metrics": {"accuracy": 0.75}},
    ]


def test_figures_are_plotly_json_with_the_shard_plots_only_when_known() -> None:
    history = [(0.0, 0, 0), (1.0, 1, 64), (2.0, 2, 128)]
    plain = jobview.figures(history, EVENTS, {})
    assert set(plain) == {"throughput", "tests"}
    json.dumps(plain)  # JSON-ready
    traces = plain["throughput"]["data"]
    assert traces[0]["y"] == [64.0, 64.0] and traces[1]["name"] == "faults"
    shard = {"pushes": 3.0, "push_bytes": 9.0, "push_mean_s": 0.002, "pull_mean_s": 0.001,
             "staleness_mean": 1.5, "refused": 0.0, "version": 3.0}  # fmt: skip
    full = jobview.figures(history, EVENTS, {"0": shard, "1": shard})
    assert {"ps_latency", "ps_load", "staleness"} <= set(full)
    assert full["ps_latency"]["data"][0]["x"] == ["ps-0", "ps-1"]
    assert full["ps_latency"]["data"][0]["y"] == pytest.approx([2.0, 2.0])


def test_the_event_log_skips_a_torn_last_line(tmp_path: Path) -> None:
    events = JobEvents(tmp_path)
    events.append("chaos", {"action": "kill", "target": "ps-0"}, at=1.0)
    events.append("decision", {"at": 2.0, "worker": "ps-0"})
    events.close()
    with (tmp_path / EVENTS_FILE).open("a") as f:
        f.write('{"at": 3.0, "kind": "cha')
    read = read_events(tmp_path)
    assert [(e["kind"], e["at"]) for e in read] == [("chaos", 1.0), ("decision", 2.0)]
    assert read_events(tmp_path / "missing") == []


def test_the_report_escapes_what_the_job_wrote_and_names_the_root_cause(tmp_path: Path) -> None:
    cause = {"at": 5.0, "role": "ps", "worker": "ps-0", "happened": "signal 9",
             "decided": "fail (exit 1): ps-0 died", "message": "<script>alert(1)</script>",
             "host": "node-a"}  # fmt: skip
    record = {
        "job": "j<b>", "state": "failed", "error": "ps-0 died (signal 9); no restarts left",
        "root_cause": cause, "consequences": [], "timeline": [[0.0, 0, 0], [1.0, 1, 64]],
        "decisions": [{k: v for k, v in cause.items() if k not in ("host",)}],
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(record))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ps-0.log").write_text("a line\nthe last error\n")
    html = build_report(tmp_path)
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)" in html
    assert "j&lt;b&gt;" in html
    assert "node-a" in html and "the last error" in html and "no restarts left" in html
    assert "signal 9" in html.split('id="fig-throughput"')[0]  # in the root cause
    # Without events.jsonl the fault timeline comes from run.json's decisions.
    assert read_events(tmp_path) == []
    assert 'id="faults"' in html


def test_a_report_needs_a_run_record(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no run\.json"):
        build_report(tmp_path)
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        build_report(tmp_path)


def test_json_log_lines_name_the_process_and_leave_tracebacks_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging
    import sys

    from elasticps.logs import PROCESS_ENV, JsonLineFormatter, json_line, process_fields

    monkeypatch.setenv(PROCESS_ENV, "trainer-7")
    monkeypatch.setenv("ELASTICPS_JOB", "j")
    fields = process_fields("trainer", None)
    assert fields["index"] == 7 and fields["job"] == "j" and fields["role"] == "trainer"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "x", logging.ERROR, "", 0, "failed %s", ("once",), sys.exc_info()
        )
    full = json.loads(JsonLineFormatter(fields).format(record))
    short = json.loads(JsonLineFormatter(fields, log_file=tmp_path / "t.log").format(record))
    assert full["message"] == short["message"] == "failed once"
    assert "ValueError: boom" in full["exc_info"] and "exc_info" not in short
    assert short["traceback_in"] == str(tmp_path / "t.log")
    line = json.loads(json_line("plain", fields, level="WARNING"))
    assert (line["level"], line["role"], line["index"]) == ("WARNING", "trainer", 7)
