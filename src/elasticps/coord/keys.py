"""The etcd key layout of a job. Pure: no I/O.

Every key of a job lives under ``/elasticps/<job>/``; every value is a UTF-8
JSON document (see ``docs/architecture.md``):

============================  ===============  =================================
key                           written by       value
============================  ===============  =================================
``master/lock``               master (lease)   ``{"address": "host:port"}``
``trainers/<id>``             trainer (lease)  the trainer's info object
``trainers_wanted``           ``scale``        wanted number of trainers, an integer
``ps_desired``                launcher         number of PS slots, a JSON integer
``ps/<index>``                PS (txn, lease)  ``{"address", "pid"}``, and
                                               ``"unix"``, ``"host_id"`` if the
                                               server also listens on AF_UNIX
``tasks/<id>``                master (fenced)  one task's ledger record
``queue/meta``                master (fenced)  the task queue's pass, counters
``queue/spec``                master (fenced)  the data split the ledger is for
``passes/<pass>``             master (fenced)  the audit of a completed pass
``checkpoints/<version>``     master (fenced)  a checkpoint manifest (later)
``job/state``                 launcher/master  a JSON string, e.g. ``"running"``
============================  ===============  =================================

Numeric ids in keys (task ids, checkpoint versions) are zero-padded so that a
prefix listing, which etcd sorts by key bytes, comes out in numeric order.

**Slot epochs.** A server claims slot ``ps/<index>`` by creating the key in a
put-if-absent transaction under its lease; the key goes away with the lease
(or when the launcher deletes it for a reaped server). The *epoch* of a claim
is the key's ``create_revision``: the etcd revision of the transaction that
created it. etcd revisions only grow, and every claim creates the key anew, so
no two claims of a slot ever have the same epoch, and a later claim has a
larger one. A reader learns the epoch with the address, from the same
key-value (:meth:`~elasticps.coord.slots.PSSlots.ps_slots`,
:meth:`~elasticps.coord.slots.PSSlots.watch_ps_slots`). Epochs survive etcd
restarts and compaction (revisions are part of etcd's data); they start again
only with a new, empty etcd, which also loses the rest of the job's state.
"""

from __future__ import annotations

import re
from typing import Final

from elasticps.errors import ConfigError

__all__ = ["Keys", "check_name"]

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]+")


def check_name(what: str, name: str) -> str:
    """Return ``name`` if it is a valid key component (``[A-Za-z0-9_.-]+``, not ``.``/``..``).

    Args:
        what: what the name is, for the message (``"job name"``).
        name: the name.

    Raises:
        ConfigError: the name is empty or has other characters.
    """
    if not _NAME_RE.fullmatch(name) or name in {".", ".."}:
        raise ConfigError(f"{what} {name!r} must be non-empty and use only A-Z a-z 0-9 _ . -")
    return name


