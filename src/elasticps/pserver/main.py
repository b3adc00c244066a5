"""The parameter-server process: claim a slot in etcd and serve a shard.

Crash recovery: with ``PSConfig.checkpoint_dir`` set, the server saves its
shard (values, optimizer state, version) to
``<checkpoint_dir>/ps-<index>/shard.safetensors`` periodically and at a clean
shutdown. A restarted server waits for a free slot (its old lease has to
expire first, so it gets its old index back), loads that file and serves it
before accepting any trainer.

Fencing: the lease guards the file as well as the slot. A server that lost
its lease stops writing checkpoints at once (another server may hold its
index and write the same file) and exits with an error, so that its launcher
restarts it and it reloads.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from elasticps.config import PSConfig
from elasticps.coord.store import JobStore
from elasticps.errors import CoordinationError, DataError
from elasticps.pserver.checkpoint import ShardCheckpointer, load_shard, shard_checkpoint_path
from elasticps.pserver.rules import make_update_rule
from elasticps.pserver.server import ParameterServer
from elasticps.pserver.shard import ParameterShard
from elasticps.snapshot import load_consistent_checkpoint

log = logging.getLogger(__name__)


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
        DataError: the shard checkpoint or the resume checkpoint is corrupt.
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
    runtime_dir = tempfile.mkdtemp(prefix="elasticps-ps-")
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
    )
    watch = None
    checkpointer: ShardCheckpointer | None = None
    try:
        log.info("parameter server listening on %s; claiming a slot", server.address)
        try:
            server.shard_index = store.claim_ps_slot_within(
                server.address, lease, config.claim_timeout_s, cancel=stop, unix=server.unix_path
            )
        except CoordinationError:
            if stop.is_set() and not lease.lost.is_set():
                return  # asked to stop while waiting for a slot: a clean exit
            raise
        log.info("parameter server %d serving on %s", server.shard_index, server.address)
        saved_version = _restore(config, server)
        if config.checkpoint_dir is not None:
            checkpointer = ShardCheckpointer(
                shard_checkpoint_path(config.checkpoint_dir, server.shard_index),
                lambda: server.shard,
                every_s=config.checkpoint_every_s,
                every_versions=config.checkpoint_every_versions,
                may_write=lambda: not lease.lost.is_set(),
                saved_version=saved_version,
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
        if checkpointer is not None:
            checkpointer.stop()
            if not lease.lost.is_set():
                try:
                    saved = checkpointer.save_now()
                    if saved is not None:
                        log.info(
                            "parameter server %d: saved version %d to %s at shutdown",
                            server.shard_index, saved.version, saved.path,
                        )  # fmt: skip
                except (OSError, ValueError, TypeError):
                    log.exception("final checkpoint of the shard failed")
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


def _prewarm_optimizer(config: PSConfig) -> None:
    """Take one step of the update rule on a dummy tensor before claiming a slot.

    The built-in rules cost nothing here. A ``torch.optim`` class
    (``--optimizer torch``) imports ``torch._dynamo`` at its first use,
    which takes 1-2 s here; paying it before the claim keeps it off the
    recovery path: a standby PS (one started while every slot is taken)
    is then ready to serve within milliseconds of claiming a freed slot.
    """
    make_update_rule(torch.zeros(1), config.optimizer).step(torch.zeros(1), config.optimizer.lr)


def _restore(config: PSConfig, server: ParameterServer) -> int | None:
    """Install the shard from this index's own checkpoint, or set up the resume.

    Returns:
        The version restored from the server's own checkpoint, or None.
    """
    index = server.shard_index
    if config.checkpoint_dir is not None:
        path = shard_checkpoint_path(config.checkpoint_dir, index)
        if path.exists():
            tensors, meta = load_shard(path)
            saved_index = meta["layout"].get("shard")  # type: ignore[attr-defined]
            if saved_index != index:
                raise DataError(
                    f"{path} holds the shard of parameter server {saved_index!r}, not {index}"
                )
            shard = ParameterShard.from_state(
                tensors,
                meta,
                optimizer=config.optimizer,
                mode=config.mode,
                frozen=config.frozen,
                max_staleness=config.max_staleness,
            )
            server.install_shard(shard)
            log.info(
                "parameter server %d: restored %d parameters at version %d from %s",
                index, shard.numel, shard.version, path,
            )  # fmt: skip
            return shard.version
    if config.resume_dir is not None:
        checkpoint = load_consistent_checkpoint(Path(config.resume_dir))
        server.resume_from(checkpoint)
        log.info(
            "parameter server %d: will resume from %s (version %s, %d parameters)",
            index, config.resume_dir, checkpoint.meta.get("version"), len(checkpoint.values),
        )  # fmt: skip
    return None


def _ids(live: dict[str, dict[str, object]]) -> set[int]:
    return {int(k) for k in live if k.isdigit()}
