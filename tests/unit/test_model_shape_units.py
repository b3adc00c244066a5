"""Tied weights, structured outputs, dict inputs and lazy modules, without servers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from torch import Tensor, nn

import elasticps
from elasticps.errors import ModelContractError
from elasticps.evaluate import MetricSet, evaluate_batches, load_parameters
from elasticps.model_file import (
    LazyModelError,
    ModelSpec,
    call_model,
    check_model,
    lazy_names,
    output_tensor,
)
from elasticps.parameters import ParameterSet, create
from elasticps.sharing import canonical_names, state_aliases, with_aliases, without_aliases

pytestmark = pytest.mark.timeout(60)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.norm = nn.BatchNorm1d(4)
        self.again = nn.ModuleList([self.norm])
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        out: Tensor = self.head(self.again[0](self.emb(tokens).mean(1)))
        return out


def test_aliases_name_every_later_name_of_a_shared_tensor() -> None:
    model = Tied()
    assert state_aliases(model) == {
        "again.0.weight": "norm.weight",
        "again.0.bias": "norm.bias",
        "again.0.running_mean": "norm.running_mean",
        "again.0.running_var": "norm.running_var",
        "again.0.num_batches_tracked": "norm.num_batches_tracked",
        "head.weight": "emb.weight",
    }
    assert canonical_names(model) == [
        "emb.weight",
        "norm.weight",
        "norm.bias",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    ]
    assert state_aliases(nn.Linear(2, 2)) == {}


def test_with_and_without_aliases_round_trip() -> None:
    t = torch.ones(2)
    aliases = {"b": "a"}
    assert with_aliases({"a": t}, aliases)["b"] is t
    assert with_aliases({"a": t, "b": torch.zeros(2)}, aliases)["b"].sum() == 0  # kept
    assert without_aliases({"a": t, "b": t}, aliases) == {"a": t}


def test_loading_a_file_of_first_names_keeps_the_tied_weights_one_parameter() -> None:
    trained = Tied()
    saved = without_aliases(trained.state_dict(), state_aliases(trained))
    model = Tied()
    load_parameters(model, saved, what="Tied")
    assert model.head.weight is model.emb.weight
    assert model.again[0].running_var is model.norm.running_var
    assert torch.equal(model.head.weight, trained.emb.weight)
    # A full state_dict (both names) loads too; the first name's value wins.
    full = dict(trained.state_dict())
    full["head.weight"] = torch.zeros_like(full["head.weight"])
    load_parameters(model, full, what="Tied")
    assert torch.equal(model.head.weight, trained.emb.weight)
    with pytest.raises(ModelContractError, match=r"missing emb\.weight"):
        load_parameters(Tied(), {k: v for k, v in saved.items() if k != "emb.weight"}, what="T")


def test_a_parameter_set_and_infer_use_the_first_name_of_a_tied_weight() -> None:
    trained = Tied()
    params = create(trained)
    assert "head.weight" not in params
    model = Tied()
    params.copy_into(model)
    assert model.head.weight is model.emb.weight
    tokens = torch.tensor([[1, 2], [3, 4]])
    trained.eval()
    assert torch.equal(elasticps.infer(Tied(), params, tokens), trained(tokens))  # type: ignore[arg-type]


class Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        out: Tensor = self.lin(x)
        return out if scale is None else out * scale


class Whole(nn.Module):
    def forward(self, features: dict[str, Tensor]) -> Tensor:
        return features["a"] + features["b"]


class AnyKeywords(nn.Module):
    def forward(self, **kwargs: Tensor) -> Tensor:
        return sum(kwargs.values(), torch.zeros(()))


def test_a_dict_of_forward_parameters_is_passed_as_keyword_arguments() -> None:
    x = torch.ones(2, 3)
    model = Keywords()
    assert torch.equal(call_model(model, {"x": x}), model(x))  # type: ignore[arg-type]
    assert torch.equal(call_model(model, {"x": x, "scale": torch.tensor(2.0)}), model(x) * 2)  # type: ignore[arg-type]
    ones = torch.ones(2)
    assert torch.equal(call_model(AnyKeywords(), {"u": ones, "v": ones}), ones * 2)  # type: ignore[arg-type]


def test_a_dict_that_forward_takes_whole_is_one_argument() -> None:
    features = {"a": torch.ones(2), "b": torch.ones(2)}
    assert torch.equal(call_model(Whole(), features), torch.full((2,), 2.0))  # type: ignore[arg-type]
    # A key forward does not take, or a missing required one: one argument.
    with pytest.raises(TypeError):
        call_model(Keywords(), {"y": torch.ones(2, 3)})
    x = torch.ones(4, 3)
    model = Keywords()
    assert torch.equal(call_model(model, x), model(x))  # type: ignore[arg-type]


@dataclasses.dataclass
class Output:
    logits: Tensor
    hidden: Tensor


def test_the_default_metrics_read_the_tensor_of_structured_outputs() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    other = torch.zeros(2)
    assert output_tensor(logits) is logits
    assert output_tensor((logits, other)) is logits
    assert output_tensor([logits]) is logits
    assert output_tensor({"logits": logits, "hidden": other}) is logits
    assert output_tensor(Output(logits, other)) is logits
    assert output_tensor({"scores": logits}) is None
    assert output_tensor(()) is None
    assert output_tensor(("text", logits)) is None
    targets = torch.tensor([0, 0])
    for outputs in (logits, (logits, other), {"logits": logits}, Output(logits, other)):
        scores = MetricSet()
        scores.update(outputs, targets)
        assert scores.compute() == {"accuracy": 0.5}, outputs
        assert scores.failed == {}


def test_outputs_without_a_tensor_get_the_files_metrics_only_with_the_outputs_as_returned() -> None:
    seen: list[object] = []

    class Mine:
        def update(self, outputs: object, targets: Tensor) -> None:
            seen.append(outputs)

        def compute(self) -> float:
            return 1.0

    scores = MetricSet({"mine": Mine()})
    outputs = {"scores": torch.zeros(2, 2)}
    scores.update(outputs, torch.tensor([0, 1]))
    assert scores.compute() == {"mine": 1.0}
    assert seen == [outputs]


def test_a_metric_that_fails_is_named_with_its_reason_and_whose_it_is() -> None:
    class Broken:
        def update(self, outputs: object, targets: Tensor) -> None:
            raise ValueError("bad shape")

        def compute(self) -> float:
            return 0.0

    class NoCompute:
        def update(self, outputs: object, targets: Tensor) -> None:
            pass

        def compute(self) -> float:
            raise RuntimeError("nothing")

    model = nn.Linear(2, 2)
    failed: dict[str, str] = {}
    result = evaluate_batches(
        model,
        nn.functional.cross_entropy,
        [(torch.ones(3, 2), torch.tensor([0, 1, 0]))],
        metrics={"broken": Broken(), "late": NoCompute()},
        owner="metrics() of model file m.py",
        failed=failed,
    )
    assert "accuracy" in result and "loss" in result and "broken" not in result
    assert failed == {
        "broken": "metrics() of model file m.py: update raised ValueError: bad shape",
        "late": "metrics() of model file m.py: compute raised RuntimeError: nothing",
    }


class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d(), nn.Dropout(0.5))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


def lazy_spec(example: pa.Table | None, build: type[nn.Module] = Lazy) -> ModelSpec:
    def batch_to_tensors(batch: pa.Table) -> tuple[Tensor, Tensor]:
        x = torch.tensor(batch.column("x").to_pylist(), dtype=torch.float32)
        return x, torch.zeros(len(x), dtype=torch.int64)

    spec = ModelSpec(
        path=Path("/models/lazy.py"),
        model_class=build.__name__,
        columns=("x",),
        build=build,
        loss=lambda outputs, targets: outputs.sum(),
        batch_to_tensors=batch_to_tensors,
    )
    return spec if example is None else spec.with_example(lambda: example)


EXAMPLE = pa.table({"x": [[float(i), 1.0, 2.0] for i in range(5)]})


def test_a_lazy_model_is_materialized_with_the_first_mini_batch_the_same_everywhere() -> None:
    assert lazy_names(Lazy()) == [
        "net.0.weight",
        "net.0.bias",
        "net.1.weight",
        "net.1.bias",
        "net.1.running_mean",
        "net.1.running_var",
    ]
    spec = lazy_spec(EXAMPLE)
    before = torch.random.get_rng_state()
    a, b = spec.instantiate(7), spec.instantiate(7)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG untouched
    assert lazy_names(a) == [] and a.net[0].weight.shape == (4, 3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    # Eval mode: the pass moved no running statistic.
    assert torch.equal(a.net[1].running_mean, torch.zeros(4))
    assert int(a.net[1].num_batches_tracked) == 0
    assert a.training
    assert not torch.equal(spec.instantiate(8).net[0].weight, a.net[0].weight)


def test_a_lazy_model_without_a_mini_batch_or_that_fails_its_pass_is_one_line() -> None:
    with pytest.raises(LazyModelError, match=r"lazy \(uninitialized\) parameters \(net.0.weight"):
        lazy_spec(None).instantiate(0)
    ragged = pa.table({"x": [[1.0, 2.0, 3.0], [1.0]]})
    with pytest.raises(
        ModelContractError,
        match=r"cannot materialize the lazy parameters of Lazy from lazy.py with the first "
        r"training mini-batch: model file lazy.py, in batch_to_tensors: ValueError",
    ):
        lazy_spec(ragged).instantiate(0)

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 1)
            self.unused = nn.LazyLinear(2)

        def forward(self, x: Tensor) -> Tensor:
            out: Tensor = self.used(x)
            return out

    with pytest.raises(ModelContractError, match=r"left parameters uninitialized \(unused.weight"):
        lazy_spec(EXAMPLE, Unused).instantiate(0)
    with pytest.raises(ModelContractError, match="run one forward pass"):
        check_model(Lazy())


def test_a_lazy_model_built_afresh_takes_the_saved_shapes() -> None:
    trained = lazy_spec(EXAMPLE).instantiate(0)
    saved = dict(trained.state_dict())
    model = Lazy()
    load_parameters(model, saved, what="Lazy")
    assert torch.equal(model.net[0].weight, trained.net[0].weight)
    params = ParameterSet(saved)
    fresh = Lazy()
    params.copy_into(fresh)
    assert torch.equal(fresh.net[1].running_var, trained.net[1].running_var)
    x = torch.ones(2, 3)
    trained.eval()
    assert torch.equal(elasticps.infer(Lazy(), params, x), trained(x))  # type: ignore[arg-type]


def test_the_python_api_materializes_a_lazy_model_with_its_first_mini_batch() -> None:
    def reader():  # type: ignore[no-untyped-def]
        for _ in range(3):
            yield torch.ones(4, 3), torch.zeros(4)

    model = Lazy()
    params = elasticps.train(
        model, lambda outputs, targets: outputs.pow(2).mean(), reader, cluster=None
    )
    assert params.shapes()["net.0.weight"] == (4, 3)
    assert lazy_names(model) == []  # materialized in place, as its first forward would


def test_evaluate_model_gives_a_lazy_model_the_shapes_of_its_parameters() -> None:
    trained = lazy_spec(EXAMPLE).instantiate(0)
    params = ParameterSet(dict(trained.state_dict()))

    def reader():  # type: ignore[no-untyped-def]
        yield torch.ones(4, 3), torch.zeros(4)

    def loss_fn(outputs: Tensor, targets: Tensor) -> Tensor:
        return outputs.pow(2).mean()

    expected = elasticps.evaluate_model(trained, params, reader, loss_fn)
    assert elasticps.evaluate_model(Lazy(), params, reader, loss_fn) == expected
    with pytest.raises(ModelContractError, match="lazy"):
        elasticps.evaluate_model(Lazy(), None, reader, loss_fn)
