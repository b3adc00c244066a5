"""A key-value store API over the parameter servers, for users coming from MXNet.

>>> import torch
>>> from elasticps import kvstore, updater
>>> kv = kvstore.create("local")
>>> kv.init("w", torch.zeros(3))
>>> kv.set_optimizer(updater.SGD(lr=0.5))
>>> kv.push("w", torch.ones(3))
>>> out = torch.empty(3)
>>> kv.pull("w", out=out)
>>> out
tensor([-0.5000, -0.5000, -0.5000])

Modeled on MXNet's ``mx.kv.create`` / ``KVStore`` (``init``, ``push``,
``pull``, ``set_optimizer``, ``rank``, ``num_workers``, ``barrier``); see
the MXNet KVStore tutorial and ``python/mxnet/kvstore.py``.

Kinds
-----
- ``local``: in-process, one worker (rank 0 of 1). With an optimizer, each
  push applies one update to the key with the same code a parameter server
  runs (:class:`~elasticps.pserver.shard.ParameterShard`, async rule, the
  schedule counted per key); without one, a push stores the pushed value
  (summed over the values given), like MXNet's local store.
- ``dist_sync`` / ``dist_async``: the real parameter servers of a job
  (sync-SGD or async-SGD), reached with the trainers' own
  :class:`~elasticps.trainer.client.ParameterClient`. Rank and worker count
  come from the job's environment (see :mod:`elasticps.dist`), so run the
  script through :func:`elasticps.dist.dist_train`.

Keys, values, lists
-------------------
Keys are ints or strings (the key's name on the servers is ``str(key)``).
Values are float tensors (stored as float32) of the shape given to
``init``. As in MXNet, ``push(key, [g1, g2])`` pushes the sum of the values,
``push([k1, k2], [g1, g2])`` pushes several keys, and
``pull(key, out=[t1, t2])`` copies the value into each output.

Layout (dist kinds)
-------------------
The servers hold one flat buffer per shard, laid out once for all keys (see
:mod:`elasticps.placement`). So the ``dist_*`` stores collect the ``init``
calls, and the first ``push`` or ``pull`` commits the layout: keys are
placed by size, largest first onto the server holding the fewest bytes (the
``balanced`` placement), and values with more than
``ELASTICPS_BIGARRAY_BOUND`` elements (default
:data:`~elasticps.placement.DEFAULT_BIG_ARRAY_BOUND`, MXNet's
``MXNET_KVSTORE_BIGARRAY_BOUND``) are sliced evenly across every server.
Every worker must ``init`` the same keys with the same shapes (in any
order); rank 0's values are the initial values. An ``init`` after the commit
raises :class:`~elasticps.errors.KVStoreError`.

Pushes are buffered per key; the next ``pull`` (or a second push of a key
already pending) sends one push of every key to every server, which is one
update (one model version). Keys not pushed since the last update take part
with a zero gradient, so push every key you pull in each step.

Batch size
----------
Each worker pushes the mean gradient of its own mini-batch, and the servers
average the workers' gradients (in ``dist_sync``, one update per step from
all workers), so the **global batch is num_workers x the per-worker
batch**, and the learning rate is that of a single-process run with the
global batch. (MXNet's ``dist_sync`` sums the workers' gradients and
expects ``rescale_grad = 1 / global batch``; here no rescaling is needed.)
In ``dist_async`` every push is applied on arrival with the per-worker
batch.

In ``dist_sync`` a step waits for every registered worker, so, as with
MXNet, every worker must make the same number of updates (give each worker
the same number of mini-batches); a worker that stops early must
:meth:`~KVStore.close` its store (which leaves the step barrier at once)
rather than wait in :meth:`~KVStore.barrier` while the others still push.

Optimizer
---------
Parameter servers always run an optimizer (:mod:`elasticps.updater`), fixed
when they start: pass the updater to :func:`elasticps.dist.dist_train`,
which starts the servers with it and exports it to the workers;
``kv.set_optimizer`` then checks that it is the same. Pushing to a
``dist_async`` (or ``dist_sync``) store without an optimizer raises
:class:`~elasticps.errors.KVStoreError`, as MXNet refuses ``dist_async``
without one.
"""

from __future__ import annotations

import abc
import atexit
import builtins
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from types import TracebackType
from typing import Self, TypeAlias

