"""What a process without a job's secret can do to the job: the attacker of the security tests.

``python -m elasticps.testing.attack --etcd HOST:PORT --job JOB`` (or
``--output DIR``, the job's output directory) reads where
the job's parameter servers and master are (from etcd, with a trainer's
stolen etcd credential when the job's etcd wants one: ``--stolen-trainer``),
then tries, with raw sockets and with the project's own client code:

- on every parameter server's TCP port and AF_UNIX socket: a HELLO, a PULL,
  a PUSH with a gradient, a CONTROL ``snapshot`` and ``seal``, sent at once
  in the clear, without TLS or the handshake, and 64 bytes of garbage;
- :class:`~elasticps.snapshot.ControlClient` with no secret and with a wrong
  one; with TLS on (``--tls on``, the default), first with a certificate of
  another CA, then with the stolen trainer's (which passes TLS, and must
  still fail on the secret);
- on the master: ``GetTask``, ``ReportTask``, ``ReportProgress`` and
  ``GetJobStatus`` through :class:`~elasticps.master.client.MasterClient`
  with no token and with a wrong one, for the id of a registered trainer
  (with TLS on, as the same two identities), and the gRPC health check
  (open, and says only SERVING; with TLS on, to a job certificate only);
- on etcd (with ``--stolen-trainer``): a plain HTTP request to its gateway,
  plain gRPC, TLS without a certificate, with another CA's ``root``
  certificate, and with the stolen trainer's: write the ledger, take the
  master lock, claim a PS slot, write the queue and the job state
  (:func:`etcd_attack`).

It prints one JSON object: ``{"attempts": [{"target", "attempt", "outcome",
"detail"}...]}``; ``outcome`` is ``refused`` (closed before any frame, or
refused by TLS, UNAUTHENTICATED or etcd's roles), ``answered`` (the job
served it: a hole) or ``open`` (served on purpose: the health check). Run it
as a separate process, without the job's secret or certificates in its
environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pyetcd import etcdrpc
from pyetcd.utils import prefix_range_end

from elasticps.coord.client import parse_endpoints
from elasticps.coord.keys import Keys
from elasticps.coord.store import JobStore
from elasticps.errors import AuthenticationError, ElasticPSError, ServiceUnavailableError
from elasticps.jobca import Credential, JobCA
from elasticps.master.client import MasterClient
from elasticps.proto import master_pb2
from elasticps.security import ETCD_CERT_ENV, ETCD_SERVER_NAME, SECRET_FILE_ENV, JobSecret
from elasticps.snapshot import ControlClient
from elasticps.tls import TLS_CERT_ENV, JobTLS, role_host
from elasticps.wire.auth import AUTH_MAGIC, CHALLENGE_BYTES
from elasticps.wire.frame import (
    DType,
    FrameHeader,
    MsgType,
    encode_header,
    send_json,
)

__all__ = ["attack", "etcd_attack", "main", "wait_for_job"]

_TIMEOUT_S = 5.0
_TLS_ALERT = b"\x15"  # the content type of a TLS alert record
_TLS_ALERT_BYTES = 7  # an alert record: 5 bytes of header, 2 of alert


def _raw_frames() -> dict[str, Callable[[socket.socket], None]]:
    """Requests sent as the first bytes of a connection, without the handshake."""

    def hello(sock: socket.socket) -> None:
        send_json(sock, MsgType.HELLO, {"trainer_id": 0, "layout": {}, "fingerprint": "x"})

    def pull(sock: socket.socket) -> None:
        sock.sendall(encode_header(FrameHeader(MsgType.PULL)))

    def push(sock: socket.socket) -> None:
        body = b"\0" * 4096
        header = FrameHeader(MsgType.PUSH, dtype=DType.FLOAT32, body_nbytes=len(body))
        sock.sendall(encode_header(header) + body)

    def snapshot(sock: socket.socket) -> None:
        send_json(sock, MsgType.CONTROL, {"op": "snapshot", "dir": "/tmp/stolen"})

    def seal(sock: socket.socket) -> None:
        send_json(sock, MsgType.CONTROL, {"op": "seal", "pass": 0})

    def garbage(sock: socket.socket) -> None:
        sock.sendall(os.urandom(64))

    return {
        "hello": hello,
        "pull": pull,
        "push": push,
        "control_snapshot": snapshot,
        "control_seal": seal,
        "garbage_response": garbage,
    }


def _raw_attempt(family: int, address: Any, send: Callable[[socket.socket], None]) -> str:
    """Send at once, then read until the server closes: ``refused`` if all it sent is
    its CHALLENGE and a refusal (32 zero bytes), or a TLS alert; else ``answered``."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT_S)
        sock.connect(address)
        try:
            send(sock)
        except (BrokenPipeError, ConnectionResetError):
            return "refused"
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            return "answered"  # still open: the server is waiting for more
    if received[:1] == _TLS_ALERT and len(received) <= _TLS_ALERT_BYTES:
        return "refused"  # a TLS server that read no ClientHello
    # All a server without TLS may send: its challenge, then the refusal once it has
    # read a whole wrong RESPONSE.
    challenge, rest = received[:CHALLENGE_BYTES], received[CHALLENGE_BYTES:]
    if challenge and not challenge.startswith(AUTH_MAGIC):
        return "answered"
    return "refused" if rest in (b"", bytes(32)) else "answered"


