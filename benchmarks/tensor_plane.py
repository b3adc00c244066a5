"""Tensor-plane benchmark: one push + pull round trip of a big float32 gradient.

The trainer side holds a flat float32 gradient of ``--mib`` MiB (default 100 MB,
25M parameters) split evenly over 1 or 2 parameter servers. One round trip is:
send every server its slice of the gradient, each server applies plain SGD in
place (``param -= lr * grad``), and the trainer receives the updated slices
back into its flat parameter buffer. Every server is a separate process.

Cases, all measured in the same run, interleaved (the case order rotates every
repetition) so that a noisy machine hurts every case alike:

``elasticps-tcp``
    The product: :class:`elasticps.pserver.server.ParameterServer` (async mode,
    ``sgd``) in a process of its own per PS, and the real
    :class:`elasticps.trainer.client.ParameterClient` doing
    ``push(want_params=True)`` (one request, the reply carries the parameters;
    this is what a trainer does when it pushes and pulls on the same step).
``elasticps-tcp-2msg``
    The same, as ``push(want_params=False)`` then ``pull()``: two exchanges.
``elasticps-unix``
    The same as ``elasticps-tcp`` over the product's AF_UNIX fast path: each
    ``ParameterServer`` also listens on a Unix socket and the client is forced
    to it with ``ParameterClient(transport="unix")``: every tensor goes
    through the socket.
``elasticps-shm``
    The same with the shared memory the product uses on one host
    (``transport="shm"``; ``"auto"``, the default, picks it for servers on
    the same host): the gradient is copied into a memfd the server maps, the
    request and reply are bare headers, the server writes the parameters
    back into the memfd.
``elasticps-tcp-auth`` / ``elasticps-unix-auth`` / ``elasticps-shm-auth``
    ``elasticps-tcp``, ``elasticps-unix`` and ``elasticps-shm`` with the job
    secret on both sides, as every job runs by default (``--auth on``): each
    connection starts with the handshake of :mod:`elasticps.wire.auth`. The
    cases without ``-auth`` are ``--auth off``. The summary gives each ratio
    (``auth_over_off``) and the connect time of every case (``connect_ms``:
    ``ParameterClient`` to the end of HELLO, the handshake included).
``elasticps-tcp-tls``
    ``elasticps-tcp-auth`` inside TLS 1.3 (:mod:`elasticps.tls`), as every TCP
    connection of a job runs by default between hosts (``--tls on``): a
    certificate of one CA made here on each side. ``tls_over_tcp`` is its
    ratio to ``elasticps-tcp-auth`` (``--tls off``), and ``tls_cpu_over_tcp``
    the same for the CPU both sides spend per round trip.
``elasticps-mapped``
    The same with the memfd's pages mapped into the client's page-aligned
    flat buffers (``map_buffers=True``, as a trainer's buffers are when the
    placement is paged): nothing is copied on the client.
``raw-tcp`` / ``raw-unix``
    The reference: a minimal server written here (16-byte header, ``recv_into``
    a preallocated buffer, ``param.add_(grad, alpha=-lr)``,
    ``sendall(memoryview)``), one connection per server, the client talking to
    all servers at once from a thread pool. Over TCP and AF_UNIX.
``raw-tcp-2conn`` / ``raw-unix-2conn``
    The reference with two connections per server, each carrying half the
    server's slice (what "more connections per PS" would buy).
``grpc-stream``
    gRPC (grpcio, generic handler, raw bytes, no protobuf): one stream-stream
    call per server per round trip, the gradient sent in 1 MiB chunks and the
    parameters streamed back in 1 MiB chunks.
``limit``
    No transport: copy the gradient into a second buffer, update, copy the
    parameters back, in this process. The memory-bandwidth floor.

Every round trip is checked: the gradient is all ones and ``lr`` is 1, so after
k round trips every parameter of a case must be exactly ``-k``.

CPU cost: ``time.process_time()`` of this process (all its threads) around each
timed round trip, plus the same figure reported by every server process of the
case, over the bytes moved (gradient out + parameters back).

Prints one JSON line per case, then a summary line. Run:

    .venv/bin/python benchmarks/tensor_plane.py            # 100 MB, ~1 min
    .venv/bin/python benchmarks/tensor_plane.py --quick    # 4 MiB, a few seconds
    .venv/bin/python benchmarks/tensor_plane.py --smoke    # the test suite's: 1 MiB, 1 rep
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from elasticps.jobca import JobCA
from elasticps.security import JobSecret
from elasticps.tls import JobTLS, role_host

LR = 1.0  # with an all-ones gradient, every parameter is exactly -k after k round trips
GRPC_CHUNK_BYTES = 1 << 20
GRPC_SERVICE = "elasticps.bench.TensorPlane"
RAW_HEADER = struct.Struct("<QQ")  # element offset in the server's shard, element count
BIG_ARRAY_BOUND = 1_000_000  # the product's default


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous float32 tensor (no copy)."""
    return t.numpy().data.cast("B")


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the peer closed before the first byte."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed with {view.nbytes - got} bytes missing")
        got += n
    return True


