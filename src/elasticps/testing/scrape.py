"""Scraping a running job's Prometheus metrics in tests, as a Prometheus server would.

:class:`MetricsScraper` reads ``OUTPUT/prometheus-targets.json`` (the file the
launcher keeps) on a thread and scrapes every target it lists, parsing each
answer with :mod:`prometheus_client`'s own text parser.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MetricsScraper", "Samples", "scrape", "total"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""One scrape: ``(sample name, sorted label pairs) -> value``."""


def scrape(address: str, timeout_s: float = 5.0) -> Samples:
    """Every sample ``http://ADDRESS/metrics`` serves now.

    Raises:
        OSError: the target did not answer.
        ValueError: the answer is not the Prometheus text format.
    """
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for (sample, got), value in samples.items()
        if sample == name and set(labels.items()) <= set(got)
    )


class MetricsScraper:
    """On a thread: every ``every_s`` seconds, read the job's targets file and scrape
    every target it lists, until :meth:`result`.

    Attributes:
        scrapes: by target (``<role>-<id>``), every scrape of it, oldest first.
        targets: the targets file as last read.
    """

    def __init__(self, output: Path, every_s: float = 0.3) -> None:
        self.output = output
        self.every_s = every_s
        self.scrapes: dict[str, list[Samples]] = {}
        self.targets: list[dict[str, object]] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                try:
                    groups = json.loads((self.output / "prometheus-targets.json").read_text())
                except (OSError, ValueError):
                    continue
                self.targets = groups
                for group in groups:
                    labels = group["labels"]
                    name = f"{labels['role']}-{labels['id']}"
                    try:
                        samples = scrape(group["targets"][0])
                    except OSError:
                        continue  # it ended since the file was written
                    self.scrapes.setdefault(name, []).append(samples)
        except BaseException as exc:
            self._error = exc

    def result(self) -> None:
        """Stop, and raise what the thread raised, if anything."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._error is not None:
            raise self._error
