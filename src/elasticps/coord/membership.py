"""Trainer membership: live trainers under their leases, and the wanted number of them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from elasticps.coord.base import StoreBase
from elasticps.coord.client import decode, decode_object, encode
from elasticps.coord.lease import KeptLease
from elasticps.coord.watch import Watch
from elasticps.errors import ConfigError, CoordinationError

__all__ = ["TrainerMap", "TrainerMembership"]

_log = logging.getLogger(__name__)

#: Trainer id -> the info object the trainer registered.
TrainerMap = dict[str, dict[str, object]]


class TrainerMembership(StoreBase):
    """Live trainers (``trainers/<id>``, each under its lease) and ``trainers_wanted``.

    See :class:`~elasticps.coord.base.StoreBase` for the constructor.
    """

    def register_trainer(
        self, trainer_id: str, info: Mapping[str, object], lease: KeptLease
    ) -> None:
        """Publish a live trainer under ``trainers/<id>``, attached to its lease.

        Args:
            trainer_id: ``[A-Za-z0-9_.-]+``.
            info: JSON-serialisable description (address, host, ...).
            lease: the trainer's lease; the key vanishes when it ends.

        Raises:
            ConfigError: the trainer id is malformed.
            CoordinationError: etcd failed.
        """
        self.put_json(self.keys.trainer(trainer_id), info, lease)

    def trainer_registered(self, trainer_id: str) -> bool:
        """Whether ``trainers/<trainer_id>`` exists (a live registration).

        Raises:
            ConfigError: the trainer id is malformed.
            CoordinationError: etcd failed.
        """
        key = self.keys.trainer(trainer_id)
        with self._etcd(f"reading {key}"):
            raw, _ = self._client.get(key)
        return raw is not None

    def live_trainers(self) -> tuple[TrainerMap, int]:
        """Read the live trainers.

        Returns:
            The map trainer id -> info, and the etcd revision of the read (pass
            revision + 1 to :meth:`watch_trainers` to miss no change).

        Raises:
            CoordinationError: etcd failed or a value is not a JSON object.
        """
        prefix = self.keys.trainers_prefix
        with self._etcd("listing trainers"):
            response = self._client.get_prefix_response(prefix)
        trainers: TrainerMap = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8")
            trainers[key[len(prefix) :]] = decode_object(kv.value, key)
        return trainers, int(response.header.revision)

    def watch_trainers(self, on_change: Callable[[TrainerMap], None], start_revision: int) -> Watch:
        """Call ``on_change`` with the full map of live trainers after each change.

        Changes are registrations, updates and removals, including removals by
        lease expiry. ``on_change`` runs on the watch's thread.

        Args:
            on_change: receives a fresh dict trainer id -> info.
            start_revision: first etcd revision to report; usually the revision
                returned by :meth:`live_trainers` plus 1.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        return self._start_watch(
            "trainers", self.keys.trainers_prefix, decode_object, on_change, start_revision
        )

    def set_trainers_wanted(self, n: int) -> None:
        """Set the wanted number of trainers; the worker manager clamps it to its range.

        Raises:
            ConfigError: ``n`` < 0.
            CoordinationError: etcd failed.
        """
        if n < 0:
            raise ConfigError(f"the wanted number of trainers must be >= 0, got {n}")
        self._put(self.keys.trainers_wanted, encode(n))

    def trainers_wanted(self) -> int | None:
        """Return the wanted number of trainers, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is not a non-negative integer.
        """
        with self._etcd("reading trainers_wanted"):
            raw, _ = self._client.get(self.keys.trainers_wanted)
        return None if raw is None else self._decode_trainers_wanted(raw, self.keys.trainers_wanted)

    @staticmethod
    def _decode_trainers_wanted(raw: bytes, key: str) -> int:
        value = decode(raw, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CoordinationError(f"etcd key {key} must hold a non-negative integer")
        return value

    def watch_trainers_wanted(self, on_change: Callable[[int | None], None]) -> Watch:
        """Call ``on_change`` with the wanted number of trainers after each change.

        Reads the current value first and watches from the next revision, so no
        change is missed. A malformed value is logged and ignored. ``on_change``
        runs on the watch's thread; it receives None if the key is deleted.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        key = self.keys.trainers_wanted
        with self._etcd("reading trainers_wanted"):
            response = self._client.get_response(key)
        start_revision = int(response.header.revision) + 1

        def decode(raw: bytes, full_key: str) -> dict[str, object]:
            try:
                return {"count": self._decode_trainers_wanted(raw, full_key)}
            except CoordinationError as exc:
                _log.warning("ignoring %s", exc)
                return {}

        def report(values: dict[str, dict[str, object]]) -> None:
            count = values.get("", {}).get("count")  # the exact key, not a longer one
            on_change(count if isinstance(count, int) else None)

        return self._start_watch("trainers_wanted", key, decode, report, start_revision)