# --- server side (runs in server processes) ------------------------------------------


class _RawServer:
    """The raw reference server: one shard, one thread per connection.

    A request is a 16-byte header (offset, count: elements of the shard) and
    ``count`` float32 gradient values; the reply is the ``count`` updated
    parameter values. Buffers are allocated once.
    """

    def __init__(self, numel: int, family: str, path: str) -> None:
        self.param = torch.zeros(numel, dtype=torch.float32)
        self.grad = torch.zeros(numel, dtype=torch.float32)
        if family == "unix":
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(path)
            self.listener.listen(8)
            self.address = path
        else:
            self.listener = socket.create_server(("127.0.0.1", 0))
            host, port = self.listener.getsockname()[:2]
            self.address = f"{host}:{port}"
        self.family = family
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.family == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(RAW_HEADER.size)
        hview = memoryview(header)
        pview, gview = _byte_view(self.param), _byte_view(self.grad)
        with conn:
            while _recv_exact(conn, hview):
                off, n = RAW_HEADER.unpack(header)
                if off + n > self.param.numel():
                    return
                _recv_exact(conn, gview[off * 4 : (off + n) * 4])
                self.param[off : off + n].add_(self.grad[off : off + n], alpha=-LR)
                conn.sendall(pview[off * 4 : (off + n) * 4])

    def close(self) -> None:
        self.listener.close()