def _client_attempt(call: Callable[[], object], *, tls: bool = False) -> tuple[str, str]:
    """Run ``call``: ``refused`` if the job turned it down (with ``tls``, a master that
    closes the connection during the TLS handshake counts: gRPC calls that unavailable)."""
    try:
        call()
    except AuthenticationError as exc:
        return "refused", str(exc)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
            return "refused", str(exc.details())
        if tls and exc.code() is grpc.StatusCode.UNAVAILABLE:
            return "refused", f"TLS handshake: {exc.details()}"
        return "answered", f"{exc.code()}: {exc.details()}"
    except ServiceUnavailableError as exc:
        if tls:
            return "refused", f"TLS handshake: {exc}"
        return "answered", f"{type(exc).__name__}: {exc}"
    except ElasticPSError as exc:
        return "answered", f"{type(exc).__name__}: {exc}"
    return "answered", "served"


def _control_stats(
    address: str, secret: JobSecret | None, tls: JobTLS | None
) -> Callable[[], object]:
    def call() -> object:
        client = ControlClient(address, timeout_s=_TIMEOUT_S, secret=secret, tls=tls)
        try:
            return client.request({"op": "stats"})
        finally:
            client.close()

    return call


def _master_calls(client: MasterClient, trainer_id: str) -> dict[str, Callable[[], object]]:
    return {
        "GetTask": lambda: client.get_task(trainer_id),
        "ReportTask": lambda: client.report_task(
            master_pb2.ReportTaskRequest(trainer_id=trainer_id, task_id=0, success=True)
        ),
        "ReportProgress": lambda: client.report_progress(
            master_pb2.ReportProgressRequest(trainer_id=trainer_id, task_id=0)
        ),
        "GetJobStatus": client.job_status,
    }


def _job_of(output: Path, deadline: float) -> tuple[str, str, str]:
    """The etcd endpoint, name and ``--tls`` of the job of ``output``, once its run.json
    says it runs."""
    while True:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((output / "run.json").read_text())
            if isinstance(record, dict) and record.get("state") == "running":
                security = record.get("security")
                tls = security.get("tls", "on") if isinstance(security, dict) else "on"
                return str(record["etcd"]), str(record["job"]), str(tls)
        if time.monotonic() > deadline:
            raise ElasticPSError(f"no running job in {output}")
        time.sleep(0.05)


