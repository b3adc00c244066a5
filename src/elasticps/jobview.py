"""What the dashboard and the report show of a job: one view, the same plots.

Pure functions from what a job publishes (``elasticps status``'s fields, its
event log ``OUTPUT/events.jsonl``, ``run.json`` and the parameter servers'
metrics) to the numbers and the Plotly figures of ``elasticps dashboard`` and
``elasticps report``. The dashboard sends the figures to its page as JSON
(plotted there by plotly.js), the report writes them into its HTML file:
both draw the same figures from the same code.

A figure is a Plotly figure as a JSON-ready dict (``{"data": [...], "layout":
{...}}``), built with :mod:`plotly.graph_objects` (the ``dashboard`` extra).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "ETA_WINDOW_S",
    "eta_s",
    "fault_rows",
    "figures",
    "test_rows",
    "throughput",
]

ETA_WINDOW_S: Final = 30.0
"""The ETA extrapolates the task rate of the last this many seconds (or of all the
history, when it is shorter)."""

_FAULT_COLOR: Final = "#c0392b"


def throughput(history: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Samples/s between consecutive points of a job's progress. Pure.

    Args:
        history: ``(unix time s, tasks done over all passes, samples done)``
            points, oldest first (``run.json``'s ``timeline``, or the
            dashboard's polls). A master that takes over counts its samples
            from 0: a point below the one before starts the count again.

    Returns:
        ``(unix time s, samples/s)`` at each point after the first that is
        later than the one before.
    """
    out: list[tuple[float, float]] = []
    for before, after in itertools.pairwise(history):
        dt = float(after[0]) - float(before[0])
        if dt <= 0:
            continue
        samples = float(after[2]) - float(before[2])
        if samples < 0:
            samples = float(after[2])  # a new master's count
        out.append((float(after[0]), samples / dt))
    return out


def eta_s(history: Sequence[Sequence[float]], total_tasks: int) -> float | None:
    """Seconds until every task of every pass is done, at the recent task rate. Pure.

    Args:
        history: as for :func:`throughput`.
        total_tasks: tasks over all passes.

    Returns:
        The estimate, 0.0 once all are done, or None before any rate is known.
    """
    if not history:
        return None
    now, done = float(history[-1][0]), float(history[-1][1])
    if done >= total_tasks:
        return 0.0
    window = [p for p in history if float(p[0]) >= now - ETA_WINDOW_S]
    first = window[0] if len(window) > 1 else history[0]
    dt, tasks = now - float(first[0]), done - float(first[1])
    if dt <= 0 or tasks <= 0:
        return None
    return (total_tasks - done) / (tasks / dt)


