"""A job's report: ``elasticps report OUTPUT`` writes one self-contained HTML file.

For a finished, stopped or failed job, from what its output directory holds
(a Kubernetes job: from what the cluster holds, :func:`build_kubernetes_report`):
``run.json`` (the state, the progress timeline, the passes' audits, the
evaluations, the supervision decisions and, for a failed job, the root
cause), the event log ``events.jsonl`` and the logs. The plots are the
dashboard's (:mod:`elasticps.jobview`); plotly.js is written into the file,
so that it opens with no network access, and keeps, as long as the output
directory does, the history of a job whose cluster is gone.

The page shows: the job's outcome and its error line; the root cause of a
failure (the first fault: process, role, host, time, what happened and its
last error line) and the faults that followed it; throughput over time with
the faults marked; the test metrics by pass; each pass's audit; the fault
timeline; and the last lines of the failing process's log.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from elasticps import jobview
from elasticps.errors import ConfigError
from elasticps.extras import require_extra
from elasticps.launcher.job_events import read_events

__all__ = ["REPORT_FILE", "build_kubernetes_report", "build_report", "write_report"]

REPORT_FILE: Final = "report.html"
"""The report's default name in the job's output directory."""

_LOG_LINES: Final = 30

_TEMPLATE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>elasticps report: {{ job }}</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1100px; padding: 0 20px;
         color: #222; }
  h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
  .state { padding: 2px 8px; border-radius: 4px; color: #fff; background: #2e7d32; }
  .state.failed, .state.interrupted { background: #c0392b; }
  .cause { border-left: 4px solid #c0392b; background: #fdf0ef; padding: 8px 14px; }
  table { border-collapse: collapse; font-size: 13px; }
  th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eee; vertical-align: top; }
  pre { background: #f4f4f4; padding: 8px; font-size: 12px; overflow-x: auto; }
  .empty { color: #888; }
</style>
<script>{{ plotly_js }}</script>
</head>
<body>
<h1>elasticps report: {{ job }} <span class="state {{ state }}" id="state">{{ state }}</span></h1>
<table id="summary">
{% for key, value in summary %}<tr><th>{{ key }}</th><td>{{ value }}</td></tr>
{% endfor %}</table>
{% if error %}<p id="error"><b>Error:</b> {{ error }}</p>{% endif %}

<h2>Root cause</h2>
{% if cause %}
<div class="cause" id="root-cause">
  <p><b>{{ cause.worker }}</b> ({{ cause.role }}{% if cause.host %}, on {{ cause.host }}{% endif %})
  at {{ cause.time }}: {{ cause.happened }}; decided: {{ cause.decided }}</p>
  {% if cause.message %}<p>its last error line: <code>{{ cause.message }}</code></p>{% endif %}
</div>
{% if consequences %}
<p>What followed:</p>
<table id="consequences"><tr><th>time</th><th>process</th><th>what</th><th>then</th></tr>
{% for d in consequences %}<tr><td>{{ d.time }}</td><td>{{ d.worker }}</td><td>{{ d.happened }}</td>
<td>{{ d.decided }}</td></tr>
{% endfor %}</table>
{% endif %}
{% elif state == "failed" %}<p id="root-cause">No process fault was recorded: the job failed on its
own (see the error above).</p>
{% else %}<p id="root-cause" class="empty">The job did not fail.</p>{% endif %}

<h2>Throughput</h2>
<div id="fig-throughput" class="figure"></div>
<h2>Test metrics</h2>
{% if tests %}<div id="fig-tests" class="figure"></div>{% else %}
<p class="empty">No per-pass evaluation (train --eval-each-pass).</p>{% endif %}
{% if final %}<p id="final">Final evaluation: {{ final }}</p>{% endif %}

<h2>Passes</h2>
{% if passes %}<table id="passes"><tr>{% for c in pass_columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for p in passes %}<tr>{% for c in pass_columns %}<td>{{ p.get(c, "") }}</td>{% endfor %}</tr>
{% endfor %}</table>{% else %}<p class="empty">No pass audit recorded.</p>{% endif %}

<h2>Fault timeline</h2>
{% if faults %}<table id="faults"><tr><th>time</th><th>process</th><th>what</th><th>then</th></tr>
{% for f in faults %}<tr><td>{{ f.time }}</td><td>{{ f.worker }}</td><td>{{ f.what }}</td>
<td>{{ f.then }}</td></tr>
{% endfor %}</table>{% else %}<p class="empty">No fault.</p>{% endif %}

{% if pods %}<h2>Pods</h2>
<table id="pods"><tr><th>pod</th><th>role</th><th>phase</th><th>state</th><th>reason</th></tr>
{% for p in pods %}<tr><td>{{ p.name }}</td><td>{{ p.role }}</td><td>{{ p.phase }}</td>
<td>{{ p.state }}</td><td>{{ p.reason }}</td></tr>
{% endfor %}</table>{% endif %}

{% if log_tail %}<h2>The last lines of {{ log_name }}</h2>
<pre id="log">{{ log_tail }}</pre>{% endif %}

<p class="empty">Written {{ written }} by elasticps report from {{ output }}.</p>
<script id="figures" type="application/json">{{ figures|tojson }}</script>
<script>
  const figures = JSON.parse(document.getElementById("figures").textContent);
  for (const [name, figure] of Object.entries(figures)) {
    const div = document.getElementById("fig-" + name);
    if (div) Plotly.newPlot(div, figure.data, figure.layout, {displayModeBar: false});
  }
</script>
</body>
</html>
"""


