"""Sparse embedding modules for model files: ``torch.nn.Embedding`` whose table lives elsewhere.

:class:`Embedding` and :class:`EmbeddingBag` are used like their
``torch.nn`` namesakes (int64 ids in, float32 rows out), but they own no
``nn.Parameter``: their table is a :class:`~elasticps.pserver.sparse.SparseTable`
named ``name``, and each forward pass fetches only the rows of the ids it
sees. :class:`HashEmbedding` and :class:`HashEmbeddingBag` take any int64 key
(no ``num_embeddings``). ::

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = elasticps.nn.Embedding(1000, 16, name="user")
            self.genres = elasticps.nn.EmbeddingBag(19, 16, name="genre", mode="mean")
            self.top = torch.nn.Linear(32, 1)

        def forward(self, x):
            return self.top(torch.cat([self.user(x["user"]), self.genres(*x["genres"])], 1))

Where the rows come from
    Each forward call takes the unique ids of its input (``torch.unique``),
    asks a *row source* for their rows as one small float32 ``[k, dim]``
    tensor, makes it a leaf that requires grad, and computes the output
    from it with ``F.embedding`` / ``F.embedding_bag`` on the inverse
    indices. The gradient of that leaf is exactly the gradient of the full
    table on those rows (the other rows' gradient is zero), so the module
    behaves like ``torch.nn.Embedding`` trained with a lazy optimizer.

    - **In process** (tests, single-process baselines, evaluation): with no
      source bound, a module reads its own :class:`LocalTable`, and a
      :class:`SparseOptimizer` applies the recorded gradients to it with a
      lazy rule, as ``torch.optim.SparseAdam`` does for
      ``nn.Embedding(sparse=True)``.
    - **In a trainer**: :func:`sparse_modules` finds the tables of a model;
      per mini-batch the trainer makes a :class:`SparseBatch`, optionally
      supplies the rows it pulled before the forward pass (ids it knows from
      :func:`batch_ids`), binds it (``with batch.bind(model):``), runs
      forward and backward, and reads :meth:`SparseBatch.gradients`: one
      ``(unique ids, gradient rows)`` pair per table, to push.

Not supported (refused or ignored, unlike ``torch.nn.Embedding``):
``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` and ``sparse``;
modules are float32 only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from elasticps.errors import ModelContractError, SparseTableError
from elasticps.pserver.sparse import (
    SparseRule,
    SparseSGD,
    SparseTable,
    TableSpec,
    check_id_range,
)

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "HashEmbedding",
    "HashEmbeddingBag",
    "LocalTable",
    "SparseBatch",
    "SparseGrad",
    "SparseModule",
    "SparseOptimizer",
    "batch_ids",
    "merge_gradients",
    "partitions",
    "sparse_module_objects",
    "sparse_modules",
    "table_specs",
]

PullFn = Callable[[TableSpec, Tensor], Tensor]
"""``pull(spec, ids) -> rows``: ids int64 ``[k]`` unique and sorted, rows float32 ``[k, dim]``."""


@dataclass(frozen=True)
class SparseGrad:
    """The gradient of one table after a backward pass.

    Attributes:
        ids: int64 ``[k]``, unique and ascending: every id the forward pass used.
        grads: float32 ``[k, dim]``: the summed gradient of each row (zero
            for a row that was looked up but did not reach the loss).
    """

    ids: Tensor
    grads: Tensor


class _Recorder:
    """The leaves handed out during one or more forward passes, by table name."""

    def __init__(self) -> None:
        self.leaves: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def record(self, name: str, ids: Tensor, rows: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return rows
        leaf = rows.detach().requires_grad_(True)
        self.leaves.setdefault(name, []).append((ids, leaf))
        return leaf

    def gradients(self, dims: Mapping[str, int]) -> dict[str, SparseGrad]:
        out = {}
        for name, records in self.leaves.items():
            ids = torch.cat([i for i, _ in records])
            grads = torch.cat(
                [
                    leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    for _, leaf in records
                ]
            )
            if len(records) > 1:
                ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
                grads = torch.zeros(len(ids), dims[name]).index_add_(0, inverse, grads)
            out[name] = SparseGrad(ids, grads.detach())
        return out

    def clear(self) -> None:
        self.leaves.clear()


class LocalTable:
    """A module's own in-process table: rows, lazy optimizer and the gradients recorded.

    Used when no :class:`SparseBatch` is bound: in tests, single-process
    baselines and evaluation.

    Args:
        spec: the table.
        rule: the lazy update rule (SGD until a :class:`SparseOptimizer` sets one).
    """

    def __init__(self, spec: TableSpec, rule: SparseRule | None = None) -> None:
        self.table = SparseTable(spec, rule)
        self._recorder = _Recorder()

    def rows(self, spec: TableSpec, ids: Tensor) -> Tensor:
        """Rows of unique ``ids`` (int64 ``[k]``) as a leaf that records its gradient.

        Returns:
            float32 ``[k, dim]``; requires grad when grad mode is on.
        """
        return self._recorder.record(spec.name, ids, self.table.lookup(ids))

    def gradients(self) -> SparseGrad | None:
        """The gradient recorded since the last :meth:`clear`, or None if nothing was looked up."""
        grads = self._recorder.gradients({self.table.spec.name: self.table.spec.dim})
        return grads.get(self.table.spec.name)

    def clear(self) -> None:
        """Forget the recorded leaves (``zero_grad``)."""
        self._recorder.clear()

    def set_table(self, table: SparseTable) -> None:
        """Use ``table`` from now on (e.g. trained rows loaded for evaluation).

        Raises:
            SparseTableError: ``table`` has another spec than this module's.
        """
        if table.spec != self.table.spec:
            raise SparseTableError(
                f"sparse table {self.table.spec.name}: cannot use a table with spec "
                f"{table.spec.describe()}, the module has {self.table.spec.describe()}"
            )
        self.table = table
        self._recorder.clear()


class SparseBatch:
    """The rows of one mini-batch, by table: the seam between a trainer and the sparse modules.

    A trainer makes one per mini-batch (or per push), supplies rows it
    pulled ahead with :meth:`supply` (or lets the modules pull on demand
    through ``pull``), runs forward and backward inside :meth:`bind`, and
    reads :meth:`gradients`. Rows of an id are fetched once per batch, so
    two forward calls over the same id (or two modules sharing a table) see
    the same values and their gradients are summed.

    Args:
        specs: the model's tables by name (:func:`table_specs`).
        pull: fetches rows on demand, for ids not supplied:
            ``pull(spec, ids)`` with ids int64 ``[k]`` unique and ascending,
            returning float32 ``[k, dim]``. None: every id must be supplied.
    """

    def __init__(self, specs: Mapping[str, TableSpec], pull: PullFn | None = None) -> None:
        self.specs = dict(specs)
        self._pull = pull
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}
        self._recorder = _Recorder()

    def _spec(self, name: str) -> TableSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise SparseTableError(f"no sparse table named {name!r} in this batch")
        return spec

    def supply(self, name: str, ids: Tensor, rows: Tensor) -> None:
        """Give the rows of ``ids`` for table ``name`` (pulled before the forward pass).

        Args:
            name: the table.
            ids: int64 ``[k]``, unique (any order).
            rows: float32 ``[k, dim]``, row ``i`` for ``ids[i]``.

        Raises:
            SparseTableError: an unknown table, or ids/rows of the wrong
                dtype or shape.
        """
        spec = self._spec(name)
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise SparseTableError(f"sparse table {name}: supplied ids must be int64 [k]")
        if rows.dtype != torch.float32 or tuple(rows.shape) != (len(ids), spec.dim):
            raise SparseTableError(
                f"sparse table {name}: supplied rows must be float32 [{len(ids)}, {spec.dim}], "
                f"got {rows.dtype} {list(rows.shape)}"
            )
        # Ids usually come ascending (torch.unique, as batch_ids gives them):
        # then there is nothing to sort, and ascending means unique.
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            order = torch.argsort(ids)
            ids, rows = ids[order], rows[order]
            if bool((ids[1:] == ids[:-1]).any()):
                raise SparseTableError(f"sparse table {name}: supplied ids are not unique")
        old = self._cache.get(name)
        if old is not None:
            keep = ~torch.isin(old[0], ids)
            ids, rows = torch.cat([old[0][keep], ids]), torch.cat([old[1][keep], rows])
            order = torch.argsort(ids)
            ids, rows = ids[order], rows[order]
        self._cache[name] = (ids, rows)

    def prefetch(self, ids_by_table: Mapping[str, Tensor]) -> None:
        """Pull the rows of the given ids through ``pull`` and keep them (one call per table).

        Args:
            ids_by_table: table name -> int64 ids (any shape, duplicates allowed).

        Raises:
            SparseTableError: no ``pull`` function, or an unknown table.
        """
        for name, ids in ids_by_table.items():
            spec = self._spec(name)
            unique = torch.unique(ids.reshape(-1).to(torch.int64))
            if self._pull is None:
                raise SparseTableError("this batch has no pull function to prefetch with")
            self.supply(name, unique, self._pull(spec, unique))

    def rows(self, spec: TableSpec, ids: Tensor) -> Tensor:
        """Rows of unique ascending ``ids`` for a module's forward pass, recorded for backward.

        Returns:
            float32 ``[k, dim]``; a leaf that requires grad when grad mode is on.

        Raises:
            SparseTableError: an unknown table, or ids neither supplied nor
                pullable.
        """
        self._spec(spec.name)
        cached = self._cache.get(spec.name)
        if cached is not None and len(cached[0]):
            pos = torch.searchsorted(cached[0], ids).clamp_(max=len(cached[0]) - 1)
            found = cached[0][pos] == ids
            if bool(found.all()):  # the usual case: every id was supplied before forward
                return self._recorder.record(spec.name, ids, cached[1][pos])
            missing = ids[~found]
        else:
            missing = ids
        if len(missing):
            if self._pull is None:
                raise SparseTableError(
                    f"sparse table {spec.name}: {len(missing)} ids were not supplied "
                    f"(first: {int(missing[0])})"
                )
            self.supply(spec.name, missing, self._pull(spec, missing))
            cached = self._cache[spec.name]
        if cached is None:  # no ids at all
            return torch.zeros(0, spec.dim)
        pos = torch.searchsorted(cached[0], ids)
        return self._recorder.record(spec.name, ids, cached[1][pos])

    def gradients(self) -> dict[str, SparseGrad]:
        """Per table, the ids used since the batch was made and the sum of their gradient rows.

        Call after ``backward()``. Tables not used in the batch are absent.
        """
        return self._recorder.gradients({n: s.dim for n, s in self.specs.items()})

    @contextlib.contextmanager
    def bind(
        self, model: nn.Module, modules: Sequence[SparseModule] | None = None
    ) -> Iterator[SparseBatch]:
        """Make every sparse module of ``model`` read its rows from this batch, inside the block.

        Args:
            model: the model.
            modules: ``sparse_module_objects(model)``, if the caller keeps it
                (a trainer does, once): saves walking the model every batch.

        Raises:
            ModelContractError: two different modules use the same table name.
        """
        if modules is None:
            modules = sparse_module_objects(model)
        previous = [m._source for m in modules]
        for m in modules:
            m._source = self
        try:
            yield self
        finally:
            for m, p in zip(modules, previous, strict=True):
                m._source = p


class SparseModule(nn.Module):
    """Base of the sparse embedding modules: a named table and where its rows come from.

    Args:
        num_embeddings: ids in ``[0, num_embeddings)``; None for any int64 key.
        embedding_dim: floats per row.
        name: the table's name. Modules of a model that declare the same
            name and the same table (dimensions, initialiser, seed) share
            one table, as one module object used twice does; the same name
            with another table is an error.
        feature: the key of the model's input mapping holding this module's
            ids, if the model takes a mapping; lets the trainer find the ids
            of a batch before the forward pass (:func:`batch_ids`).
        init: ``normal``, ``uniform`` or ``zeros``.
        init_scale: standard deviation or bound of the initialiser.
        seed: seed of the initial values.
        partition: how the parameter servers split the table's rows:
            ``hash`` (a hash of the id; balances skewed ids) or ``range``
            (contiguous id ranges; fixed tables only).

    Raises:
        ConfigError: an invalid table spec or partition.
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        name: str,
        feature: str | None = None,
        init: str = "normal",
        init_scale: float = 1.0,
        seed: int = 0,
        partition: str = "hash",
    ) -> None:
        super().__init__()
        if partition not in ("hash", "range") or (partition == "range" and num_embeddings is None):
            from elasticps.errors import ConfigError

            raise ConfigError(
                f"sparse table {name}: partition must be 'hash', or 'range' for a table with "
                f"num_embeddings, got {partition!r}"
            )
        self.partition = partition
        self.spec = TableSpec(
            name=name,
            dim=embedding_dim,
            num_embeddings=num_embeddings,
            init=init,
            init_scale=init_scale,
            seed=seed,
        )
        self.feature = feature
        self.local = LocalTable(self.spec)
        self._source: SparseBatch | None = None

    @property
    def num_embeddings(self) -> int | None:
        """The fixed table's size, or None for a hashed table."""
        return self.spec.num_embeddings

    @property
    def embedding_dim(self) -> int:
        """Floats per row."""
        return self.spec.dim

    def extra_repr(self) -> str:
        """For ``print(model)``."""
        return f"{self.spec.num_embeddings}, {self.spec.dim}, name={self.spec.name!r}"

    def _rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows [k, dim], inverse)`` for ids of any shape: ``rows[inverse]`` are their rows."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise SparseTableError(
                f"sparse table {self.spec.name}: ids must be int64, got {ids.dtype}"
            )
        flat = ids.reshape(-1).to(torch.int64)
        check_id_range(self.spec.name, flat, self.spec.num_embeddings)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        source = self._source if self._source is not None else self.local
        return source.rows(self.spec, unique), inverse.reshape(ids.shape)


