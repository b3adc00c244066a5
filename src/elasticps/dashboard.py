"""The live dashboard of a local job: ``elasticps dashboard JOB`` (or ``--output DIR``).

One page, served on 127.0.0.1 by :mod:`aiohttp`, that shows a job as it runs
and updates without a reload: progress and ETA, throughput over time, each
parameter server shard's load, latency and staleness, the stragglers, the
fault timeline and the test metrics of each pass. The page fetches
``/api/job`` every ``interval_s`` and draws its figures with plotly.js, served
from the plotly package itself (the page needs no network).

``/api/job`` is what the job publishes, read the way ``elasticps status``
reads it, never the roles' internals: the status (the master's progress
through etcd, the same dict as ``status --json``), the event log
``OUTPUT/events.jsonl`` (faults, decisions, test evaluations), ``run.json``
once the job has ended, and the parameter servers' Prometheus metrics (the
targets in ``OUTPUT/prometheus-targets.json``). The numbers and the figures
come from :mod:`elasticps.jobview`, as the report's do.

The server binds 127.0.0.1 only: the page shows a job's state to whoever can
reach it, and takes no input but the URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Final

from elasticps import jobview
from elasticps.extras import require_extra
from elasticps.jobs import read_run, run_status, shard_loads
from elasticps.launcher.job_events import read_events

__all__ = ["DEFAULT_INTERVAL_S", "Dashboard", "serve"]

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S: Final = 2.0
"""How often the dashboard reads the job, and its page refreshes, seconds."""

_SCRAPE_TIMEOUT_S: Final = 2.0
_HISTORY_POINTS: Final = 3600  # an hour of polls at 1 s


class Dashboard:
    """The view of one job's output directory, refreshed by :meth:`poll`.

    Args:
        output: the job's output directory.
        interval_s: seconds between polls (and the page's refreshes), > 0.

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, output: Path, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.output = output.resolve()
        self.interval_s = interval_s
        self._history: list[tuple[float, int, int]] = []
        self._shards: dict[str, dict[str, float]] = {}
        self._polls = 0
        self.view: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        """Read the job once and return the new view (blocking: a few etcd and HTTP calls).

        Returns:
            ``{"status"`` (``status --json``'s dict, or None before the job
            has started), ``"eta_s"``, ``"samples_per_s"``, ``"shards"`` (each
            shard's load, :func:`elasticps.metrics.shard_load`), ``"faults"``
            (:func:`~elasticps.jobview.fault_rows`), ``"tests"``,
            ``"final_evaluation"``, ``"figures"``, ``"polls"``, ``"updated_at"``
            (unix s), ``"interval_s"``}.
        """
        run = read_run(self.output)
        status = run_status(run) if run is not None else None
        now = time.time()
        history: list[tuple[float, int, int]] = self._history
        if status is not None and run is not None:
            timeline = run.record.get("timeline")
            if status["state"] not in ("running", "stopping", "starting") and timeline:
                history = [(float(t), int(d), int(s)) for t, d, s in timeline]
            elif "tasks_done_all_passes" in status and "samples" in status:
                point = (now, int(status["tasks_done_all_passes"]), int(status["samples"]))
                self._history = [*self._history, point][-_HISTORY_POINTS:]
                history = self._history
            if status["state"] == "running":
                # A shard whose server is restarting keeps its last values.
                self._shards = dict(
                    sorted(
                        {**self._shards, **shard_loads(self.output, _SCRAPE_TIMEOUT_S)}.items(),
                        key=_by_index,
                    )
                )
        events = read_events(self.output)
        rate = jobview.throughput(history)
        total = int(status.get("tasks_all_passes", 0)) if status else 0
        self._polls += 1
        self.view = {
            "status": status,
            "eta_s": jobview.eta_s(history, total) if total else None,
            "samples_per_s": rate[-1][1] if rate else None,
            "shards": self._shards,
            "faults": jobview.fault_rows(events),
            "tests": jobview.test_rows(events),
            "final_evaluation": run.record.get("evaluation") if run is not None else None,
            "figures": jobview.figures(history, events, self._shards),
            "polls": self._polls,
            "updated_at": now,
            "interval_s": self.interval_s,
        }
        return self.view


def _by_index(item: tuple[str, object]) -> int:
    return int(item[0])


def _page() -> bytes:
    return resources.files("elasticps").joinpath("static/dashboard.html").read_bytes()


def serve(
    output: Path,
    *,
    port: int = 0,
    interval_s: float = DEFAULT_INTERVAL_S,
    on_ready: Callable[[str], None] = print,
) -> None:
    """Serve the dashboard of the job in ``output`` on 127.0.0.1 until interrupted.

    Args:
        output: the job's output directory.
        port: the TCP port (0: a free one).
        interval_s: seconds between reads of the job, > 0.
        on_ready: called with the page's URL once it is served.

    Raises:
        MissingExtraError: the ``dashboard`` extra is not installed.
        ValueError: ``interval_s`` <= 0.
        OSError: the port cannot be bound.
    """
    require_extra("dashboard", "elasticps dashboard")
    dashboard = Dashboard(output, interval_s)
    asyncio.run(_serve(dashboard, port, on_ready))


async def _serve(dashboard: Dashboard, port: int, on_ready: Callable[[str], None]) -> None:
    import plotly.offline
    from aiohttp import web

    page = _page()
    plotly_js = plotly.offline.get_plotlyjs().encode()

    async def index(_: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def script(_: web.Request) -> web.Response:
        return web.Response(body=plotly_js, content_type="application/javascript")

    async def job(_: web.Request) -> web.Response:
        body = json.dumps(dashboard.view, default=str)
        return web.Response(
            text=body, content_type="application/json", headers={"Cache-Control": "no-store"}
        )

    async def poll_forever() -> None:
        while True:
            try:
                await asyncio.to_thread(dashboard.poll)
            except Exception as exc:  # a torn file, etcd gone: the next poll tries again
                log.warning("dashboard: cannot read the job: %s", exc)
            await asyncio.sleep(dashboard.interval_s)

    await asyncio.to_thread(dashboard.poll)
    app = web.Application()
    app.add_routes(
        [web.get("/", index), web.get("/plotly.min.js", script), web.get("/api/job", job)]
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    on_ready(f"http://127.0.0.1:{bound}/")
    poller = asyncio.create_task(poll_forever())
    try:
        await asyncio.Event().wait()
    finally:
        poller.cancel()
        await runner.cleanup()
