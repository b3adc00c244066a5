"""The parameter-server process: claim a slot in etcd and serve a shard."""

from __future__ import annotations

import logging
import threading

from elasticps.config import PSConfig
from elasticps.coord.store import JobStore
from elasticps.pserver.server import ParameterServer

log = logging.getLogger(__name__)


def run_ps(config: PSConfig, stop: threading.Event) -> None:
    """Run one parameter server until ``stop`` is set, a shutdown command, or lease loss.

    The server binds first, then claims the first free ``/ps/<index>`` slot
    with its address under a lease, then follows trainer membership for the
    sync barrier.

    Raises:
        CoordinationError: etcd is unreachable or every slot is taken.
        OSError: the port cannot be bound.
    """
    store = JobStore(config.common.etcd_endpoint, config.common.job)
    lease = store.grant_lease(config.common.lease_ttl_s, on_lost=stop.set)
    # Bind before claiming, so the address we publish is already accepting.
    server = ParameterServer(
        shard_index=-1,
        mode=config.mode,
        optimizer=config.optimizer,
        host=config.host,
        port=config.port,
        init_timeout_s=config.init_timeout_s,
        on_shutdown=stop.set,
    )
    watch = None
    try:
        server.shard_index = store.claim_ps_slot(server.address, lease)
        log.info("parameter server %d serving on %s", server.shard_index, server.address)

        live, revision = store.live_trainers()
        server.set_live_trainers(_ids(live))
        watch = store.watch_trainers(lambda cur: server.set_live_trainers(_ids(cur)), revision + 1)
        serving = threading.Thread(target=server.serve_forever, name="ps-accept", daemon=True)
        serving.start()
        stop.wait()
    finally:
        server.stop()
        if watch is not None:
            watch.cancel()
        if not lease.lost.is_set():
            lease.revoke()
        store.close()


def _ids(live: dict[str, dict[str, object]]) -> set[int]:
    return {int(k) for k in live if k.isdigit()}