class Embedding(SparseModule):
    """A sparse ``torch.nn.Embedding``: ids of any shape ``[...]`` to rows ``[..., dim]``.

    Args: as :class:`SparseModule` (``num_embeddings`` first, like ``torch.nn.Embedding``).

    Raises:
        ConfigError: an invalid table spec.
    """

    def forward(self, ids: Tensor) -> Tensor:
        """Look up rows.

        Args:
            ids: int64 (or int32) ``[...]``.

        Returns:
            float32 ``[..., dim]``.

        Raises:
            SparseTableError: ids not integer, or out of a fixed table's range.
        """
        rows, inverse = self._rows(ids)
        return F.embedding(inverse, rows)


class HashEmbedding(Embedding):
    """A sparse embedding over any int64 key (a hashed, growing table).

    Args:
        embedding_dim: floats per row.
        name: the table's name.
        **kwargs: ``feature``, ``init``, ``init_scale``, ``seed`` as :class:`SparseModule`.

    Raises:
        ConfigError: an invalid table spec.
    """

    def __init__(self, embedding_dim: int, *, name: str, **kwargs: Any) -> None:
        super().__init__(None, embedding_dim, name=name, **kwargs)


class EmbeddingBag(SparseModule):
    """A sparse ``torch.nn.EmbeddingBag``: pools the rows of each bag of ids (sum, mean or max).

    For multi-valued features (a movie's genres). As ``torch.nn.EmbeddingBag``,
    bags are the rows of a 2-d input, or, for bags of different lengths, a
    1-d input cut by ``offsets``.

    Args:
        num_embeddings: ids in ``[0, num_embeddings)``; None for any int64 key.
        embedding_dim: floats per row.
        name: the table's name.
        mode: ``sum``, ``mean`` (default, as ``torch.nn.EmbeddingBag``) or ``max``.
        **kwargs: ``feature``, ``init``, ``init_scale``, ``seed`` as :class:`SparseModule`.

    Raises:
        ConfigError: an invalid table spec or mode.
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        name: str,
        mode: str = "mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, name=name, **kwargs)
        if mode not in ("sum", "mean", "max"):
            from elasticps.errors import ConfigError

            raise ConfigError(f"EmbeddingBag mode must be sum, mean or max, got {mode!r}")
        self.mode = mode

    def forward(
        self,
        ids: Tensor,
        offsets: Tensor | None = None,
        per_sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Pool the rows of each bag.

        Args:
            ids: int64 ``[B, L]`` (B bags of L ids), or ``[N]`` with ``offsets``.
            offsets: int64 ``[B]``, the start of each bag in a 1-d ``ids``
                (an empty bag pools to zeros).
            per_sample_weights: float32, same shape as ``ids``, with ``mode="sum"``.

        Returns:
            float32 ``[B, dim]``.

        Raises:
            SparseTableError: ids not integer, or out of a fixed table's range.
        """
        rows, inverse = self._rows(ids)
        return F.embedding_bag(
            inverse, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights
        )

    def extra_repr(self) -> str:
        """For ``print(model)``."""
        return f"{super().extra_repr()}, mode={self.mode!r}"