import torch

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.coord.store import JobStore, KeptLease
from elasticps.errors import ConfigError, KVStoreError, ServiceUnavailableError
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND, ParamSpec, Placement, plan_placement
from elasticps.pserver.shard import ParameterShard
from elasticps.trainer.client import ParameterClient
from elasticps.updater import Updater, as_config

__all__ = [
    "DistKVStore",
    "KVStore",
    "Key",
    "LocalKVStore",
    "create",
    "env_optimizer_config",
]

log = logging.getLogger(__name__)

Key: TypeAlias = int | str
"""A KVStore key: an int or a string (its name on the servers is ``str(key)``)."""

Values: TypeAlias = torch.Tensor | Sequence[torch.Tensor | Sequence[torch.Tensor]]
Keys: TypeAlias = Key | Sequence[Key]

KINDS = ("local", "dist_sync", "dist_async")

ENV_OPTIMIZER = "ELASTICPS_OPTIMIZER_CONFIG"
"""Environment variable with the servers' optimizer config as JSON (set by dist_train)."""

# Seconds to wait for the servers, the other workers (barriers) and etcd.
_CONNECT_TIMEOUT_S = 120.0
_POLL_S = 0.02


def create(name: str = "local") -> KVStore:
    """Create a KVStore (MXNet's ``mx.kv.create``).

    Args:
        name: ``"local"``, ``"dist_sync"`` or ``"dist_async"``.

    Returns:
        A :class:`LocalKVStore` or a :class:`DistKVStore`.

    Raises:
        ConfigError: an unknown kind, or a ``dist_*`` kind outside a job
            launched by :func:`elasticps.dist.dist_train` (no
            ``ELASTICPS_ETCD`` / ``ELASTICPS_JOB``), or one whose
            ``ELASTICPS_MODE`` contradicts the kind.
    """
    if name == "local":
        return LocalKVStore()
    if name in ("dist_sync", "dist_async"):
        return DistKVStore.from_env(name)
    raise ConfigError(f"unknown kvstore type {name!r}; expected one of {', '.join(KINDS)}")


def env_optimizer_config() -> OptimizerConfig | None:
    """The servers' optimizer as exported by dist_train (``ELASTICPS_OPTIMIZER_CONFIG``).

    Raises:
        ConfigError: the variable is set but is not a valid config.
    """
    raw = os.environ.get(ENV_OPTIMIZER)
    if not raw:
        return None
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise TypeError("not an object")
        return OptimizerConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{ENV_OPTIMIZER} is not a valid optimizer config: {exc}") from exc


def _name(key: object) -> str:
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise KVStoreError(f"kvstore keys are ints or strings, got {key!r:.60}")
    name = str(key)
    if not name:
        raise KVStoreError("kvstore keys must not be empty strings")
    return name


def _group(keys: Keys, values: object, what: str) -> list[tuple[str, list[torch.Tensor]]]:
    """Normalize MXNet-style ``(key, value | [values])`` or ``([keys], [values])``."""
    if not isinstance(keys, list | tuple):
        return [(_name(keys), _tensors(values, what))]
    if not isinstance(values, list | tuple) or len(values) != len(keys):
        raise KVStoreError(f"{what}: give one value (or list of values) per key")
    return [(_name(k), _tensors(v, what)) for k, v in zip(keys, values, strict=True)]


def _tensors(values: object, what: str) -> list[torch.Tensor]:
    raw = list(values) if isinstance(values, list | tuple) else [values]
    items = [v for v in raw if isinstance(v, torch.Tensor)]
    if not items or len(items) != len(raw):
        raise KVStoreError(f"{what}: values must be torch tensors, got {values!r:.80}")
    for v in items:
        if not v.is_floating_point():
            raise KVStoreError(f"{what}: values must be floating point, got {v.dtype}")
    return items


