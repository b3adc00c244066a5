"""TLS on the tensor plane and on gRPC: a parameter server and a gRPC server in this
process, on 127.0.0.1, with certificates from a job CA made here, and peers with
certificates from another CA, with none, or speaking plain TCP."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from torch import nn

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import AuthenticationError
from elasticps.jobca import JobCA
from elasticps.netutil import LOOPBACK
from elasticps.pserver.server import ParameterServer
from elasticps.security import JobSecret
from elasticps.testing import wait_for
from elasticps.tls import JobTLS, role_host
from elasticps.trainer.client import ParameterClient
from elasticps.trainer.flat import bind_flat_buffers
from elasticps.wire.frame import HEADER_SIZE

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 10.0
SGD_LR1 = OptimizerConfig(name="sgd", lr=1.0)


def credential(ca: JobCA, role: str, directory: Path) -> JobTLS:
    ca.issue(role, dns_names=(role_host(role),)).write(directory / role)
    return JobTLS.from_dir(directory / role)


@pytest.fixture
def job(tmp_path: Path) -> dict[str, JobTLS]:
    """One job's ps, trainer and master credentials, and an outsider's from another CA."""
    ca, other = JobCA.generate("j"), JobCA.generate("other")
    creds = {role: credential(ca, role, tmp_path / "job") for role in ("ps", "trainer", "master")}
    creds["outsider"] = credential(other, "trainer", tmp_path / "other")
    creds["other-ps"] = credential(other, "ps", tmp_path / "other")
    return creds


class Model(nn.Module):
    """A 300x300 layer (360 KB of float32: TLS sends it in many records) and a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(300, 300)


@contextlib.contextmanager
def serving(tls: JobTLS) -> Iterator[ParameterServer]:
    """A parameter server with ``tls`` and the job secret, in a thread, stopped at the end."""
    ps = ParameterServer(
        0,
        UpdateMode.ASYNC,
        SGD_LR1,
        host=LOOPBACK,
        port=0,
        init_timeout_s=DEADLINE_S,
        secret=SECRET,
        tls=tls,
    )
    thread = threading.Thread(target=ps.serve_forever, daemon=True)
    thread.start()
    try:
        yield ps
    finally:
        ps.stop()
        thread.join(timeout=DEADLINE_S)
        assert not thread.is_alive()


@pytest.fixture
def server(job: dict[str, JobTLS]) -> Iterator[ParameterServer]:
    with serving(job["ps"]) as ps:
        yield ps


SECRET = JobSecret.generate()


def client(address: str, tls: JobTLS | None, values: torch.Tensor | None = None) -> ParameterClient:
    """A client of one server, over TCP, whose model holds ``values`` (flat)."""
    flat = bind_flat_buffers(Model(), 1, 8)
    if values is not None:
        flat.params[: values.numel()].copy_(values)  # the parameters, then page padding
    return ParameterClient(
        flat.placement,
        [address],
        flat.params,
        flat.grads,
        1,
        timeout_s=DEADLINE_S,
        transport="tcp",
        secret=SECRET,
        tls=tls,
    )


def refusals(server: ParameterServer) -> dict[str, int]:
    return server._refusals.counts()


def test_pushes_and_pulls_over_tls_give_exact_values(
    server: ParameterServer, job: dict[str, JobTLS]
) -> None:
    numel = sum(p.numel() for p in Model().parameters())
    values = torch.arange(numel, dtype=torch.float32) / 4
    first = client(server.address, job["trainer"], values)
    try:
        first.hello(initialize=True)
        assert first.transports == ["tcp"]
        assert first._conns[0].sock.version() == "TLSv1.3"  # type: ignore[union-attr]
        first._grads.fill_(0.5)
        first.push(num_samples=1, want_params=True)
        assert torch.equal(first._params[:numel], values - 0.5)
    finally:
        first.close()
    second = client(server.address, job["master"])
    try:
        second.hello(initialize=False)
        assert torch.equal(second._params[:numel], values - 0.5)
    finally:
        second.close()
    assert refusals(server) == {}


def test_a_peer_of_another_ca_or_without_tls_is_refused_before_any_frame(
    server: ParameterServer, job: dict[str, JobTLS]
) -> None:
    with pytest.raises(AuthenticationError) as refused:
        client(server.address, job["outsider"])
    assert refused.value.reason == "tls"
    wait_for(lambda: refusals(server).get("tls", 0) == 1, "the refusal counted", DEADLINE_S)
    # Plain TCP: a well-formed frame header, refused as a bad TLS record.
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as sock:
        sock.sendall(bytes(HEADER_SIZE))
        with contextlib.suppress(ConnectionResetError):  # closed with the header unread
            assert sock.recv(1) == b""  # or closed, unanswered
    wait_for(lambda: refusals(server).get("tls", 0) == 2, "the plain peer counted", DEADLINE_S)


def test_a_server_of_another_ca_is_refused_by_the_trainer(
    job: dict[str, JobTLS],
) -> None:
    with (
        serving(job["other-ps"]) as impostor,
        pytest.raises(AuthenticationError, match="certificate verify failed") as refused,
    ):
        client(impostor.address, job["trainer"])
    assert refused.value.reason == "tls"


def test_a_trainer_certificate_cannot_pose_as_a_parameter_server(
    job: dict[str, JobTLS],
) -> None:
    with (
        serving(job["trainer"]) as impostor,
        pytest.raises(AuthenticationError, match=r"ps\.elasticps\.internal") as refused,
    ):
        client(impostor.address, job["master"])
    assert refused.value.reason == "tls"


def test_grpc_answers_a_job_certificate_only(job: dict[str, JobTLS]) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port(f"{LOOPBACK}:0", job["master"].grpc_server_credentials())
    server.start()
    address = f"{LOOPBACK}:{port}"
    override = (("grpc.ssl_target_name_override", role_host("master")),)

    def check(channel: grpc.Channel) -> str:
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
            except grpc.RpcError as exc:
                return str(exc.code())  # type: ignore[attr-defined]
            return "ok"

    try:
        creds = job["trainer"].grpc_channel_credentials()
        assert check(grpc.secure_channel(address, creds, options=override)) == "ok"
        other = job["outsider"].grpc_channel_credentials()
        assert "UNAVAILABLE" in check(grpc.secure_channel(address, other, options=override))
        ca_only = grpc.ssl_channel_credentials(root_certificates=job["ps"].credential().ca_pem)
        assert "UNAVAILABLE" in check(grpc.secure_channel(address, ca_only, options=override))
        assert "UNAVAILABLE" in check(grpc.insecure_channel(address))
    finally:
        server.stop(grace=None)