def wait_for_job(etcd: str, job: str, timeout_s: float, tls: Credential | None = None) -> None:
    """Wait until the job's etcd answers and holds every PS slot it wants and a master.

    Raises:
        ElasticPSError: not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with JobStore(etcd, job, timeout_s=2.0, tls=tls) as store:
                wanted = store.ps_desired()
                if wanted and len(store.ps_slots()) >= wanted:
                    store.master_address(timeout_s=1.0)
                    return
        except ElasticPSError:
            pass
        if time.monotonic() > deadline:
            raise ElasticPSError(f"job {job} did not start training within {timeout_s} s")
        time.sleep(0.1)


def _outsider(ca_pem: bytes, directory: Path) -> JobTLS:
    """A trainer certificate of another CA, trusting the job's CA (whose certificate is
    no secret): TLS that the job's servers must refuse."""
    issued = JobCA.generate("attacker").issue("trainer", dns_names=(role_host("trainer"),))
    Credential(ca_pem, issued.cert_pem, issued.key_pem).write(directory)
    return JobTLS.from_dir(directory)


def attack(
    etcd: str,
    job: str,
    trainer_id: str = "0",
    stolen: Path | None = None,
    *,
    tls: bool = True,
) -> list[dict[str, str]]:
    """Try every plane of a running job without its secret; return each attempt's outcome.

    Args:
        etcd: the job's etcd endpoint.
        job: the job name.
        trainer_id: a registered trainer's id, to pose as.
        stolen: the directory of a trainer's credential (``ca.pem``, ``cert.pem``,
            ``key.pem``): find the servers with it in etcd, and try with it what
            needs the secret too, and in etcd what a trainer may not do; None:
            the job's etcd has no TLS.
        tls: the job runs with TLS on (``--tls on``): the TCP attempts of the
            project's clients are made with another CA's certificate (and the
            stolen one), and a master that closes during the handshake refused.

    Returns:
        ``{"target", "attempt", "outcome", "detail"}`` per attempt (see the
        module docstring).

    Raises:
        ElasticPSError: etcd holds no PS slot or no master for the job.
    """
    results: list[dict[str, str]] = []

    def record(target: str, attempt: str, outcome: str, detail: str = "") -> None:
        results.append({"target": target, "attempt": attempt, "outcome": outcome, "detail": detail})

    etcd_cred = None if stolen is None else Credential.read_dir(stolen, ETCD_SERVER_NAME)
    with JobStore(etcd, job, tls=etcd_cred) as store:
        slots = store.ps_slots()
        master = store.master_address(timeout_s=10.0)
    if not slots:
        raise ElasticPSError(f"job {job} has no PS slot in etcd")
    wrong = JobSecret.generate()
    # Who the project's clients pose as: (label, TLS); with TLS on, another CA's
    # certificate and, if stolen, a real trainer's (whose connection still needs the
    # secret). Plain TCP to a TLS port is tried with raw sockets.
    identities: list[tuple[str, JobTLS | None]] = [("", None)]
    with tempfile.TemporaryDirectory(prefix="elasticps-attacker-") as scratch:
        if tls:
            if etcd_cred is None:
                raise ElasticPSError("with TLS on, give the stolen trainer's directory")
            identities = [
                ("another CA's certificate, ", _outsider(etcd_cred.ca_pem, Path(scratch) / "o")),
                ("stolen trainer certificate, ", JobTLS.from_dir(stolen)),  # type: ignore[arg-type]
            ]
        for index, slot in sorted(slots.items()):
            host, _, port = slot.address.rpartition(":")
            endpoints: list[tuple[str, int, Any]] = [
                (f"ps-{index} tcp {slot.address}", socket.AF_INET, (host, int(port)))
            ]
            if slot.unix:
                endpoints.append((f"ps-{index} unix {slot.unix}", socket.AF_UNIX, slot.unix))
            for target, family, address in endpoints:
                for name, send in _raw_frames().items():
                    try:
                        record(target, f"raw {name}", _raw_attempt(family, address, send))
                    except OSError as exc:
                        record(target, f"raw {name}", "refused", str(exc))
            for who, job_tls in identities:
                for label, secret in (("no secret", None), ("wrong secret", wrong)):
                    outcome, detail = _client_attempt(_control_stats(slot.address, secret, job_tls))
                    record(
                        f"ps-{index} tcp {slot.address}",
                        f"ControlClient, {who}{label}",
                        outcome,
                        detail,
                    )
        for who, job_tls in identities:
            for label, secret in (("no token", None), ("wrong token", wrong)):
                client = MasterClient(
                    master, retry_s=0.0, rpc_timeout_s=_TIMEOUT_S, secret=secret, tls=job_tls
                )
                try:
                    for name, call in _master_calls(client, trainer_id).items():
                        outcome, detail = _client_attempt(call, tls=tls)
                        record(f"master {master}", f"{name}, {who}{label}", outcome, detail)
                finally:
                    client.close()
        _health(master, record, identities[-1][1] if tls else None)
    if stolen is not None:
        assert etcd_cred is not None
        results += etcd_attack(etcd, Keys(job), etcd_cred)
    return results


