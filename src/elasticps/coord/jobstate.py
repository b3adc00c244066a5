"""The job's progress: its state (``job/state``) and the audits of completed passes."""

from __future__ import annotations

from collections.abc import Callable

from elasticps.coord.base import StoreBase
from elasticps.coord.client import decode, decode_object, encode
from elasticps.coord.watch import Watch
from elasticps.errors import CoordinationError

__all__ = ["JobProgress"]


class JobProgress(StoreBase):
    """``job/state`` and the pass audits under ``passes/``.

    See :class:`~elasticps.coord.base.StoreBase` for the constructor.
    """

    def pass_summaries(self) -> dict[int, dict[str, object]]:
        """Every pass audit written so far, by pass (0-based).

        Raises:
            CoordinationError: etcd failed, or an audit is malformed.
        """
        found, _ = self.get_prefix_json(self.keys.passes_prefix)
        return {int(k): v for k, v in found.items() if k.isdigit()}

    def watch_pass_summaries(
        self, on_change: Callable[[dict[int, dict[str, object]]], None]
    ) -> Watch:
        """Call ``on_change`` with every pass audit written so far, after each new one.

        The master writes ``passes/<n>`` in the transaction that completes
        pass ``n``. Reads the prefix first and watches from the next revision,
        so no pass is missed. ``on_change`` runs on the watch's thread.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        prefix = self.keys.passes_prefix
        _, revision = self.get_prefix_json(prefix)

        def report(values: dict[str, dict[str, object]]) -> None:
            on_change({int(k): v for k, v in values.items() if k.isdigit()})

        return self._start_watch("pass summaries", prefix, decode_object, report, revision + 1)

    def set_job_state(self, state: str) -> None:
        """Set the job state (e.g. ``"running"``, ``"finished"``).

        Raises:
            CoordinationError: etcd failed.
        """
        self._put(self.keys.job_state, encode(state))

    def job_state(self) -> str | None:
        """Return the job state, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is not a JSON string.
        """
        key = self.keys.job_state
        with self._etcd("reading the job state"):
            raw, _ = self._client.get(key)
        if raw is None:
            return None
        state = decode(raw, key)
        if not isinstance(state, str):
            raise CoordinationError(f"etcd key {key} must hold a JSON string")
        return state
