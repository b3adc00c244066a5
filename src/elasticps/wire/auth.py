"""The tensor plane's handshake: a connection proves the job secret before its first frame.

Every connection to a parameter server, TCP or AF_UNIX, starts with three
fixed-size messages, before any frame is read:

====================  =====  ===================================================
message               bytes  content
====================  =====  ===================================================
server: CHALLENGE        49  ``b"EPSAUTH1"`` | flags (u8) | epoch (u64 LE) |
                             nonce_s (32 random bytes)
client: RESPONSE         64  nonce_c (32 random bytes) | mac_c (32)
server: CONFIRM          32  mac_s, or 32 zero bytes: refused
====================  =====  ===================================================

``mac_c = HMAC-SHA256(K, b"client" | nonce_s | nonce_c | epoch)`` and
``mac_s = HMAC-SHA256(K, b"server" | nonce_s | nonce_c | epoch)`` (RFC 2104),
with ``K`` the tensor-plane key of the job secret
(:meth:`elasticps.security.JobSecret.tensor_plane_key`) and ``epoch`` the
slot epoch the server holds. Both sides' fresh nonces make every exchange
new, so a recorded one cannot be replayed; the epoch binds it to one holder
of the slot; and ``mac_s`` proves to the client that the server holds the
secret too, so a process squatting on a freed port cannot pose as a server.
The server compares with :func:`hmac.compare_digest`. A wrong answer gets
32 zero bytes (so that the client can tell a refusal from a server that
died) and the connection is closed; a late (:data:`HANDSHAKE_TIMEOUT_S`) or
short one is closed. No frame is read from either. On the client's side, a
server that closes or stalls mid-handshake is a broken connection
(``OSError``, retried like any other), not an authentication failure.

A server without a secret (a job run with ``--auth off``) sends flags 0 and
expects no RESPONSE; a client that holds a secret refuses such a server, and
a client without one refuses a server that asks for one: both say what to fix.

Over AF_UNIX (and so for shared memory, whose file descriptors travel on
that socket), each side also checks with ``SO_PEERCRED`` that the peer runs
as the same user (:func:`check_peer_uid`).

The handshake costs one round trip per connection (connections last the
job); frames after it are not touched (``benchmarks/README.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import struct
from typing import Final

from elasticps.errors import AuthenticationError
from elasticps.wire.frame import ConnectionClosedError, recv_exact_into

__all__ = [
    "CHALLENGE_BYTES",
    "HANDSHAKE_TIMEOUT_S",
    "AuthenticationError",
    "check_peer_uid",
    "client_handshake",
    "server_handshake",
]

AUTH_MAGIC: Final = b"EPSAUTH1"
_CHALLENGE: Final = struct.Struct("<8sBQ32s")
CHALLENGE_BYTES: Final = _CHALLENGE.size  # 49
_NONCE_BYTES: Final = 32
_MAC_BYTES: Final = 32
_FLAG_AUTH: Final = 1
_REFUSED: Final = bytes(32)

HANDSHAKE_TIMEOUT_S: Final = 10.0
"""How long the server waits for a RESPONSE, and the client for each message, seconds."""

_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _mac(key: bytes, side: bytes, nonce_s: bytes, nonce_c: bytes, epoch: int) -> bytes:
    return hmac.new(
        key, side + nonce_s + nonce_c + epoch.to_bytes(8, "little"), hashlib.sha256
    ).digest()


def _recv(sock: socket.socket, nbytes: int) -> bytes:
    """Exactly ``nbytes`` bytes (raises ``ConnectionClosedError`` or ``TimeoutError``)."""
    buf = bytearray(nbytes)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def server_handshake(
    sock: socket.socket, key: bytes | None, epoch: int, *, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Authenticate the client of a newly accepted connection (the server's side).

    Args:
        sock: the accepted, blocking stream socket; its timeout is set to
            ``timeout_s`` for the handshake and back to blocking after it.
        key: the tensor-plane key, or None to ask for no proof (``--auth off``).
        epoch: the slot epoch this server holds (0 before its claim).
        timeout_s: how long the client has to answer, seconds.

    Raises:
        AuthenticationError: the client's answer is wrong, short or late.
        OSError: the connection broke.
    """
    nonce_s = secrets.token_bytes(_NONCE_BYTES)
    sock.settimeout(timeout_s)
    try:
        flags = _FLAG_AUTH if key is not None else 0
        sock.sendall(_CHALLENGE.pack(AUTH_MAGIC, flags, epoch, nonce_s))
        if key is None:
            return
        try:
            answer = _recv(sock, _NONCE_BYTES + _MAC_BYTES)
        except TimeoutError:
            raise AuthenticationError(
                "timeout", "no RESPONSE within the handshake's time"
            ) from None
        except ConnectionClosedError as exc:
            raise AuthenticationError(
                "short", f"the peer closed before its RESPONSE: {exc}"
            ) from None
        nonce_c, mac_c = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
        if not hmac.compare_digest(mac_c, _mac(key, b"client", nonce_s, nonce_c, epoch)):
            with contextlib.suppress(OSError):
                sock.sendall(_REFUSED)
            raise AuthenticationError("bad_mac", "the client does not hold the job secret")
        sock.sendall(_mac(key, b"server", nonce_s, nonce_c, epoch))
    finally:
        sock.settimeout(None)


