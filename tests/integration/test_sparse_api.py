"""Sparse tables through the Python API: train, ParameterSet by id, infer, frozen and shared tables.

``elasticps.train`` in process (``cluster=None``) and on real local servers
(``Local``: etcd, master and PS processes, trainer threads): with one sync
trainer both apply the same updates, tables included.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import elasticps
import elasticps.nn as enn
from elasticps import parameters
from elasticps.errors import MissingParameterError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORDS, DIM = 20, 4
gen = torch.Generator().manual_seed(0)
Q = torch.randint(0, 12, (64,), generator=gen)  # words 12..19 never used
D = torch.randint(0, 12, (64,), generator=gen)
K = torch.randint(0, 3, (64,), generator=gen)
T = torch.randn(64, generator=gen)


class Ranker(nn.Module):
    """A query and a document feature share the table ``words`` by name; ``kind`` is another."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(DIM, 1)
        # No ``feature``: the inputs are one tensor, so rows are pulled as modules meet ids.
        self.query = enn.Embedding(WORDS, DIM, name="words", init_scale=0.5)
        self.doc = enn.Embedding(WORDS, DIM, name="words", init_scale=0.5)
        self.kind = enn.Embedding(3, DIM, name="kind", init_scale=0.5)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: int64 ``[B, 3]`` (query word, document word, kind)."""
        out: Tensor = self.out(self.query(x[:, 0]) * self.doc(x[:, 1]) + self.kind(x[:, 2]))[:, 0]
        return out


X = torch.stack([Q, D, K], 1)


def reader() -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(0, 64, 16):
        yield X[i : i + 16], T[i : i + 16]


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.mse_loss(outputs, targets)


def test_in_process_training_returns_tables_to_inspect_export_save_and_infer_with(
    tmp_path: Path,
) -> None:
    model = Ranker()
    result = elasticps.train(
        model,
        mse,
        reader,
        updater=elasticps.updater.SGD(lr=0.1),
        num_passes=2,
        frozen_parameters={"kind"},
        cluster=None,
    )
    assert set(result) == {"out.weight", "out.bias"}
    assert sorted(result.tables) == ["kind", "words"]  # one table for two features
    used = torch.unique(torch.cat([Q, D]))
    ids, rows = result.export_table("words")
    assert torch.equal(ids, used)  # only rows a batch used are stored
    initial = model.query.local.table.lookup(torch.arange(WORDS))
    assert not torch.equal(rows, initial[used])
    assert torch.equal(result.rows("words", torch.tensor([19])), initial[19:])
    # Frozen: pulled, never changed (and not even stored).
    assert len(result.tables["kind"]) == 0
    assert torch.equal(
        result.rows("kind", torch.arange(3)), model.kind.local.table.lookup(torch.arange(3))
    )
    # infer runs with the trained rows, and leaves the model's own tables alone.
    inputs = X[:4]
    trained = elasticps.infer(model, result, inputs)
    fresh = Ranker()
    result.copy_into(fresh)
    with torch.no_grad():
        assert torch.allclose(fresh(inputs), trained)  # type: ignore[arg-type]
        assert not torch.allclose(model(inputs), trained)  # type: ignore[arg-type]
    # Saved with the set, as row chunks beside the file; loaded back by id.
    path = result.save(tmp_path / "ranker.safetensors")
    assert (tmp_path / "ranker.tables" / "sparse" / "words" / "index.json").is_file()
    again = parameters.load(path)
    assert torch.equal(again.export_table("words")[1], rows)
    with pytest.raises(MissingParameterError, match="no sparse table named 'nope'"):
        again.rows("nope", torch.tensor([0]))


def test_local_servers_train_the_tables_as_in_process_training_does() -> None:
    """One sync trainer on real servers applies the updates in-process training
    applies, tables included (one server: see the sparse/dense equivalence test
    in test_sparse_jobs.py for why)."""
    model = Ranker()
    common = {"updater": elasticps.updater.SGD(lr=0.1), "num_passes": 2}
    local = elasticps.train(
        model, mse, reader, cluster=elasticps.Local(trainers=1, ps=1, mode="sync"), **common
    )
    alone = elasticps.train(model, mse, reader, cluster=None, **common)
    for name in alone:
        torch.testing.assert_close(local[name], alone[name], atol=1e-6, rtol=0)
    for table in ("words", "kind"):
        ids, rows = alone.export_table(table)
        local_ids, local_rows = local.export_table(table)
        assert torch.equal(ids, local_ids)
        torch.testing.assert_close(local_rows, rows, atol=1e-6, rtol=0)