def _health(
    master: str, record: Callable[[str, str, str, str], None], job_tls: JobTLS | None
) -> None:
    """The gRPC health check: open in the clear without TLS; with TLS, refused in the
    clear and open to a certificate of the job (it says only SERVING)."""
    target = f"master {master}"

    def check(channel: grpc.Channel) -> str:
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_TIMEOUT_S)
            return str(reply.status)

    if job_tls is None:
        record(target, "health check", "open", check(grpc.insecure_channel(master)))
        return
    outcome, detail = _client_attempt(lambda: check(grpc.insecure_channel(master)), tls=True)
    record(target, "health check, plain", outcome, detail)
    options = (("grpc.ssl_target_name_override", role_host("master")),)
    channel = grpc.secure_channel(master, job_tls.grpc_channel_credentials(), options=options)
    record(target, "health check, stolen trainer certificate", "open", check(channel))


def _etcd_refused(call: Callable[[], object]) -> tuple[str, str]:
    """``refused`` if etcd turned the call down (its TLS handshake, or its roles)."""
    try:
        call()
    except grpc.FutureTimeoutError:
        return "refused", "no TLS session: etcd wants a certificate from the job's CA"
    except grpc.RpcError as exc:
        if exc.code() in (
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.UNAVAILABLE,
        ):
            return "refused", f"{exc.code().name}: {exc.details()}"
        return "answered", f"{exc.code().name}: {exc.details()}"
    return "answered", "served"


def _kv(channel: grpc.Channel) -> Any:
    grpc.channel_ready_future(channel).result(timeout=_TIMEOUT_S)
    return etcdrpc.KVStub(channel)


