"""The MNIST MLP of ``examples/mnist_mlp.py``, paced: each mini-batch's loss waits 20 ms.

A model file for tests that need a job to keep running while they look at it
(``status``, ``logs``, ``stop``, a second job on its output). The job trains as
usual, but its trainer sleeps most of the time, so it leaves the CPU to the
tests beside it. Everything but the pace is the example's.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from torch import Tensor

PACE_S = 0.02
"""How long each call of :func:`loss` sleeps first, seconds."""

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_mlp.py"
_spec = importlib.util.spec_from_file_location("paced_mlp_example", _EXAMPLE)
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

COLUMNS = _example.COLUMNS
Model = _example.Model
batch_to_tensors = _example.batch_to_tensors


def loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """The example's loss, after :data:`PACE_S` of sleep."""
    time.sleep(PACE_S)
    result: Tensor = _example.loss(outputs, targets)
    return result