class HashEmbeddingBag(EmbeddingBag):
    """A sparse ``torch.nn.EmbeddingBag`` over any int64 key.

    Args:
        embedding_dim: floats per row.
        name: the table's name.
        mode: ``sum``, ``mean`` or ``max``.
        **kwargs: ``feature``, ``init``, ``init_scale``, ``seed`` as :class:`SparseModule`.

    Raises:
        ConfigError: an invalid table spec or mode.
    """

    def __init__(self, embedding_dim: int, *, name: str, mode: str = "mean", **kwargs: Any) -> None:
        super().__init__(None, embedding_dim, name=name, mode=mode, **kwargs)


def sparse_modules(model: nn.Module) -> dict[str, SparseModule]:
    """The sparse modules of ``model`` by table name, in ``named_modules`` order.

    Modules that declare the same table name and spec share one table: the
    first one found stands for it, and the others are made to use its
    in-process table (so that single-process training updates it once).

    Raises:
        ModelContractError: two modules use the same table name for
            different tables (another dimension, size, initialiser, seed or
            partition).
    """
    found: dict[str, SparseModule] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, SparseModule):
            other = found.get(module.spec.name)
            if other is None:
                found[module.spec.name] = module
            elif other is not module:
                if other.spec != module.spec or other.partition != module.partition:
                    raise ModelContractError(
                        f"two sparse modules use the table name {module.spec.name!r} for "
                        f"different tables (the second at {path or 'the root'}: "
                        f"{module.spec.describe()} vs {other.spec.describe()}); give each its "
                        "own name, or declare the same table to share it"
                    )
                module.local = other.local
    return found