def _start_grpc(specs: Sequence[dict[str, Any]]) -> tuple[Any, dict[str, str]]:
    """One gRPC server; each spec gets its own method and its own buffers."""
    from concurrent import futures

    import grpc

    def make_handler(numel: int) -> Callable[[Iterator[bytes], Any], Iterator[bytes]]:
        param = torch.zeros(numel, dtype=torch.float32)
        grad = torch.zeros(numel, dtype=torch.float32)
        pview, gview = _byte_view(param), _byte_view(grad)
        nbytes = numel * 4

        def round_trip(chunks: Iterator[bytes], context: Any) -> Iterator[bytes]:
            off = 0
            for chunk in chunks:
                n = len(chunk)
                if off + n > nbytes:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many bytes")
                gview[off : off + n] = chunk
                off += n
            if off != nbytes:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"got {off} of {nbytes} bytes")
            param.add_(grad, alpha=-LR)
            for lo in range(0, nbytes, GRPC_CHUNK_BYTES):
                # gRPC takes bytes, not memoryviews: this copy is part of its cost.
                yield pview[lo : lo + GRPC_CHUNK_BYTES].tobytes()

        return round_trip

    handlers = {
        spec["id"]: grpc.stream_stream_rpc_method_handler(make_handler(spec["numel"]))
        for spec in specs
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, {spec["id"]: f"127.0.0.1:{port}" for spec in specs}


def _server_process(kind: str, specs: list[dict[str, Any]], conn: Connection, threads: int) -> None:
    """Entry point of one server process: start ``specs``, then answer the control pipe.

    Control messages: ``"cpu"`` -> this process's CPU seconds so far;
    ``"stop"`` -> close everything and return.
    """
    if threads > 0:
        torch.set_num_threads(threads)
    closers: list[Callable[[], None]] = []
    addresses: dict[str, str] = {}
    if kind == "elasticps":
        from elasticps.config import OptimizerConfig, UpdateMode
        from elasticps.pserver.server import ParameterServer

        for spec in specs:
            server = ParameterServer(
                spec["index"],
                UpdateMode.ASYNC,
                OptimizerConfig(name="sgd", lr=LR),
                unix_path=spec.get("path"),
                secret=JobSecret(bytes.fromhex(spec["secret"])) if "secret" in spec else None,
                tls=JobTLS.from_dir(Path(spec["tls"])) if "tls" in spec else None,
            )
            threading.Thread(target=server.serve_forever, daemon=True).start()
            addresses[spec["id"]] = server.address
            closers.append(server.stop)
    elif kind == "raw":
        for spec in specs:
            raw = _RawServer(spec["numel"], spec["family"], spec.get("path", ""))
            addresses[spec["id"]] = raw.address
            closers.append(raw.close)
    elif kind == "grpc":
        grpc_server, addresses = _start_grpc(specs)
        closers.append(lambda: grpc_server.stop(grace=None).wait(10))
    else:
        raise ValueError(kind)
    conn.send(addresses)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg == "cpu":
            conn.send(time.process_time())
        elif msg == "stop":
            break
    for close in closers:
        with contextlib.suppress(Exception):
            close()
    conn.send("stopped")
    conn.close()
    # Skip interpreter finalization: a daemon connection thread that wakes up
    # inside a torch call during it aborts the process ("terminate called
    # without an active exception"), which would only be noise here.
    sys.stdout.flush()
    os._exit(0)


@dataclass
class ServerProcess:
    """A server process and its control pipe."""

    name: str
    proc: mp.process.BaseProcess
    conn: Connection
    addresses: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def cpu_s(self) -> float:
        self.conn.send("cpu")
        return float(self.conn.recv())

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            self.conn.send("stop")
            if self.conn.poll(10):
                self.conn.recv()
        self.proc.join(timeout=10)
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, 9)  # by PID, only our own child
            self.proc.join(timeout=5)


# --- client side ----------------------------------------------------------------------


@dataclass
class Case:
    """One measured configuration.

    Attributes:
        name: case name (see the module docstring).
        num_ps: number of servers, 0 for the in-process limit.
        round_trip: performs one round trip.
        params: the client's parameter buffer, checked after each round trip.
        servers: the processes whose CPU time belongs to this case.
    """

    name: str
    num_ps: int
    round_trip: Callable[[], None]
    params: torch.Tensor
    servers: list[ServerProcess]
    close: Callable[[], None] = lambda: None
    times_ms: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    done: int = 0
    connect_ms: float = 0.0


