"""The master lock, and the ledger writes fenced by it.

Only the holder of ``master/lock`` (a put-if-absent key under the master's
lease) is the master. Every ledger write compares, inside the same etcd
transaction, that the lock is still held by the writer's lease, so a master
that lost its lock cannot write even before it notices.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from pyetcd.utils import prefix_range_end

from elasticps.coord.base import StoreBase
from elasticps.coord.client import (
    MAX_TXN_OPS,
    LeaseEquals,
    address_of,
    encode,
    poll_delays,
    sleep_until_next_poll,
)
from elasticps.coord.lease import KeptLease
from elasticps.errors import ConfigError, CoordinationError

__all__ = ["MasterLock"]


class MasterLock(StoreBase):
    """``master/lock`` and the writes fenced by it.

    See :class:`~elasticps.coord.base.StoreBase` for the constructor.
    """

    def acquire_master_lock(self, address: str, lease: KeptLease) -> bool:
        """Try once to become the master: put-if-absent ``master/lock`` under the lease.

        Args:
            address: where the master serves, ``"host:port"``.
            lease: the master's lease; the lock is released when it ends.

        Returns:
            True if this lease now holds the lock (including if it already did).

        Raises:
            CoordinationError: etcd failed.
        """
        return self.acquire_master_lock_with({"address": address}, lease)

    def acquire_master_lock_with(self, value: Mapping[str, object], lease: KeptLease) -> bool:
        """Like :meth:`acquire_master_lock`, with more in the lock's JSON value.

        Args:
            value: the lock's value; must hold the master's ``"address"``
                (``"host:port"``), and may hold more (e.g. its ``"pid"``, which the
                local launcher uses to find the active master).
            lease: the master's lease; the lock is released when it ends.

        Returns:
            True if this lease now holds the lock (including if it already did;
            the value is then left as it was).

        Raises:
            ConfigError: ``value`` has no string ``"address"``.
            CoordinationError: etcd failed.
        """
        if not isinstance(value.get("address"), str):
            raise ConfigError(f"the master lock's value needs a string 'address', got {value!r}")
        key = self.keys.master_lock
        txns = self._client.transactions
        succeeded, responses = self._txn(
            "acquiring the master lock",
            compare=[txns.version(key) == 0],
            success=[txns.put(key, encode(dict(value)), lease=lease.id)],
            failure=[txns.get(key)],
        )
        if succeeded:
            return True
        held = responses[0] if responses else []
        return bool(held) and int(held[0][1].lease_id) == lease.id

    def master_address(self, timeout_s: float) -> str:
        """Wait until a master holds the lock; return its address.

        Args:
            timeout_s: how long to wait, in seconds.

        Raises:
            CoordinationError: no master within ``timeout_s``, or etcd failed.
        """
        key = self.keys.master_lock
        deadline = time.monotonic() + timeout_s
        delays = poll_delays()
        while True:
            with self._etcd("reading the master lock"):
                raw, _ = self._client.get(key)
            if raw is not None:
                return address_of(raw, key)
            if time.monotonic() >= deadline:
                raise CoordinationError(f"no master holds {key} after {timeout_s:g} s")
            sleep_until_next_poll(delays, deadline)

    def fenced_put(self, key: str, value: str, lease: KeptLease) -> bool:
        """Write ``key`` only while ``lease`` holds the master lock.

        The check and the write are one etcd transaction, so a master that lost
        its lock (lease expired, another master took over) cannot write, even if
        it has not noticed yet. The written key is not attached to the lease.

        Args:
            key: the full key, e.g. ``keys.task(7)``.
            value: the value (JSON text by convention).
            lease: the lease the caller acquired the master lock with.

        Returns:
            True if written; False if ``lease`` does not hold the lock (step down).

        Raises:
            CoordinationError: etcd failed.
        """
        txns = self._client.transactions
        succeeded, _ = self._txn(
            f"fenced write of {key}",
            compare=[LeaseEquals(self.keys.master_lock, lease.id)],
            success=[txns.put(key, value)],
            failure=[],
        )
        return bool(succeeded)

    def fenced_write(
        self,
        puts: Sequence[tuple[str, str]],
        lease: KeptLease,
        *,
        delete_prefixes: Sequence[str] = (),
        delete_keys: Sequence[str] = (),
    ) -> bool:
        """Write several keys in one transaction, only while ``lease`` holds the master lock.

        Like :meth:`fenced_put`, but all-or-nothing over many keys: the prefix
        and key deletions run first, then the puts, in order. The written keys are not
        attached to the lease. etcd refuses a transaction in which a put falls
        inside a deleted range.

        Args:
            puts: ``(key, value)`` pairs (full keys, JSON text by convention).
            lease: the lease the caller acquired the master lock with.
            delete_prefixes: key prefixes to delete first (each is one operation).
            delete_keys: single keys to delete first (each is one operation).

        Returns:
            True if written; False if ``lease`` does not hold the lock (step down).

        Raises:
            ConfigError: more than :data:`MAX_TXN_OPS` operations, or none.
            CoordinationError: etcd failed.
        """
        num_ops = len(puts) + len(delete_prefixes) + len(delete_keys)
        if not 0 < num_ops <= MAX_TXN_OPS:
            raise ConfigError(f"a fenced write needs 1..{MAX_TXN_OPS} operations, got {num_ops}")
        txns = self._client.transactions
        ops: list[Any] = [
            txns.delete(prefix, range_end=prefix_range_end(prefix.encode("utf-8")))
            for prefix in delete_prefixes
        ]
        ops.extend(txns.delete(key) for key in delete_keys)
        ops.extend(txns.put(key, value) for key, value in puts)
        succeeded, _ = self._txn(
            f"fenced write of {num_ops} key(s)",
            compare=[LeaseEquals(self.keys.master_lock, lease.id)],
            success=ops,
            failure=[],
        )
        return bool(succeeded)
