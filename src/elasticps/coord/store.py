"""The job's view of etcd: one :class:`JobStore` per process.

This package is a thin I/O shell over the ``pyetcd`` client (``etcd-sdk-python``).
Decisions (which task to dispatch, when to scale) live elsewhere; here every
method is one or two etcd round trips, and every etcd or gRPC failure leaves as
:class:`~elasticps.errors.CoordinationError`.

The store is split by concern, one small module each:

- :mod:`~elasticps.coord.keys`: the key layout under ``/elasticps/<job>/``
  (documented there, with the epochs of parameter-server slots);
- :mod:`~elasticps.coord.client`: the shared etcd client, error translation
  and JSON codec;
- :mod:`~elasticps.coord.lease`: kept leases and their local validity;
- :mod:`~elasticps.coord.watch`: prefix watches that survive etcd restarts;
- :mod:`~elasticps.coord.base`: one connection with its leases, watches and
  generic JSON access;
- :mod:`~elasticps.coord.membership`: live trainers and the wanted number;
- :mod:`~elasticps.coord.slots`: parameter-server slots and their epochs;
- :mod:`~elasticps.coord.masterlock`: the master lock and fenced writes;
- :mod:`~elasticps.coord.jobstate`: the job state and pass audits.

:class:`JobStore` is all of them on one connection. The names callers use are
re-exported here.
"""

from __future__ import annotations

from elasticps.coord.client import MAX_TXN_OPS, is_transient
from elasticps.coord.jobstate import JobProgress
from elasticps.coord.keys import Keys
from elasticps.coord.lease import KeptLease
from elasticps.coord.masterlock import MasterLock
from elasticps.coord.membership import TrainerMap, TrainerMembership
from elasticps.coord.slots import PSSlot, PSSlots, SlotClaim
from elasticps.coord.watch import Watch

__all__ = [
    "MAX_TXN_OPS",
    "JobStore",
    "KeptLease",
    "Keys",
    "PSSlot",
    "SlotClaim",
    "TrainerMap",
    "Watch",
    "is_transient",
]


class JobStore(TrainerMembership, PSSlots, MasterLock, JobProgress):
    """The job's view of etcd. Owns one pyetcd client (one per process is enough).

    Leases and generic JSON access come from
    :class:`~elasticps.coord.base.StoreBase`; trainers from
    :class:`~elasticps.coord.membership.TrainerMembership`; parameter-server
    slots and their epochs from :class:`~elasticps.coord.slots.PSSlots`; the
    master lock and fenced writes from
    :class:`~elasticps.coord.masterlock.MasterLock`; the job state and pass
    audits from :class:`~elasticps.coord.jobstate.JobProgress`.

    Args:
        endpoint: etcd client endpoint, ``"host:port"`` or ``"http://host:port"``.
        job: the job name; every key lives under ``/elasticps/<job>/``.
        timeout_s: how long to wait for etcd to answer at construction, and the
            deadline of every etcd request, in seconds.
        tls: the TLS identity to show etcd; None: this process's
            (:func:`~elasticps.security.etcd_tls_from_env`), if any.

    Raises:
        ConfigError: the endpoint or the job name is malformed, or a TLS file
            cannot be read.
        CoordinationError: etcd did not answer within ``timeout_s``.
    """