def _events_of(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An event log rebuilt from ``run.json`` (a run without ``events.jsonl``)."""
    events: list[dict[str, Any]] = []
    for decision in record.get("decisions") or []:
        if isinstance(decision, dict) and isinstance(decision.get("at"), int | float):
            events.append({**decision, "kind": "decision"})
    for chaos in record.get("chaos") or []:
        if isinstance(chaos, dict) and isinstance(chaos.get("wall_clock_s"), int | float):
            events.append({**chaos, "kind": "chaos", "at": chaos["wall_clock_s"]})
    for evaluation in record.get("pass_evaluations") or []:
        if isinstance(evaluation, dict) and isinstance(evaluation.get("time"), int | float):
            events.append(
                {
                    "kind": "evaluation",
                    "at": evaluation["time"],
                    "pass": evaluation.get("pass_id", 0),
                    "metrics": evaluation.get("metrics", {}),
                }
            )
    return sorted(events, key=lambda e: float(e["at"]))


def _clock(unix_s: object) -> str:
    if not isinstance(unix_s, int | float):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _with_time(decision: Mapping[str, Any]) -> dict[str, Any]:
    return {**decision, "time": _clock(decision.get("at"))}


def _log_tail(output: Path, worker: str) -> tuple[str, str]:
    """The last lines of ``worker``'s newest log (``("", "")`` without one)."""
    logs = sorted((output / "logs").glob(f"{worker}*.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return "", ""
    lines = logs[-1].read_text(encoding="utf-8", errors="replace").splitlines()
    return f"logs/{logs[-1].name}", "\n".join(lines[-_LOG_LINES:])


def _metrics_line(metrics: object) -> str:
    if not isinstance(metrics, dict):
        return ""
    return ", ".join(
        f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if isinstance(v, int | float)
    )


def _pass_columns(passes: Sequence[Mapping[str, Any]]) -> list[str]:
    columns: list[str] = []
    for p in passes:
        for key, value in p.items():
            if key not in columns and isinstance(value, str | int | float | bool):
                columns.append(key)
    return columns


def build_report(output: Path) -> str:
    """The report of the job in ``output``, as one HTML document.

    Raises:
        ConfigError: ``output`` holds no ``run.json``, or an unreadable one.
        MissingExtraError: the ``dashboard`` extra is not installed.
    """
    require_extra("dashboard", "elasticps report")
    output = output.resolve()
    try:
        record = json.loads((output / "run.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{output} holds no run.json: not a job's output directory") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {output / 'run.json'}: {exc}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{output / 'run.json'} is not a JSON object")
    events = read_events(output) or _events_of(record)
    cause = record.get("root_cause") if isinstance(record.get("root_cause"), dict) else None
    log_name, log_tail = _log_tail(output, str(cause["worker"])) if cause else ("", "")
    return _render(record, events, source=str(output), log_name=log_name, log_tail=log_tail)


def build_kubernetes_report(status: Mapping[str, Any], logs: Mapping[str, str]) -> str:
    """The report of a Kubernetes job, from ``elasticps status --backend kubernetes``'s dict.

    A Kubernetes job keeps no ``run.json``: its state record (the failure and
    the supervision decisions that led to it) and its pods are what the
    cluster holds, and the root cause is found in those decisions as for any
    job (:func:`elasticps.launcher.supervisor.root_cause`).

    Args:
        status: :func:`elasticps.launcher.kubernetes.job_status`'s dict.
        logs: the last lines of the failing worker's pod log, by pod name ({}: none).

    Raises:
        MissingExtraError: the ``dashboard`` extra is not installed.
    """
    from elasticps.launcher.supervisor import Decision, root_cause

    require_extra("dashboard", "elasticps report")
    decisions = [d for d in status.get("decisions") or [] if Decision.from_dict(d) is not None]
    parsed = [d for d in map(Decision.from_dict, decisions) if d is not None]
    record: dict[str, Any] = {
        "job": status.get("job", "?"),
        "state": status.get("state", "?"),
        "error": status.get("failure") or None,
        "exit_code": status.get("exit_code"),
        "decisions": decisions,
    }
    if record["state"] == "failed":
        cause, after = root_cause(parsed, None)
        record["root_cause"] = cause.as_dict() if cause is not None else None
        record["consequences"] = [d.as_dict() for d in after]
    name, tail = next(iter(logs.items()), ("", ""))
    source = f"namespace {status.get('namespace', '?')} (Kubernetes)"
    pods = [p for p in status.get("pods") or [] if isinstance(p, dict)]
    return _render(
        record, _events_of(record), source=source, log_name=name, log_tail=tail, pods=pods
    )


def _render(
    record: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    *,
    source: str,
    log_name: str,
    log_tail: str,
    pods: Sequence[Mapping[str, Any]] = (),
) -> str:
    import jinja2
    import markupsafe
    import plotly.offline

    timeline = [p for p in record.get("timeline") or [] if isinstance(p, list) and len(p) == 3]
    state = str(record.get("state", "?"))
    cause = record.get("root_cause") if isinstance(record.get("root_cause"), dict) else None
    passes = [p for p in record.get("passes") or [] if isinstance(p, dict)]
    summary = [
        (key, record[key])
        for key in ("job", "state", "epochs", "samples", "wall_s", "exactly_once", "records_lost",
                    "exit_code")
        if record.get(key) is not None
    ]  # fmt: skip
    template = jinja2.Environment(autoescape=True).from_string(_TEMPLATE)
    return template.render(
        job=record.get("job", "?"),
        state=state,
        summary=summary,
        error=record.get("error"),
        cause=_with_time(cause) if cause else None,
        consequences=[_with_time(d) for d in record.get("consequences") or []],
        tests=jobview.test_rows(events),
        final=_metrics_line(record.get("evaluation")),
        passes=passes,
        pass_columns=_pass_columns(passes),
        faults=jobview.fault_rows(events),
        pods=pods,
        log_name=log_name,
        log_tail=log_tail,
        figures=jobview.figures(timeline, events, {}),
        plotly_js=markupsafe.Markup(plotly.offline.get_plotlyjs()),
        output=source,
        written=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def write_report(output: Path, target: Path | None = None) -> Path:
    """Write the report of the job in ``output`` (see :func:`build_report`).

    Args:
        output: the job's output directory.
        target: the HTML file (default ``OUTPUT/report.html``).

    Returns:
        The file written.

    Raises:
        ConfigError, MissingExtraError: as :func:`build_report`.
        OSError: the file cannot be written.
    """
    from elasticps.pserver.atomic import write_atomic

    path = target if target is not None else output / REPORT_FILE
    write_atomic(path, build_report(output).encode())
    return path
