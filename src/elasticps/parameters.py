"""Parameter sets: named float32 tensors, shared by name across layers and models.

A :class:`ParameterSet` maps a parameter name to a tensor. Names are what
elasticps trains: **one name is one parameter**, on the parameter servers and
in a set. A tensor shared between layers of one model (``torch`` reports it
once, under its first name) is one entry; models built with the same module
names (a GAN's ``G.*`` and ``D.*`` in two jobs) read and write the same
entries.

>>> import torch
>>> from elasticps import parameters
>>> ps = parameters.create(torch.nn.Linear(3, 2))
>>> ps.names()
['weight', 'bias']
>>> ps.shapes()["weight"]
(2, 3)

A model's persistent buffers (BatchNorm's running statistics) are model
state too: :func:`elasticps.train` returns them in its set, under their
``state_dict()`` names and in their own dtypes, and :meth:`ParameterSet.copy_into`
and :func:`elasticps.infer` use those the set holds (a set without them
leaves the model's own).

Sets save and load as safetensors (no pickle), see :meth:`ParameterSet.save`
and :func:`load`.

Sparse tables (:mod:`elasticps.nn`) are not tensors of the mapping: a set
trained with them carries them in :attr:`ParameterSet.tables` (a
:class:`~elasticps.tables.TableSet`), where a row is looked up by id
(:meth:`ParameterSet.rows`) and a table exported as ``(ids, rows)``
(:meth:`ParameterSet.export_table`); :meth:`ParameterSet.save` writes them as
row-chunked part files in a ``.tables`` directory beside the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from elasticps.buffers import model_buffers
from elasticps.errors import ConfigError, DataError, MissingParameterError

if TYPE_CHECKING:
    from elasticps.tables import TableSet

__all__ = ["ParameterSet", "create", "load"]

_FORMAT = "elasticps.parameters/1"


class ParameterSet(Mapping[str, torch.Tensor]):
    """An immutable mapping from parameter name to tensor.

    The tensors are the set's own (detached, contiguous copies made by
    :func:`create`, :meth:`from_tensors` or :func:`load`); changing a model
    afterwards does not change the set.

    Args:
        tensors: name -> tensor; copied.
        tables: the sparse tables trained with them (a
            :class:`~elasticps.tables.TableSet`, kept, not copied), or None.

    Raises:
        ConfigError: a name is empty or not a string, a value is not a
            tensor, or ``tables`` is not a TableSet.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], tables: Mapping[str, object] | None = None
    ) -> None:
        from elasticps.tables import TableSet

        if tables is not None and not isinstance(tables, TableSet):
            raise ConfigError("tables must be an elasticps.tables.TableSet")
        self._tables = tables if tables is not None else TableSet({})
        own: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"parameter names must be non-empty strings, got {name!r}")
            if not isinstance(value, torch.Tensor):
                raise ConfigError(f"parameter {name} is a {type(value).__name__}, not a tensor")
            own[name] = value.detach().clone().contiguous()
        self._tensors = own

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> ParameterSet:
        """Build a set from ``name -> tensor`` (copied)."""
        return cls(tensors)

    # --- Mapping -----------------------------------------------------------------

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    # --- sparse tables ---------------------------------------------------------------

    @property
    def tables(self) -> TableSet:
        """The sparse tables trained with the parameters (empty if none)."""
        return self._tables

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of sparse table ``table`` by id: float32 ``[k, dim]`` for int64 ``[k]``.

        Raises:
            MissingParameterError: no such table.
            SparseTableError: an id out of a fixed table's range.
        """
        return self._tables.rows(table, ids)

    def export_table(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored row of ``table``: ``(ids int64 [n] ascending, rows float32 [n, dim])``.

        Raises:
            MissingParameterError: no such table.
        """
        return self._tables.export(table)

    # --- inspection ----------------------------------------------------------------

    def names(self) -> list[str]:
        """Parameter names, in insertion (model) order."""
        return list(self._tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape."""
        return {n: tuple(t.shape) for n, t in self._tensors.items()}

    def dtypes(self) -> dict[str, torch.dtype]:
        """Name -> dtype (float32 for trained parameters; buffers keep their own)."""
        return {n: t.dtype for n, t in self._tensors.items()}

    def numel(self) -> int:
        """Total number of elements over all parameters."""
        return sum(t.numel() for t in self._tensors.values())

    def nbytes(self) -> int:
        """Total size of the tensors, bytes."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def describe(self) -> str:
        """A table: one line per parameter (name, shape, dtype, elements), then totals."""
        width = max((len(n) for n in self._tensors), default=4)
        lines = [f"{'name':<{width}}  {'shape':<16} {'dtype':<8} {'numel':>10}"]
        for n, t in self._tensors.items():
            dtype = str(t.dtype).removeprefix("torch.")
            lines.append(f"{n:<{width}}  {tuple(t.shape)!s:<16} {dtype:<8} {t.numel():>10}")
        lines.append(f"{len(self)} parameters, {self.numel()} elements, {self.nbytes()} bytes")
        return "\n".join(lines)

    def __repr__(self) -> str:
        tables = f", {len(self._tables)} sparse tables" if len(self._tables) else ""
        return f"ParameterSet({len(self)} parameters, {self.numel()} elements{tables})"

    def equal(self, other: Mapping[str, torch.Tensor]) -> bool:
        """True if ``other`` has the same names, shapes, dtypes and bit-identical values."""
        if set(other) != set(self._tensors):
            return False
        return all(
            t.dtype == other[n].dtype and t.shape == other[n].shape and torch.equal(t, other[n])
            for n, t in self._tensors.items()
        )

    def select(self, patterns: Iterable[str]) -> ParameterSet:
        """The sub-set whose names match any glob pattern (``fnmatch``), e.g. ``{"D.*"}``."""
        import fnmatch

        pats = list(patterns)
        return ParameterSet(
            {n: t for n, t in self._tensors.items() if any(fnmatch.fnmatchcase(n, p) for p in pats)}
        )

    # --- models ------------------------------------------------------------------------

    def missing_for(self, model: nn.Module) -> list[str]:
        """Names of ``model``'s parameters that the set lacks, in model order."""
        return [n for n, _ in model.named_parameters() if n not in self._tensors]

    def buffers_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The set's tensors for ``model``'s persistent buffers that it holds, by name.

        Raises:
            ConfigError: a shape differs from the model's.
        """
        out = {}
        for n, b in model_buffers(model):
            t = self._tensors.get(n)
            if t is None:
                continue
            if tuple(t.shape) != tuple(b.shape):
                raise ConfigError(
                    f"buffer {n} has shape {tuple(t.shape)} in the set but "
                    f"{tuple(b.shape)} in {type(model).__name__}"
                )
            out[n] = t
        return out

    def tensors_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The set's tensors for exactly ``model``'s parameters, by name.

        Raises:
            MissingParameterError: the set lacks some; the message names them.
            ConfigError: a shape differs from the model's.
        """
        missing = self.missing_for(model)
        if missing:
            shown = ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else "")
            raise MissingParameterError(
                f"the parameter set lacks {len(missing)} parameter(s) of "
                f"{type(model).__name__}: {shown}"
            )
        out = {}
        for n, p in model.named_parameters():
            t = self._tensors[n]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(
                    f"parameter {n} has shape {tuple(t.shape)} in the set but "
                    f"{tuple(p.shape)} in {type(model).__name__}"
                )
            out[n] = t
        return out

    def copy_into(self, model: nn.Module, *, strict: bool = True) -> list[str]:
        """Copy the set's values into ``model``'s parameters, in place, by name.

        The model's persistent buffers that the set holds are copied too (in
        the buffer's dtype); those it lacks keep their values, whatever
        ``strict`` says.

        Args:
            model: the module to fill.
            strict: if True, every model parameter must be in the set.

        Sparse tables of the set are bound to the model's sparse modules of
        the same name (the modules read them from then on). Lazy parameters
        and buffers of the model take the set's shapes. A tensor the model
        holds under several names is filled once, under its first name.

        Returns:
            The names of the model's parameters that were not in the set (only
            possible with ``strict=False``; they keep their values).

        Raises:
            MissingParameterError: ``strict`` and the set lacks some parameters.
            ConfigError: a shape differs.
        """
        from elasticps.model_file import materialize_as

        materialize_as(model, self._tensors)  # a lazy model takes the set's shapes
        missing = self.missing_for(model)
        if strict and missing:
            self.tensors_for(model)  # raises, naming them
        with torch.no_grad():
            for n, p in model.named_parameters():
                t = self._tensors.get(n)
                if t is None:
                    continue
                if tuple(t.shape) != tuple(p.shape):
                    raise ConfigError(
                        f"parameter {n} has shape {tuple(t.shape)} in the set but "
                        f"{tuple(p.shape)} in {type(model).__name__}"
                    )
                p.copy_(t)
            buffers = dict(model_buffers(model))
            for n, t in self.buffers_for(model).items():
                buffers[n].copy_(t)
        if len(self._tables):
            self._tables.bind(model, strict=False)
        return missing

    # --- files -------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the set to one safetensors file (written to a temporary name, then renamed).

        Sparse tables, if any, go to ``<stem>.tables/`` beside the file, as
        row-chunked part files (:meth:`~elasticps.tables.TableSet.save`).

        Args:
            path: the file, e.g. ``gan.safetensors``; parent directories are created.

        Returns:
            The path written.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        order = json.dumps(self.names())
        if len(self._tables):
            self._tables.save(_tables_dir(target))
        save_file(dict(self._tensors), str(tmp), metadata={"format": _FORMAT, "names": order})
        tmp.replace(target)
        return target


