"""TensorBoard scalars of a job, written by its launcher (``train --tensorboard DIR``).

One :class:`JobScalars` per job writes one event file through
:class:`torch.utils.tensorboard.SummaryWriter`, from what the launcher already
follows: the master's progress (samples trained, the last loss), the pass
audits in etcd, the per-pass test evaluations (``--eval-each-pass``) and a
stream's lag. Writing from the launcher, not from the roles, keeps one curve
per scalar however many masters, parameter servers and trainers restart: the
launcher outlives them all.

The step of the training scalars is the number of samples trained since the
job started, counted by the launcher so that it never goes back: a master
that takes over counts its samples from 0 again, and those are added on.
The per-pass scalars' step is the number of passes completed.

Scalars (tags):

- ``train/loss``: the mean loss of the last reported task;
- ``train/samples_per_s``: samples trained per second, over the last second
  or more;
- ``pass/records_trained``, ``pass/records_skipped``, ``pass/tasks_failed``:
  from each pass's audit;
- ``test/<metric>`` (``test/accuracy``, ``test/loss``, ...): each pass's test
  evaluation;
- ``stream/lag_records``: records behind the head of a Kafka stream;
- ``train/staleness``: in async-SGD, the mean staleness of the pushes since the
  last point (model versions), from the parameter servers' metrics, every second.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from elasticps.extras import require_extra

if TYPE_CHECKING:
    from elasticps.launcher.pass_eval import PassEvaluation

__all__ = ["JobScalars", "check_available"]

_RATE_WINDOW_S: Final = 1.0


def check_available() -> None:
    """Check that TensorBoard's writer can be imported (without importing it).

    Raises:
        MissingExtraError: the ``tensorboard`` extra is not installed.
    """
    require_extra("tensorboard", "--tensorboard")


class JobScalars:
    """The TensorBoard writer of one job's launcher.

    Args:
        log_dir: the directory of the event files (``--tensorboard DIR``).

    Raises:
        MissingExtraError: TensorBoard is not installed.
        OSError: the directory cannot be created.
    """

    def __init__(self, log_dir: Path) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=5)
        self._step = 0
        self._reported = 0  # the master's count at the last progress
        self._rate_t: float | None = None
        self._rate_step = 0
        self._passes: set[int] = set()
        self._evaluated: set[int] = set()

    @property
    def step(self) -> int:
        """Samples trained since the job started, as counted here (never decreasing)."""
        return self._step

    def progress(
        self,
        samples: int,
        loss: float,
        *,
        lag: int | None = None,
        now: float | None = None,
    ) -> None:
        """Record the master's progress.

        Args:
            samples: samples trained, as the master now counts them (its count
                restarts at 0 after a failover).
            loss: the mean loss of the last reported task (NaN: none yet).
            lag: records behind the stream's head, or None.
            now: monotonic time, seconds; None: now.
        """
        now = time.monotonic() if now is None else now
        delta = samples - self._reported if samples >= self._reported else samples
        self._reported = samples
        self._step += delta
        if delta > 0 and math.isfinite(loss):
            self._writer.add_scalar("train/loss", loss, self._step)
        if self._rate_t is None:
            self._rate_t, self._rate_step = now, self._step
        elif now - self._rate_t >= _RATE_WINDOW_S:
            rate = (self._step - self._rate_step) / (now - self._rate_t)
            self._writer.add_scalar("train/samples_per_s", rate, self._step)
            self._rate_t, self._rate_step = now, self._step
        if lag is not None:
            self._writer.add_scalar("stream/lag_records", lag, self._step)

    def staleness(self, mean: float) -> None:
        """Record the mean staleness of the recent pushes, model versions."""
        if math.isfinite(mean):
            self._writer.add_scalar("train/staleness", mean, self._step)

    def passes(self, audits: Mapping[int, Mapping[str, Any]]) -> None:
        """Record each pass audit not recorded yet (``passes/<n>`` in etcd)."""
        for pass_id in sorted(set(audits) - self._passes):
            self._passes.add(pass_id)
            audit = audits[pass_id]
            for key in ("records_trained", "records_skipped", "tasks_failed"):
                value = audit.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._writer.add_scalar(f"pass/{key}", value, pass_id + 1)

    def evaluations(self, evaluations: Sequence[PassEvaluation]) -> None:
        """Record each per-pass test evaluation not recorded yet."""
        for evaluation in evaluations:
            if evaluation.pass_id in self._evaluated:
                continue
            self._evaluated.add(evaluation.pass_id)
            for name, value in sorted(evaluation.metrics.items()):
                if isinstance(value, int | float) and math.isfinite(value):
                    self._writer.add_scalar(f"test/{name}", value, evaluation.pass_id + 1)
            if "loss" not in evaluation.metrics and math.isfinite(evaluation.loss):
                self._writer.add_scalar("test/loss", evaluation.loss, evaluation.pass_id + 1)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
