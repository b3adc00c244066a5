"""elasticps: elastic, fault-tolerant parameter-server training for PyTorch.

A job is one master (task dispatch over gRPC), parameter servers (shards of
the parameters and their optimizer state, served over a socket tensor plane)
and trainers (the user's ``torch.nn.Module``), coordinated through etcd.
Start with the README, or ``elasticps train --help``.

The Python API:

- :func:`train` runs a job (in-process with ``cluster=None``, on local
  servers with :class:`Local`, or on other machines with :class:`Hosts` or
  :class:`Slurm`) and returns a :class:`ParameterSet`;
- :func:`infer` runs a model, or a sub-network of it, with a ParameterSet;
- :func:`evaluate_model` reports a model's mean loss and metrics on test data;
- :mod:`elasticps.parameters` creates, saves and loads parameter sets;
- :mod:`elasticps.events` are the events an ``event_handler`` receives;
- :mod:`elasticps.updater` are the optimizers (with learning-rate schedules)
  the parameter servers run;
- :mod:`elasticps.kvstore` is an MXNet-style push/pull API (``local``,
  ``dist_sync``, ``dist_async``);
- :func:`dist_train` is one entry point from laptop to cluster: it launches
  the job, or plays its role inside one;
- :mod:`elasticps.nn` are sparse embedding modules (``Embedding``,
  ``EmbeddingBag`` and their hashed variants) whose tables live on the
  parameter servers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from elasticps.errors import (
    ConfigError,
    DataError,
    ElasticPSError,
    FrozenParameterError,
    MissingParameterError,
    ModelContractError,
    StaleTaskError,
    UserError,
)

if TYPE_CHECKING:
    from elasticps import events, kvstore, nn, parameters, updater
    from elasticps.api.cluster import Hosts, Local, Parquet, Slurm
    from elasticps.api.train import evaluate_model, infer, train
    from elasticps.dist import LaunchResult, dist_train
    from elasticps.parameters import ParameterSet

__version__ = "0.1.0"

# The Python API imports torch; the role processes (master, PS) and the CLI
# import this package too, so its names load on first use (PEP 562). This
# keeps the master's start-up about 1.5 s shorter on a 2-core machine.
_LAZY = {
    "events": ("elasticps.events", None),
    "kvstore": ("elasticps.kvstore", None),
    "nn": ("elasticps.nn", None),
    "parameters": ("elasticps.parameters", None),
    "updater": ("elasticps.updater", None),
    "Hosts": ("elasticps.api.cluster", "Hosts"),
    "Local": ("elasticps.api.cluster", "Local"),
    "Slurm": ("elasticps.api.cluster", "Slurm"),
    "Parquet": ("elasticps.api.cluster", "Parquet"),
    "infer": ("elasticps.api.train", "infer"),
    "evaluate_model": ("elasticps.api.train", "evaluate_model"),
    "train": ("elasticps.api.train", "train"),
    "LaunchResult": ("elasticps.dist", "LaunchResult"),
    "dist_train": ("elasticps.dist", "dist_train"),
    "ParameterSet": ("elasticps.parameters", "ParameterSet"),
}


def __getattr__(name: str) -> object:
    """Load a public name of the Python API on first use.

    Raises:
        AttributeError: ``name`` is not a public name of elasticps.
    """
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'elasticps' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ConfigError",
    "DataError",
    "ElasticPSError",
    "FrozenParameterError",
    "Hosts",
    "LaunchResult",
    "Local",
    "MissingParameterError",
    "ModelContractError",
    "ParameterSet",
    "Parquet",
    "Slurm",
    "StaleTaskError",
    "UserError",
    "__version__",
    "dist_train",
    "evaluate_model",
    "events",
    "infer",
    "kvstore",
    "nn",
    "parameters",
    "train",
    "updater",
]