def etcd_attack(endpoint: str, keys: Keys, stolen: Credential | None) -> list[dict[str, str]]:
    """Try the job's etcd: without TLS, without a certificate, with another CA's, and
    with ``stolen`` (a trainer's credential) against keys a trainer must not write.

    Returns:
        ``{"target", "attempt", "outcome", "detail"}`` per attempt.
    """
    results: list[dict[str, str]] = []
    target = f"etcd {endpoint}"
    root = keys.root.encode()
    read_all = etcdrpc.RangeRequest(key=root, range_end=prefix_range_end(root))
    ledger = etcdrpc.PutRequest(key=keys.task(0).encode(), value=b'{"state":"done"}')

    def attempt(name: str, make: Callable[[], grpc.Channel], request: Any) -> None:
        def call() -> object:
            with make() as channel:
                stub = _kv(channel)
                if isinstance(request, etcdrpc.RangeRequest):
                    return stub.Range(request, timeout=_TIMEOUT_S)
                if isinstance(request, etcdrpc.TxnRequest):
                    return stub.Txn(request, timeout=_TIMEOUT_S)
                return stub.Put(request, timeout=_TIMEOUT_S)

        outcome, detail = _etcd_refused(call)
        results.append({"target": target, "attempt": name, "outcome": outcome, "detail": detail})

    with contextlib.suppress(OSError):  # an HTTP request to etcd's JSON gateway, in the clear
        host, port = parse_endpoints(endpoint)[0]
        with socket.create_connection((host, port), timeout=_TIMEOUT_S) as sock:
            sock.sendall(b"POST /v3/kv/range HTTP/1.1\r\nHost: etcd\r\nContent-Length: 2\r\n\r\n{}")
            sock.settimeout(_TIMEOUT_S)
            try:
                reply = sock.recv(4096)
            except OSError:
                reply = b""
        served = reply.startswith(b"HTTP/1.1 200")
        results.append(
            {
                "target": target,
                "attempt": "HTTP range, plain",
                "outcome": "answered" if served else "refused",
                "detail": reply[:40].decode("latin-1"),
            }
        )
    netloc = ",".join(f"{h}:{p}" for h, p in parse_endpoints(endpoint)[:1])
    attempt("read the job's keys, plain gRPC", lambda: grpc.insecure_channel(netloc), read_all)
    ca_pem = stolen.ca_pem if stolen is not None else None
    name_option = [("grpc.ssl_target_name_override", stolen.server_name)] if stolen else []

    def tls_channel(key: bytes | None, cert: bytes | None) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(ca_pem, key, cert)
        return grpc.secure_channel(netloc, creds, options=name_option)

    attempt("read the job's keys, TLS, no certificate", lambda: tls_channel(None, None), read_all)
    other = JobCA.generate(keys.job).issue("root")
    attempt(
        "write the ledger, TLS, another CA's root certificate",
        lambda: tls_channel(other.key_pem, other.cert_pem),
        ledger,
    )
    if stolen is None:
        return results

    def trainer() -> grpc.Channel:
        return tls_channel(stolen.key_pem, stolen.cert_pem)

    claim = etcdrpc.TxnRequest(
        compare=[
            etcdrpc.Compare(
                result=etcdrpc.Compare.EQUAL,
                target=etcdrpc.Compare.CREATE,
                key=keys.ps(0).encode(),
                create_revision=0,
            )
        ],
        success=[
            etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=keys.ps(0).encode(), value=b"{}"))
        ],
        failure=[
            etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=keys.ps(0).encode(), value=b"{}"))
        ],
    )
    for name, request in (
        ("write the ledger", ledger),
        ("take the master lock", etcdrpc.PutRequest(key=keys.master_lock.encode(), value=b"{}")),
        ("claim PS slot 0", claim),
        ("write the queue", etcdrpc.PutRequest(key=keys.queue_meta.encode(), value=b"{}")),
        ("write the job state", etcdrpc.PutRequest(key=keys.job_state.encode(), value=b'"done"')),
    ):
        attempt(f"{name}, stolen trainer certificate", trainer, request)
    return results


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); exit 0 however the attempts went."""
    parser = argparse.ArgumentParser(prog="python -m elasticps.testing.attack")
    parser.add_argument("--etcd", default="", help="the job's etcd endpoint, HOST:PORT")
    parser.add_argument("--job", default="", help="the job name")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="instead of --etcd and --job: the job's output directory, whose run.json names "
        "them once the job runs (waited for, as long as --wait-s)",
    )
    parser.add_argument("--trainer-id", default="0", help="a registered trainer's id to pose as")
    parser.add_argument(
        "--stolen-trainer",
        type=Path,
        default=None,
        help="a directory with a trainer's etcd credential (ca.pem, cert.pem, key.pem): "
        "find the servers with it, and try what a trainer may not write",
    )
    parser.add_argument(
        "--wait-s", type=float, default=0.0, help="first wait this long for the job to train"
    )
    parser.add_argument(
        "--tls",
        choices=("on", "off"),
        default=None,
        help="whether the job runs with TLS on (default: what its run.json says, else on)",
    )
    args = parser.parse_args(argv)
    for name in (SECRET_FILE_ENV, ETCD_CERT_ENV, TLS_CERT_ENV):
        if os.environ.get(name):
            parser.error(f"run without {name}: the attacker holds none of the job's files")
    deadline = time.monotonic() + args.wait_s
    tls = "on"
    if args.output is not None:
        args.etcd, args.job, tls = _job_of(args.output, deadline)
    tls = args.tls or tls
    if not args.etcd or not args.job:
        parser.error("give --etcd and --job, or --output")
    stolen = None
    if args.stolen_trainer is not None:
        stolen = Credential.read_dir(args.stolen_trainer, ETCD_SERVER_NAME)
    if args.wait_s > 0:
        wait_for_job(args.etcd, args.job, max(1.0, deadline - time.monotonic()), stolen)
    attempts = attack(args.etcd, args.job, args.trainer_id, args.stolen_trainer, tls=tls == "on")
    print(json.dumps({"attempts": attempts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