def _sum(name: str, values: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    total = torch.zeros(shape, dtype=torch.float32)
    for v in values:
        if v.shape != shape:
            raise KVStoreError(
                f"key {name!r} holds shape {tuple(shape)}, got a value of shape {tuple(v.shape)}"
            )
        total += v.detach().to(torch.float32)
    return total


class KVStore(abc.ABC):
    """The KVStore interface (see the module docstring for semantics).

    Usable as a context manager; :meth:`close` releases connections.
    """

    kind: str
    """``"local"``, ``"dist_sync"`` or ``"dist_async"``."""

    @property
    def type(self) -> str:
        """The kind of store, as MXNet's ``kv.type``."""
        return self.kind

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This worker's rank, ``0 <= rank < num_workers``."""

    @property
    @abc.abstractmethod
    def num_workers(self) -> int:
        """Number of workers in the job."""

    @abc.abstractmethod
    def init(self, key: Keys, value: Values) -> None:
        """Declare keys with their initial values.

        Args:
            key: a key or a list of keys.
            value: a float tensor (any shape), or one per key; copied.

        Raises:
            KVStoreError: a key is already initialized, or (dist) the layout
                is already committed.
        """

    @abc.abstractmethod
    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """Push gradients (or values, for ``local`` without an optimizer).

        Args:
            key: a key or a list of keys.
            value: for one key a tensor or a list of tensors (summed); for a
                list of keys one such item per key. Shapes must equal the
                ``init`` shape; float32 on the wire.
            priority: ignored (MXNet compatibility).

        Raises:
            KVStoreError: unknown key, wrong shape, or a dist store without
                an optimizer.
        """

    @abc.abstractmethod
    def pull(self, key: Keys, out: Values, priority: int = 0) -> None:
        """Copy the current values into ``out`` (in place).

        Args:
            key: a key or a list of keys.
            out: for one key a tensor or a list of tensors (each receives
                the value); for a list of keys one such item per key.
            priority: ignored (MXNet compatibility).

        Raises:
            KVStoreError: unknown key or wrong shape.
        """

    @abc.abstractmethod
    def set_optimizer(self, optimizer: Updater | OptimizerConfig) -> None:
        """Set the optimizer applied to pushes (an :mod:`elasticps.updater` updater).

        Raises:
            KVStoreError: (dist) the servers run another optimizer.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every worker has reached this barrier (no-op for ``local``).

        Raises:
            ServiceUnavailableError: the others did not arrive in time.
        """

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections and registrations; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: builtins.type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --- local ---------------------------------------------------------------------------


class LocalKVStore(KVStore):
    """An in-process KVStore: one worker, no servers (MXNet's ``local``)."""

    kind = "local"

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._shards: dict[str, ParameterShard] = {}
        self._optimizer: OptimizerConfig | None = None

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def num_workers(self) -> int:
        """Always 1."""
        return 1

    def init(self, key: Keys, value: Values) -> None:
        """See :meth:`KVStore.init`."""
        for name, values in _group(key, value, "init"):
            if name in self._values:
                raise KVStoreError(f"key {name!r} is already initialized")
            self._values[name] = values[0].detach().to(torch.float32).clone()

    def set_optimizer(self, optimizer: Updater | OptimizerConfig) -> None:
        """See :meth:`KVStore.set_optimizer`; optimizer state starts fresh."""
        self._optimizer = as_config(optimizer)
        self._shards.clear()

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """See :meth:`KVStore.push`."""
        for name, values in _group(key, value, "push"):
            stored = self._get(name)
            merged = _sum(name, values, stored.shape)
            if self._optimizer is None:
                stored.copy_(merged)
                continue
            shard = self._shards.get(name)
            if shard is None:
                numel = stored.numel()
                layout: dict[str, object] = {
                    "shard": 0,
                    "numel": numel,
                    "pieces": [[name, 0, numel]],
                }
                shard = ParameterShard(layout, name, self._optimizer, UpdateMode.ASYNC)
                self._shards[name] = shard
            # The stored tensor is the shard's value buffer from now on.
            shard.values.copy_(stored.reshape(-1))
            shard.push(0, merged.reshape(-1), shard.version, 1)
            stored.copy_(shard.values.view_as(stored))

    def pull(self, key: Keys, out: Values, priority: int = 0) -> None:
        """See :meth:`KVStore.pull`."""
        for name, outs in _group(key, out, "pull"):
            stored = self._get(name)
            for o in outs:
                if o.shape != stored.shape:
                    raise KVStoreError(
                        f"key {name!r} holds shape {tuple(stored.shape)}, "
                        f"out has shape {tuple(o.shape)}"
                    )
                o.copy_(stored)

    def barrier(self) -> None:
        """No-op: one worker."""

    def _get(self, name: str) -> torch.Tensor:
        stored = self._values.get(name)
        if stored is None:
            raise KVStoreError(f"key {name!r} is not initialized; call kv.init first")
        return stored


# --- dist ----------------------------------------------------------------------------


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(
                f"{name} is not set: dist kvstores run inside a job launched by "
                "elasticps.dist_train (see elasticps.dist)"
            )
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from exc


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from exc


class DistKVStore(KVStore):
    """A KVStore on the parameter servers of a job (``dist_sync`` / ``dist_async``).

    Build it with :func:`create` inside a job launched by
    :func:`elasticps.dist.dist_train`; see the module docstring.

    Args:
        kind: ``"dist_sync"`` or ``"dist_async"``.
        etcd_endpoint: the job's etcd, ``host:port``.
        job: the job name.
        rank: this worker's rank, ``0 <= rank < num_workers``; its trainer id.
        num_workers: number of workers.
        big_array_bound: values with more elements are sliced across all servers.
        lease_ttl_s: TTL of this worker's registration lease, seconds.
        connect_timeout_s: how long to wait for servers and other workers, seconds.

    Raises:
        ConfigError: invalid rank, worker count or bound.
    """

    def __init__(
        self,
        kind: str,
        *,
        etcd_endpoint: str,
        job: str,
        rank: int,
        num_workers: int,
        big_array_bound: int = DEFAULT_BIG_ARRAY_BOUND,
        lease_ttl_s: float = 5.0,
        connect_timeout_s: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        if kind not in ("dist_sync", "dist_async"):
            raise ConfigError(f"DistKVStore kind must be dist_sync or dist_async, got {kind!r}")
        if num_workers < 1 or not 0 <= rank < num_workers:
            raise ConfigError(f"need 0 <= rank < num_workers, got rank {rank} of {num_workers}")
        if big_array_bound < 1:
            raise ConfigError(f"big-array bound must be >= 1, got {big_array_bound}")
        self.kind = kind
        self.mode = UpdateMode.SYNC if kind == "dist_sync" else UpdateMode.ASYNC
        self._rank = rank
        self._num_workers = num_workers
        self._big_array_bound = big_array_bound
        self._lease_ttl_s = lease_ttl_s
        self._timeout_s = connect_timeout_s
        self._store = JobStore(etcd_endpoint, job)
        self._lock = threading.RLock()
        self._specs: dict[str, torch.Tensor] = {}  # name -> initial value (until commit)
        self._placement: Placement | None = None
        self._params: torch.Tensor | None = None
        self._grads: torch.Tensor | None = None
        self._client: ParameterClient | None = None
        self._lease: KeptLease | None = None
        self._pending: set[str] = set()
        self._barriers = 0
        self._optimizer: OptimizerConfig | None = None
        self._server_optimizer = env_optimizer_config()
        self._closed = False
        # Leave the sync barrier at once (lease revoked) when the process ends
        # without close(), instead of one lease TTL later.
        atexit.register(self.close)

    @classmethod
    def from_env(cls, kind: str) -> DistKVStore:
        """Build the store from the job's environment (see :mod:`elasticps.dist`).

        Raises:
            ConfigError: ``ELASTICPS_ETCD``, ``ELASTICPS_JOB``, ``ELASTICPS_RANK``
                missing or malformed, or ``ELASTICPS_MODE`` contradicts ``kind``.
        """
        etcd = os.environ.get("ELASTICPS_ETCD")
        job = os.environ.get("ELASTICPS_JOB")
        if not etcd or not job:
            raise ConfigError(
                f"kvstore {kind!r} needs ELASTICPS_ETCD and ELASTICPS_JOB: run the script "
                "through elasticps.dist_train, which launches the servers and sets them "
                "(or use kvstore.create('local'))"
            )
        mode = os.environ.get("ELASTICPS_MODE")
        wanted = "sync" if kind == "dist_sync" else "async"
        if mode and mode != wanted:
            raise ConfigError(
                f"kvstore {kind!r} needs parameter servers in {wanted} mode, but the job "
                f"runs them in {mode} mode (dist_train(mode=...))"
            )
        return cls(
            kind,
            etcd_endpoint=etcd,
            job=job,
            rank=_env_int("ELASTICPS_RANK"),
            num_workers=_env_int("ELASTICPS_NUM_WORKERS"),
            big_array_bound=_env_int("ELASTICPS_BIGARRAY_BOUND", DEFAULT_BIG_ARRAY_BOUND),
            lease_ttl_s=_env_float("ELASTICPS_LEASE_TTL_S", 5.0),
        )

    @property
    def rank(self) -> int:
        """This worker's rank (``ELASTICPS_RANK``)."""
        return self._rank

    @property
    def num_workers(self) -> int:
        """Number of workers (``ELASTICPS_NUM_WORKERS``)."""
        return self._num_workers

    @property
    def placement(self) -> Placement | None:
        """Where each key lives on the servers, once the layout is committed."""
        return self._placement

    def init(self, key: Keys, value: Values) -> None:
        """See :meth:`KVStore.init`; only before the first push or pull."""
        with self._lock:
            for name, values in _group(key, value, "init"):
                if self._placement is not None:
                    raise KVStoreError(
                        f"cannot init key {name!r}: the layout on the parameter servers was "
                        "fixed by the first push or pull; init every key before that"
                    )
                if name in self._specs:
                    raise KVStoreError(f"key {name!r} is already initialized")
                self._specs[name] = values[0].detach().to(torch.float32).clone()

    def set_optimizer(self, optimizer: Updater | OptimizerConfig) -> None:
        """Check ``optimizer`` against the servers' (see the module docstring).

        Raises:
            KVStoreError: dist_train started the servers with another optimizer.
        """
        config = as_config(optimizer)
        if self._server_optimizer is not None and config != self._server_optimizer:
            raise KVStoreError(
                f"the parameter servers run {self._server_optimizer}, not {config}: the "
                "optimizer is fixed when the servers start; pass this updater to "
                "elasticps.dist_train(updater=...)"
            )
        if self._server_optimizer is None:
            log.warning(
                "kvstore: cannot check the servers' optimizer (%s is not set); assuming %s",
                ENV_OPTIMIZER, config,
            )  # fmt: skip
        self._optimizer = config

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """See :meth:`KVStore.push`; buffered until the next pull."""
        with self._lock:
            if self._optimizer is None:
                raise KVStoreError(
                    f"{self.kind} needs an optimizer on the parameter servers: call "
                    "kv.set_optimizer(elasticps.updater....) before pushing (MXNet refuses "
                    "dist_async without one too)"
                )
            self._commit()
            assert self._placement is not None and self._grads is not None
            groups = _group(key, value, "push")
            if any(name in self._pending for name, _ in groups):
                self._flush()
            for name, values in groups:
                spec = self._spec(name)
                off = self._placement.flat_offsets[name]
                merged = _sum(name, values, torch.Size(spec.shape))
                self._grads[off : off + spec.numel].copy_(merged.reshape(-1))
                self._pending.add(name)

    def pull(self, key: Keys, out: Values, priority: int = 0) -> None:
        """See :meth:`KVStore.pull`; sends the buffered pushes first."""
        with self._lock:
            self._commit()
            assert self._placement is not None and self._params is not None
            assert self._client is not None
            if self._pending:
                self._flush()
            else:
                self._client.pull()
            for name, outs in _group(key, out, "pull"):
                spec = self._spec(name)
                off = self._placement.flat_offsets[name]
                value = self._params[off : off + spec.numel].view(spec.shape)
                for o in outs:
                    if tuple(o.shape) != spec.shape:
                        raise KVStoreError(
                            f"key {name!r} holds shape {spec.shape}, out has shape {tuple(o.shape)}"
                        )
                    o.copy_(value)

    def barrier(self) -> None:
        """Wait until every worker calls its ``n``-th barrier (etcd keys, polled).

        Raises:
            ServiceUnavailableError: not every worker arrived in ``connect_timeout_s``.
        """
        with self._lock:
            self._barriers += 1
            self._barrier(f"user-{self._barriers}")

    def close(self) -> None:
        """Send nothing more, revoke this worker's registration, close connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._client is not None:
                self._client.close()
            if self._lease is not None and not self._lease.lost.is_set():
                self._lease.revoke()
            self._store.close()
        atexit.unregister(self.close)

    # --- internals ----------------------------------------------------------------------

    def _spec(self, name: str) -> ParamSpec:
        assert self._placement is not None
        try:
            return self._placement.param(name)
        except KeyError:
            raise KVStoreError(f"key {name!r} is not initialized; call kv.init first") from None

    def _barrier(self, label: str) -> None:
        prefix = f"{self._store.keys.kvstore_prefix}barrier/{label}/"
        self._store.put_json(prefix + str(self._rank), {"pid": os.getpid()})
        deadline = time.monotonic() + self._timeout_s
        while True:
            arrived, _ = self._store.get_prefix_json(prefix)
            if len(arrived) >= self._num_workers:
                return
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"barrier {label}: only {len(arrived)} of {self._num_workers} workers "
                    f"arrived within {self._timeout_s:g} s"
                )
            time.sleep(_POLL_S)

    def _commit(self) -> None:
        """Fix the layout, connect, register, initialize the servers (rank 0's values)."""
        if self._closed:
            raise KVStoreError("the kvstore is closed")
        if self._client is not None:
            return
        if not self._specs:
            raise KVStoreError("no key was initialized; call kv.init before push or pull")
        num_ps = self._store.ps_desired()
        if num_ps is None:
            raise ConfigError("the job has no parameter servers (ps_desired is not set in etcd)")
        names = sorted(self._specs)  # every worker agrees, whatever its init order
        specs = [ParamSpec(n, tuple(self._specs[n].shape)) for n in names]
        placement = plan_placement(specs, num_ps, self._big_array_bound)
        params = torch.empty(placement.total_numel, dtype=torch.float32)
        for name in names:
            off = placement.flat_offsets[name]
            value = self._specs[name]
            params[off : off + value.numel()].copy_(value.reshape(-1))
        grads = torch.zeros(placement.total_numel, dtype=torch.float32)
        slots = self._store.wait_ps_slots(self._timeout_s)
        client = ParameterClient(
            placement,
            slots,
            params,
            grads,
            self._rank,
            timeout_s=self._timeout_s,
            resolve=lambda i: self._store.wait_ps_slots(1.0)[i],
            reconnect_timeout_s=self._timeout_s,
            sync=self.mode is UpdateMode.SYNC,
        )
        try:
            self._lease = self._store.grant_lease(self._lease_ttl_s)
            self._store.register_trainer(str(self._rank), {"pid": os.getpid()}, self._lease)
            if self._rank == 0:
                client.hello(initialize=True)
            self._barrier("init")
            if self._rank != 0:
                client.hello(initialize=False)
            if self.mode is UpdateMode.SYNC:
                self._wait_servers_see_every_worker(client)
        except BaseException:
            client.close()
            raise
        self._placement, self._params, self._grads, self._client = (
            placement,
            params,
            grads,
            client,
        )
        self._specs.clear()  # the flat buffer holds the values now
        log.info(
            "kvstore %s: rank %d of %d, %d keys on %d parameter servers",
            self.kind, self._rank, self._num_workers, len(names), num_ps,
        )  # fmt: skip

    def _wait_servers_see_every_worker(self, client: ParameterClient) -> None:
        # A sync step waits for the workers its server knows (etcd watch); a
        # first push before a server heard of everyone would leave the
        # others' first gradients stale.
        deadline = time.monotonic() + self._timeout_s
        while True:
            seen = [
                stats.get("live_trainers", 0) if isinstance(stats, dict) else 0
                for stats in (answer.get("stats") for answer in client.stats())
            ]
            if all(isinstance(n, int) and n >= self._num_workers for n in seen):
                return
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"the parameter servers saw {seen} of {self._num_workers} workers "
                    f"within {self._timeout_s:g} s"
                )
            time.sleep(_POLL_S)

    def _flush(self) -> None:
        assert self._client is not None and self._grads is not None
        try:
            self._client.push(1, want_params=True)
        finally:
            # A refused push (RemoteError, e.g. a frozen key) is dropped with
            # its error; the next push starts from zero gradients.
            self._grads.zero_()
            self._pending.clear()


def optimizer_env(config: OptimizerConfig) -> str:
    """The value of ``ELASTICPS_OPTIMIZER_CONFIG`` for ``config`` (JSON)."""
    return json.dumps(asdict(config), sort_keys=True)
