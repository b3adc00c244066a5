"""elasticps: elastic, fault-tolerant parameter-server training for PyTorch.

A job is one master (task dispatch over gRPC), parameter servers (shards of
the parameters and their optimizer state, served over a socket tensor plane)
and trainers (the user's ``torch.nn.Module``), coordinated through etcd.
Start with the README, or ``elasticps train --help``.

The Python API:

- :func:`train` runs a job (in-process with ``cluster=None``, or on local
  servers with :class:`Local`) and returns a :class:`ParameterSet`;
- :func:`infer` runs a model, or a sub-network of it, with a ParameterSet;
- :mod:`elasticps.parameters` creates, saves and loads parameter sets;
- :mod:`elasticps.events` are the events an ``event_handler`` receives;
- :mod:`elasticps.updater` are the optimizers (with learning-rate schedules)
  the parameter servers run;
- :mod:`elasticps.kvstore` is an MXNet-style push/pull API (``local``,
  ``dist_sync``, ``dist_async``);
- :func:`dist_train` is one entry point from laptop to cluster: it launches
  the job, or plays its role inside one.
"""

from elasticps import events, kvstore, parameters, updater
from elasticps.api.cluster import Local, Parquet
from elasticps.api.train import infer, train
from elasticps.dist import LaunchResult, dist_train
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
from elasticps.parameters import ParameterSet

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "ElasticPSError",
    "FrozenParameterError",
    "LaunchResult",
    "Local",
    "MissingParameterError",
    "ModelContractError",
    "ParameterSet",
    "Parquet",
    "StaleTaskError",
    "UserError",
    "__version__",
    "dist_train",
    "events",
    "infer",
    "kvstore",
    "parameters",
    "train",
    "updater",
]
