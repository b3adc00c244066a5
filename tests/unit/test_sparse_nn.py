"""elasticps.nn: sparse modules behave as torch.nn.Embedding(Bag) + a lazy optimizer, and the
SparseBatch seam a trainer uses gives the same gradients as the local backend."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import elasticps.nn as enn
from elasticps.errors import ConfigError, ModelContractError, SparseTableError
from elasticps.pserver.sparse import SparseAdam, SparseTable, TableSpec, initial_rows

N, DIM = 30, 6


class Small(nn.Module):
    """A small ranking-like model: a fixed table, a hashed bag and a dense head."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.sparse = sparse
        if sparse:
            self.user: nn.Module = enn.Embedding(N, DIM, name="user", feature="user")
            self.tags: nn.Module = enn.EmbeddingBag(N, DIM, name="tag", mode="mean", feature="tags")
        else:
            self.user = nn.Embedding(N, DIM)
            self.tags = nn.EmbeddingBag(N, DIM, mode="mean")
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, x: dict[str, object]) -> Tensor:
        values, offsets = x["tags"]  # type: ignore[misc]
        joined = torch.cat([self.user(x["user"]), self.tags(values, offsets)], dim=1)
        return self.head(joined).squeeze(1)


def _batch(gen: torch.Generator, b: int = 16) -> tuple[dict[str, object], Tensor]:
    lengths = torch.randint(1, 4, (b,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    values = torch.randint(0, N, (int(lengths.sum()),), generator=gen)
    users = torch.randint(0, N, (b,), generator=gen)
    return {"user": users, "tags": (values, offsets)}, torch.randint(
        0, 2, (b,), generator=gen
    ).float()


def _pair() -> tuple[Small, Small]:
    torch.manual_seed(0)
    sparse = Small(sparse=True)
    dense = Small(sparse=False)
    dense.head.load_state_dict(sparse.head.state_dict())
    with torch.no_grad():
        for name in ("user", "tags"):
            spec = getattr(sparse, name).spec
            getattr(dense, name).weight.copy_(torch.from_numpy(initial_rows(spec, np.arange(N))))
    return sparse, dense


def _table(model: Small, name: str) -> Tensor:
    return getattr(model, name).local.table.lookup(np.arange(N))


def test_sparse_path_trained_with_sgd_equals_nn_embedding_with_dense_sgd() -> None:
    sparse, dense = _pair()
    lr = 0.2
    dense_opt = torch.optim.SGD(dense.parameters(), lr=lr)
    head_opt = torch.optim.SGD(sparse.parameters(), lr=lr)
    sparse_opt = enn.SparseOptimizer(sparse, lr=lr)
    gen = torch.Generator().manual_seed(1)
    loss_fn = nn.BCEWithLogitsLoss()
    for _ in range(60):
        x, y = _batch(gen)
        for model, opts in ((sparse, (head_opt, sparse_opt)), (dense, (dense_opt,))):
            for o in opts:
                o.zero_grad()
            loss_fn(model(x), y).backward()
            for o in opts:
                o.step()
    torch.testing.assert_close(
        _table(sparse, "user"), dense.user.weight.detach(), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        _table(sparse, "tags"), dense.tags.weight.detach(), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(sparse.head.weight, dense.head.weight, rtol=0, atol=1e-5)


def test_sparse_adam_with_table_steps_matches_torch_sparse_adam() -> None:
    module = enn.Embedding(N, DIM, name="e")
    ref = nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(initial_rows(module.spec, np.arange(N))))
    opt = enn.SparseOptimizer(module, SparseAdam(step_count="table"), lr=0.01)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(2)
    for _ in range(40):
        ids = torch.randint(0, N, (12,), generator=gen)
        w = torch.randn(12, DIM, generator=gen)
        (module(ids) * w).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (ref(ids) * w).sum().backward()
        ref_opt.step()
    # SparseAdam adds eps before bias correction, torch.optim.Adam (ours) after it.
    torch.testing.assert_close(
        module.local.table.lookup(np.arange(N)), ref.weight.detach(), rtol=0, atol=1e-5
    )


def test_outputs_have_the_shapes_of_torch_modules() -> None:
    emb = enn.HashEmbedding(DIM, name="h")
    assert emb(torch.tensor([[1, -5], [2**40, 1]])).shape == (2, 2, DIM)
    bag = enn.HashEmbeddingBag(DIM, name="hb", mode="sum")
    assert bag(torch.tensor([[1, 2, 3], [4, 5, 6]])).shape == (2, DIM)
    empty_bag = bag(torch.tensor([7, 8]), torch.tensor([0, 2]))  # the second bag is empty
    assert torch.equal(empty_bag[1], torch.zeros(DIM))
    same = emb(torch.tensor([9, 9]))
    assert torch.equal(same[0], same[1])


def test_invalid_ids_and_modes_are_refused() -> None:
    emb = enn.Embedding(5, DIM, name="e")
    with pytest.raises(SparseTableError, match="out of range"):
        emb(torch.tensor([5]))
    with pytest.raises(SparseTableError, match="int64"):
        emb(torch.tensor([0.5]))
    with pytest.raises(ConfigError):
        enn.EmbeddingBag(5, DIM, name="b", mode="median")
    with pytest.raises(ConfigError):
        enn.Embedding(5, DIM, name="bad/name")


def test_two_modules_may_not_claim_one_table_name_for_different_tables() -> None:
    model = nn.Sequential(enn.Embedding(5, DIM, name="x"), enn.Embedding(6, DIM, name="x"))
    with pytest.raises(ModelContractError, match="table name 'x'"):
        enn.sparse_modules(model)


def test_two_modules_declaring_one_table_share_it_by_name() -> None:
    """Two features (a query's and a document's words) look up one table by its name."""
    query = enn.Embedding(5, DIM, name="words", feature="query")
    doc = enn.Embedding(5, DIM, name="words", feature="doc")
    model = nn.ModuleDict({"q": query, "d": doc})
    assert list(enn.sparse_modules(model)) == ["words"]
    assert doc.local is query.local
    inputs = {"query": torch.tensor([1, 2]), "doc": torch.tensor([2, 3])}
    assert enn.batch_ids(model, inputs)["words"].tolist() == [1, 2, 3]
    batch = enn.SparseBatch(enn.table_specs(model), pull=lambda s, i: query.local.table.lookup(i))
    with batch.bind(model):
        (query(inputs["query"]).sum() + doc(inputs["doc"]).sum()).backward()
    grads = batch.gradients()["words"]
    assert grads.ids.tolist() == [1, 2, 3]
    assert grads.grads[:, 0].tolist() == [1.0, 2.0, 1.0]  # id 2 is used by both features
    shared = enn.Embedding(5, DIM, name="x")
    assert list(enn.table_specs(nn.Sequential(shared, shared))) == ["x"]


def test_no_grad_forward_records_nothing() -> None:
    emb = enn.Embedding(N, DIM, name="e")
    with torch.no_grad():
        emb(torch.tensor([1, 2]))
    assert emb.local.gradients() is None


# --- the trainer seam ---------------------------------------------------------------------


def _ps(model: nn.Module) -> dict[str, SparseTable]:
    """A stand-in for the parameter servers: one table per spec."""
    return {name: SparseTable(spec) for name, spec in enn.table_specs(model).items()}


def test_batch_ids_collects_each_tables_ids_before_forward() -> None:
    sparse, _ = _pair()
    x, _ = _batch(torch.Generator().manual_seed(3))
    ids = enn.batch_ids(sparse, x)
    assert set(ids) == {"user", "tag"}
    assert torch.equal(ids["user"], torch.unique(x["user"]))  # type: ignore[arg-type]
    assert torch.equal(ids["tag"], torch.unique(x["tags"][0]))  # type: ignore[index]
    assert enn.batch_ids(sparse, torch.zeros(3)) == {}
    with pytest.raises(ModelContractError, match="feature 'user'"):
        enn.batch_ids(sparse, {"tags": x["tags"]})


def test_supplied_rows_give_the_same_gradients_as_the_local_backend() -> None:
    sparse, _ = _pair()
    local = copy.deepcopy(sparse)
    servers = _ps(sparse)
    gen = torch.Generator().manual_seed(4)
    x, y = _batch(gen)

    # The trainer: ids before forward, one pull per table, bind, forward/backward, gradients.
    batch = enn.SparseBatch(enn.table_specs(sparse))
    for name, ids in enn.batch_ids(sparse, x).items():
        batch.supply(name, ids, servers[name].lookup(ids))
    with batch.bind(sparse):
        nn.functional.binary_cross_entropy_with_logits(sparse(x), y).backward()
    grads = batch.gradients()

    nn.functional.binary_cross_entropy_with_logits(local(x), y).backward()
    for name, module in enn.sparse_modules(local).items():
        expected = module.local.gradients()
        assert expected is not None
        assert torch.equal(grads[name].ids, expected.ids)
        assert torch.equal(grads[name].grads, expected.grads)
        assert grads[name].grads.dtype == torch.float32
        assert grads[name].grads.shape == (len(grads[name].ids), DIM)
    # Binding is undone: the model reads its local tables again.
    assert all(m._source is None for m in enn.sparse_modules(sparse).values())


def test_rows_not_supplied_are_pulled_on_demand_once_per_batch() -> None:
    emb = enn.Embedding(N, DIM, name="e")
    server = SparseTable(emb.spec)
    pulls: list[list[int]] = []

    def pull(spec: TableSpec, ids: Tensor) -> Tensor:
        pulls.append(ids.tolist())
        return server.lookup(ids)

    batch = enn.SparseBatch(enn.table_specs(emb), pull=pull)
    batch.prefetch({"e": torch.tensor([3, 1, 3])})
    with batch.bind(emb):
        out = emb(torch.tensor([1, 3, 5])).sum() + emb(torch.tensor([5, 5])).sum()
        out.backward()
    assert pulls == [[1, 3], [5]]
    grad = batch.gradients()["e"]
    assert grad.ids.tolist() == [1, 3, 5]
    assert grad.grads[:, 0].tolist() == [1.0, 1.0, 3.0]  # 5 was used three times


def test_a_batch_without_pull_refuses_ids_not_supplied() -> None:
    emb = enn.Embedding(N, DIM, name="e")
    batch = enn.SparseBatch(enn.table_specs(emb))
    batch.supply("e", torch.tensor([1]), torch.zeros(1, DIM))
    with batch.bind(emb), pytest.raises(SparseTableError, match="not supplied"):
        emb(torch.tensor([1, 2]))
    with pytest.raises(SparseTableError, match="must be float32"):
        batch.supply("e", torch.tensor([1]), torch.zeros(2, DIM))
    with pytest.raises(SparseTableError, match="no sparse table"):
        batch.supply("nope", torch.tensor([1]), torch.zeros(1, DIM))


def test_pushing_batch_gradients_to_tables_equals_local_training() -> None:
    sparse, _ = _pair()
    local = copy.deepcopy(sparse)
    servers = _ps(sparse)
    local_opt = enn.SparseOptimizer(local, lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        x, y = _batch(gen)
        batch = enn.SparseBatch(
            enn.table_specs(sparse), pull=lambda s, i: servers[s.name].lookup(i)
        )
        with batch.bind(sparse):
            nn.functional.binary_cross_entropy_with_logits(sparse(x), y).backward()
        for name, g in batch.gradients().items():
            servers[name].apply(g.ids, g.grads, 0.1)
        sparse.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(local(x), y).backward()
        local_opt.step()
        local.zero_grad()
    for name, module in enn.sparse_modules(local).items():
        assert torch.equal(
            servers[name].lookup(np.arange(N)), module.local.table.lookup(np.arange(N))
        )


def test_merged_gradients_of_two_batches_equal_one_batch_of_both() -> None:
    emb = enn.Embedding(N, DIM, name="e")
    server = SparseTable(emb.spec)
    pull = lambda s, i: server.lookup(i)  # noqa: E731
    parts = []
    for ids in (torch.tensor([1, 2]), torch.tensor([2, 3])):
        batch = enn.SparseBatch(enn.table_specs(emb), pull=pull)
        with batch.bind(emb):
            emb(ids).sum().backward()
        parts.append(batch.gradients())
    merged = enn.merge_gradients(parts, scale=0.5)["e"]
    assert merged.ids.tolist() == [1, 2, 3]
    assert merged.grads[:, 0].tolist() == [0.5, 1.0, 0.5]


def test_a_local_table_can_be_replaced_by_trained_rows() -> None:
    emb = enn.Embedding(N, DIM, name="e")
    trained = SparseTable(emb.spec)
    trained.apply(torch.tensor([4]), torch.ones(1, DIM), 1.0)
    emb.local.set_table(trained)
    assert torch.equal(emb(torch.tensor([4]))[0], trained.lookup(torch.tensor([4]))[0])
    with pytest.raises(SparseTableError, match="cannot use"):
        emb.local.set_table(SparseTable(TableSpec("other", DIM)))
