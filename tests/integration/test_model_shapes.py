"""Whole jobs of models of common shapes: tied weights, structured outputs, lazy modules.

Each model trains a small synthetic sequence classification (8 tokens of a
50-word vocabulary; the label says whether more than 4 tokens are below 25)
with 2 trainers and 2 parameter servers through ``elasticps train``, in sync
and in async mode. Every job must end with exit 0 and a result line with its
loss, and both ``elasticps evaluate`` and :func:`elasticps.infer`, from
``model.safetensors`` alone, must reproduce that loss.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import elasticps
from elasticps import parameters
from elasticps.evaluate import load_parameters
from elasticps.model_file import load_model_file
from elasticps.testing import run_elasticps, run_train
from elasticps.testing.audit import check_run, write_dataset

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JOB_TIMEOUT_S = 150.0
TEST_ROWS = 300  # one evaluation batch (elasticps evaluate reads 500 rows at a time)

COMMON = """
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

COLUMNS = ("tokens", "label")


def _tokens(batch):
    t = batch.column("tokens").combine_chunks().flatten().to_numpy()
    t = torch.from_numpy(t.reshape(batch.num_rows, -1).astype(np.int64))
    return t, torch.from_numpy(batch.column("label").to_numpy().astype(np.int64))
"""

# An embedding tied to an output projection, as GPT-2 and T5 tie theirs, and
# a BatchNorm reached through two modules (its parameters and running
# statistics are shared).
TIED = """
class Model(nn.Module):
    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.blocks = nn.ModuleList([self.norm])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.cls = nn.Linear(vocab, 2)

    def forward(self, tokens):
        h = self.blocks[0](self.emb(tokens).mean(1))
        return self.cls(self.head(h))


def loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


batch_to_tensors = _tokens
"""

BODY = """
class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 2)

    def hidden(self, tokens):
        return self.emb(tokens).mean(1)
"""

# Hugging Face style: a dict, with a metric of the file's own that reads it.
DICT_OUTPUT = (
    BODY
    + """
class Model(Body):
    def forward(self, tokens):
        h = self.hidden(tokens)
        return {"logits": self.out(h), "hidden": h}


def loss(outputs, targets):
    return F.cross_entropy(outputs["logits"], targets)


batch_to_tensors = _tokens


class HiddenNorm:
    def __init__(self):
        self.total, self.rows = 0.0, 0

    def update(self, outputs, targets):
        self.total += float(outputs["hidden"].norm(dim=1).sum())
        self.rows += len(targets)

    def compute(self):
        return self.total / self.rows


def metrics():
    return {"hidden_norm": HiddenNorm()}
"""
)

TUPLE_OUTPUT = (
    BODY
    + """
class Model(Body):
    def forward(self, tokens):
        h = self.hidden(tokens)
        return self.out(h), h.pow(2).mean()


def loss(outputs, targets):
    logits, aux = outputs
    return F.cross_entropy(logits, targets) + 0.01 * aux


batch_to_tensors = _tokens
"""
)

DATACLASS_OUTPUT = (
    BODY
    + """
@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class Model(Body):
    def forward(self, tokens):
        h = self.hidden(tokens)
        return Output(logits=self.out(h), hidden=h)


def loss(outputs, targets):
    return F.cross_entropy(outputs.logits, targets)


batch_to_tensors = _tokens
"""
)

# batch_to_tensors returns a dict: forward is called with keyword arguments.
DICT_INPUTS = (
    BODY
    + """
class Model(Body):
    def forward(self, tokens, mask):
        e = self.emb(tokens) * mask.unsqueeze(2)
        return self.out(e.sum(1) / mask.sum(1, keepdim=True))


def loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


def batch_to_tensors(batch):
    tokens, labels = _tokens(batch)
    mask = (tokens != 0).to(torch.float32)
    mask[:, 0] = 1.0
    return {"tokens": tokens, "mask": mask}, labels
"""
)

# Sizes found by the first mini-batch: lazy parameters and lazy buffers.
LAZY = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.net = nn.Sequential(
            nn.LazyLinear(16), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Dropout(0.1), nn.LazyLinear(2)
        )

    def forward(self, tokens):
        return self.net(self.emb(tokens).flatten(1))


def loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


batch_to_tensors = _tokens
"""

# Trains; then its loss and its own metric both fail on the test data.
FAILS_TO_EVALUATE = (
    BODY
    + """
class Model(Body):
    def forward(self, tokens):
        return self.out(self.hidden(tokens))


def loss(outputs, targets):
    if not torch.is_grad_enabled():
        raise KeyError("logits")
    return F.cross_entropy(outputs, targets)


batch_to_tensors = _tokens


class Broken:
    def update(self, outputs, targets):
        raise ValueError("not this metric")

    def compute(self):
        return 0.0


def metrics():
    return {"broken": Broken()}
"""
)

