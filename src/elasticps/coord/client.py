"""The etcd client the coordination modules share, and the translation of its errors.

Internal to :mod:`elasticps.coord`: the other modules of the package build on
these helpers; users go through :class:`~elasticps.coord.store.JobStore`.
Here are the connection (:func:`connect`), the errors the ``pyetcd`` client
raises and which of them are worth a retry (:func:`is_transient`), the JSON
codec of every value, and the polling pace of the ``wait_*`` methods.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Final

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exceptions

from elasticps.coord.etcd_server import parse_endpoint
from elasticps.errors import ConfigError, CoordinationError
from elasticps.jobca import Credential
from elasticps.security import etcd_tls_from_env

__all__ = [
    "ETCD_ERRORS",
    "MAX_TXN_OPS",
    "POLL_MAX_S",
    "LeaseEquals",
    "address_of",
    "connect",
    "decode",
    "decode_object",
    "describe",
    "encode",
    "is_transient",
    "parse_endpoints",
    "poll_delays",
    "sleep_until_next_poll",
]

#: The errors the pyetcd client raises for etcd or transport failures.
ETCD_ERRORS: Final = (etcd_exceptions.Etcd3Exception, grpc.RpcError)

#: Longest sleep between two reads while waiting for a key, in seconds.
POLL_MAX_S: Final = 0.05
#: First sleep between two reads while waiting for a key, in seconds.
POLL_MIN_S: Final = 0.005

#: How long a member of a several-member etcd that failed a request is skipped, in seconds.
_FAILOVER_RETRY_S: Final = 2.0

#: Most operations etcd accepts in one transaction (its ``--max-txn-ops`` default).
MAX_TXN_OPS: Final = 128

# gRPC's default reconnect backoff grows to 120 s, far longer than a lease TTL:
# after an etcd restart the client would stay disconnected long after etcd is
# back. Cap it at 1 s.
_GRPC_OPTIONS: Final = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """Split a comma-separated list of etcd client endpoints (the members of one cluster).

    Args:
        endpoints: ``"host:port"`` or ``"http://host:port"``, or several of them
            separated by commas (``"10.0.0.1:2379,10.0.0.2:2379"``).

    Returns:
        ``(host, port)`` of each, in order, without duplicates.

    Raises:
        ConfigError: the list is empty or an endpoint is malformed.
    """
    parsed: list[tuple[str, int]] = []
    for part in endpoints.split(","):
        if not part.strip():
            raise ConfigError(f"etcd endpoints {endpoints!r}: an empty endpoint")
        address = parse_endpoint(part)
        if address not in parsed:
            parsed.append(address)
    return parsed


def connect(endpoint: str, timeout_s: float, tls: Credential | None = None) -> Any:
    """A pyetcd client of the etcd at ``endpoint``, once its channel is ready.

    With several endpoints (the members of one etcd cluster), the client
    starts on the first member that answers, and a request that fails with
    ``UNAVAILABLE`` or ``DEADLINE_EXCEEDED`` marks its member failed for
    :data:`_FAILOVER_RETRY_S` seconds, so that the caller's retry goes to
    another member (pyetcd's failover).

    Args:
        endpoint: ``"host:port"`` or ``"http://host:port"``, or several
            separated by commas.
        timeout_s: how long to wait for etcd to answer, and the deadline of
            every request made with the client, in seconds.
        tls: the TLS identity to show etcd; None: this process's
            (:func:`~elasticps.security.etcd_tls_from_env`), and plain TCP if
            it has none.

    Returns:
        The client (``pyetcd.MultiEndpointEtcd3Client``); close it when done.

    Raises:
        ConfigError: the endpoint is malformed, or the TLS files cannot be read.
        CoordinationError: no member answered within ``timeout_s``.
    """
    addresses = parse_endpoints(endpoint)
    # pyetcd marks an endpoint "failed" after one UNAVAILABLE error and then
    # refuses to use it for time_retry seconds (300 by default); with a single
    # endpoint that would make an etcd restart fatal. Retry at once instead.
    # With several members, skip a failed one briefly, so the next try fails over.
    time_retry = 0.0 if len(addresses) == 1 else _FAILOVER_RETRY_S
    tls = tls if tls is not None else etcd_tls_from_env()
    options: list[tuple[str, Any]] = list(_GRPC_OPTIONS)
    creds = None
    if tls is not None:
        creds = grpc.ssl_channel_credentials(tls.ca_pem, tls.key_pem, tls.cert_pem)
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
    eps = [
        pyetcd.Endpoint(
            f"[{host}]" if ":" in host else host,
            port,
            secure=creds is not None,
            creds=creds,
            time_retry=time_retry,
            opts=options,
        )
        for host, port in addresses
    ]
    client = pyetcd.MultiEndpointEtcd3Client(
        endpoints=eps, timeout=timeout_s, failover=len(eps) > 1
    )
    futures = {ep.netloc: grpc.channel_ready_future(ep.channel) for ep in eps}
    deadline = time.monotonic() + timeout_s
    ready = None
    while ready is None and time.monotonic() < deadline:
        ready = next((label for label, f in futures.items() if f.done()), None)
        if ready is None:
            time.sleep(0.01)
    for future in futures.values():
        future.cancel()
    if ready is None:
        client.close()
        raise CoordinationError(
            f"etcd at {endpoint} did not answer within {timeout_s:g} s; is it running?"
        )
    # Start on a member that answers (pyetcd picks one at random).
    client._current_endpoint_label = ready
    return client


def describe(exc: BaseException) -> str:
    """One line describing a pyetcd or gRPC error."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        call: Any = exc
        return f"{call.code().name}: {call.details()}"
    return str(exc) or type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """Whether an error (or its cause) means etcd could not be reached or did not answer
    in time, so that retrying the same request may succeed.

    Errors such as an invalid request or a failed compare are not transient.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(
            seen,
            etcd_exceptions.ConnectionFailedError
            | etcd_exceptions.ConnectionTimeoutError
            | etcd_exceptions.NoServerAvailableError
            | etcd_exceptions.InternalServerError,
        ):
            return True
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            call: Any = seen
            if call.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return True
        seen = seen.__cause__
    return False


# --- values ---------------------------------------------------------------------------


def encode(obj: object) -> str:
    """``obj`` as compact JSON text with sorted keys (the form of every value written)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def decode(raw: bytes, key: str) -> object:
    """Decode the UTF-8 JSON value of ``key``.

    Raises:
        CoordinationError: the value is not UTF-8 JSON.
    """
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CoordinationError(f"etcd key {key} does not hold valid UTF-8 JSON") from exc


def decode_object(raw: bytes, key: str) -> dict[str, object]:
    """Decode the value of ``key``, which must be a JSON object.

    Raises:
        CoordinationError: the value is not a UTF-8 JSON object.
    """
    value = decode(raw, key)
    if not isinstance(value, dict):
        raise CoordinationError(f"etcd key {key} holds {type(value).__name__}, expected an object")
    return value


def address_of(raw: bytes, key: str) -> str:
    """The string ``"address"`` of the JSON object held by ``key``.

    Raises:
        CoordinationError: the value is not a JSON object with a string ``"address"``.
    """
    address = decode_object(raw, key).get("address")
    if not isinstance(address, str):
        raise CoordinationError(f"etcd key {key} has no string 'address'")
    return address


# --- polling --------------------------------------------------------------------------


def poll_delays() -> Iterator[float]:
    """Sleeps between polls, in seconds: 5 ms doubling up to 50 ms."""
    delay = POLL_MIN_S
    while True:
        yield delay
        delay = min(delay * 2, POLL_MAX_S)


def sleep_until_next_poll(delays: Iterator[float], deadline: float) -> None:
    """Sleep for the next of ``delays``, but not past ``deadline`` (monotonic seconds)."""
    time.sleep(max(0.0, min(next(delays), deadline - time.monotonic())))


# --- transactions ---------------------------------------------------------------------


class LeaseEquals:
    """A transaction compare ``lease(key) == lease_id``; pyetcd only builds the others.

    pyetcd's ``transaction`` only calls ``build_message()`` on each compare. For a
    missing key etcd compares lease 0, so the compare fails for any granted lease.
    """

    def __init__(self, key: str, lease_id: int) -> None:
        self._key = key
        self._lease_id = lease_id

    def build_message(self) -> Any:
        """The ``etcdserverpb.Compare`` message."""
        compare = etcdrpc.Compare()
        compare.key = self._key.encode("utf-8")
        compare.result = etcdrpc.Compare.EQUAL
        compare.target = etcdrpc.Compare.LEASE
        compare.lease = self._lease_id
        return compare