def _even_split(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _fan_out(pool: ThreadPoolExecutor, jobs: Sequence[Callable[[], None]]) -> None:
    if len(jobs) == 1:
        jobs[0]()
        return
    for f in [pool.submit(job) for job in jobs]:
        f.result()


def _raw_case(
    name: str,
    addresses: list[str],
    *,
    family: str,
    conns_per_server: int,
    grads: torch.Tensor,
    pool: ThreadPoolExecutor,
    servers: list[ServerProcess],
) -> Case:
    numel = grads.numel()
    params = torch.zeros(numel, dtype=torch.float32)
    pview, gview = _byte_view(params), _byte_view(grads)
    socks: list[socket.socket] = []
    jobs: list[Callable[[], None]] = []
    for address, (lo, hi) in zip(addresses, _even_split(numel, len(addresses)), strict=True):
        for clo, chi in _even_split(hi - lo, conns_per_server):
            if family == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(address)
            else:
                host, port = address.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(sock)
            header = RAW_HEADER.pack(clo, chi - clo)
            b0, b1 = (lo + clo) * 4, (lo + chi) * 4

            def job(
                sock: socket.socket = sock, header: bytes = header, b0: int = b0, b1: int = b1
            ) -> None:
                sock.sendall(header)
                sock.sendall(gview[b0:b1])
                _recv_exact(sock, pview[b0:b1])

            jobs.append(job)

    def close() -> None:
        for s in socks:
            s.close()

    return Case(name, len(addresses), lambda: _fan_out(pool, jobs), params, servers, close)


def _grpc_case(
    addresses: list[str],
    ids: list[str],
    grads: torch.Tensor,
    pool: ThreadPoolExecutor,
    servers: list[ServerProcess],
) -> Case:
    import grpc

    numel = grads.numel()
    params = torch.zeros(numel, dtype=torch.float32)
    pview, gview = _byte_view(params), _byte_view(grads)
    channels = []
    jobs: list[Callable[[], None]] = []
    for address, method_id, (lo, hi) in zip(
        addresses, ids, _even_split(numel, len(addresses)), strict=True
    ):
        channel = grpc.insecure_channel(address)
        channels.append(channel)
        # No (de)serializers: raw bytes in, raw bytes out.
        call = channel.stream_stream(
            f"/{GRPC_SERVICE}/{method_id}", request_serializer=None, response_deserializer=None
        )
        b0, b1 = lo * 4, hi * 4

        def job(call: Any = call, b0: int = b0, b1: int = b1) -> None:
            def chunks() -> Iterator[bytes]:
                for c in range(b0, b1, GRPC_CHUNK_BYTES):
                    yield gview[c : min(c + GRPC_CHUNK_BYTES, b1)].tobytes()

            off = b0
            for chunk in call(chunks()):
                n = len(chunk)
                pview[off : off + n] = chunk
                off += n
            if off != b1:
                raise RuntimeError(f"gRPC returned {off - b0} of {b1 - b0} bytes")

        jobs.append(job)

    def close() -> None:
        for ch in channels:
            ch.close()

    return Case("grpc-stream", len(addresses), lambda: _fan_out(pool, jobs), params, servers, close)


def _elasticps_case(
    name: str,
    addresses: list[str],
    grads: torch.Tensor,
    servers: list[ServerProcess],
    *,
    two_messages: bool,
    transport: str,
    mapped: bool = False,
    secret: JobSecret | None = None,
    tls: JobTLS | None = None,
) -> Case:
    from elasticps.placement import ParamSpec, plan_placement
    from elasticps.trainer.client import ParameterClient
    from elasticps.trainer.pages import page_aligned_zeros

    numel = grads.numel()
    num_ps = len(addresses)
    # The product slices a parameter over all PS above the bound; a --quick
    # gradient is smaller, so lower the bound to keep the same placement.
    bound = min(BIG_ARRAY_BOUND, max(1, numel // num_ps - 1))
    placement = plan_placement([ParamSpec("w", (numel,))], num_ps, bound)
    # A paged placement may pad the flat buffers to whole pages after "w".
    total = placement.total_numel
    params = torch.zeros(total, dtype=torch.float32)
    if mapped:  # buffers of their own, page-aligned, that the shared memory replaces
        params = page_aligned_zeros(total)
    if mapped or total != numel:
        padded = page_aligned_zeros(total) if mapped else torch.zeros(total, dtype=torch.float32)
        padded[:numel].copy_(grads)
        grads = padded
    t0 = time.perf_counter()
    client = ParameterClient(
        placement,
        addresses,
        params,
        grads,
        trainer_id=0,
        transport=transport,
        map_buffers=mapped,
        secret=secret,
        tls=tls,
    )
    client.hello(initialize=True)
    connect_ms = (time.perf_counter() - t0) * 1e3
    wire = "unix" if transport == "shm" else transport
    if set(client.transports) != {wire}:
        raise RuntimeError(f"{name}: connected over {client.transports}, not {wire}")
    if [c.shared for c in client._conns] != [transport == "shm"] * num_ps:
        raise RuntimeError(f"{name}: shared memory is not as asked")
    if [c.mapped for c in client._conns] != [mapped] * num_ps:
        raise RuntimeError(f"{name}: the buffers are not mapped as asked")

    def round_trip() -> None:
        if two_messages:
            client.push(1, want_params=False)
            client.pull()
        else:
            client.push(1, want_params=True)

    return Case(
        name, num_ps, round_trip, params[:numel], servers, client.close, connect_ms=connect_ms
    )


def _limit_case(grads: torch.Tensor) -> Case:
    numel = grads.numel()
    params = torch.zeros(numel, dtype=torch.float32)
    server_grad = torch.empty(numel, dtype=torch.float32)
    server_param = torch.zeros(numel, dtype=torch.float32)

    def round_trip() -> None:
        server_grad.copy_(grads)
        server_param.add_(server_grad, alpha=-LR)
        params.copy_(server_param)

    return Case("limit", 0, round_trip, params, [])


# --- the run ----------------------------------------------------------------------------


ALL_CASES = (
    "limit",
    "elasticps-tcp",
    "elasticps-tcp-2msg",
    "elasticps-unix",
    "elasticps-shm",
    "elasticps-mapped",
    "elasticps-tcp-auth",
    "elasticps-unix-auth",
    "elasticps-shm-auth",
    "elasticps-tcp-tls",
    "raw-tcp",
    "raw-tcp-2conn",
    "raw-unix",
    "raw-unix-2conn",
    "grpc-stream",
)


def _spawn_servers(
    numel: int,
    ps_counts: Sequence[int],
    workdir: str,
    threads: int,
    wanted: Sequence[str],
    *,
    secret: JobSecret,
    tls_dirs: dict[str, str],
) -> dict[str, ServerProcess]:
    """One process per (server kind, PS index); it hosts that index for every PS count.

    The processes are forked from a multiprocessing fork server that imported
    this module (and torch) once, as the product's launcher starts its roles:
    each starts in well under a second instead of importing torch again.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "elasticps.pserver.server"])
    plans: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for num_ps in ps_counts:
        for index, (lo, hi) in enumerate(_even_split(numel, num_ps)):
            n = hi - lo
            for kind, all_variants in (
                (
                    "elasticps",
                    [
                        ("elasticps-tcp", {}),
                        ("elasticps-tcp-2msg", {}),
                        ("elasticps-unix", {"family": "unix"}),
                        ("elasticps-shm", {"family": "unix"}),
                        ("elasticps-mapped", {"family": "unix"}),
                        ("elasticps-tcp-auth", {"secret": secret.key.hex()}),
                        ("elasticps-unix-auth", {"family": "unix", "secret": secret.key.hex()}),
                        ("elasticps-shm-auth", {"family": "unix", "secret": secret.key.hex()}),
                        ("elasticps-tcp-tls", {"secret": secret.key.hex(), "tls": tls_dirs["ps"]}),
                    ],
                ),
                (
                    "raw",
                    [
                        (f"raw-{fam}{suffix}", {"family": fam})
                        for fam in ("tcp", "unix")
                        for suffix in ("", "-2conn")
                    ],
                ),
                ("grpc", [("grpc-stream", {})]),
            ):
                variants = [(case, extra) for case, extra in all_variants if case in wanted]
                if not variants:
                    continue
                _, specs = plans.setdefault(f"{kind}-{index}", (kind, []))
                for case, extra in variants:
                    sid = f"{case}_{num_ps}_{index}"
                    spec: dict[str, Any] = {"id": sid, "numel": n, "index": index, **extra}
                    if extra.get("family") == "unix":
                        spec["path"] = os.path.join(workdir, f"{sid}.sock")
                    specs.append(spec)
    started: dict[str, ServerProcess] = {}
    try:
        for name, (kind, specs) in plans.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_server_process, args=(kind, specs, child, threads), name=name, daemon=True
            )
            proc.start()
            started[name] = ServerProcess(name, proc, parent)
        for server in started.values():
            if not server.conn.poll(120):
                raise RuntimeError(f"server process {server.name} did not start")
            server.addresses = server.conn.recv()
    except BaseException:
        for server in started.values():
            server.stop()
        raise
    return started


def _build_cases(
    ps_counts: Sequence[int],
    servers: dict[str, ServerProcess],
    grads: torch.Tensor,
    pool: ThreadPoolExecutor,
    wanted: Sequence[str],
    *,
    secret: JobSecret,
    tls_dirs: dict[str, str],
) -> list[Case]:
    cases = [_limit_case(grads)] if "limit" in wanted else []
    trainer_tls = JobTLS.from_dir(Path(tls_dirs["trainer"]))
    for num_ps in ps_counts:

        def procs(kind: str, num_ps: int = num_ps) -> list[ServerProcess]:
            return [servers[f"{kind}-{i}"] for i in range(num_ps)]

        def addrs(kind: str, case: str, num_ps: int = num_ps) -> list[str]:
            return [servers[f"{kind}-{i}"].addresses[f"{case}_{num_ps}_{i}"] for i in range(num_ps)]

        for name in (
            "elasticps-tcp",
            "elasticps-tcp-2msg",
            "elasticps-unix",
            "elasticps-shm",
            "elasticps-mapped",
            "elasticps-tcp-auth",
            "elasticps-unix-auth",
            "elasticps-shm-auth",
            "elasticps-tcp-tls",
        ):
            if name not in wanted:
                continue
            cases.append(
                _elasticps_case(
                    name,
                    addrs("elasticps", name),
                    grads,
                    procs("elasticps"),
                    two_messages=name.endswith("2msg"),
                    transport="shm" if name == "elasticps-mapped" else name.split("-")[1],
                    mapped=name == "elasticps-mapped",
                    secret=secret if name.endswith(("-auth", "-tls")) else None,
                    tls=trainer_tls if name.endswith("-tls") else None,
                )
            )
        for fam in ("tcp", "unix"):
            for conns, suffix in ((1, ""), (2, "-2conn")):
                name = f"raw-{fam}{suffix}"
                if name not in wanted:
                    continue
                cases.append(
                    _raw_case(
                        name,
                        addrs("raw", name),
                        family=fam,
                        conns_per_server=conns,
                        grads=grads,
                        pool=pool,
                        servers=procs("raw"),
                    )
                )
        if "grpc-stream" not in wanted:
            continue
        ids = [f"grpc-stream_{num_ps}_{i}" for i in range(num_ps)]
        cases.append(_grpc_case(addrs("grpc", "grpc-stream"), ids, grads, pool, procs("grpc")))
    return cases


def _run_once(case: Case, *, measure: bool) -> None:
    before = [s.cpu_s() for s in case.servers] if measure else []
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    case.round_trip()
    elapsed = time.perf_counter() - t0
    cpu1 = time.process_time()
    case.done += 1
    expected = -float(case.done) * LR
    n = case.params.numel()
    for i in (0, n // 2, n - 1):
        if float(case.params[i]) != expected:
            raise AssertionError(
                f"{case.name} ({case.num_ps} PS): params[{i}] = {float(case.params[i])} "
                f"after {case.done} round trips, expected {expected}"
            )
    if measure:
        case.times_ms.append(elapsed * 1e3)
        case.client_cpu_s += cpu1 - cpu0
        case.server_cpu_s += sum(s.cpu_s() - b for s, b in zip(case.servers, before, strict=True))


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=100 / 1.048576, help="gradient size, MiB")
    parser.add_argument("--reps", type=int, default=15, help="timed round trips per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed round trips per case")
    parser.add_argument("--ps", default="1,2", help="comma-separated PS counts")
    parser.add_argument(
        "--server-threads", type=int, default=0, help="torch threads per server (0: torch default)"
    )
    parser.add_argument(
        "--cases", default=",".join(ALL_CASES), help="comma-separated subset, e.g. for profiling"
    )
    parser.add_argument("--quick", action="store_true", help="4 MiB, 3 reps: a smoke run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: every case, 1 MiB, 1 rep, 1 warm-up (figures mean nothing)",
    )
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that every process started here is stopped.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.quick:
        args.mib, args.reps, args.warmup = 4.0, 3, 1
    if args.smoke:
        args.mib, args.reps, args.warmup = 1.0, 1, 1
    numel = int(args.mib * (1 << 20)) // 4
    ps_counts = [int(x) for x in args.ps.split(",")]
    wanted = args.cases.split(",")
    for name in wanted:
        if name not in ALL_CASES:
            parser.error(f"unknown case {name!r}; choose from {', '.join(ALL_CASES)}")
    torch.manual_seed(0)
    grads = torch.ones(numel, dtype=torch.float32)
    workdir = tempfile.mkdtemp(prefix="tpbench-")
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="bench-fanout")
    servers: dict[str, ServerProcess] = {}
    cases: list[Case] = []
    try:
        secret = JobSecret.generate()
        ca = JobCA.generate("tensor-plane-benchmark")
        tls_dirs = {}
        for role in ("ps", "trainer"):
            directory = Path(workdir) / "tls" / role
            ca.issue(role, dns_names=(role_host(role),)).write(directory)
            tls_dirs[role] = str(directory)
        servers = _spawn_servers(
            numel, ps_counts, workdir, args.server_threads, wanted, secret=secret, tls_dirs=tls_dirs
        )
        cases = _build_cases(
            ps_counts, servers, grads, pool, wanted, secret=secret, tls_dirs=tls_dirs
        )
        for case in cases:
            for _ in range(args.warmup):
                _run_once(case, measure=False)
        for rep in range(args.reps):
            shift = rep % len(cases)
            for case in cases[shift:] + cases[:shift]:
                _run_once(case, measure=True)
        _report(cases, ps_counts, numel, args, [s.pid for s in servers.values()])
    finally:
        for case in cases:
            with contextlib.suppress(Exception):
                case.close()
        for server in servers.values():
            server.stop()
        pool.shutdown(wait=False)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _report(
    cases: list[Case],
    ps_counts: Sequence[int],
    numel: int,
    args: argparse.Namespace,
    server_pids: list[int],
) -> None:
    nbytes = numel * 4
    medians: dict[str, dict[str, float]] = {}
    cpu: dict[str, dict[str, float]] = {}
    connect: dict[str, dict[str, float]] = {}
    for case in cases:
        med = statistics.median(case.times_ms)
        moved_gb = 2 * nbytes * len(case.times_ms) / 1e9
        cpu_per_gb = (case.client_cpu_s + case.server_cpu_s) / moved_gb
        key = str(case.num_ps)
        medians.setdefault(key, {})[case.name] = round(med, 2)
        cpu.setdefault(key, {})[case.name] = round(cpu_per_gb, 3)
        if case.connect_ms:
            connect.setdefault(key, {})[case.name] = round(case.connect_ms, 2)
        _emit(
            {
                "bench": "tensor_plane",
                "case": case.name,
                "num_ps": case.num_ps,
                "mb": round(nbytes / 1e6, 1),
                "reps": len(case.times_ms),
                "ms_median": round(med, 2),
                "ms_min": round(min(case.times_ms), 2),
                "ms_max": round(max(case.times_ms), 2),
                "gb_per_s": round(2 * nbytes / 1e9 / (med / 1e3), 2),
                "cpu_s_per_gb": round(cpu_per_gb, 3),
                "client_cpu_ms": round(case.client_cpu_s * 1e3 / len(case.times_ms), 1),
                "server_cpu_ms": round(case.server_cpu_s * 1e3 / len(case.times_ms), 1),
                "verified_round_trips": case.done,
                "connect_ms": round(case.connect_ms, 2),
            }
        )
    ratios: dict[str, dict[str, float]] = {}
    for num_ps in ps_counts:
        m = {**medians.get(str(num_ps), {}), **medians.get("0", {})}
        pairs = {
            "elasticps_over_raw_tcp": ("elasticps-tcp", "raw-tcp"),
            "elasticps_over_raw_unix": ("elasticps-tcp", "raw-unix"),
            "elasticps_unix_over_raw_unix": ("elasticps-unix", "raw-unix"),
            "elasticps_unix_over_tcp": ("elasticps-unix", "elasticps-tcp"),
            "elasticps_shm_over_unix": ("elasticps-shm", "elasticps-unix"),
            "elasticps_shm_over_raw_unix": ("elasticps-shm", "raw-unix"),
            "elasticps_mapped_over_shm": ("elasticps-mapped", "elasticps-shm"),
            "elasticps_mapped_over_raw_unix": ("elasticps-mapped", "raw-unix"),
            "elasticps_over_limit": ("elasticps-tcp", "limit"),
            "auth_over_off_tcp": ("elasticps-tcp-auth", "elasticps-tcp"),
            "auth_over_off_unix": ("elasticps-unix-auth", "elasticps-unix"),
            "auth_over_off_shm": ("elasticps-shm-auth", "elasticps-shm"),
            "tls_over_tcp": ("elasticps-tcp-tls", "elasticps-tcp-auth"),
        }
        r = {k: round(m[a] / m[b], 3) for k, (a, b) in pairs.items() if a in m and b in m}
        c = cpu.get(str(num_ps), {})
        if "elasticps-tcp-tls" in c and "elasticps-tcp-auth" in c:
            r["tls_cpu_over_tcp"] = round(c["elasticps-tcp-tls"] / c["elasticps-tcp-auth"], 3)
        if "grpc-stream" in m and "elasticps-tcp" in m:
            r["elasticps_speedup_vs_grpc"] = round(m["grpc-stream"] / m["elasticps-tcp"], 2)
        if "grpc-stream" in m and "elasticps-unix" in m:
            r["elasticps_unix_speedup_vs_grpc"] = round(m["grpc-stream"] / m["elasticps-unix"], 2)
        ratios[str(num_ps)] = r
    top = str(max(ps_counts))
    _emit(
        {
            "summary": True,
            "bench": "tensor_plane",
            "mb": round(nbytes / 1e6, 1),
            "reps": args.reps,
            "server_threads": args.server_threads or torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "server_pids": server_pids,
            "ms_median": medians,
            "cpu_s_per_gb": cpu,
            "connect_ms": connect,
            "ratios": ratios,
            "targets": {
                "num_ps": int(top),
                "within_1.25x_raw_tcp": _at_most(ratios[top].get("elasticps_over_raw_tcp"), 1.25),
                "unix_within_1.25x_raw_unix": _at_most(
                    ratios[top].get("elasticps_unix_over_raw_unix"), 1.25
                ),
                "at_least_2.5x_faster_than_grpc": _at_least(
                    ratios[top].get("elasticps_speedup_vs_grpc"), 2.5
                ),
                "unix_at_least_2.5x_faster_than_grpc": _at_least(
                    ratios[top].get("elasticps_unix_speedup_vs_grpc"), 2.5
                ),
                "auth_within_2pct_unix": _at_most(ratios[top].get("auth_over_off_unix"), 1.02),
                "auth_within_2pct_shm": _at_most(ratios[top].get("auth_over_off_shm"), 1.02),
            },
        }
    )


def _at_most(value: float | None, target: float) -> bool | None:
    return None if value is None else value <= target


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
