"""The audit model: one counter per training record, to check exactly-once on the parameters.

This file is a model file (``elasticps train --model``, see the model
contract) and a module of helpers. The model holds one float32 counter per
record of its data set; its loss over a mini-batch is ``-sum(counter[idx])``,
so with SGD at learning rate 1 every *applied* gradient adds exactly +1 to
the counter of each record in it, on whichever parameter server holds that
counter. After a job of P passes, every counter must be exactly P: a counter
below P is a record whose gradient was lost on its shard, above P one applied
twice. The check reads the final parameters, not the ledger: it is the
guarantee as a user sees it.

Run it (any launcher, any faults)::

    elasticps data audit --output DIR --records 4000
    elasticps train --model DIR/audit_model.py --data DIR --optimizer sgd --lr 1 \\
        --model-args '{"records": 4000}' --sync-reduction sum --push-every 1 \\
        --big-array-bound 500 --output RUN --chaos kill:ps@40%
    elasticps audit RUN

Three settings make the +1 exact: SGD with ``--lr 1`` (no momentum, no
schedule); ``--push-every 1`` (a trainer averages the mini-batches it
accumulates); and in sync mode ``--sync-reduction sum`` (a sync step sums the
trainers' gradients instead of averaging them by samples). A
``--big-array-bound`` below the record count slices the counters over every
parameter server, so that each of them is audited.

The tied variant (``--model-class SharedModel``) reaches the same counters
through two names, as a language model ties its embedding and output
weights: half of each record's gradient comes through each name, and the
one shared parameter must still get exactly +1 per record and pass.

The sparse variant (``--model-class SparseModel``) keeps the counters as the
rows of a sparse embedding table instead (:mod:`elasticps.nn`, one row of
one float per record, spread over every server by a hash of the record's
index), plus one dense counter of all records: it checks the same guarantee
for rows pulled and pushed by id. :func:`check_run` reads the rows from the
run's final consistent checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

import elasticps.nn as enn

__all__ = [
    "COLUMNS",
    "AuditResult",
    "Model",
    "SharedModel",
    "SparseModel",
    "batch_to_tensors",
    "check_counters",
    "check_run",
    "loss",
    "model_file",
    "write_dataset",
]

COLUMNS = ("idx",)
"""The Parquet column the model reads: the record's index, int64."""

DEFAULT_RECORDS = 4000
"""Counters of a :class:`Model` built without arguments."""


class Model(nn.Module):
    """One float32 counter per record, all starting at 0.

    Args:
        records: how many records the data set has (counters), >= 1.
    """

    def __init__(self, records: int = DEFAULT_RECORDS) -> None:
        super().__init__()
        self.counter = nn.Parameter(torch.zeros(records, dtype=torch.float32))

    def forward(self, idx: Tensor) -> Tensor:
        """The counters of a mini-batch's records: float32 ``[B]`` for int64 ``[B]`` indices."""
        return self.counter[idx]


class _Holder(nn.Module):
    """A module that holds a parameter it shares with another module."""

    def __init__(self, counter: nn.Parameter) -> None:
        super().__init__()
        self.counter = counter


class SharedModel(nn.Module):
    """The counters of :class:`Model`, reached through two names: ``counter`` and ``tied.counter``.

    ``named_parameters()`` lists the one parameter once, as ``counter``;
    ``state_dict()`` lists both names. The forward pass reads half of each
    counter through each name, so the gradient of each record is still -1.

    Args:
        records: how many records the data set has (counters), >= 1.
    """

    def __init__(self, records: int = DEFAULT_RECORDS) -> None:
        super().__init__()
        self.counter = nn.Parameter(torch.zeros(records, dtype=torch.float32))
        self.tied = _Holder(self.counter)

    def forward(self, idx: Tensor) -> Tensor:
        """The counters of a mini-batch's records: float32 ``[B]`` for int64 ``[B]`` indices."""
        out: Tensor = 0.5 * self.counter[idx] + 0.5 * self.tied.counter[idx]
        return out


SPARSE_TABLE = "audit_rows"
"""The sparse variant's table: one row of one float per record."""


class SparseModel(nn.Module):
    """One sparse-table row per record, and a dense counter of every record seen.

    Each mini-batch pulls the rows of its records only and pushes one
    gradient row (-1) per record; ``seen`` gets -1 per record too, so after P
    passes it is P times the number of records.

    Args:
        records: how many records the data set has (rows), >= 1.
    """

    def __init__(self, records: int = DEFAULT_RECORDS) -> None:
        super().__init__()
        self.rows = enn.Embedding(records, 1, name=SPARSE_TABLE, init="zeros")
        self.seen = nn.Parameter(torch.zeros(1, dtype=torch.float32))

    def forward(self, idx: Tensor) -> Tensor:
        """Each record's row plus the dense counter: float32 ``[B]`` for int64 ``[B]``."""
        out: Tensor = self.rows(idx)[:, 0] + self.seen
        return out


def loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """``-sum(counter[idx])``: its gradient is -1 for each record of the batch."""
    del targets
    return -outputs.sum()


def batch_to_tensors(batch: object) -> tuple[Tensor, Tensor]:
    """A pyarrow table with column ``idx`` -> (int64 ``[B]`` indices, zeros ``[B]``)."""
    import pyarrow as pa

    assert isinstance(batch, pa.Table)
    idx = torch.from_numpy(batch.column("idx").to_numpy().astype("int64"))
    return idx, torch.zeros(len(idx), dtype=torch.float32)


def model_file() -> Path:
    """The path of this model file, for ``elasticps train --model``."""
    return Path(__file__)


