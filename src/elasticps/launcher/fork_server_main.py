"""The fork server's process: ``python -m elasticps.launcher.fork_server_main FD PRELOAD``.

:class:`~elasticps.launcher.spawn.ForkServer` starts it; see
:mod:`elasticps.launcher.spawn` for the protocol. Each child it forks runs the
``elasticps`` command's ``main``. This entry point lives apart from
:mod:`~elasticps.launcher.spawn` because it depends on the command, which
depends on the launchers, which depend on ``spawn``: here nothing imports it
back. ``spawn.PRELOAD`` names the command's module among what the server
imports before its first fork, so each child starts with it imported.
``elasticps train`` does not start this process: its launcher forks the
server from itself and hands it the command's ``main`` directly.
"""

from __future__ import annotations

import sys

from elasticps.launcher.spawn import exit_now, serve


def run_command(args: list[str]) -> int:
    """Run ``elasticps <args>`` in this (forked) process; return its exit status."""
    from elasticps.cli import main

    return main(args)


if __name__ == "__main__":
    # Nothing to clean up after serve(); the launcher waits for this exit at
    # the end of every job.
    exit_now(serve(sys.argv[1:], run_command))
