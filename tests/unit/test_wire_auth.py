"""The tensor plane's handshake on socket pairs, and the job secret's file."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticps.errors import AuthenticationError, ConfigError
from elasticps.security import (
    AUTH_OFF_ENV,
    SECRET_FILE_ENV,
    JobSecret,
    Refusals,
    job_credentials,
    output_secret,
    secret_from_env,
)
from elasticps.wire.auth import CHALLENGE_BYTES, check_peer_uid, client_handshake, server_handshake

pytestmark = pytest.mark.timeout(30)

KEY = JobSecret.generate().tensor_plane_key()
OTHER = JobSecret.generate().tensor_plane_key()


class _Server:
    """The server end of a socket pair, running ``handshake`` on a thread."""

    def __init__(self, sock: socket.socket, handshake: Callable[[socket.socket], object]) -> None:
        self.outcome: object = None
        self._thread = threading.Thread(target=self._run, args=(sock, handshake), daemon=True)
        self._thread.start()

    def _run(self, sock: socket.socket, handshake: Callable[[socket.socket], object]) -> None:
        try:
            self.outcome = handshake(sock)
        except BaseException as exc:
            self.outcome = exc
        finally:
            sock.close()


def _pair(server: Callable[[socket.socket], object]) -> tuple[socket.socket, _Server]:
    """The client end of a socket pair whose server end runs ``server`` on a thread."""
    a, b = socket.socketpair()
    return a, _Server(b, server)


def _server_result(server: _Server) -> object:
    server._thread.join(10)
    return server.outcome


def test_the_same_secret_on_both_sides_authenticates_both() -> None:
    client, outcome = _pair(lambda s: server_handshake(s, KEY, 7))
    with client:
        assert client_handshake(client, KEY, 7) == 7
        assert client.gettimeout() is None
    assert _server_result(outcome) is None


def test_a_wrong_secret_is_refused_and_the_client_is_told() -> None:
    client, outcome = _pair(lambda s: server_handshake(s, KEY, 3))
    with client, pytest.raises(AuthenticationError) as caught:
        client_handshake(client, OTHER, 3)
    assert caught.value.reason == "refused"
    server = _server_result(outcome)
    assert isinstance(server, AuthenticationError) and server.reason == "bad_mac"


def test_a_client_without_a_secret_refuses_a_server_that_asks_for_one() -> None:
    client, outcome = _pair(lambda s: server_handshake(s, KEY, 1))
    with client, pytest.raises(AuthenticationError) as caught:
        client_handshake(client, None, 1)
    assert caught.value.reason == "no_secret"
    client.close()
    server = _server_result(outcome)
    assert isinstance(server, AuthenticationError) and server.reason == "short"


def test_a_client_with_a_secret_refuses_a_server_without_one() -> None:
    client, outcome = _pair(lambda s: server_handshake(s, None, 1))
    with client, pytest.raises(AuthenticationError) as caught:
        client_handshake(client, KEY, 1)
    assert caught.value.reason == "unauthenticated_server"
    assert _server_result(outcome) is None


def test_neither_side_with_a_secret_is_auth_off() -> None:
    client, outcome = _pair(lambda s: server_handshake(s, None, 5))
    with client:
        assert client_handshake(client, None, 0) == 5
    assert _server_result(outcome) is None


def test_a_server_of_another_epoch_is_named() -> None:
    client, _ = _pair(lambda s: server_handshake(s, KEY, 9))
    with client, pytest.raises(AuthenticationError) as caught:
        client_handshake(client, KEY, 8)
    assert caught.value.reason == "wrong_epoch"


def test_a_silent_client_times_out_and_a_server_that_dies_is_a_broken_connection() -> None:
    client, outcome = _pair(lambda s: server_handshake(s, KEY, 1, timeout_s=0.2))
    with client:
        assert len(client.recv(CHALLENGE_BYTES)) == CHALLENGE_BYTES
        server = _server_result(outcome)
        assert isinstance(server, AuthenticationError) and server.reason == "timeout"
        # The server closed: for the client that is an OSError (retried), not a refusal.
        with pytest.raises(OSError):
            client_handshake(client, KEY, 1)


def test_garbage_and_a_replayed_response_are_refused() -> None:
    for answer in (os.urandom(64), b"\0" * 64):
        client, outcome = _pair(lambda s: server_handshake(s, KEY, 1))
        with client:
            client.recv(CHALLENGE_BYTES)
            client.sendall(answer)
            assert client.recv(64) == bytes(32)  # the refusal, then the close
        server = _server_result(outcome)
        assert isinstance(server, AuthenticationError) and server.reason == "bad_mac"


def test_the_peer_of_a_unix_socket_pair_runs_as_this_user() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        check_peer_uid(a)


def test_a_secret_file_is_mode_0600_and_read_back(tmp_path: Path) -> None:
    secret = JobSecret.generate()
    path = tmp_path / "job-secret"
    secret.write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert JobSecret.read(path) == secret
    assert "hidden" in repr(secret) and secret.key.hex() not in repr(secret)
    assert secret.grpc_token() != secret.key.hex()
    assert secret.tensor_plane_key() != secret.key


def test_a_secret_file_others_may_read_or_without_a_secret_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "job-secret"
    JobSecret.generate().write(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        JobSecret.read(path)
    path.write_text("not hex\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="does not hold a job secret"):
        JobSecret.read(path)
    path.write_text("ab" * 8 + "\n")
    with pytest.raises(ConfigError, match="32 bytes"):
        JobSecret.read(path)
    with pytest.raises(ConfigError, match="cannot read"):
        JobSecret.read(tmp_path / "missing")


def test_job_credentials_give_the_roles_the_secret_and_restore_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(AUTH_OFF_ENV, "1")
    with job_credentials(tmp_path, auth=True) as secret:
        assert secret is not None
        assert os.environ[SECRET_FILE_ENV] == str(tmp_path / "security" / "job-secret")
        assert AUTH_OFF_ENV not in os.environ
        assert secret_from_env() == secret == output_secret(tmp_path)
        assert (tmp_path / "security").stat().st_mode & 0o777 == 0o700
    assert SECRET_FILE_ENV not in os.environ and os.environ[AUTH_OFF_ENV] == "1"
    with job_credentials(tmp_path / "off", auth=False) as none:
        assert none is None and secret_from_env() is None
        assert not (tmp_path / "off" / "security").exists()


def test_refusals_are_counted_by_reason_and_logged_at_each_doubling() -> None:
    refusals = Refusals()
    logged = [refusals.add("bad_mac" if i % 2 else "short") for i in range(1, 10)]
    assert logged == [1, 2, None, 4, None, None, None, 8, None]
    assert refusals.counts() == {"bad_mac": 5, "short": 4}