def create(models: nn.Module | Iterable[nn.Module]) -> ParameterSet:
    """The parameters of one model, or of several models at once, by name.

    A tensor shared between layers counts once (under its first name, as
    ``named_parameters`` reports it). Parameters of different models with the
    same name are one parameter: the first model's value is taken, and the
    shapes must agree.

    Args:
        models: a ``torch.nn.Module`` or an iterable of them.

    Returns:
        The set; its tensors are copies.

    Raises:
        ConfigError: two models have a parameter of the same name with
            different shapes or dtypes, or there are no parameters.
    """
    if isinstance(models, nn.Module):
        models = [models]
    out: dict[str, torch.Tensor] = {}
    for model in models:
        for name, p in model.named_parameters():
            seen = out.get(name)
            if seen is None:
                out[name] = p
            elif seen.shape != p.shape or seen.dtype != p.dtype:
                raise ConfigError(
                    f"parameter {name} is {tuple(seen.shape)} {seen.dtype} in one model and "
                    f"{tuple(p.shape)} {p.dtype} in another; one name is one parameter"
                )
    if not out:
        raise ConfigError("the models have no parameters")
    return ParameterSet(out)


def _tables_dir(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".safetensors") + ".tables")


def load(path: str | Path) -> ParameterSet:
    """Read a set written by :meth:`ParameterSet.save` (or any safetensors file).

    Sparse tables saved beside the file are read too (all of each table).

    Raises:
        DataError: the file is missing or not a valid safetensors file.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"parameter file not found: {p}")
    try:
        tensors = load_file(str(p))
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise DataError(f"cannot read parameters from {p}: {exc}") from exc
    names = tensors.keys()
    try:
        order = json.loads(meta.get("names", "[]"))
    except json.JSONDecodeError:
        order = []
    tables = None
    if _tables_dir(p).is_dir():
        from elasticps.tables import load_tables

        tables = load_tables(_tables_dir(p))
    if isinstance(order, list) and sorted(order) == sorted(names):
        return ParameterSet({n: tensors[n] for n in order}, tables)
    return ParameterSet(tensors, tables)
