"""What a stream job's launcher adds: trained offsets in checkpoints, and ``OUTPUT/latest/``.

- Every consistent checkpoint of a stream job records, in its manifest under
  ``extra.stream``, what the parameter servers hold of the stream, read while
  they are frozen (:func:`stream_extra`): per partition, the offset ranges
  every server holds. ``--resume`` of that checkpoint goes on from exactly
  there: the ranges no server held whole are trained first, then the
  stream from the end of the last task cut.
- Every ``--checkpoint-every-s`` the launcher publishes the latest consistent
  model for serving (:class:`LatestPublisher`): a consistent checkpoint plus
  ``model.safetensors`` go into ``OUTPUT/models/<n>/``, then the symlink
  ``OUTPUT/latest`` is switched to it with one ``rename``, so a reader that
  opens ``OUTPUT/latest/model.safetensors`` sees a whole model, the previous
  one or the new one. The two newest directories are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError
from elasticps.master.shards import coverage_report
from elasticps.master.stream import committed_offsets, offsets_of
from elasticps.master.taskqueue import DataRange
from elasticps.snapshot import ControlClient

__all__ = [
    "KEEP_MODELS",
    "LATEST",
    "LatestPublisher",
    "offsets_of",
    "publish_latest",
    "stream_extra",
]

log = logging.getLogger(__name__)

LATEST = "latest"
"""The symlink, in the output directory, to the latest published model."""

KEEP_MODELS = 2
"""Published model directories kept (the one ``latest`` names and the one before)."""


def stream_extra(store: JobStore, clients: Sequence[ControlClient]) -> dict[str, object]:
    """The ``extra.stream`` of a consistent checkpoint, read while every server is frozen.

    The ledger is read here too, while frozen: a task added after the read
    cannot have been applied yet.

    Raises:
        ServiceUnavailableError / RemoteError: a server did not answer.
        CoordinationError: etcd did not answer.
    """
    raw, _ = store.get_prefix_json(store.keys.tasks_prefix)
    ranges: dict[int, DataRange] = {}
    for suffix, record in raw.items():
        data = record.get("data")
        if suffix.isdigit() and isinstance(data, list) and len(data) == 3:
            ranges[int(suffix)] = DataRange(str(data[0]), int(data[1]), int(data[2]))
    reports = []
    for index, client in enumerate(clients):
        answer = client.request({"op": "coverage", "pass": 0})
        if answer.get("initialized", True):
            reports.append(coverage_report(index, answer))
    return {"stream": {"partitions": committed_offsets(ranges, reports)}}


def publish_latest(output: Path, model_dir: Path) -> None:
    """Point ``output/latest`` at ``model_dir`` atomically (a symlink replaced by rename)."""
    link = output / LATEST
    tmp = output / f".{LATEST}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(model_dir, output), tmp)
    os.replace(tmp, link)


class LatestPublisher:
    """Publishes a stream job's latest consistent model every ``every_s`` seconds.

    Args:
        output: the job's output directory.
        every_s: seconds between two publications.
        take: writes a consistent checkpoint and ``model.safetensors`` into the
            directory it is given (the launcher's checkpoint and final pull).
    """

    def __init__(self, output: Path, every_s: float, take: Callable[[Path], object]) -> None:
        self._output = output
        self._every_s = every_s
        self._take = take
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latest-model", daemon=True)

    def start(self) -> None:
        """Start publishing."""
        self._thread.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop, after a publication in progress."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.publish_once()

    def publish_once(self) -> Path | None:
        """Take and publish one model; None if it failed (logged; the next one may not)."""
        models = self._output / "models"
        names = [int(p.name) for p in models.glob("[0-9]*") if p.name.isdigit()]
        target = models / f"{max(names, default=-1) + 1:06d}"
        try:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            self._take(target)
            publish_latest(self._output, target)
        except (ElasticPSError, OSError) as exc:
            log.warning("publishing the latest model failed: %s", exc)
            shutil.rmtree(target, ignore_errors=True)
            return None
        for old in sorted(p for p in models.iterdir() if p.name.isdigit())[:-KEEP_MODELS]:
            shutil.rmtree(old, ignore_errors=True)
        return target