MODELS = {
    "tied": TIED,
    "dict-output": DICT_OUTPUT,
    "tuple-output": TUPLE_OUTPUT,
    "dataclass-output": DATACLASS_OUTPUT,
    "dict-inputs": DICT_INPUTS,
    "lazy": LAZY,
}


def write_table(path: Path, tokens: np.ndarray) -> None:
    labels = ((tokens < 25).sum(1) > 4).astype(np.int64)
    column = pa.array(list(tokens.astype(np.int32)), pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": column, "label": labels}), path, row_group_size=100)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sequences")
    rng = np.random.default_rng(0)
    write_table(root / "train.parquet", rng.integers(0, 50, size=(1200, 8)))
    write_table(root / "test.parquet", rng.integers(0, 50, size=(TEST_ROWS, 8)))
    return root


def train(
    tmp_path: Path, source: str, data: Path, mode: str, *extra: str
) -> tuple[dict[str, object], Path, Path]:
    """Run a 2-trainer, 2-PS job; return its result line, output and model file."""
    model_file = tmp_path / "model.py"
    model_file.write_text(textwrap.dedent(COMMON + source))
    output = tmp_path / "out"
    line, _ = run_train(
        [
            "--model", model_file, "--data", data, "--output", output, "--trainers", "2",
            "--ps", "2", "--mode", mode, "--epochs", "3", "--batch-size", "50",
            "--records-per-task", "200", "--lease-ttl-s", "2", "--optimizer", "adam",
            "--lr", "0.01", *extra,
        ],
        pids_file=output / "pids.json",
        timeout_s=JOB_TIMEOUT_S,
    )  # fmt: skip
    return line, output, model_file


