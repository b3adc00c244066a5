"""Parameter-server slots: ``ps_desired``, the claims ``ps/<index>`` and their epochs.

A server claims the lowest free slot with a put-if-absent transaction under
its lease; the slot frees when the lease ends. Each claim has an *epoch*: the
etcd revision at which the claim's transaction created the key (its
``create_revision``). No two claims of a slot ever share an epoch, and a
later claim has a larger one, so a server, a client or a checkpoint can name
"slot 1 as held by the claim of epoch 812" and tell it from any successor
(see :mod:`elasticps.coord.keys`). Epochs are read from the same key-value as
the address, so a reader never pairs one claim's address with another's epoch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticps.coord.base import StoreBase
from elasticps.coord.client import (
    address_of,
    decode,
    decode_object,
    encode,
    poll_delays,
    sleep_until_next_poll,
)
from elasticps.coord.lease import KeptLease
from elasticps.coord.watch import Watch, WatchedValue
from elasticps.errors import ConfigError, CoordinationError

__all__ = ["PSSlot", "PSSlots", "SlotClaim"]


@dataclass(frozen=True)
class SlotClaim:
    """A slot this process claimed, and the epoch of the claim.

    Attributes:
        index: the slot, 0-based.
        epoch: the etcd revision that created ``ps/<index>`` for this claim (>= 1).

    Raises:
        ConfigError: a negative index or an epoch < 1.
    """

    index: int
    epoch: int

    def __post_init__(self) -> None:
        if self.index < 0 or self.epoch < 1:
            raise ConfigError(f"a slot claim needs index >= 0 and epoch >= 1, got {self}")


@dataclass(frozen=True)
class PSSlot:
    """A claimed parameter-server slot as readers see it.

    Attributes:
        index: the slot, 0-based.
        address: where trainers reach the server, ``"host:port"``.
        epoch: the claim's epoch, the ``create_revision`` of ``ps/<index>`` (>= 1);
            0 for a server reached by a fixed address without coordination (tools
            and tests), whose unclaimed server also holds epoch 0.
        unix: the AF_UNIX path the server also listens on, or None.
        host_id: the server's host id (:func:`~elasticps.wire.frame.local_host_id`)
            when ``unix`` is set, else None.

    Raises:
        ConfigError: a negative index or a negative epoch.
    """

    index: int
    address: str
    epoch: int
    unix: str | None = None
    host_id: str | None = None

    def __post_init__(self) -> None:
        if self.index < 0 or self.epoch < 0:
            raise ConfigError(f"a PS slot needs index >= 0 and epoch >= 0, got {self}")

    @property
    def claim(self) -> SlotClaim:
        """The slot's index and epoch."""
        return SlotClaim(self.index, self.epoch)


def _optional_str(value: dict[str, object], name: str) -> str | None:
    field = value.get(name)
    return field if isinstance(field, str) else None


def _slot(index: int, value: dict[str, object], key: str, epoch: int) -> PSSlot:
    """The slot record ``value`` of ``key``, read at ``epoch``.

    Raises:
        CoordinationError: no string ``"address"``.
    """
    address = value.get("address")
    if not isinstance(address, str):
        raise CoordinationError(f"etcd key {key} has no string 'address'")
    return PSSlot(
        index=index,
        address=address,
        epoch=epoch,
        unix=_optional_str(value, "unix"),
        host_id=_optional_str(value, "host_id"),
    )


def _decode_slot_value(raw: bytes, key: str) -> dict[str, object]:
    """A slot's JSON object; CoordinationError (so that a watch skips it) without an address."""
    value = decode_object(raw, key)
    if not isinstance(value.get("address"), str):
        raise CoordinationError(f"etcd key {key} has no string 'address'")
    return value


