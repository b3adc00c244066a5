"""MNIST multi-layer perceptron: an elasticps model file.

The model-file contract
-----------------------
A model file is a plain Python file. ``elasticps`` imports it in every trainer
(``--model examples/mnist_mlp.py``) and uses four names from it:

``COLUMNS``
    A tuple of the Parquet column names the model reads. The job checks that
    the dataset has them before any trainer starts, and trainers read only
    these columns.

``Model``
    A ``torch.nn.Module`` subclass, constructed with the keyword arguments of
    ``--model-args`` (none by default). Another class name can be chosen with
    ``--model-class``. Every trainer builds it under the same
    ``torch.manual_seed``, so all trainers start from identical parameters.
    All parameters must be float32. Buffers (BatchNorm statistics) are model
    state too: the parameter servers carry and save them.

``loss(outputs, targets) -> Tensor``
    The scalar mean loss of one mini-batch. Trainers call ``backward()`` on it
    and push the gradients to the parameter servers.

``batch_to_tensors(batch) -> (inputs, targets)``
    Turns one mini-batch, a ``pyarrow.Table`` holding (at least) ``COLUMNS``,
    into the model's input and the loss's target. ``Model()(inputs)`` must be
    valid. Any shapes train; the evaluation adds to the loss the metrics that
    fit them: for classification (``outputs`` float32 [B, classes],
    ``targets`` int64 [B], as here) the accuracy,
    ``argmax(outputs, dim=1) == targets``.

``metrics()`` (optional)
    Returns fresh ``torchmetrics`` metrics by name, reported by every
    evaluation after the default ones.

The whole contract is ``docs/model-contract.md``.

A model file should import only installed packages (its directory is not added
to ``sys.path``) and should do no work at import time beyond definitions.

This file trains on the Parquet files written by ``elasticps data mnist``:
``pixels`` (fixed_size_list<uint8>[784], row-major 28x28, 0..255) and
``label`` (int64, 0..9).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)
from torch import Tensor, nn

COLUMNS = ("pixels", "label")

PIXELS_PER_IMAGE = 784
NUM_CLASSES = 10
# Mean and standard deviation of the MNIST training pixels scaled to [0, 1].
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class MLP(nn.Module):
    """A fully connected ReLU network: 784 -> hidden_sizes... -> 10.

    Args:
        hidden_sizes: width of each hidden layer, e.g. ``(256,)``; an empty
            sequence gives multinomial logistic regression.
    """

    def __init__(self, hidden_sizes: Sequence[int] = (256,)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = PIXELS_PER_IMAGE
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, NUM_CLASSES))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: Tensor) -> Tensor:
        """Map images to class logits.

        Args:
            inputs: float32 [B, 784], standardised pixels.

        Returns:
            Logits, float32 [B, 10].
        """
        logits: Tensor = self.layers(inputs)
        return logits


class Model(MLP):
    """The default model: 784-256-10 with ReLU (203,530 parameters)."""

    def __init__(self) -> None:
        super().__init__((256,))


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
        batch: a table with ``pixels`` (fixed_size_list<uint8>[784]) and
            ``label`` (int64) columns, B rows.

    Returns:
        ``(inputs, targets)``: inputs float32 [B, 784], pixels scaled to
        [0, 1] then standardised with the MNIST mean and std; targets int64 [B].
    """
    # flatten() honours the offset of a sliced array; combine_chunks() joins
    # the row groups a range read may span.
    pixels = batch.column("pixels").combine_chunks().flatten().to_numpy()
    images = pixels.reshape(batch.num_rows, PIXELS_PER_IMAGE).astype(np.float32)
    images = (images / 255.0 - MNIST_MEAN) / MNIST_STD
    labels = batch.column("label").to_numpy().astype(np.int64)
    return torch.from_numpy(images.astype(np.float32, copy=False)), torch.from_numpy(labels)