def evaluate_again(tmp_path: Path, model_file: Path, output: Path, data: Path) -> dict[str, float]:
    done = run_elasticps(
        ["evaluate", "--model", model_file, "--output", output, "--data", data / "test.parquet"],
        timeout_s=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def infer_loss(model_file: Path, output: Path, data: Path) -> float:
    """The test loss of ``infer()`` with ``model.safetensors``, in one batch."""
    spec = load_model_file(model_file)
    model = spec.build()
    saved = parameters.load(output / "model.safetensors")
    inputs, targets = spec.batch_to_tensors(pq.read_table(data / "test.parquet"))
    outputs = elasticps.infer(model, saved, inputs)
    return float(spec.loss(outputs, targets))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("shape", list(MODELS))
def test_model_trains_exits_zero_and_its_loss_is_reproduced_from_the_saved_model(
    tmp_path: Path, data: Path, shape: str, mode: str
) -> None:
    line, output, model_file = train(tmp_path, MODELS[shape], data, mode)

    loss = float(str(line["loss"]))
    assert math.isfinite(loss) and line["test_samples"] == TEST_ROWS, line
    assert line["exactly_once"] is True
    assert "metrics_failed" not in line, line
    # Class scores under every shape: the tensor, a tuple's first element,
    # the dict's and the dataclass's logits.
    assert 0.0 <= float(str(line["accuracy"])) <= 1.0, line
    if shape == "dict-output":
        assert float(str(line["hidden_norm"])) > 0.0, line  # the file's metric saw the dict
    again = evaluate_again(tmp_path, model_file, output, data)
    assert again["loss"] == line["loss"]
    assert again["accuracy"] == line["accuracy"]
    assert infer_loss(model_file, output, data) == pytest.approx(loss, rel=1e-6, abs=1e-7)


def test_tied_weights_are_stored_once_and_restored_as_one_parameter(
    tmp_path: Path, data: Path
) -> None:
    line, output, model_file = train(tmp_path, TIED, data, "sync")

    saved = load_file(str(output / "model.safetensors"))
    # One tensor for each shared one, under its first name.
    assert "emb.weight" in saved and "head.weight" not in saved
    assert "norm.running_mean" in saved and "blocks.0.running_mean" not in saved
    assert "norm.weight" in saved and "blocks.0.weight" not in saved
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["shared"] == {
        "blocks.0.weight": "norm.weight",
        "blocks.0.bias": "norm.bias",
        "blocks.0.running_mean": "norm.running_mean",
        "blocks.0.running_var": "norm.running_var",
        "blocks.0.num_batches_tracked": "norm.num_batches_tracked",
        "head.weight": "emb.weight",
    }
    assert int(saved["norm.num_batches_tracked"]) > 0  # the shared buffer trained once

    spec = load_model_file(model_file)
    # PyTorch's load_state_dict: the file fills the one shared tensor; the
    # names it reports missing are aliases the manifest lists (BatchNorm
    # does not report its num_batches_tracked).
    model = spec.build()
    result = model.load_state_dict(saved, strict=False)
    assert "head.weight" in result.missing_keys
    assert set(result.missing_keys) <= set(manifest["shared"]), result.missing_keys
    assert not result.unexpected_keys
    assert model.head.weight is model.emb.weight
    assert model.blocks[0].running_mean is model.norm.running_mean
    assert torch.equal(model.head.weight, saved["emb.weight"])
    # elasticps' ParameterSet, and the loader of evaluate and --eval-each-pass.
    for load in (
        lambda m: parameters.load(output / "model.safetensors").copy_into(m),
        lambda m: load_parameters(m, saved, what="the tied model"),
    ):
        model = spec.build()
        load(model)
        assert model.head.weight is model.emb.weight
        assert model.blocks[0].running_var is model.norm.running_var
        assert torch.equal(model.head.weight, saved["emb.weight"])
        assert torch.equal(model.blocks[0].running_var, saved["norm.running_var"])
    assert float(str(line["loss"])) == evaluate_again(tmp_path, model_file, output, data)["loss"]


def test_a_model_whose_loss_and_metric_fail_on_the_test_data_exits_zero_and_says_why(
    tmp_path: Path, data: Path
) -> None:
    line, output, _ = train(tmp_path, FAILS_TO_EVALUATE, data, "sync")

    assert (output / "model.safetensors").is_file()
    failed = line["metrics_failed"]
    assert isinstance(failed, dict) and set(failed) == {"loss"}, line
    assert "in loss: KeyError: 'logits'" in failed["loss"], failed
    assert "loss" not in line and "test_samples" not in line
    record = json.loads((output / "run.json").read_text())
    assert record["metrics_failed"] == failed
    assert record["evaluation"] is None


def test_a_metric_of_the_model_file_that_fails_is_named_with_its_reason(
    tmp_path: Path, data: Path
) -> None:
    source = FAILS_TO_EVALUATE.replace("if not torch.is_grad_enabled():", "if False:")
    line, output, _ = train(tmp_path, source, data, "async")

    assert math.isfinite(float(str(line["loss"]))) and "accuracy" in line, line
    failed = line["metrics_failed"]
    assert isinstance(failed, dict) and set(failed) == {"broken"}, line
    assert failed["broken"].startswith("metrics() of model file model.py: update raised")
    assert "ValueError: not this metric" in failed["broken"]
    assert json.loads((output / "run.json").read_text())["metrics_failed"] == failed


AUDIT_RECORDS = 2000


def test_a_tied_checkpoint_resumes_onto_three_servers_and_every_record_counts_once(
    tmp_path: Path,
) -> None:
    """The audit's counters reached through two names (``counter``, ``tied.counter``).

    Two passes on 2 PS, then ``--resume`` of that job's checkpoint onto 3 PS
    for two more, with a PS killed: every counter must be exactly 4.
    """
    audit = tmp_path / "audit"
    write_dataset(audit, AUDIT_RECORDS)
    common = [
        "--model", audit / "audit_model.py", "--model-class", "SharedModel",
        "--model-args", json.dumps({"records": AUDIT_RECORDS}), "--data", audit,
        "--optimizer", "sgd", "--lr", "1", "--sync-reduction", "sum", "--push-every", "1",
        "--big-array-bound", "500", "--trainers", "2", "--epochs", "2",
        "--records-per-task", "200", "--lease-ttl-s", "2", "--checkpoint-every-s", "0.5",
    ]  # fmt: skip
    first = tmp_path / "first"
    run_train(
        [*common, "--output", first, "--ps", "2", "--mode", "async"],
        pids_file=first / "pids.json",
        timeout_s=JOB_TIMEOUT_S,
    )
    assert check_run(first).exactly_once
    assert "tied.counter" not in load_file(str(first / "model.safetensors"))

    second = tmp_path / "second"
    line, _ = run_train(
        [
            *common, "--output", second, "--ps", "3", "--mode", "sync",
            "--resume", first / "snapshot", "--chaos", "kill:ps@40%",
        ],
        pids_file=second / "pids.json",
        timeout_s=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert line["exactly_once"] is True
    result = check_run(second, passes=4)
    assert result.exactly_once, result.as_dict()
    record = json.loads((second / "run.json").read_text())
    assert any(count for name, count in record["restarts"].items() if name.startswith("ps-"))
    assert json.loads((second / "manifest.json").read_text())["shared"] == {
        "tied.counter": "counter"
    }


UNUSED_LAZY = LAZY.replace(
    "nn.Dropout(0.1), nn.LazyLinear(2)\n        )",
    "nn.Dropout(0.1), nn.LazyLinear(2)\n        )\n        self.unused = nn.LazyLinear(3)",
)


def test_a_lazy_model_that_cannot_be_materialized_is_refused_before_launch(
    tmp_path: Path, data: Path
) -> None:
    assert "self.unused" in UNUSED_LAZY
    model_file = tmp_path / "model.py"
    model_file.write_text(textwrap.dedent(COMMON + UNUSED_LAZY))
    output = tmp_path / "out"
    done = run_elasticps(
        ["train", "--model", model_file, "--data", data, "--output", output, "--no-progress"],
        timeout_s=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("elasticps: error: Model from model.py: a forward pass of the first "), (
        last
    )
    assert "left parameters uninitialized (unused.weight, unused.bias)" in last
    assert not (output / "pids.json").exists()
