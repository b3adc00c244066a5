"""The parameter-server process: claim a slot in etcd and serve a shard.

Crash recovery: with ``PSConfig.checkpoint_dir`` set, the server keeps its
shard (values, optimizer state, version, and the push keys it applied) in
checkpoint files (:class:`~elasticps.pserver.checkpoint.ShardFiles`): in
async mode every ``checkpoint_every_s`` seconds on its own, in sync mode when
the master asks (so that every shard saves the same version), at every pass
the master seals, and at a clean shutdown. A restarted server waits for a
free slot (its old lease has to expire first, or the launcher releases it),
loads the newest good file and serves it before accepting any trainer. What
it applied after that file is re-opened by the master at the end of the pass
(:mod:`elasticps.master.verify`), so no acknowledged update is lost. In sync
mode a restored server does not serve until the master has realigned every
shard to one version (:mod:`elasticps.master.align`).

Fencing: the slot's epoch guards everything the server does. Requests carry
it (:mod:`elasticps.pserver.server`); checkpoint files are named after it;
and the server serves and writes only while its lease is known to be valid,
so that a server cut off from etcd stops before a successor can take over
(see ``KeptLease.valid_until``). A server that lost its lease exits with an
error, so that its launcher restarts it and it reloads.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import torch

from elasticps import metrics
from elasticps.config import PSConfig, UpdateMode, check_sparse_eviction, ledger_only
from elasticps.coord.store import JobStore, KeptLease
from elasticps.errors import CoordinationError, ElasticPSError
from elasticps.netutil import runtime_dir as make_runtime_dir
from elasticps.pserver.checkpoint import CheckpointHealth, ShardCheckpointer, ShardFiles
from elasticps.pserver.rules import make_update_rule
from elasticps.pserver.server import ParameterServer
from elasticps.pserver.shard import ParameterShard, ShardClosedError
from elasticps.pserver.sparse import EvictionPolicy
from elasticps.security import secret_from_env
from elasticps.snapshot import load_consistent_checkpoint
from elasticps.storage import Location
from elasticps.tls import tls_from_env

log = logging.getLogger(__name__)


class CheckpointWriteError(ElasticPSError):
    """The parameter server's last checkpoint could not be written at shutdown."""


