"""elasticps: elastic, fault-tolerant parameter-server training for PyTorch.

A job is one master (task dispatch over gRPC), parameter servers (shards of
the parameters and their optimizer state, served over a socket tensor plane)
and trainers (the user's ``torch.nn.Module``), coordinated through etcd.
Start with the README, or ``elasticps train --help``.
"""

from elasticps.errors import (
    ConfigError,
    DataError,
    ElasticPSError,
    ModelContractError,
    StaleTaskError,
    UserError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "ElasticPSError",
    "ModelContractError",
    "StaleTaskError",
    "UserError",
    "__version__",
]
