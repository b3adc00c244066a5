"""etcd's users and roles for one job: who may write which keys.

A job whose etcd runs with client TLS (``--client-cert-auth``, see
:func:`~elasticps.coord.etcd_server.tls_flags`) knows each client by the
common name of its certificate, which is an etcd user here. Each user has
one role of the same name, granted only the key ranges that role writes
(:func:`role_grants`, pure):

=========  ======================  =====================================
user       reads                   writes
=========  ======================  =====================================
root       everything              everything (etcd's ``root`` role)
master     the job's keys          the job's keys
ps         the job's keys          ``ps/``, ``restores/``, ``health/``,
                                   ``metrics/``
trainer    the job's keys          ``trainers/``, ``kvstore/``,
                                   ``metrics/``
=========  ======================  =====================================

So a trainer's stolen key cannot write the task ledger nor take the master
lock, and a parameter server's cannot either; neither can claim the other's
keys. etcd checks every request against these grants (etcd's
"Role-based access control" guide).

:func:`enable_auth` creates the users and roles and turns authentication on;
it runs once, as the launcher, before any role starts. Users are known by
their certificates: each gets a random password that is never used.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

import grpc
from pyetcd import etcdrpc
from pyetcd.utils import prefix_range_end

from elasticps.coord.client import connect, describe
from elasticps.coord.keys import Keys
from elasticps.errors import CoordinationError
from elasticps.jobca import Credential
from elasticps.security import ETCD_ROLES

__all__ = ["Access", "Grant", "enable_auth", "permits", "role_grants"]

ROOT: Final = "root"


class Access(IntEnum):
    """etcd's permission types (``authpb.Permission.Type``)."""

    READ = 0
    WRITE = 1
    READWRITE = 2


@dataclass(frozen=True)
class Grant:
    """One key range a role may read or write: ``[key, range_end)``, or ``key`` alone
    if ``range_end`` is empty."""

    access: Access
    key: str
    range_end: str = ""

    @classmethod
    def prefix(cls, access: Access, prefix: str) -> Grant:
        """The grant of every key under ``prefix``."""
        end = prefix_range_end(prefix.encode("utf-8")).decode("utf-8")
        return cls(access, prefix, end)


def role_grants(keys: Keys) -> dict[str, tuple[Grant, ...]]:
    """What each role of the job whose keys are ``keys`` may read and write. Pure.

    Returns:
        Role name -> its grants, for every :data:`~elasticps.security.ETCD_ROLES`
        entry but ``root`` (which etcd grants everything).
    """
    read_all = Grant.prefix(Access.READ, keys.root)
    return {
        "master": (Grant.prefix(Access.READWRITE, keys.root),),
        "ps": (
            read_all,
            Grant.prefix(Access.READWRITE, keys.ps_prefix),
            Grant.prefix(Access.READWRITE, keys.restores_prefix),
            Grant.prefix(Access.READWRITE, keys.health_prefix),
            Grant.prefix(Access.READWRITE, keys.metrics_prefix),
        ),
        "trainer": (
            read_all,
            Grant.prefix(Access.READWRITE, keys.trainers_prefix),
            Grant.prefix(Access.READWRITE, keys.kvstore_prefix),
            Grant.prefix(Access.READWRITE, keys.metrics_prefix),
        ),
    }


def permits(grants: tuple[Grant, ...], key: str, *, write: bool) -> bool:
    """Whether ``grants`` let their holder read (or, with ``write``, write) ``key``,
    as etcd decides it. Pure."""
    wanted = (Access.WRITE, Access.READWRITE) if write else (Access.READ, Access.READWRITE)
    for grant in grants:
        if grant.access not in wanted:
            continue
        if grant.range_end:
            if grant.key <= key < grant.range_end:
                return True
        elif key == grant.key:
            return True
    return False


def _already(exc: grpc.RpcError) -> bool:
    call: Any = exc
    return call.code() == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in str(
        call.details()
    )


def enable_auth(
    endpoint: str,
    keys: Keys,
    root: Credential,
    *,
    grants: Mapping[str, tuple[Grant, ...]] | None = None,
    timeout_s: float = 10.0,
) -> None:
    """Create the job's etcd users and roles and turn etcd's authentication on.

    Idempotent: users and roles that exist are kept (an etcd restarted on its
    data keeps them), and enabling an enabled etcd changes nothing.

    Args:
        endpoint: the etcd, which must run with client TLS and trust ``root``'s CA.
        keys: the job's keys.
        root: the credential whose common name is ``root``.
        grants: role -> grants; default :func:`role_grants`.
        timeout_s: deadline of each request, seconds.

    Raises:
        CoordinationError: etcd refused a request or did not answer.
    """
    grants = role_grants(keys) if grants is None else grants
    client = connect(endpoint, timeout_s, tls=root)
    try:
        stub = client.authstub
        calls: list[tuple[str, Any, Any]] = [
            ("role add root", stub.RoleAdd, etcdrpc.AuthRoleAddRequest(name=ROOT))
        ]
        for user in ETCD_ROLES:
            password = secrets.token_hex(16)  # never used: users are known by certificate
            calls.append(
                (
                    f"user add {user}",
                    stub.UserAdd,
                    etcdrpc.AuthUserAddRequest(name=user, password=password),
                )
            )
            if user != ROOT:
                calls.append(
                    (f"role add {user}", stub.RoleAdd, etcdrpc.AuthRoleAddRequest(name=user))
                )
                for grant in grants.get(user, ()):
                    perm = etcdrpc.Permission(
                        permType=int(grant.access),
                        key=grant.key.encode("utf-8"),
                        range_end=grant.range_end.encode("utf-8"),
                    )
                    calls.append(
                        (
                            f"grant {user} {grant.access.name} {grant.key}",
                            stub.RoleGrantPermission,
                            etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=perm),
                        )
                    )
            calls.append(
                (
                    f"grant role {user}",
                    stub.UserGrantRole,
                    etcdrpc.AuthUserGrantRoleRequest(user=user, role=user),
                )
            )
        calls.append(("auth enable", stub.AuthEnable, etcdrpc.AuthEnableRequest()))
        for what, method, request in calls:
            try:
                method(request, timeout_s)
            except grpc.RpcError as exc:
                if not _already(exc):
                    raise CoordinationError(
                        f"etcd {endpoint}: {what} failed: {describe(exc)}"
                    ) from exc
    finally:
        client.close()