class Keys:
    """Builds the etcd keys of one job. Pure: no I/O.

    Args:
        job: the job name, ``[A-Za-z0-9_.-]+``.

    Raises:
        ConfigError: the job name is empty or has other characters.
    """

    def __init__(self, job: str) -> None:
        self.job: Final = check_name("job name", job)
        #: Prefix of every key of the job, ending in ``/``.
        self.root: Final = f"/elasticps/{job}/"

    @property
    def master_lock(self) -> str:
        """Key held (under a lease) by the active master; its value holds the address."""
        return self.root + "master/lock"

    @property
    def trainers_prefix(self) -> str:
        """Prefix of the live trainers' keys."""
        return self.root + "trainers/"

    @property
    def health_prefix(self) -> str:
        """Prefix of the parameter servers' checkpoint health records."""
        return self.root + "health/"

    def health(self, ps_index: int) -> str:
        """Key of parameter server ``ps_index``'s checkpoint health record."""
        return f"{self.health_prefix}ps-{ps_index}"

    @property
    def metrics_prefix(self) -> str:
        """Prefix of the roles' metrics targets (:mod:`elasticps.metrics`)."""
        return self.root + "metrics/"

    def metrics(self, name: str) -> str:
        """Key of one role's metrics target (``ps-0``, ``trainer-3``, ``master-<pid>``).

        Raises:
            ConfigError: the name has characters other than ``[A-Za-z0-9_.-]``.
        """
        return self.metrics_prefix + check_name("metrics target", name)

    @property
    def kvstore_prefix(self) -> str:
        """Prefix of the KVStore API's keys (its workers' barriers)."""
        return self.root + "kvstore/"

    def trainer(self, trainer_id: str) -> str:
        """Key of one trainer's registration.

        Raises:
            ConfigError: the id is empty or has characters other than ``[A-Za-z0-9_.-]``.
        """
        return self.trainers_prefix + check_name("trainer id", trainer_id)

    @property
    def ps_desired(self) -> str:
        """Key holding the number of parameter-server slots."""
        return self.root + "ps_desired"

    @property
    def trainers_wanted(self) -> str:
        """Key holding the wanted number of trainers (``elasticps scale``), a JSON integer."""
        return self.root + "trainers_wanted"

    @property
    def ps_prefix(self) -> str:
        """Prefix of the claimed parameter-server slots."""
        return self.root + "ps/"

    def ps(self, index: int) -> str:
        """Key of parameter-server slot ``index`` (0-based).

        The key's ``create_revision`` is the epoch of the claim that holds the
        slot (see the module docstring).

        Raises:
            ConfigError: the index is negative.
        """
        if index < 0:
            raise ConfigError(f"parameter-server index must be >= 0, got {index}")
        return f"{self.ps_prefix}{index}"

    @property
    def restores_prefix(self) -> str:
        """Prefix of the restore records: what each PS found in its checkpoint files."""
        return self.root + "restores/"

    def restore(self, index: int, epoch: int) -> str:
        """Key of the restore record of parameter server ``index`` at slot epoch ``epoch``.

        Written without a lease by the server as it starts, so that it outlives
        the server; the launcher copies every one into ``run.json``.

        Raises:
            ConfigError: the index or the epoch is negative.
        """
        if index < 0 or epoch < 0:
            raise ConfigError(f"restore record needs index, epoch >= 0, got {index}, {epoch}")
        return f"{self.restores_prefix}ps-{index}-e{epoch:012d}"

    @property
    def tasks_prefix(self) -> str:
        """Prefix of the task ledger, one key per task."""
        return self.root + "tasks/"

    def task(self, task_id: int) -> str:
        """Key of one task's ledger entry; the id is zero-padded to 10 digits.

        Raises:
            ConfigError: the id is negative.
        """
        if task_id < 0:
            raise ConfigError(f"task id must be >= 0, got {task_id}")
        return f"{self.tasks_prefix}{task_id:010d}"

    @property
    def queue_meta(self) -> str:
        """Key of the task queue's meta record (pass, finished, ...); exists once the
        ledger is complete."""
        return self.root + "queue/meta"

    @property
    def queue_spec(self) -> str:
        """Key identifying the data split the task ledger was created for."""
        return self.root + "queue/spec"

    @property
    def stream_lag(self) -> str:
        """Key of a stream job's lag (records read but not trained, per partition)."""
        return self.root + "stream/lag"

    @property
    def passes_prefix(self) -> str:
        """Prefix of the per-pass audit summaries."""
        return self.root + "passes/"

    def pass_summary(self, pass_id: int) -> str:
        """Key of the audit summary of pass ``pass_id``, zero-padded to 6 digits.

        Raises:
            ConfigError: the pass id is negative.
        """
        if pass_id < 0:
            raise ConfigError(f"pass id must be >= 0, got {pass_id}")
        return f"{self.passes_prefix}{pass_id:06d}"

    @property
    def checkpoints_prefix(self) -> str:
        """Prefix of the checkpoint manifests."""
        return self.root + "checkpoints/"

    def checkpoint(self, version: int) -> str:
        """Key of the manifest of the checkpoint at model ``version``, zero-padded to 12 digits.

        Raises:
            ConfigError: the version is negative.
        """
        if version < 0:
            raise ConfigError(f"checkpoint version must be >= 0, got {version}")
        return f"{self.checkpoints_prefix}{version:012d}"

    @property
    def job_state(self) -> str:
        """Key holding the job's state as a JSON string (e.g. ``"running"``)."""
        return self.root + "job/state"

    def __repr__(self) -> str:
        return f"Keys({self.job!r})"