def client_handshake(
    sock: socket.socket,
    key: bytes | None,
    epoch: int,
    *,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> int:
    """Prove the job secret to a server, and check that it holds it too (the client's side).

    Args:
        sock: a newly connected stream socket; its timeout is ``timeout_s``
            during the handshake and is left blocking after it.
        key: the tensor-plane key, or None for a job run with ``--auth off``.
        epoch: the slot epoch the client expects the server to hold; 0 for any.
        timeout_s: how long to wait for each of the server's messages, seconds.

    Returns:
        The epoch the server holds.

    Raises:
        AuthenticationError: the server refused this side's secret (``refused``),
            is not an elasticps server, holds
            another epoch (``wrong_epoch``), asks for a secret this side lacks,
            offers no authentication while this side has a secret, or answers
            a wrong ``mac_s``.
        OSError: the connection broke, or the server answered nothing in time
            (``TimeoutError``): retry.
    """
    sock.settimeout(timeout_s)
    try:
        # The server closing or stalling here is a broken connection, not a refusal:
        # ConnectionClosedError becomes ConnectionResetError, TimeoutError stays.
        magic, flags, server_epoch, nonce_s = _CHALLENGE.unpack(_recv(sock, CHALLENGE_BYTES))
        if magic != AUTH_MAGIC:
            raise AuthenticationError(
                "bad_challenge", "the peer is not an elasticps parameter server of this version"
            )
        if epoch and server_epoch != epoch:
            raise AuthenticationError(
                "wrong_epoch", f"the server holds epoch {server_epoch}, expected {epoch}"
            )
        if not flags & _FLAG_AUTH:
            if key is not None:
                raise AuthenticationError(
                    "unauthenticated_server",
                    "the parameter server asks for no job secret (its job runs with --auth "
                    "off, or it is not this job's); refusing it",
                )
            return int(server_epoch)
        if key is None:
            raise AuthenticationError(
                "no_secret",
                "the parameter server asks for the job secret, and this process has none "
                "(set ELASTICPS_JOB_SECRET_FILE, or run the job with --auth off)",
            )
        nonce_c = secrets.token_bytes(_NONCE_BYTES)
        sock.sendall(nonce_c + _mac(key, b"client", nonce_s, nonce_c, server_epoch))
        mac_s = _recv(sock, _MAC_BYTES)
        if mac_s == _REFUSED:
            raise AuthenticationError(
                "refused", "the parameter server refused this process's job secret"
            )
        if not hmac.compare_digest(mac_s, _mac(key, b"server", nonce_s, nonce_c, server_epoch)):
            raise AuthenticationError(
                "bad_mac", "the parameter server does not hold the job secret"
            )
        return int(server_epoch)
    except ConnectionClosedError as exc:
        raise ConnectionResetError(f"the server closed during the handshake: {exc}") from None
    finally:
        sock.settimeout(None)


def check_peer_uid(sock: socket.socket) -> None:
    """Check that the peer of an AF_UNIX socket runs as this process's user (``SO_PEERCRED``).

    Raises:
        AuthenticationError: it runs as another user (``peer_uid``).
        OSError: the socket is not a connected AF_UNIX socket.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    _, uid, _ = _PEERCRED.unpack(raw)
    if uid != os.geteuid():
        raise AuthenticationError(
            "peer_uid", f"the AF_UNIX peer runs as uid {uid}, not as this process's {os.geteuid()}"
        )
