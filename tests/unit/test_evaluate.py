"""Tests of evaluation: accuracy and sample-weighted loss over a Parquet file."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elasticps.checkpoint import load_checkpoint, save_checkpoint
from elasticps.data.mnist import prepare_mnist
from elasticps.errors import ConfigError, DataError, ModelContractError
from elasticps.evaluate import evaluate
from elasticps.model_file import ModelSpec, load_model_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# outputs = [-x, x] for a scalar feature x, with the rigged weights below.
THRESHOLD_MODEL = """
import torch
import torch.nn.functional as F

COLUMNS = ("x", "y")

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 2)

    def forward(self, inputs):
        return self.linear(inputs)

def loss(outputs, targets):
    return F.cross_entropy(outputs, targets)

def batch_to_tensors(batch):
    x = torch.tensor(batch.column("x").to_pylist(), dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(batch.column("y").to_pylist(), dtype=torch.int64)
    return x, y
"""

RIGGED = {"linear.weight": torch.tensor([[-1.0], [1.0]]), "linear.bias": torch.zeros(2)}
XS = [-2.0, -1.0, 0.5, 3.0]


@pytest.fixture
def spec(tmp_path: Path) -> ModelSpec:
    path = tmp_path / "threshold.py"
    path.write_text(textwrap.dedent(THRESHOLD_MODEL))
    return load_model_file(path)


def write_data(path: Path, xs: list[float], ys: list[int]) -> Path:
    table = pa.table({"x": pa.array(xs, pa.float32()), "y": pa.array(ys, pa.int64())})
    pq.write_table(table, path, row_group_size=2)
    return path


def hand_loss(x: float, label: int) -> float:
    """Cross-entropy of logits [-x, x] for ``label``."""
    logits = [-x, x]
    return math.log(math.exp(logits[0]) + math.exp(logits[1])) - logits[label]


@pytest.mark.parametrize("batch_size", [1, 3, 4, 500])
def test_a_perfect_model_scores_accuracy_one_and_the_hand_computed_loss(
    spec: ModelSpec, tmp_path: Path, batch_size: int
) -> None:
    labels = [0, 0, 1, 1]
    data = write_data(tmp_path / "d.parquet", XS, labels)
    result = evaluate(spec, RIGGED, data, batch_size=batch_size)
    assert result["accuracy"] == 1.0
    assert result["samples"] == 4.0
    expected = sum(hand_loss(x, y) for x, y in zip(XS, labels, strict=True)) / 4
    assert result["loss"] == pytest.approx(expected, rel=1e-6)


def test_loss_is_weighted_by_samples_when_batches_differ_in_size(
    spec: ModelSpec, tmp_path: Path
) -> None:
    labels = [1, 0, 0, 1]  # first and third wrong
    data = write_data(tmp_path / "d.parquet", XS, labels)
    # Batches of 3 and 1 rows: an unweighted mean of batch means would differ.
    result = evaluate(spec, RIGGED, data, batch_size=3)
    assert result["accuracy"] == 0.5
    expected = sum(hand_loss(x, y) for x, y in zip(XS, labels, strict=True)) / 4
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    batch_means = [
        sum(hand_loss(x, y) for x, y in zip(XS[:3], labels[:3], strict=True)) / 3,
        hand_loss(XS[3], labels[3]),
    ]
    assert result["loss"] != pytest.approx(sum(batch_means) / 2, rel=1e-3)


def test_mismatched_parameters_are_one_line_model_contract_errors(
    spec: ModelSpec, tmp_path: Path
) -> None:
    data = write_data(tmp_path / "d.parquet", XS, [0, 0, 1, 1])
    wrong = {"linear.weight": torch.zeros(2, 3), "extra": torch.zeros(1)}
    with pytest.raises(ModelContractError) as info:
        evaluate(spec, wrong, data)
    message = str(info.value)
    assert "parameters do not match Model from threshold.py" in message
    assert "missing linear.bias" in message
    assert "unexpected extra" in message
    assert "shape mismatch linear.weight [2, 3] vs model [2, 1]" in message
    assert "\n" not in message


def test_missing_columns_are_reported_before_building_the_model(
    spec: ModelSpec, tmp_path: Path
) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": [1.0], "z": [0]}), path)
    with pytest.raises(DataError, match=r"lacks column\(s\) 'y'; it has: 'x', 'z'"):
        evaluate(spec, {}, path)


def test_empty_data_and_bad_batch_size_are_rejected(spec: ModelSpec, tmp_path: Path) -> None:
    empty = write_data(tmp_path / "empty.parquet", [], [])
    with pytest.raises(DataError, match="has no rows"):
        evaluate(spec, RIGGED, empty)
    with pytest.raises(ConfigError, match="batch_size"):
        evaluate(spec, RIGGED, empty, batch_size=0)
    with pytest.raises(DataError, match="data file not found"):
        evaluate(spec, RIGGED, tmp_path / "absent.parquet")


SHAPES_MODEL = """
import torch

COLUMNS = ("x", "y")

class Model(torch.nn.Module):
    def __init__(self, outputs=1):
        super().__init__()
        self.linear = torch.nn.Linear(1, outputs)

    def forward(self, inputs):
        return self.linear(inputs).squeeze(1)

def loss(outputs, targets):
    return ((outputs - targets.float()) ** 2).mean()

def batch_to_tensors(batch):
    x = torch.tensor(batch.column("x").to_pylist(), dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(batch.column("y").to_pylist(), dtype=torch.float32)
    return x, y
"""

IDENTITY = {"linear.weight": torch.tensor([[1.0]]), "linear.bias": torch.zeros(1)}


def shapes_spec(
    tmp_path: Path, extra: str = "", args: dict[str, object] | None = None
) -> ModelSpec:
    path = tmp_path / "shapes.py"
    path.write_text(textwrap.dedent(SHAPES_MODEL) + textwrap.dedent(extra))
    return load_model_file(path, model_args=args)


def test_a_regression_gets_its_loss_mse_and_mae(tmp_path: Path) -> None:
    targets = [0.0, 2.0, 1.0, 3.0]  # not all 0 or 1: a regression
    data = write_data(tmp_path / "d.parquet", XS, [0, 2, 1, 3])
    result = evaluate(shapes_spec(tmp_path), IDENTITY, data, batch_size=3)
    errors = [x - y for x, y in zip(XS, targets, strict=True)]
    mse = sum(e * e for e in errors) / 4
    assert list(result) == ["mse", "mae", "loss", "samples"]
    assert result["mse"] == pytest.approx(mse, rel=1e-6)
    assert result["loss"] == pytest.approx(mse, rel=1e-6)
    assert result["mae"] == pytest.approx(sum(abs(e) for e in errors) / 4, rel=1e-6)


def test_one_logit_with_zero_one_targets_gets_accuracy_and_auc(tmp_path: Path) -> None:
    # Logits x: positive means class 1; the third row (0.5, target 0) is wrong.
    xs, labels = [-2.0, -1.0, 0.5, 3.0, 2.0], [0, 0, 0, 1, 1]
    table = pa.table({"x": pa.array(xs, pa.float32()), "y": pa.array(labels, pa.int64())})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    result = evaluate(shapes_spec(tmp_path), IDENTITY, tmp_path / "d.parquet", batch_size=2)
    assert list(result) == ["accuracy", "auc", "loss", "samples"]
    assert result["accuracy"] == pytest.approx(0.8)
    assert result["auc"] == 1.0  # every positive's logit is above every negative's


def test_shapes_it_cannot_judge_get_the_loss_alone(tmp_path: Path) -> None:
    extra = """
    def batch_to_tensors(batch):
        x = torch.tensor(batch.column("x").to_pylist(), dtype=torch.float32).unsqueeze(1)
        return x, torch.zeros(1)
    def loss(outputs, targets):
        return outputs.mean() * 0 + targets.sum()
    """
    data = write_data(tmp_path / "d.parquet", XS, [0, 0, 1, 1])
    result = evaluate(shapes_spec(tmp_path, extra), IDENTITY, data)
    assert list(result) == ["loss", "samples"]


def test_the_model_files_own_metrics_are_reported_and_a_broken_one_is_left_out(
    tmp_path: Path,
) -> None:
    extra = """
    def metrics():
        from torchmetrics.regression import MeanSquaredError, R2Score

        class Broken:
            def update(self, preds, target):
                raise RuntimeError("no")
            def compute(self):
                return 0.0

        return {"r2": R2Score(), "rmse": MeanSquaredError(squared=False), "broken": Broken()}
    """
    data = write_data(tmp_path / "d.parquet", XS, [0, 2, 1, 3])
    result = evaluate(shapes_spec(tmp_path, extra), IDENTITY, data)
    assert list(result) == ["mse", "mae", "r2", "rmse", "loss", "samples"]
    assert result["rmse"] == pytest.approx(math.sqrt(result["mse"]), rel=1e-5)


def test_model_args_build_the_model_they_name(tmp_path: Path) -> None:
    spec = shapes_spec(tmp_path, args={"outputs": 2})
    assert spec.model_args == {"outputs": 2}
    assert spec.build().state_dict()["linear.weight"].shape == (2, 1)
    with pytest.raises(ModelContractError, match=r"cannot construct Model\(\*\*\{'width'"):
        shapes_spec(tmp_path, args={"width": 3}).build()


def test_example_checkpoint_evaluates_on_converted_mnist(tmp_path: Path) -> None:
    _, test = prepare_mnist(tmp_path / "mnist")
    spec = load_model_file(EXAMPLES / "mnist_mlp.py")
    save_checkpoint(tmp_path / "ckpt", spec.instantiate(0).state_dict(), {"model_version": 0})
    tensors, _ = load_checkpoint(tmp_path / "ckpt")
    result = evaluate(spec, tensors, test, batch_size=300)
    assert result["samples"] == 1000.0
    assert 0.0 <= result["accuracy"] <= 0.3  # untrained: near chance (0.1)
    assert result["loss"] == pytest.approx(math.log(10), abs=0.3)


def test_default_metrics_equal_torchmetrics_on_random_batches() -> None:
    """Accuracy, MSE and MAE (computed without importing torchmetrics) against
    torchmetrics' MulticlassAccuracy (micro), BinaryAccuracy, MeanSquaredError and
    MeanAbsoluteError, over several batches each, bit for bit."""
    from torchmetrics.classification import BinaryAccuracy, MulticlassAccuracy
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError

    from elasticps.evaluate import _BinaryAccuracy, _MeanError, _MulticlassAccuracy

    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        classes = 2 + trial % 5
        ours_mc, theirs_mc = (
            _MulticlassAccuracy(classes),
            MulticlassAccuracy(classes, average="micro", sync_on_compute=False),
        )
        ours_b, theirs_b = _BinaryAccuracy(), BinaryAccuracy(sync_on_compute=False)
        ours_mse, theirs_mse = _MeanError(squared=True), MeanSquaredError(sync_on_compute=False)
        ours_mae, theirs_mae = _MeanError(squared=False), MeanAbsoluteError(sync_on_compute=False)
        for _ in range(3):
            rows = int(torch.randint(1, 40, (), generator=gen))
            logits = torch.randn(rows, classes, generator=gen)
            labels = torch.randint(0, classes, (rows,), generator=gen)
            ours_mc.update(logits, labels)
            theirs_mc.update(logits, labels)
            scores = torch.randn(rows, generator=gen) * 3  # logits: outside [0, 1]
            zero_one = torch.randint(0, 2, (rows,), generator=gen)
            ours_b.update(scores, zero_one)
            theirs_b.update(scores, zero_one)
            preds, targets = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
            for ours, theirs in ((ours_mse, theirs_mse), (ours_mae, theirs_mae)):
                ours.update(preds, targets)
                theirs.update(preds, targets)
        for ours, theirs in (
            (ours_mc, theirs_mc), (ours_b, theirs_b), (ours_mse, theirs_mse), (ours_mae, theirs_mae)
        ):  # fmt: skip
            assert torch.equal(ours.compute().float(), theirs.compute().float()), trial