def sparse_module_objects(model: nn.Module) -> list[SparseModule]:
    """Every sparse module object of ``model`` (shared tables included), once each.

    A caller that runs many batches of one model keeps this list and passes
    it to :func:`batch_ids` and :meth:`SparseBatch.bind`, instead of having
    each walk the model's modules again.

    Raises:
        ModelContractError: two different modules use the same table name
            (see :func:`sparse_modules`).
    """
    sparse_modules(model)  # checks shared names
    seen: dict[int, SparseModule] = {}
    for _, module in model.named_modules():
        if isinstance(module, SparseModule):
            seen.setdefault(id(module), module)
    return list(seen.values())


def partitions(model: nn.Module) -> dict[str, str]:
    """Table name -> how its rows are partitioned (``hash`` or ``range``).

    Raises:
        ModelContractError: see :func:`sparse_modules`.
    """
    return {name: m.partition for name, m in sparse_modules(model).items()}


def table_specs(model: nn.Module) -> dict[str, TableSpec]:
    """The specs of ``model``'s sparse tables by name (what the parameter servers must hold).

    Raises:
        ModelContractError: see :func:`sparse_modules`.
    """
    return {name: m.spec for name, m in sparse_modules(model).items()}


def batch_ids(
    model: nn.Module, inputs: object, modules: Sequence[SparseModule] | None = None
) -> dict[str, Tensor]:
    """The unique ids of each table that a batch's inputs hold, before the forward pass.

    Only modules created with ``feature=KEY`` and inputs that are a mapping
    are covered: the ids of such a module are ``inputs[KEY]`` (or its first
    element, for an ``(ids, offsets)`` pair). Other modules pull on demand
    during the forward pass.

    Args:
        model: the model.
        inputs: what ``batch_to_tensors`` returned as the model's input.
        modules: ``sparse_module_objects(model)``, if the caller keeps it.

    Returns:
        Table name -> int64 ``[k]`` unique ascending ids (tables sharing a
        name are merged).

    Raises:
        ModelContractError: a module's feature key is missing from the inputs.
    """
    if not isinstance(inputs, Mapping):
        return {}
    found: dict[str, list[Tensor]] = {}
    for module in sparse_module_objects(model) if modules is None else modules:
        name = module.spec.name
        if module.feature is None:
            continue
        if module.feature not in inputs:
            raise ModelContractError(
                f"sparse table {name}: feature {module.feature!r} is not in the model's inputs "
                f"(keys: {', '.join(map(str, inputs))})"
            )
        value = inputs[module.feature]
        ids = value[0] if isinstance(value, (tuple, list)) else value
        found.setdefault(name, []).append(torch.as_tensor(ids).reshape(-1).to(torch.int64))
    return {name: torch.unique(torch.cat(parts)) for name, parts in found.items()}


