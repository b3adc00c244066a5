"""MNIST residual network with BatchNorm: an elasticps model file.

It follows the model-file contract (``docs/model-contract.md``): ``COLUMNS``,
a ``Model`` class, ``loss(outputs, targets)`` and ``batch_to_tensors(batch)``,
on the files of ``elasticps data mnist``, as ``examples/mnist_cnn.py`` does.
Unlike that CNN it has **buffers**: every convolution is followed by
``nn.BatchNorm2d``, whose running mean, running variance and batch counter
are trained state. elasticps keeps them on the parameter servers with the
parameters (each trainer sends what its forward passes did to them, the
servers combine it, every pull brings the result back), saves them in
``model.safetensors``, and evaluates with them, as in a single process.

The network is a small ResNet (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016: basic blocks of two 3x3 convolutions with an
identity shortcut, or a strided 1x1 convolution where the shape changes),
about 44k parameters at the default width (24). Its width is a constructor
argument, so ``--model-args '{"width": 32}'`` trains a wider one; the
arguments are recorded with the checkpoint, so ``elasticps evaluate`` and
``--resume`` rebuild the same network. Train it with the main job's command::

    elasticps train --model examples/mnist_resnet.py --data data/mnist --trainers 2 \\
        --ps 2 --mode sync --epochs 5 --output runs/resnet --overwrite
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


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, plus the shortcut, then ReLU.

    Shapes: float32 [B, C_in, H, W] -> [B, C_out, H / stride, W / stride].

    Args:
        channels_in: input channels.
        channels_out: output channels.
        stride: stride of the first convolution (2 halves the image).
    """

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block (see the class docstring for shapes)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Model(nn.Module):
    """Stem conv -> max pool -> block(width) -> block(2 width, stride 2) -> mean -> linear.

    Shapes: [B, 1, 28, 28] -> [B, w, 28, 28] -> [B, w, 14, 14] -> [B, w, 14, 14]
    -> [B, 2w, 7, 7] -> [B, 2w] -> [B, 10].

    Args:
        width: channels of the first stage (the second has twice as many).
    """

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.stage1 = BasicBlock(width, width)
        self.stage2 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width, NUM_CLASSES)

    def forward(self, inputs: Tensor) -> Tensor:
        """Map images to class logits.

        Args:
            inputs: float32 [B, 1, 28, 28], standardised pixels.

        Returns:
            Logits, float32 [B, 10].
        """
        x = F.max_pool2d(self.stem(inputs), 2)
        x = self.stage2(self.stage1(x))
        logits: Tensor = self.fc(x.mean(dim=(2, 3)))
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
