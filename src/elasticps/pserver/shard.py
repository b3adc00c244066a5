"""One parameter-server shard: parameters, optimizer state and update rules.

This module does no I/O: the tensor-plane server (:mod:`elasticps.pserver.server`)
receives gradients into buffers and calls into a :class:`ParameterShard`.
Unit tests drive it directly.

The shard keeps its parameters as one flat float32 tensor, laid out as the
:class:`~elasticps.placement.ShardLayout` says. The optimizers offered here
(SGD, momentum, Adam, AdaGrad) are element-wise, so one ``torch.optim`` step
over the flat tensor equals one step per parameter, at the cost of a single
kernel launch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import ElasticPSError, LayoutMismatchError


def make_optimizer(params: list[torch.Tensor], config: OptimizerConfig) -> torch.optim.Optimizer:
    """Build the ``torch.optim`` optimizer named by ``config``.

    Args:
        params: leaf float32 tensors to optimize.
        config: optimizer name and hyper-parameters.

    Returns:
        ``torch.optim.SGD`` (``sgd``; ``momentum`` sets its momentum),
        ``torch.optim.Adam`` or ``torch.optim.Adagrad``.
    """
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.name == "momentum":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.name == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.name == "adagrad":
        return torch.optim.Adagrad(params, lr=config.lr, weight_decay=config.weight_decay)
    raise ValueError(f"unknown optimizer {config.name!r}")  # unreachable: config validates


class ShardClosedError(ElasticPSError):
    """The shard is shutting down; a waiting push was released without an update."""


@dataclass(frozen=True)
class PushResult:
    """Outcome of one push.

    Attributes:
        accepted: the gradient counted towards an update; False if it was
            stale (computed on an older model version) and dropped.
        version: the shard's model version after the push was handled (in
            sync mode, after the step it joined was applied).
    """

    accepted: bool
    version: int


@dataclass(frozen=True)
class ShardStats:
    """Counters of a shard, for logs and the ``stats`` control command."""

    version: int
    pushes: int
    stale_pushes: int
    steps: int
    live_trainers: int


class ParameterShard:
    """Parameters and optimizer state of one shard, and the sync/async update rules.

    Thread-safe: the tensor-plane server calls it from one thread per
    connection.

    Args:
        layout: the shard layout as described by the first trainer's HELLO
            (``ShardLayout.describe()``), kept for checkpoints and checks.
        fingerprint: SHA-256 of the layout; later HELLOs must match it.
        optimizer: optimizer configuration.
        mode: sync-SGD or async-SGD.
    """

    def __init__(
        self,
        layout: dict[str, object],
        fingerprint: str,
        optimizer: OptimizerConfig,
        mode: UpdateMode,
    ) -> None:
        numel = layout.get("numel")
        if not isinstance(numel, int) or numel < 0:
            raise LayoutMismatchError(f"layout has an invalid numel: {numel!r}")
        self.layout = layout
        self.fingerprint = fingerprint
        self.numel = numel
        self.mode = mode
        self._param = torch.nn.Parameter(torch.zeros(numel, dtype=torch.float32))
        self._optimizer = make_optimizer([self._param], optimizer)
        self._acc = torch.zeros(numel, dtype=torch.float32)
        self._acc_samples = 0
        self._cond = threading.Condition()
        self._version = 0
        self._round = 0
        self._contributors: set[int] = set()
        self._live: set[int] = set()
        self._closed = False
        self._pushes = 0
        self._stale = 0
        self._steps = 0

    # --- state -------------------------------------------------------------

    @property
    def values(self) -> torch.Tensor:
        """The parameters: float32 ``[numel]``. Written in place by updates.

        Readers in async mode may see a mix of two versions (as in Hogwild);
        in sync mode replies are sent between steps, so reads are whole.
        """
        return self._param.data

    @property
    def version(self) -> int:
        """Model version: the number of updates applied so far."""
        with self._cond:
            return self._version

    def stats(self) -> ShardStats:
        """A snapshot of the shard's counters."""
        with self._cond:
            return ShardStats(
                self._version, self._pushes, self._stale, self._steps, len(self._live)
            )

    def check_fingerprint(self, fingerprint: str) -> None:
        """Raise LayoutMismatchError if a trainer's layout differs from the shard's."""
        if fingerprint != self.fingerprint:
            raise LayoutMismatchError(
                "the trainer's parameter layout differs from the one this parameter server "
                "holds (different model, --ps count or --big-array-bound?)"
            )

    # --- membership (sync barrier) ------------------------------------------

    def set_live_trainers(self, trainer_ids: set[int]) -> None:
        """Set the trainers the sync barrier waits for (those alive in etcd).

        A trainer that left no longer holds up the current step; one that
        joined is waited for from the next step on.
        """
        with self._cond:
            self._live = set(trainer_ids)
            self._maybe_complete_round()

    def close(self) -> None:
        """Release every waiting push with :class:`ShardClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- updates -------------------------------------------------------------

    def push(
        self,
        trainer_id: int,
        grad: torch.Tensor | None,
        model_version: int,
        num_samples: int,
        *,
        max_staleness: int | None = None,
    ) -> PushResult:
        """Apply, or join the sync step with, one gradient.

        Args:
            trainer_id: the pushing trainer.
            grad: float32 ``[numel]``, the mean gradient over ``num_samples``
                samples; ``None`` for an empty push, by which an idle trainer
                takes part in a sync step without a gradient.
            model_version: the shard version the gradient was computed on.
            num_samples: samples behind the gradient; weights it in sync mode.
            max_staleness: async only: drop gradients more than this many
                versions behind (``None`` accepts any).

        Returns:
            Whether the gradient was used, and the version after it.

        Raises:
            ShardClosedError: the shard closed while the push waited.
        """
        if grad is not None and grad.numel() != self.numel:
            raise LayoutMismatchError(
                f"gradient has {grad.numel()} elements, shard has {self.numel}"
            )
        if self.mode is UpdateMode.ASYNC:
            return self._push_async(grad, model_version, max_staleness)
        return self._push_sync(trainer_id, grad, model_version, num_samples)

    def _push_async(
        self, grad: torch.Tensor | None, model_version: int, max_staleness: int | None
    ) -> PushResult:
        with self._cond:
            self._pushes += 1
            if grad is None:
                return PushResult(False, self._version)
            if max_staleness is not None and self._version - model_version > max_staleness:
                self._stale += 1
                return PushResult(False, self._version)
            self._param.grad = grad
            self._optimizer.step()
            self._param.grad = None
            self._version += 1
            self._steps += 1
            return PushResult(True, self._version)

    def _push_sync(
        self, trainer_id: int, grad: torch.Tensor | None, model_version: int, num_samples: int
    ) -> PushResult:
        with self._cond:
            self._pushes += 1
            if model_version != self._version or trainer_id in self._contributors:
                # Computed on an older version (the step went on without this
                # trainer), or a second push in one step: drop, as ElasticDL does.
                self._stale += 1
                return PushResult(False, self._version)
            if grad is not None and num_samples > 0:
                self._acc.add_(grad, alpha=float(num_samples))
                self._acc_samples += num_samples
            self._contributors.add(trainer_id)
            # A trainer that pushes is alive, even if etcd's watch has not told us yet.
            self._live.add(trainer_id)
            my_round = self._round
            self._maybe_complete_round()
            while self._round == my_round:
                if self._closed:
                    raise ShardClosedError("parameter server is shutting down")
                self._cond.wait()
            return PushResult(grad is not None and num_samples > 0, self._version)

    def _maybe_complete_round(self) -> None:
        # Caller holds self._cond.
        if not self._contributors or not self._live <= self._contributors:
            return
        if self._acc_samples > 0:
            self._acc.div_(float(self._acc_samples))
            self._param.grad = self._acc
            self._optimizer.step()
            self._param.grad = None
            self._version += 1
            self._steps += 1
        self._acc.zero_()
        self._acc_samples = 0
        self._contributors.clear()
        self._round += 1
        self._cond.notify_all()