def run_ps(config: PSConfig, stop: threading.Event) -> None:
    """Run one parameter server until ``stop`` is set, a shutdown command, or lease loss.

    The server binds first, then claims the lowest free ``/ps/<index>`` slot
    with its address under a lease (waiting up to ``claim_timeout_s`` for one
    to free), restores its shard from its own checkpoint if there is one (or
    prepares to resume from ``resume_dir``), then serves and follows trainer
    membership for the sync barrier.

    Raises:
        CoordinationError: etcd is unreachable, no slot freed in time, or the
            lease was lost (the caller should exit non-zero, to be restarted).
        DataError: the resume checkpoint is corrupt.
        CheckpointWriteError: the final checkpoint could not be written (the
            updates since the last good one are lost if nothing else holds them).
        OSError: the port cannot be bound.
    """
    # One intra-op thread: the fused optimizer step is memory-bound, and a
    # second thread only competes with the trainers on a small machine.
    torch.set_num_threads(1)
    _prewarm_optimizer(config)
    store = JobStore(config.common.etcd_endpoint, config.common.job)
    lease = store.grant_lease(config.common.lease_ttl_s, on_lost=stop.set)
    # Bind before claiming, so the address we publish is already accepting.
    # Also on AF_UNIX, in a private runtime dir, for trainers on this host.
    runtime_dir = make_runtime_dir("elasticps-ps-")
    server = ParameterServer(
        shard_index=-1,
        mode=config.mode,
        optimizer=config.optimizer,
        host=config.host,
        port=config.port,
        init_timeout_s=config.init_timeout_s,
        on_shutdown=stop.set,
        frozen=config.frozen,
        max_staleness=config.max_staleness,
        unix_path=os.path.join(runtime_dir, "ps.sock"),
        gate=lambda: _wait_lease_valid(lease, stop),
        holds_slot=lambda: _lease_valid(lease),
        reduction=config.sync_reduction,
        eviction=_eviction(config),
        secret=secret_from_env(),
        tls=tls_from_env(),
    )
    watch = None
    checkpointer: ShardCheckpointer | None = None
    files: ShardFiles | None = None
    try:
        log.info("parameter server listening on %s; claiming a slot", server.address)
        try:
            claim = store.claim_ps_slot_with_epoch(
                server.address, lease, config.claim_timeout_s, cancel=stop, unix=server.unix_path
            )
        except CoordinationError:
            if stop.is_set() and not lease.lost.is_set():
                return  # asked to stop while waiting for a slot: a clean exit
            raise
        index, epoch = claim.index, claim.epoch
        server.shard_index, server.epoch = index, epoch
        log.info("parameter server %d (epoch %d) serving on %s", index, epoch, server.address)
        if metrics.enabled():
            metrics.PS_SLOT_EPOCH.labels(str(index)).set(epoch)
            address = metrics.serve(config.host)
            metrics.register(store, lease, "ps", str(index), address)
            log.info("parameter server %d metrics on http://%s/metrics", index, address)
        if config.checkpoint_dir is not None:
            files = ShardFiles(
                config.checkpoint_dir,
                index,
                epoch,
                config.run_id,
                may_write=lambda: _lease_valid(lease),
            )
            server.files = files
        saved_version = _restore(config, server, files)
        if files is not None:
            _publish_restore(store, files, index, epoch, saved_version)
        health_key = store.keys.health(index)

        def publish(health: CheckpointHealth) -> None:
            try:
                store.put_json(
                    health_key,
                    {
                        "epoch": epoch,
                        "ok": health.ok,
                        "failing_since_unix_s": health.failing_since_unix_s,
                        "error": health.error,
                        "failures": health.failures,
                        "saved_version": health.saved_version,
                    },
                    lease,
                )
            except ElasticPSError as exc:
                log.warning("could not publish the checkpoint health: %s", exc)

        if files is not None and (config.mode is UpdateMode.ASYNC or ledger_only()):
            checkpointer = ShardCheckpointer(
                files,
                lambda: server.shard,
                every_s=config.checkpoint_every_s,
                every_versions=config.checkpoint_every_versions,
                saved_version=saved_version,
                on_health=publish,
            )
            checkpointer.start()

        live, revision = store.live_trainers()
        server.set_live_trainers(_ids(live))
        watch = store.watch_trainers(lambda cur: server.set_live_trainers(_ids(cur)), revision + 1)
        serving = threading.Thread(target=server.serve_forever, name="ps-accept", daemon=True)
        serving.start()
        stop.wait()
    finally:
        server.stop()  # no push is applied after this: the shard is closed
        shutil.rmtree(runtime_dir, ignore_errors=True)
        final_error: BaseException | None = None
        if checkpointer is not None:
            checkpointer.stop()
        shard = server.shard
        if files is not None and shard is not None and _lease_valid(lease):
            try:
                saved = files.save(*shard.state())
                if saved is not None:
                    log.info(
                        "parameter server %d: saved version %d to %s at shutdown",
                        server.shard_index, saved.version, saved.path,
                    )  # fmt: skip
            except (OSError, ValueError, TypeError) as exc:
                log.exception("final checkpoint of the shard failed")
                final_error = exc
        if watch is not None:
            watch.cancel()
        if not lease.lost.is_set():
            lease.revoke()
        store.close()
    if lease.lost.is_set():
        raise CoordinationError(
            f"parameter server {server.shard_index}: lease lost; exiting so that it is "
            "restarted and reloads its checkpoint"
        )
    if final_error is not None:
        raise CheckpointWriteError(
            f"parameter server {server.shard_index}: the checkpoint at shutdown failed: "
            f"{final_error}"
        ) from final_error


