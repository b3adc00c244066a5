"""Makes the packages of elasticps's extras unimportable, in every process that starts.

Put this directory first on ``PYTHONPATH`` to run elasticps as a core-only
install would (``pip install elasticps`` without extras), though the extras
are installed. Used by ``tests/unit/test_core_install.py``.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

# Import names of what the extras bring (and of their own heavy dependencies).
BLOCKED = frozenset(
    {
        "kubernetes", "yaml", "mlxtend", "sklearn", "matplotlib", "scipy", "pandas",
        "kubernetes_validate", "aiohttp", "pydantic",
    }
)  # fmt: skip


class _Blocker(MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: core-only)", name=name)


sys.meta_path.insert(0, _Blocker())