def merge_gradients(
    gradients: list[dict[str, SparseGrad]], scale: float = 1.0
) -> dict[str, SparseGrad]:
    """Sum the gradients of several mini-batches per table, times ``scale``.

    For a trainer that pushes every n mini-batches: merge the n
    :meth:`SparseBatch.gradients` with ``scale=1/n`` (the dense gradient
    pushed is the mean of the n per-batch gradients too).

    Args:
        gradients: per mini-batch, table name -> :class:`SparseGrad`.
        scale: factor applied to the sums.

    Returns:
        Table name -> :class:`SparseGrad` with unique ascending ids.
    """
    if len(gradients) == 1 and scale == 1.0:
        return dict(gradients[0])  # one batch's ids are unique and ascending already
    out: dict[str, SparseGrad] = {}
    names = {name for grads in gradients for name in grads}
    for name in sorted(names):
        parts = [g[name] for g in gradients if name in g]
        ids = torch.cat([p.ids for p in parts])
        rows = torch.cat([p.grads for p in parts])
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        summed = torch.zeros(len(unique), rows.shape[1]).index_add_(0, inverse, rows)
        out[name] = SparseGrad(unique, summed * scale if scale != 1.0 else summed)
    return out


class SparseOptimizer:
    """Applies the recorded gradients of a model's sparse modules to their local tables.

    The in-process counterpart of the parameter servers' lazy optimizers:
    with ``torch.optim`` for the dense parameters, it makes a model file
    train in one process exactly as ``torch.nn.Embedding`` with a lazy
    optimizer would (``SparseSGD`` equals dense SGD on an ``nn.Embedding``).

    Args:
        model: the model; its sparse modules must hold no rows yet if
            ``rule`` differs from theirs.
        rule: the lazy rule, e.g. ``SparseAdam()`` (default ``SparseSGD()``).
        lr: learning rate, > 0.

    Raises:
        ConfigError: ``lr`` is not > 0.
        SparseTableError: a table already holds rows under another rule.
        ModelContractError: see :func:`sparse_modules`.
    """

    def __init__(self, model: nn.Module, rule: SparseRule | None = None, *, lr: float) -> None:
        if not lr > 0:
            from elasticps.errors import ConfigError

            raise ConfigError(f"lr must be > 0, got {lr}")
        self.lr = lr
        self.rule = rule if rule is not None else SparseSGD()
        self.modules = list(sparse_modules(model).values())
        for m in self.modules:
            if m.local.table.rule != self.rule:
                m.local.table.set_rule(self.rule)

    def step(self) -> None:
        """Apply the gradient recorded since the last step to every table, then clear it.

        Every table takes a step (an unused one an empty step), so versions
        stay aligned across tables.
        """
        for m in self.modules:
            grad = m.local.gradients()
            if grad is None:
                m.local.table.apply(np.zeros(0, np.int64), torch.zeros(0, m.spec.dim), self.lr)
            else:
                m.local.table.apply(grad.ids, grad.grads, self.lr)
            m.local.clear()

    def zero_grad(self) -> None:
        """Forget the gradients recorded since the last step."""
        for m in self.modules:
            m.local.clear()
