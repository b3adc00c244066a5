"""Tests of the model-file contract and of the example model files."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from elasticps.data.mnist import prepare_mnist
from elasticps.data.parquet import RangeReader
from elasticps.errors import ModelContractError
from elasticps.model_file import ModelSpec, check_model, load_model_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

GOOD = """
import torch
import torch.nn.functional as F

COLUMNS = ("x", "y")

class Helper(torch.nn.Module):
    pass

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, inputs):
        return self.linear(inputs)

def loss(outputs, targets):
    return F.cross_entropy(outputs, targets)

def batch_to_tensors(batch):
    x = torch.tensor(batch.column("x").to_pylist(), dtype=torch.float32)
    y = torch.tensor(batch.column("y").to_pylist(), dtype=torch.int64)
    return x, y
"""


def write_model(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_conforming_file_loads_into_a_spec(tmp_path: Path) -> None:
    path = write_model(tmp_path, GOOD)
    spec = load_model_file(path)
    assert isinstance(spec, ModelSpec)
    assert spec.path == path.resolve()
    assert spec.model_class == "Model"
    assert spec.columns == ("x", "y")
    model = spec.build()
    outputs = model(torch.zeros(4, 3))
    assert outputs.shape == (4, 2)
    value = spec.loss(outputs, torch.zeros(4, dtype=torch.int64))
    assert value.shape == ()


def test_model_class_can_be_chosen(tmp_path: Path) -> None:
    spec = load_model_file(write_model(tmp_path, GOOD), model_class="Helper")
    assert spec.model_class == "Helper"
    assert type(spec.build()).__name__ == "Helper"


def test_instantiate_gives_identical_parameters_for_equal_seeds(tmp_path: Path) -> None:
    spec = load_model_file(write_model(tmp_path, GOOD))
    first, second, other = spec.instantiate(7), spec.instantiate(7), spec.instantiate(8)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name])
    assert not torch.equal(first.state_dict()["linear.weight"], other.state_dict()["linear.weight"])


def test_instantiate_leaves_the_global_rng_untouched(tmp_path: Path) -> None:
    spec = load_model_file(write_model(tmp_path, GOOD))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    spec.instantiate(0)
    assert torch.equal(torch.rand(3), expected)


def test_each_load_gets_its_own_module(tmp_path: Path) -> None:
    first = write_model(tmp_path, GOOD, "a.py")
    second = write_model(tmp_path, GOOD.replace("Linear(3, 2)", "Linear(5, 2)"), "b.py")
    before = set(sys.modules)
    spec_a, spec_b = load_model_file(first), load_model_file(second)
    assert spec_a.build().state_dict()["linear.weight"].shape == (2, 3)
    assert spec_b.build().state_dict()["linear.weight"].shape == (2, 5)
    added = set(sys.modules) - before
    assert len(added) == 2
    assert all(name.startswith("_elasticps_model_file_") for name in added)


@pytest.mark.parametrize(
    ("source", "model_class", "pattern"),
    [
        (
            GOOD + "\nundefined_name + 1\n",
            "Model",
            r"^error in model file .*model\.py, line \d+: NameError: "
            r"name 'undefined_name' is not defined$",
        ),
        (
            GOOD + "\ndef broken(:\n",
            "Model",
            r"^error in model file .*model\.py, line \d+: SyntaxError: ",
        ),
        (
            "import no_such_module_for_elasticps\n",
            "Model",
            r"error in model file .*: ModuleNotFoundError: No module named "
            r"'no_such_module_for_elasticps'",
        ),
        (
            GOOD,
            "Net",
            r"has no class 'Net'; torch.nn.Module subclasses it defines: Helper, Model",
        ),
        (
            # Imported modules (Linear) are not listed as defined by the file.
            "import torch\nfrom torch.nn import Linear\nclass Mine(torch.nn.Module):\n    pass\n",
            "Model",
            r"has no class 'Model'; torch.nn.Module subclasses it defines: Mine \(choose one",
        ),
        (
            GOOD.replace("class Helper(torch.nn.Module):", "class Helper:"),
            "Helper",
            r"'Helper' in model file .*model\.py is not a torch.nn.Module subclass "
            r"\(it is a class\)",
        ),
        (
            GOOD + "\ndef Plain():\n    pass\n",
            "Plain",
            r"'Plain' in model file .* is not a torch.nn.Module subclass \(it is function\)",
        ),
        (
            GOOD.replace("def loss(", "def lossy("),
            "Model",
            r"model file .*model\.py does not define loss\(outputs, targets\) -> Tensor",
        ),
        (
            GOOD + "\nloss = 3\n",
            "Model",
            r"'loss' in model file .* is not callable \(it is int\)",
        ),
        (
            GOOD.replace("def batch_to_tensors(", "def to_tensors("),
            "Model",
            r"does not define batch_to_tensors\(batch\) -> \(inputs, targets\)",
        ),
        (
            GOOD.replace('COLUMNS = ("x", "y")', ""),
            "Model",
            r"does not define COLUMNS",
        ),
        (
            GOOD.replace('COLUMNS = ("x", "y")', 'COLUMNS = ["x", "y"]'),
            "Model",
            r"COLUMNS in model file .* must be a non-empty tuple of column names",
        ),
        (
            GOOD.replace('COLUMNS = ("x", "y")', 'COLUMNS = ("x", 2)'),
            "Model",
            r"COLUMNS .* must be a non-empty tuple",
        ),
        (
            GOOD.replace('COLUMNS = ("x", "y")', 'COLUMNS = "x"'),
            "Model",
            r"COLUMNS .* must be a non-empty tuple",
        ),
        (
            GOOD.replace('COLUMNS = ("x", "y")', "COLUMNS = ()"),
            "Model",
            r"COLUMNS .* must be a non-empty tuple",
        ),
        (
            GOOD.replace('COLUMNS = ("x", "y")', 'COLUMNS = ("x", "x")'),
            "Model",
            r"COLUMNS .* repeats a column",
        ),
    ],
)
def test_contract_violations_are_one_line_model_contract_errors(
    tmp_path: Path, source: str, model_class: str, pattern: str
) -> None:
    path = write_model(tmp_path, source)
    with pytest.raises(ModelContractError, match=pattern) as info:
        load_model_file(path, model_class)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_model_contract_error(tmp_path: Path) -> None:
    with pytest.raises(ModelContractError, match=r"model file not found: .*absent\.py"):
        load_model_file(tmp_path / "absent.py")
    with pytest.raises(ModelContractError, match="model file not found"):
        load_model_file(tmp_path)  # a directory


def test_file_without_any_module_lists_none(tmp_path: Path) -> None:
    path = write_model(tmp_path, "COLUMNS = ('x',)\n")
    with pytest.raises(ModelContractError, match=r"defines: \(none\)"):
        load_model_file(path)


def test_sys_exit_in_a_model_file_is_reported_not_raised(tmp_path: Path) -> None:
    path = write_model(tmp_path, "import sys\nsys.exit(3)\n")
    with pytest.raises(ModelContractError, match="SystemExit: 3"):
        load_model_file(path)


def test_constructor_failure_is_reported_when_building(tmp_path: Path) -> None:
    source = GOOD.replace("def __init__(self):", "def __init__(self, width):")
    spec = load_model_file(write_model(tmp_path, source))
    with pytest.raises(ModelContractError, match=r"cannot construct Model\(\) .*TypeError"):
        spec.instantiate(0)


def test_instantiate_rejects_non_float32_parameters(tmp_path: Path) -> None:
    source = GOOD.replace("torch.nn.Linear(3, 2)", "torch.nn.Linear(3, 2).double()")
    spec = load_model_file(write_model(tmp_path, source))
    with pytest.raises(
        ModelContractError, match=r"must be float32; found linear.weight \(float64\)"
    ):
        spec.instantiate(0)


def test_check_model_rejects_models_without_trainable_parameters() -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ModelContractError, match="no trainable parameters"):
        check_model(frozen)
    with pytest.raises(ModelContractError, match="no trainable parameters"):
        check_model(nn.ReLU())
    check_model(nn.Linear(2, 2))


# --- the examples ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_train(tmp_path_factory: pytest.TempPathFactory) -> Path:
    train, _ = prepare_mnist(tmp_path_factory.mktemp("mnist"), row_group_rows=16)
    return train


@pytest.mark.parametrize(
    ("example", "input_shape"),
    [("mnist_mlp.py", (40, 784)), ("mnist_cnn.py", (40, 1, 28, 28))],
)
def test_examples_follow_the_contract_and_run_on_converted_mnist(
    mnist_train: Path, example: str, input_shape: tuple[int, ...]
) -> None:
    spec = load_model_file(EXAMPLES / example)
    assert spec.columns == ("pixels", "label")
    model = spec.instantiate(0)
    with RangeReader() as reader:
        batch = reader.read_rows(mnist_train, 10, 50, spec.columns)  # spans 3 row groups
    inputs, targets = spec.batch_to_tensors(batch)
    assert inputs.dtype == torch.float32
    assert inputs.shape == input_shape
    assert targets.dtype == torch.int64
    assert targets.tolist() == batch["label"].to_pylist()
    outputs = model(inputs)
    assert outputs.shape == (40, 10)
    value = spec.loss(outputs, targets)
    assert value.shape == ()
    assert 1.0 < value.item() < 4.0  # near log(10) = 2.3 for an untrained model
    value.backward()


@pytest.mark.parametrize("example", ["mnist_mlp.py", "mnist_cnn.py"])
def test_example_batches_from_range_reads_match_the_full_table(
    mnist_train: Path, example: str
) -> None:
    spec = load_model_file(EXAMPLES / example)
    full_inputs, full_targets = spec.batch_to_tensors(pq.read_table(mnist_train))
    with RangeReader() as reader:
        inputs, targets = spec.batch_to_tensors(reader.read_rows(mnist_train, 37, 90))
    assert torch.equal(inputs, full_inputs[37:90])
    assert torch.equal(targets, full_targets[37:90])
    # Standardised with the MNIST mean/std: background pixels map to -0.1307 / 0.3081.
    assert float(full_inputs.min()) == pytest.approx(-0.1307 / 0.3081, abs=1e-6)
    assert abs(float(full_inputs.mean())) < 0.2


def test_a_metrics_name_that_is_not_callable_is_a_contract_error(tmp_path: Path) -> None:
    path = write_model(tmp_path, GOOD + "\nmetrics = 3\n")
    with pytest.raises(ModelContractError, match=r"'metrics' in model file .* is not callable"):
        load_model_file(path)
    assert load_model_file(write_model(tmp_path, GOOD, "plain.py")).metrics is None


@pytest.mark.parametrize("text", ["[1, 2]", "{hidden: 3}", "7"])
def test_model_args_must_be_a_json_object(text: str) -> None:
    from elasticps.config import parse_model_args
    from elasticps.errors import ConfigError

    assert parse_model_args("") == {}
    assert parse_model_args('{"hidden": 256}') == {"hidden": 256}
    with pytest.raises(ConfigError, match="--model-args must be a JSON object"):
        parse_model_args(text)