def train_args(data: Path, out: Path, mode: str, epochs: int) -> list[str]:
    """``elasticps train`` arguments of the audit job the tests and soaks run.

    The settings that make the +1 exact (see the module docstring), 3 trainers
    and 2 PS over the counters, 200 records a task, a 2 s lease and a shard
    checkpoint every second.

    Args:
        data: a directory made by :func:`write_dataset`.
        out: the job's ``--output``.
        mode: ``sync`` or ``async``.
        epochs: passes.
    """
    return [
        "--model", str(data / "audit_model.py"), "--data", str(data),
        "--output", str(out), "--optimizer", "sgd", "--lr", "1", "--sync-reduction", "sum",
        "--push-every", "1", "--big-array-bound", "500", "--trainers", "3", "--ps", "2",
        "--mode", mode, "--epochs", str(epochs), "--records-per-task", "200",
        "--lease-ttl-s", "2", "--checkpoint-every-s", "1",
    ]  # fmt: skip


def write_dataset(out: Path, records: int, *, row_group_size: int = 100) -> None:
    """Write an audit data set: ``train.parquet`` (indices 0..records-1) and this model file.

    Also writes ``audit.json`` (``{"records": n}``) and copies the model file
    to ``out/audit_model.py``.

    Args:
        out: the directory (created if missing).
        records: number of records, >= 1.
        row_group_size: rows per Parquet row group.

    Raises:
        ValueError: ``records`` < 1.
        OSError: the directory cannot be written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if records < 1:
        raise ValueError(f"records must be >= 1, got {records}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table({"idx": pa.array(range(records), type=pa.int64())})
    pq.write_table(table, out / "train.parquet", row_group_size=row_group_size)
    shutil.copyfile(model_file(), out / "audit_model.py")
    (out / "audit.json").write_text(json.dumps({"records": records}) + "\n")


@dataclass(frozen=True)
class AuditResult:
    """What the counters say after a job.

    Attributes:
        passes: the passes the job ran (each record's expected count).
        records: the number of counters.
        exact: records whose counter equals ``passes``.
        short: records applied fewer times (lost updates), and
        updates_lost: how many updates they lack in all.
        over: records applied more times (duplicated updates), and
        updates_duplicated: how many extra updates in all.
        not_integer: counters that are not whole numbers (a wrong setting:
            not SGD at lr 1, push_every > 1, or a mean sync reduction).
    """

    passes: int
    records: int
    exact: int
    short: int
    updates_lost: int
    over: int
    updates_duplicated: int
    not_integer: int

    @property
    def exactly_once(self) -> bool:
        """Whether every record's gradient was applied exactly once per pass."""
        return self.exact == self.records

    def as_dict(self) -> dict[str, object]:
        """JSON-ready, with ``exactly_once``."""
        return {**self.__dict__, "exactly_once": self.exactly_once}


def check_counters(counter: Tensor, passes: int) -> AuditResult:
    """Compare every record's counter with the number of passes.

    Args:
        counter: float32 ``[records]``, the trained ``counter`` parameter.
        passes: passes the job ran, >= 0.

    Returns:
        The counts of exact, short and over-applied records.

    Raises:
        ValueError: ``counter`` is not one-dimensional.
    """
    if counter.dim() != 1:
        raise ValueError(f"counter must be 1-D, got shape {list(counter.shape)}")
    c = counter.detach().to(torch.float64)
    rounded = torch.round(c)
    not_integer = int((c != rounded).sum())
    diff = rounded - passes
    return AuditResult(
        passes=passes,
        records=int(c.numel()),
        exact=int((diff == 0).sum()),
        short=int((diff < 0).sum()),
        updates_lost=int(-diff.clamp(max=0).sum()),
        over=int((diff > 0).sum()),
        updates_duplicated=int(diff.clamp(min=0).sum()),
        not_integer=not_integer,
    )


def check_run(run_dir: str | Path, passes: int | None = None) -> AuditResult:
    """Check a finished job's ``model.safetensors`` (passes from its manifest).

    ``run_dir`` is the job's ``--output``: a directory or a storage URL.

    Raises:
        DataError: the run's files are missing or unreadable.
    """
    from elasticps.checkpoint import load_checkpoint
    from elasticps.errors import DataError
    from elasticps.storage import Location

    where = Location.of(run_dir)
    tensors, manifest = load_checkpoint(where)
    if passes is None:
        epochs = manifest.get("epochs")
        if not isinstance(epochs, int):
            raise DataError(f"{where / 'manifest.json'} does not say how many passes ran")
        passes = epochs
    counter = tensors.get("counter")
    if counter is None and "seen" in tensors:
        counter = sparse_counters(where.local_path / "snapshot")
    if counter is None:
        raise DataError(f"{run_dir} holds no 'counter' parameter: not an audit model's run")
    return check_counters(counter, passes)


def sparse_counters(snapshot_dir: Path, records: int | None = None) -> Tensor:
    """The sparse variant's counters, one per record, from a consistent checkpoint.

    Args:
        snapshot_dir: the checkpoint (a job's ``OUTPUT/snapshot``).
        records: how many records; default: the table's size.

    Returns:
        float32 ``[records]``; a record never trained reads 0.

    Raises:
        DataError: the checkpoint holds no audit table.
    """
    from elasticps.errors import DataError
    from elasticps.tables import load_tables

    tables = load_tables(snapshot_dir)
    if SPARSE_TABLE not in tables:
        raise DataError(f"{snapshot_dir} holds no {SPARSE_TABLE!r} table: not an audit model's run")
    table = tables[SPARSE_TABLE]
    n = records if records is not None else table.spec.num_embeddings
    assert n is not None
    return table.lookup(torch.arange(n, dtype=torch.int64))[:, 0]