def _publish_restore(
    store: JobStore, files: ShardFiles, index: int, epoch: int, version: int | None
) -> None:
    """Record which checkpoint file the server loaded, and which it skipped and why.

    Written without a lease, so that it outlives the server: the launcher
    copies every record into ``run.json`` (``checkpoint_restores``). A server
    that found no file (a first start, or every file gone) records that too.
    """
    skipped = files.skipped_files()
    try:
        store.put_json(
            store.keys.restore(index, epoch),
            {
                "ps": index,
                "epoch": epoch,
                "unix_s": round(time.time(), 3),
                "restored_from": files.restored_from,
                "version": version,
                "skipped": skipped,
            },
        )
    except ElasticPSError as exc:
        log.warning("could not publish what the restore found: %s", exc)


def _lease_valid(lease: KeptLease) -> bool:
    """Whether the lease is known to be held now (see ``KeptLease.is_valid``)."""
    return lease.is_valid()


def _wait_lease_valid(lease: KeptLease, stop: threading.Event) -> None:
    """Block while the lease is not known to be valid; raise once it never will be.

    Raises:
        ShardClosedError: the lease is lost or the server is stopping.
    """
    while not lease.is_valid():
        if lease.lost.is_set() or stop.is_set():
            raise ShardClosedError("parameter server lost its lease")
        lease.wait_valid(0.1)


def _prewarm_optimizer(config: PSConfig) -> None:
    """Take one step of the update rule on a dummy tensor before claiming a slot.

    The built-in rules cost nothing here. A ``torch.optim`` class
    (``--optimizer torch``) imports ``torch._dynamo`` at its first use,
    which takes 1-2 s here; paying it before the claim keeps it off the
    recovery path: a standby PS (one started while every slot is taken)
    is then ready to serve within milliseconds of claiming a freed slot.
    """
    make_update_rule(torch.zeros(1), config.optimizer).step(torch.zeros(1), config.optimizer.lr)


def _restore(config: PSConfig, server: ParameterServer, files: ShardFiles | None) -> int | None:
    """Install the shard from this slot's newest good checkpoint, or set up the resume.

    Returns:
        The version restored from the slot's own checkpoint, or None.
    """
    index = server.shard_index
    if files is not None:
        found = files.restore()
        for reason in files.skipped_files():
            log.error("parameter server %d: skipping a checkpoint: %s", index, reason)
        if found is not None:
            tensors, meta, _ = found
            shard = ParameterShard.from_state(
                tensors,
                meta,
                optimizer=config.optimizer,
                mode=config.mode,
                frozen=config.frozen,
                max_staleness=config.max_staleness,
                reduction=config.sync_reduction,
                eviction=_eviction(config),
            )
            if config.mode is UpdateMode.SYNC and not ledger_only():
                # The other shards may be past this version: wait until the
                # master has brought every shard to one version.
                shard.set_serving(False)
            server.install_shard(shard)
            log.info(
                "parameter server %d: restored %d parameters at version %d (pass %d sealed) "
                "from epoch %s%s",
                index, shard.numel, shard.version, shard.stats().sealed_through,
                meta.get("epoch"),
                "; waiting for the master to realign the shards"
                if config.mode is UpdateMode.SYNC else "",
            )  # fmt: skip
            return shard.version
        if files.skipped_files():
            log.error(
                "parameter server %d: no usable checkpoint; the shard starts from the job's "
                "initial parameters and the master reports what was lost",
                index,
            )
    if config.resume_dir is not None:
        where = Location.of(config.resume_dir)
        checkpoint = load_consistent_checkpoint(where)
        server.resume_from(checkpoint, where)
        log.info(
            "parameter server %d: will resume from %s (version %s, %d parameters)",
            index, config.resume_dir, checkpoint.meta.get("version"), len(checkpoint.values),
        )  # fmt: skip
    return None


def _eviction(config: PSConfig) -> EvictionPolicy | None:
    """The sparse-row eviction of ``--sparse-eviction``, or None."""
    options = check_sparse_eviction(config.sparse_eviction)
    return EvictionPolicy(**options) if options else None


def _ids(live: dict[str, dict[str, object]]) -> set[int]:
    return {int(k) for k in live if k.isdigit()}
