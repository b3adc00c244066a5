"""``python -m elasticps``: the same as the ``elasticps`` command."""

from elasticps.cli import run

run()