def fault_rows(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The fault timeline: every injected fault and every supervision decision on a
    process, oldest first. Pure.

    Args:
        events: the job's event log (:func:`elasticps.launcher.job_events.read_events`).

    Returns:
        ``{"at" (unix s), "time" ("HH:MM:SS", local), "worker", "what", "then"}`` each:
        a chaos fault (``what`` ``kill``, ``pause``, ``damage``...; ``then`` the pid),
        or a decision (``what`` ``signal 9``, ``exit 1``...; ``then`` ``restart 1/3``,
        ``replace``, ``fail (exit 1): ...``; ``worker`` names the host its process
        ran on, where the event log has it).
    """
    rows = []
    for event in events:
        kind, at = event.get("kind"), float(event.get("at", 0.0))
        if kind == "chaos":
            pid = event.get("pid")
            then = f"pid {pid}" if pid is not None else "no such process"
            row = {"worker": event.get("target", "?"), "what": event.get("action", "?")}
            row["then"] = then + (" (random)" if event.get("random") else "")
        elif kind == "decision" and event.get("role") != "job":
            host = event.get("host")
            row = {
                "worker": f"{event.get('worker', '?')}" + (f" on {host}" if host else ""),
                "what": event.get("happened", "?"),
                "then": event.get("decided", ""),
            }
        else:
            continue
        rows.append({"at": at, "time": time.strftime("%H:%M:%S", time.localtime(at)), **row})
    return sorted(rows, key=lambda r: float(r["at"]))


def test_rows(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each pass's test metrics, by pass (the last evaluation of a pass wins). Pure.

    Returns:
        ``{"pass" (1-based), "metrics": {name: value}}`` each, by pass.
    """
    by_pass: dict[int, dict[str, float]] = {}
    for event in events:
        if event.get("kind") == "evaluation" and isinstance(event.get("metrics"), dict):
            by_pass[int(event.get("pass", 0))] = {
                str(k): float(v) for k, v in event["metrics"].items() if isinstance(v, int | float)
            }
    return [{"pass": p + 1, "metrics": by_pass[p]} for p in sorted(by_pass)]


def figures(
    history: Sequence[Sequence[float]],
    events: Sequence[Mapping[str, Any]],
    shards: Mapping[str, Mapping[str, float]],
) -> dict[str, dict[str, Any]]:
    """The view's plots, as Plotly figure dicts. Pure (but for plotly's import).

    Args:
        history: as for :func:`throughput`.
        events: the job's event log.
        shards: each parameter server shard's load
            (:func:`elasticps.metrics.shard_load`), by shard; {} when not known.

    Returns:
        ``throughput`` (samples/s over time, faults marked), ``tests`` (each test
        metric by pass), and with ``shards``: ``ps_latency`` (mean push and pull
        time per shard, milliseconds), ``ps_load`` (pushes per shard) and
        ``staleness`` (mean staleness per shard, model versions).

    Raises:
        MissingExtraError: the ``dashboard`` extra (plotly) is not installed.
    """
    from elasticps.extras import require_extra

    require_extra("dashboard", "plots")
    import plotly.graph_objects as go

    def as_dict(fig: go.Figure) -> dict[str, Any]:
        fig.update_layout(margin={"l": 50, "r": 20, "t": 40, "b": 40}, height=280)
        out: dict[str, Any] = json.loads(fig.to_json())
        return out

    out = {}
    rate = throughput(history)
    fig = go.Figure(
        go.Scatter(
            x=[_iso(t) for t, _ in rate], y=[r for _, r in rate], mode="lines", name="samples/s"
        )
    )
    faults = fault_rows(events)
    if faults:
        top = max((r for _, r in rate), default=1.0)
        fig.add_trace(
            go.Scatter(
                x=[_iso(f["at"]) for f in faults],
                y=[top] * len(faults),
                mode="markers",
                marker={"color": _FAULT_COLOR, "symbol": "x", "size": 10},
                text=[f"{f['worker']}: {f['what']} → {f['then']}" for f in faults],
                hoverinfo="text",
                name="faults",
            )
        )
    fig.update_layout(title="Throughput (samples/s)", xaxis_title="time", yaxis_title="samples/s")
    out["throughput"] = as_dict(fig)

    tests = test_rows(events)
    fig = go.Figure()
    for name in sorted({n for row in tests for n in row["metrics"]}):
        points = [(row["pass"], row["metrics"][name]) for row in tests if name in row["metrics"]]
        fig.add_trace(
            go.Scatter(
                x=[p for p, _ in points], y=[v for _, v in points], mode="lines+markers", name=name
            )
        )
    fig.update_layout(title="Test metrics by pass", xaxis_title="pass")
    out["tests"] = as_dict(fig)

    if shards:
        names = [f"ps-{s}" for s in shards]
        fig = go.Figure(
            [
                go.Bar(x=names, y=[1e3 * v["push_mean_s"] for v in shards.values()], name="push"),
                go.Bar(x=names, y=[1e3 * v["pull_mean_s"] for v in shards.values()], name="pull"),
            ]
        )
        fig.update_layout(title="Mean push and pull time per shard (ms)", yaxis_title="ms")
        out["ps_latency"] = as_dict(fig)
        fig = go.Figure(go.Bar(x=names, y=[v["pushes"] for v in shards.values()], name="pushes"))
        fig.update_layout(title="Pushes per shard", yaxis_title="pushes")
        out["ps_load"] = as_dict(fig)
        fig = go.Figure(
            go.Bar(x=names, y=[v["staleness_mean"] for v in shards.values()], name="staleness")
        )
        fig.update_layout(title="Mean staleness per shard (model versions)")
        out["staleness"] = as_dict(fig)
    return out


def _iso(unix_s: float) -> str:
    """Local time as Plotly reads a date axis (``YYYY-MM-DD HH:MM:SS.mmm``)."""
    whole = int(unix_s)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(whole))
    return f"{stamp}.{int((unix_s - whole) * 1000):03d}"
