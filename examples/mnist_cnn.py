"""MNIST convolutional network: an elasticps model file.

It follows the same contract as ``examples/mnist_mlp.py`` (see that file's
docstring): ``COLUMNS``, a ``Model`` class constructed with no arguments,
``loss(outputs, targets)`` and ``batch_to_tensors(batch)``.

The network is small enough to train quickly on one CPU thread (about 47k
parameters): two 5x5 convolutions with max pooling, then two linear layers.
Trained alone with Adam (lr 1e-3, batch 32) for 5 epochs over the 4,000
training images of ``elasticps data mnist``, it reaches about 96% accuracy
on the 1,000 test images.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)
from torch import Tensor, nn

COLUMNS = ("pixels", "label")

IMAGE_SIDE = 28
NUM_CLASSES = 10
# Mean and standard deviation of the MNIST training pixels scaled to [0, 1].
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class Model(nn.Module):
    """Conv(1->16, 5x5) -> ReLU -> MaxPool(2) -> Conv(16->32, 5x5) -> ReLU -> MaxPool(2)
    -> Linear(512->64) -> ReLU -> Linear(64->10).

    Shapes: [B, 1, 28, 28] -> [B, 16, 12, 12] -> [B, 32, 4, 4] -> [B, 64] -> [B, 10].
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, NUM_CLASSES)

    def forward(self, inputs: Tensor) -> Tensor:
        """Map images to class logits.

        Args:
            inputs: float32 [B, 1, 28, 28], standardised pixels.

        Returns:
            Logits, float32 [B, 10].
        """
        x = F.max_pool2d(F.relu(self.conv1(inputs)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        logits: Tensor = self.fc2(x)
        return logits


def loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of the mini-batch.

    Args:
        outputs: logits, float32 [B, 10].
        targets: class indices, int64 [B].

    Returns:
        Scalar float32 tensor.
    """
    return F.cross_entropy(outputs, targets)


def batch_to_tensors(batch: pa.Table) -> tuple[Tensor, Tensor]:
    """Convert a mini-batch of MNIST rows to tensors.

    Args:
        batch: a table with ``pixels`` (fixed_size_list<uint8>[784], row-major
            28x28) and ``label`` (int64) columns, B rows.

    Returns:
        ``(inputs, targets)``: inputs float32 [B, 1, 28, 28], pixels scaled to
        [0, 1] then standardised with the MNIST mean and std; targets int64 [B].
    """
    pixels = batch.column("pixels").combine_chunks().flatten().to_numpy()
    images = pixels.reshape(batch.num_rows, 1, IMAGE_SIDE, IMAGE_SIDE).astype(np.float32)
    images = (images / 255.0 - MNIST_MEAN) / MNIST_STD
    labels = batch.column("label").to_numpy().astype(np.int64)
    return torch.from_numpy(images.astype(np.float32, copy=False)), torch.from_numpy(labels)