class PSSlots(StoreBase):
    """``ps_desired`` and the parameter-server slots ``ps/<index>``, with their epochs.

    See :class:`~elasticps.coord.base.StoreBase` for the constructor.
    """

    # --- ps_desired ---------------------------------------------------------------------

    def set_ps_desired(self, n: int) -> None:
        """Set the number of parameter-server slots.

        Raises:
            ConfigError: ``n`` < 1.
            CoordinationError: etcd failed.
        """
        if n < 1:
            raise ConfigError(f"the number of parameter servers must be >= 1, got {n}")
        self._put(self.keys.ps_desired, encode(n))

    def ps_desired(self) -> int | None:
        """Return the number of parameter-server slots, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is not an integer.
        """
        with self._etcd("reading ps_desired"):
            raw, _ = self._client.get(self.keys.ps_desired)
        return None if raw is None else self._decode_ps_desired(raw)

    def _decode_ps_desired(self, raw: bytes) -> int:
        value = decode(raw, self.keys.ps_desired)
        if not isinstance(value, int) or isinstance(value, bool):
            raise CoordinationError(f"etcd key {self.keys.ps_desired} must hold an integer")
        return value

    # --- claiming -----------------------------------------------------------------------

    def claim_ps_slot(self, address: str, lease: KeptLease) -> int:
        """Claim the lowest free parameter-server slot for ``address``.

        Each slot is claimed with a put-if-absent transaction under the lease, so
        two servers never hold the same slot; a slot frees when its holder's
        lease ends.

        Args:
            address: where trainers reach this server, ``"host:port"``.
            lease: the server's lease.

        Returns:
            The claimed index, 0-based.

        Raises:
            CoordinationError: ps_desired is unset, every slot is taken, or etcd failed.
        """
        n = self.ps_desired()
        if n is None:
            raise CoordinationError(f"cannot claim a PS slot: {self.keys.ps_desired} is not set")
        claim = self._try_claim_ps_slot(address, lease, n)
        if claim is None:
            raise CoordinationError(f"cannot claim a PS slot: all {n} slots are taken")
        return claim.index

    def claim_ps_slot_within(
        self,
        address: str,
        lease: KeptLease,
        timeout_s: float,
        *,
        cancel: threading.Event | None = None,
        unix: str | None = None,
    ) -> int:
        """Claim the lowest free parameter-server slot, waiting up to ``timeout_s`` for one.

        A restarted server uses this to get its old index back: its slot frees
        when the old lease expires, and until then every slot may be taken.
        Also waits for ``ps_desired`` to be set. :meth:`claim_ps_slot_with_epoch`
        does the same and also returns the claim's epoch.

        Args:
            address: where trainers reach this server, ``"host:port"``.
            lease: the server's lease.
            timeout_s: how long to keep trying, in seconds (0: once).
            cancel: when set, stop waiting (raises CoordinationError).
            unix: the AF_UNIX path the server also listens on, recorded next to
                ``address`` (as ``"unix"``, with ``"host_id"``) for clients on the
                same host; None: TCP only.

        Returns:
            The claimed index, 0-based.

        Raises:
            CoordinationError: no slot freed in time, cancelled, or etcd failed.
        """
        return self.claim_ps_slot_with_epoch(
            address, lease, timeout_s, cancel=cancel, unix=unix
        ).index

    def claim_ps_slot_with_epoch(
        self,
        address: str,
        lease: KeptLease,
        timeout_s: float,
        *,
        cancel: threading.Event | None = None,
        unix: str | None = None,
    ) -> SlotClaim:
        """Claim the lowest free parameter-server slot, waiting up to ``timeout_s``; with epoch.

        Like :meth:`claim_ps_slot_within`. The epoch is the ``create_revision``
        of ``ps/<index>``, read inside the claiming transaction, so it is this
        claim's and no other's.

        Args:
            address: where trainers reach this server, ``"host:port"``.
            lease: the server's lease.
            timeout_s: how long to keep trying, in seconds (0: once).
            cancel: when set, stop waiting (raises CoordinationError).
            unix: the AF_UNIX path the server also listens on, recorded next to
                ``address`` (as ``"unix"``, with ``"host_id"``); None: TCP only.

        Returns:
            The claimed slot's index and the claim's epoch.

        Raises:
            CoordinationError: no slot freed in time, cancelled, or etcd failed.
        """
        deadline = time.monotonic() + timeout_s
        delays = poll_delays()
        while True:
            n = self.ps_desired()
            claim = None if n is None else self._try_claim_ps_slot(address, lease, n, unix)
            if claim is not None:
                return claim
            if cancel is not None and cancel.is_set():
                raise CoordinationError("cancelled while waiting for a free PS slot")
            if time.monotonic() >= deadline:
                if n is None:
                    raise CoordinationError(
                        f"cannot claim a PS slot: {self.keys.ps_desired} was not set "
                        f"within {timeout_s:g} s"
                    )
                raise CoordinationError(
                    f"cannot claim a PS slot: all {n} slots stayed taken for {timeout_s:g} s"
                )
            sleep_until_next_poll(delays, deadline)

    def _try_claim_ps_slot(
        self, address: str, lease: KeptLease, n: int, unix: str | None = None
    ) -> SlotClaim | None:
        """One pass of put-if-absent transactions over slots 0..n-1; the claim won, or None.

        Raises:
            CoordinationError: etcd failed, or did not return the key it created.
        """
        txns = self._client.transactions
        record: dict[str, object] = {"address": address, "pid": os.getpid()}
        if unix is not None:
            from elasticps.wire.frame import local_host_id

            record.update(unix=unix, host_id=local_host_id())
        value = encode(record)
        for index in range(n):
            key = self.keys.ps(index)
            # The get after the put runs in the same transaction (one etcd
            # revision) and sees the put: its create_revision is this claim's.
            succeeded, responses = self._txn(
                f"claiming {key}",
                compare=[txns.version(key) == 0],
                success=[txns.put(key, value, lease=lease.id), txns.get(key)],
                failure=[],
            )
            if succeeded:
                read = responses[1] if len(responses) > 1 else []
                if not read:
                    raise CoordinationError(f"etcd did not return {key} after creating it")
                return SlotClaim(index, int(read[0][1].create_revision))
        return None

    # --- reading ------------------------------------------------------------------------

    def slot_epoch(self, index: int) -> int | None:
        """The epoch of the claim that holds slot ``index`` now, from one read.

        Args:
            index: the slot, 0-based.

        Returns:
            The ``create_revision`` of ``ps/<index>``, or None if the slot is free.

        Raises:
            ConfigError: ``index`` < 0.
            CoordinationError: etcd failed.
        """
        key = self.keys.ps(index)
        with self._etcd(f"reading {key}"):
            raw, meta = self._client.get(key)
        return None if raw is None else int(meta.create_revision)

    def ps_slots(self) -> dict[int, PSSlot]:
        """The claimed slots with their addresses and epochs, from one consistent read.

        Returns every claimed ``ps/<index>``, including any at or beyond
        ``ps_desired`` (left by a larger job, until their leases end).

        Returns:
            Slot index -> slot.

        Raises:
            CoordinationError: etcd failed, or a slot's value is not a JSON
                object with a string ``"address"``.
        """
        return self._ps_snapshot()[1]

    def _ps_snapshot(self) -> tuple[int | None, dict[int, PSSlot]]:
        """ps_desired and the claimed slots, from one consistent read.

        ``ps_desired`` and ``ps/<i>`` share the prefix ``<root>ps``, so one range
        read returns both at the same revision.

        Raises:
            CoordinationError: etcd failed, or a value is malformed.
        """
        root_ps = self.keys.root + "ps"
        with self._etcd("listing PS slots"):
            response = self._client.get_prefix_response(root_ps)
        desired: int | None = None
        slots: dict[int, PSSlot] = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8")
            if key == self.keys.ps_desired:
                desired = self._decode_ps_desired(kv.value)
            elif key.startswith(self.keys.ps_prefix):
                suffix = key[len(self.keys.ps_prefix) :]
                if suffix.isdigit():
                    index = int(suffix)
                    value = decode_object(kv.value, key)
                    slots[index] = _slot(index, value, key, int(kv.create_revision))
        return desired, slots

    def ps_addresses(self, timeout_s: float) -> list[str]:
        """Wait until every parameter-server slot is claimed; return their addresses.

        Args:
            timeout_s: how long to wait, in seconds.

        Returns:
            The addresses of slots 0..ps_desired-1, in index order.

        Raises:
            CoordinationError: the slots were not all claimed in time (the message
                names the missing indices), or etcd failed.
        """
        return [slot.address for slot in self.wait_ps_slots(timeout_s)]

    def wait_ps_slots(
        self, timeout_s: float, *, cancel: threading.Event | None = None
    ) -> list[PSSlot]:
        """Wait until every parameter-server slot is claimed; return them with their epochs.

        Each result comes from one consistent read of ``ps_desired`` and the slots.

        Args:
            timeout_s: how long to wait, in seconds.
            cancel: when set, stop waiting (raises CoordinationError).

        Returns:
            Slots 0..ps_desired-1, in index order.

        Raises:
            CoordinationError: the slots were not all claimed in time (the message
                names the missing indices), cancelled, or etcd failed.
        """
        deadline = time.monotonic() + timeout_s
        delays = poll_delays()
        while True:
            if cancel is not None and cancel.is_set():
                raise CoordinationError("cancelled while waiting for the parameter servers")
            desired, slots = self._ps_snapshot()
            if desired is not None:
                missing = [i for i in range(desired) if i not in slots]
                if not missing:
                    return [slots[i] for i in range(desired)]
            if time.monotonic() >= deadline:
                if desired is None:
                    raise CoordinationError(
                        f"{self.keys.ps_desired} was not set within {timeout_s:g} s"
                    )
                raise CoordinationError(
                    f"parameter servers missing after {timeout_s:g} s: "
                    f"slots {missing} of {desired} are not claimed"
                )
            sleep_until_next_poll(delays, deadline)

    def wait_ps_address(self, index: int, *, not_equal: str | None = None, timeout_s: float) -> str:
        """Wait until slot ``index`` is claimed (by an address other than ``not_equal``).

        Args:
            index: the slot, 0-based.
            not_equal: an address to wait past (the server that went away), or None.
            timeout_s: how long to wait, in seconds.

        Returns:
            The address of the server holding the slot.

        Raises:
            CoordinationError: nothing suitable within ``timeout_s``, or etcd failed.
        """
        key = self.keys.ps(index)
        deadline = time.monotonic() + timeout_s
        delays = poll_delays()
        while True:
            with self._etcd(f"reading {key}"):
                raw, _ = self._client.get(key)
            if raw is not None:
                address = address_of(raw, key)
                if address != not_equal:
                    return address
            if time.monotonic() >= deadline:
                raise CoordinationError(
                    f"no parameter server claimed slot {index} within {timeout_s:g} s"
                    + ("" if not_equal is None else f" (other than {not_equal})")
                )
            sleep_until_next_poll(delays, deadline)

    # --- watching -----------------------------------------------------------------------

    def watch_ps(
        self, on_change: Callable[[dict[int, str]], None], start_revision: int = 0
    ) -> Watch:
        """Call ``on_change`` with slot index -> address after each change of ``ps/``.

        Args:
            on_change: receives a fresh dict of claimed slots; runs on the
                watch's thread.
            start_revision: first etcd revision to report; 0 reads the current
                slots first and watches from there.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        if start_revision <= 0:
            _, start_revision = self.get_prefix_json(self.keys.ps_prefix)
            start_revision += 1

        def report(slots: dict[str, dict[str, object]]) -> None:
            on_change(
                {
                    int(k): str(v["address"])
                    for k, v in slots.items()
                    if k.isdigit() and isinstance(v.get("address"), str)
                }
            )

        return self._start_watch(
            "parameter servers", self.keys.ps_prefix, decode_object, report, start_revision
        )

    def watch_ps_slots(
        self, on_change: Callable[[dict[int, PSSlot]], None], start_revision: int = 0
    ) -> Watch:
        """Call ``on_change`` with the claimed slots and their epochs after each change.

        Each slot's epoch is the ``create_revision`` of its key-value in the
        watch event, or in the re-read after the watch's history was compacted,
        so it is always the epoch of the claim whose address is reported. A slot
        freed and claimed again while the watch was broken (an etcd restart) is
        reported as a change even if the new claim has the same address. Values
        without a string ``"address"`` are skipped.

        Args:
            on_change: receives a fresh dict slot index -> slot; runs on the
                watch's thread.
            start_revision: first etcd revision to report; 0 watches from the
                current revision and reports the current slots first.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        prefix = self.keys.ps_prefix
        if start_revision <= 0:
            with self._etcd("reading the etcd revision"):
                response = self._client.get_response(prefix)
            start_revision = int(response.header.revision) + 1
            report_first = True
        else:
            report_first = False

        def report(state: dict[str, WatchedValue]) -> None:
            slots: dict[int, PSSlot] = {}
            for name, watched in state.items():
                if name.isascii() and name.isdigit():
                    index = int(name)
                    key = prefix + name
                    slots[index] = _slot(index, watched.value, key, watched.create_revision)
            on_change(slots)

        watch = self._start_watch_revisions(
            "parameter-server slots", prefix, _decode_slot_value, report, start_revision
        )
        if report_first:
            watch.report_now()
        return watch
