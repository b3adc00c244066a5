"""What a process without a job's secret can do to the job: the attacker of the security tests.

``python -m elasticps.testing.attack --etcd HOST:PORT --job JOB`` (or
``--output DIR``, the job's output directory) reads where
the job's parameter servers and master are (from etcd, which a job's
processes on one machine share; see the README's Security section), then
tries, with raw sockets and with the project's own client code:

- on every parameter server's TCP port and AF_UNIX socket: a HELLO, a PULL,
  a PUSH with a gradient, a CONTROL ``snapshot`` and ``seal``, sent at once
  without the handshake, and 64 bytes of garbage as the handshake;
- :class:`~elasticps.snapshot.ControlClient` with no secret and with a wrong
  one;
- on the master: ``GetTask``, ``ReportTask`` and ``ReportProgress`` through
  :class:`~elasticps.master.client.MasterClient` with no token and with a
  wrong one, for the id of a registered trainer, and the gRPC health check
  (which is open, and says only SERVING).

It prints one JSON object: ``{"attempts": [{"target", "attempt", "outcome",
"detail"}...]}``; ``outcome`` is ``refused`` (closed before any frame, or
refused with UNAUTHENTICATED), ``answered`` (the job served it: a hole) or
``open`` (served on purpose: the health check). Run it as a separate
process, without ``ELASTICPS_JOB_SECRET_FILE`` in its environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticps.coord.store import JobStore
from elasticps.errors import AuthenticationError, ElasticPSError
from elasticps.master.client import MasterClient
from elasticps.proto import master_pb2
from elasticps.security import SECRET_FILE_ENV, JobSecret
from elasticps.snapshot import ControlClient
from elasticps.wire.auth import CHALLENGE_BYTES
from elasticps.wire.frame import (
    ConnectionClosedError,
    DType,
    FrameHeader,
    MsgType,
    encode_header,
    recv_exact_into,
    send_json,
)

__all__ = ["attack", "main", "wait_for_job"]

_TIMEOUT_S = 5.0


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
    """``refused`` if the server sends nothing after its CHALLENGE but a refusal, and
    closes; else ``answered``."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT_S)
        sock.connect(address)
        try:
            recv_exact_into(sock, memoryview(bytearray(CHALLENGE_BYTES)))
        except ConnectionClosedError:
            return "refused"
        send(sock)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            return "answered"  # still open: the server is waiting for more
    # All the server may send after its challenge: the refusal (32 zero bytes),
    # once it has read a whole wrong RESPONSE.
    return "refused" if received in (b"", bytes(32)) else "answered"


def _client_attempt(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except AuthenticationError as exc:
        return "refused", str(exc)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
            return "refused", str(exc.details())
        return "answered", f"{exc.code()}: {exc.details()}"
    except ElasticPSError as exc:
        return "answered", f"{type(exc).__name__}: {exc}"
    return "answered", "served"


def _control_stats(address: str, secret: JobSecret | None) -> Callable[[], object]:
    def call() -> object:
        client = ControlClient(address, timeout_s=_TIMEOUT_S, secret=secret)
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


def _job_of(output: Path, deadline: float) -> tuple[str, str]:
    """The etcd endpoint and name of the job of ``output``, once its run.json says it runs."""
    while True:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((output / "run.json").read_text())
            if isinstance(record, dict) and record.get("state") == "running":
                return str(record["etcd"]), str(record["job"])
        if time.monotonic() > deadline:
            raise ElasticPSError(f"no running job in {output}")
        time.sleep(0.05)


def wait_for_job(etcd: str, job: str, timeout_s: float) -> None:
    """Wait until the job's etcd answers and holds every PS slot it wants and a master.

    Raises:
        ElasticPSError: not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with JobStore(etcd, job, timeout_s=2.0) as store:
                wanted = store.ps_desired()
                if wanted and len(store.ps_slots()) >= wanted:
                    store.master_address(timeout_s=1.0)
                    return
        except ElasticPSError:
            pass
        if time.monotonic() > deadline:
            raise ElasticPSError(f"job {job} did not start training within {timeout_s} s")
        time.sleep(0.1)


def attack(etcd: str, job: str, trainer_id: str = "0") -> list[dict[str, str]]:
    """Try every plane of a running job without its secret; return each attempt's outcome.

    Args:
        etcd: the job's etcd endpoint.
        job: the job name.
        trainer_id: a registered trainer's id, to pose as.

    Returns:
        ``{"target", "attempt", "outcome", "detail"}`` per attempt (see the
        module docstring).

    Raises:
        ElasticPSError: etcd holds no PS slot or no master for the job.
    """
    results: list[dict[str, str]] = []

    def record(target: str, attempt: str, outcome: str, detail: str = "") -> None:
        results.append({"target": target, "attempt": attempt, "outcome": outcome, "detail": detail})

    with JobStore(etcd, job) as store:
        slots = store.ps_slots()
        master = store.master_address(timeout_s=10.0)
    if not slots:
        raise ElasticPSError(f"job {job} has no PS slot in etcd")
    wrong = JobSecret.generate()
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
        for label, secret in (("no secret", None), ("wrong secret", wrong)):
            outcome, detail = _client_attempt(_control_stats(slot.address, secret))
            record(f"ps-{index} tcp {slot.address}", f"ControlClient, {label}", outcome, detail)
    for label, secret in (("no token", None), ("wrong token", wrong)):
        client = MasterClient(master, retry_s=0.0, rpc_timeout_s=_TIMEOUT_S, secret=secret)
        try:
            for name, call in _master_calls(client, trainer_id).items():
                outcome, detail = _client_attempt(call)
                record(f"master {master}", f"{name}, {label}", outcome, detail)
        finally:
            client.close()
    with grpc.insecure_channel(master) as channel:
        stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_TIMEOUT_S)
        record(f"master {master}", "health check", "open", str(reply.status))
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
        "--wait-s", type=float, default=0.0, help="first wait this long for the job to train"
    )
    args = parser.parse_args(argv)
    if os.environ.get(SECRET_FILE_ENV):
        parser.error(f"run without {SECRET_FILE_ENV}: the attacker holds no secret")
    deadline = time.monotonic() + args.wait_s
    if args.output is not None:
        args.etcd, args.job = _job_of(args.output, deadline)
    if not args.etcd or not args.job:
        parser.error("give --etcd and --job, or --output")
    if args.wait_s > 0:
        wait_for_job(args.etcd, args.job, max(1.0, deadline - time.monotonic()))
    print(json.dumps({"attempts": attack(args.etcd, args.job, args.trainer_id)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
