"""Large MNIST MLP for the benchmarks: 784-4096-4096-10 with ReLU (20,037,642 parameters).

A model file (see the contract in ``examples/mnist_mlp.py``): ``COLUMNS``,
``Model``, ``loss`` and ``batch_to_tensors``. Self-contained, because a model
file may import only installed packages. Reads the Parquet files written by
``elasticps data mnist``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)
from torch import Tensor, nn

COLUMNS = ("pixels", "label")

PIXELS_PER_IMAGE = 784
NUM_CLASSES = 10
HIDDEN = (4096, 4096)
# Mean and standard deviation of the MNIST training pixels scaled to [0, 1].
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class Model(nn.Module):
    """784 -> 4096 -> 4096 -> 10, ReLU between layers (80 MB of float32)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = PIXELS_PER_IMAGE
        for hidden in HIDDEN:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, NUM_CLASSES))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits float32 [B, 10] from standardised pixels float32 [B, 784]."""
        logits: Tensor = self.layers(inputs)
        return logits


def loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of the mini-batch (scalar float32)."""
    return F.cross_entropy(outputs, targets)


def batch_to_tensors(batch: pa.Table) -> tuple[Tensor, Tensor]:
    """Pixels float32 [B, 784] (scaled to [0, 1], standardised) and labels int64 [B]."""
    pixels = batch.column("pixels").combine_chunks().flatten().to_numpy()
    images = pixels.reshape(batch.num_rows, PIXELS_PER_IMAGE).astype(np.float32)
    images = (images / 255.0 - MNIST_MEAN) / MNIST_STD
    labels = batch.column("label").to_numpy().astype(np.int64)
    return torch.from_numpy(images.astype(np.float32, copy=False)), torch.from_numpy(labels)
