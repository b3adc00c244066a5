"""Byte balance of the default (``balanced``) placement on real models' shapes.

In sync mode the most-loaded parameter server sets the step time, so every
shard should carry about the mean number of bytes: here at most 1.10x.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from elasticps.model_file import load_model_file
from elasticps.placement import BALANCE_TOLERANCE, ParamSpec, Placement, plan_placement
from elasticps.trainer.flat import bind_flat_buffers, param_specs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PS_COUNTS = (2, 3, 4, 8)
MAX_OVER_MEAN = 1.10

# torchvision's resnet18() parameters (11,689,512 elements), in model order.
RESNET18: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("conv1.weight", (64, 3, 7, 7)),
    ("bn1.weight", (64,)),
    ("bn1.bias", (64,)),
    ("layer1.0.conv1.weight", (64, 64, 3, 3)),
    ("layer1.0.bn1.weight", (64,)),
    ("layer1.0.bn1.bias", (64,)),
    ("layer1.0.conv2.weight", (64, 64, 3, 3)),
    ("layer1.0.bn2.weight", (64,)),
    ("layer1.0.bn2.bias", (64,)),
    ("layer1.1.conv1.weight", (64, 64, 3, 3)),
    ("layer1.1.bn1.weight", (64,)),
    ("layer1.1.bn1.bias", (64,)),
    ("layer1.1.conv2.weight", (64, 64, 3, 3)),
    ("layer1.1.bn2.weight", (64,)),
    ("layer1.1.bn2.bias", (64,)),
    ("layer2.0.conv1.weight", (128, 64, 3, 3)),
    ("layer2.0.bn1.weight", (128,)),
    ("layer2.0.bn1.bias", (128,)),
    ("layer2.0.conv2.weight", (128, 128, 3, 3)),
    ("layer2.0.bn2.weight", (128,)),
    ("layer2.0.bn2.bias", (128,)),
    ("layer2.0.downsample.0.weight", (128, 64, 1, 1)),
    ("layer2.0.downsample.1.weight", (128,)),
    ("layer2.0.downsample.1.bias", (128,)),
    ("layer2.1.conv1.weight", (128, 128, 3, 3)),
    ("layer2.1.bn1.weight", (128,)),
    ("layer2.1.bn1.bias", (128,)),
    ("layer2.1.conv2.weight", (128, 128, 3, 3)),
    ("layer2.1.bn2.weight", (128,)),
    ("layer2.1.bn2.bias", (128,)),
    ("layer3.0.conv1.weight", (256, 128, 3, 3)),
    ("layer3.0.bn1.weight", (256,)),
    ("layer3.0.bn1.bias", (256,)),
    ("layer3.0.conv2.weight", (256, 256, 3, 3)),
    ("layer3.0.bn2.weight", (256,)),
    ("layer3.0.bn2.bias", (256,)),
    ("layer3.0.downsample.0.weight", (256, 128, 1, 1)),
    ("layer3.0.downsample.1.weight", (256,)),
    ("layer3.0.downsample.1.bias", (256,)),
    ("layer3.1.conv1.weight", (256, 256, 3, 3)),
    ("layer3.1.bn1.weight", (256,)),
    ("layer3.1.bn1.bias", (256,)),
    ("layer3.1.conv2.weight", (256, 256, 3, 3)),
    ("layer3.1.bn2.weight", (256,)),
    ("layer3.1.bn2.bias", (256,)),
    ("layer4.0.conv1.weight", (512, 256, 3, 3)),
    ("layer4.0.bn1.weight", (512,)),
    ("layer4.0.bn1.bias", (512,)),
    ("layer4.0.conv2.weight", (512, 512, 3, 3)),
    ("layer4.0.bn2.weight", (512,)),
    ("layer4.0.bn2.bias", (512,)),
    ("layer4.0.downsample.0.weight", (512, 256, 1, 1)),
    ("layer4.0.downsample.1.weight", (512,)),
    ("layer4.0.downsample.1.bias", (512,)),
    ("layer4.1.conv1.weight", (512, 512, 3, 3)),
    ("layer4.1.bn1.weight", (512,)),
    ("layer4.1.bn1.bias", (512,)),
    ("layer4.1.conv2.weight", (512, 512, 3, 3)),
    ("layer4.1.bn2.weight", (512,)),
    ("layer4.1.bn2.bias", (512,)),
    ("fc.weight", (1000, 512)),
    ("fc.bias", (1000,)),
)

# 784-4096-4096-10 with biases (20,037,642 elements), as benchmarks/models/mlp_20m.py.
MLP_20M: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("layers.0.weight", (4096, 784)),
    ("layers.0.bias", (4096,)),
    ("layers.2.weight", (4096, 4096)),
    ("layers.2.bias", (4096,)),
    ("layers.4.weight", (10, 4096)),
    ("layers.4.bias", (10,)),
)

LITERAL_MODELS = {"resnet18": RESNET18, "mlp_20m": MLP_20M}


def max_over_mean(placement: Placement) -> float:
    """Bytes of the most-loaded shard over the mean (all shards hold float32)."""
    loads = [shard.numel for shard in placement.shards]
    return max(loads) / (sum(loads) / len(loads))


def test_literal_shapes_have_the_models_sizes() -> None:
    assert sum(math.prod(shape) for _, shape in RESNET18) == 11_689_512
    assert sum(math.prod(shape) for _, shape in MLP_20M) == 20_037_642


@pytest.mark.parametrize("num_ps", PS_COUNTS)
@pytest.mark.parametrize("model", sorted(LITERAL_MODELS))
def test_largest_shard_is_within_ten_percent_of_the_mean(model: str, num_ps: int) -> None:
    params = [ParamSpec(name, shape) for name, shape in LITERAL_MODELS[model]]

    placement = plan_placement(params, num_ps)

    assert max_over_mean(placement) <= MAX_OVER_MEAN


@pytest.mark.parametrize("num_ps", PS_COUNTS)
@pytest.mark.parametrize("example", ["mnist_cnn", "mnist_mlp", "mnist_resnet"])
def test_examples_are_balanced_with_their_buffers(example: str, num_ps: int) -> None:
    model = load_model_file(EXAMPLES / f"{example}.py").build()

    placement = bind_flat_buffers(model, num_ps).placement

    assert max_over_mean(placement) <= MAX_OVER_MEAN


def test_resnet18_keeps_its_small_tensors_whole() -> None:
    params = [ParamSpec(name, shape) for name, shape in RESNET18]

    placement = plan_placement(params, 8)

    pieces = {name: 0 for name, _ in RESNET18}
    for shard in placement.shards:
        for piece in shard.pieces:
            pieces[piece.name] += 1
    # Every BatchNorm weight and bias (at most 512 elements) goes whole to one PS.
    assert all(pieces[name] == 1 for name, shape in RESNET18 if len(shape) == 1)
    assert max_over_mean(placement) <= 1 + BALANCE_TOLERANCE + 1e-6


def test_a_dominant_tensor_is_sliced_below_the_big_array_bound() -> None:
    # The example CNN's fc1 holds 79% of its parameters, far below 10**6 elements.
    params = [
        ParamSpec("conv1.weight", (16, 1, 5, 5)),
        ParamSpec("conv1.bias", (16,)),
        ParamSpec("conv2.weight", (32, 16, 5, 5)),
        ParamSpec("conv2.bias", (32,)),
        ParamSpec("fc1.weight", (64, 512)),
        ParamSpec("fc1.bias", (64,)),
        ParamSpec("fc2.weight", (10, 64)),
        ParamSpec("fc2.bias", (10,)),
    ]

    placement = plan_placement(params, 2)

    fc1 = [p for shard in placement.shards for p in shard.pieces if p.name == "fc1.weight"]
    assert sorted(p.shard for p in fc1) == [0, 1]
    assert max_over_mean(placement) <= MAX_OVER_MEAN


def test_no_shard_is_left_empty_by_a_four_tensor_model() -> None:
    params = [ParamSpec("w1", (512, 784)), ParamSpec("b1", (512,)),
              ParamSpec("w2", (10, 512)), ParamSpec("b2", (10,))]  # fmt: skip

    placement = plan_placement(params, 4)

    assert min(shard.numel for shard in placement.shards) > 0
    assert max_over_mean(placement) <= MAX_OVER_MEAN


def test_homes_depend_on_names_and_shapes_not_on_model_order() -> None:
    params = [ParamSpec(name, shape) for name, shape in RESNET18]

    forward = plan_placement(params, 4)
    backward = plan_placement(params[::-1], 4)

    def homes(placement: Placement) -> dict[str, list[tuple[int, int, int]]]:
        found: dict[str, list[tuple[int, int, int]]] = {}
        for shard in placement.shards:
            for p in shard.pieces:
                found.setdefault(p.name, []).append((shard.index, p.param_start, p.param_end))
        return found

    assert homes(forward) == homes(backward)
    assert forward == plan_placement(list(params), 4)


def test_hash_placement_stays_selectable_and_unbalanced_on_the_example_cnn() -> None:
    model = load_model_file(EXAMPLES / "mnist_cnn.py").build()

    placement = plan_placement(param_specs(model), 2, strategy="hash")

    assert placement.strategy == "hash"
    assert max_over_mean(placement) > 1.5
