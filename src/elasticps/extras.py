"""Optional parts of elasticps, installed as pip extras.

The core install (``pip install elasticps``) is what training needs. The
rest comes with extras, declared in ``pyproject.toml``:

- ``kubernetes``: the Kubernetes backend (``elasticps submit``, and
  ``status``/``logs``/``scale``/``delete`` with ``--backend kubernetes``);
- ``kafka``: training from a Kafka stream (``--data kafka://HOST:PORT/topic``);
- ``examples``: the example data sets and scripts (``elasticps data mnist``);
- ``tensorboard``: TensorBoard scalars of a job (``train --tensorboard DIR``);
- ``dashboard``: the live dashboard and the HTML report of a job
  (``elasticps dashboard``, ``elasticps report``);
- ``dev``: tests, linters and the documentation site;
- ``all``: all of them.

A command that needs a missing extra stops with one line naming it
(:func:`require_extra`), instead of a traceback from a failed import.
"""

from __future__ import annotations

import importlib.util
from typing import Final

from elasticps.errors import MissingExtraError

__all__ = ["EXTRA_MODULES", "require_extra"]

EXTRA_MODULES: Final[dict[str, tuple[str, ...]]] = {
    "kubernetes": ("kubernetes", "yaml"),
    "examples": ("mlxtend",),
    "kafka": ("confluent_kafka",),
    "tensorboard": ("tensorboard",),
    "dashboard": ("aiohttp", "plotly", "jinja2"),
}
"""The modules each extra brings that elasticps imports (by import name)."""


def require_extra(extra: str, what: str) -> None:
    """Check that the modules of ``extra`` can be imported, without importing them.

    Args:
        extra: a key of :data:`EXTRA_MODULES`.
        what: what needs it, for the message (e.g. ``"elasticps submit"``).

    Raises:
        MissingExtraError: a module of the extra is not installed; the message
            says what to install.
    """
    missing = [name for name in EXTRA_MODULES[extra] if _find(name) is None]
    if missing:
        raise MissingExtraError(
            f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"pip install 'elasticps[{extra}]'"
        )


def _find(name: str) -> object:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a blocked or half-imported module
        return None
