"""The trainer's push options, A/B: background pushes, 16-bit gradients, Unix vs TCP.

One trainer (this process, 1 torch thread) trains a model file on the MNIST
Parquet data against 2 real parameter servers (``ParameterServer``, async,
Adam lr 1e-3), each in a process of its own, through the real
``ParameterClient``. The loop is the worker's: ``batch_to_tensors``,
forward, backward, a push every ``--push-every`` mini-batches (the mean
gradient), a pull every ``--pull-every``.

``throughput`` (default)
    samples/s of each client configuration, ``--steps`` mini-batches per
    repetition, configurations interleaved (the order rotates every
    repetition), medians over ``--reps``. Configurations: ``blocking``
    (``overlap_push=False``), ``overlap`` (``overlap_push=True``), each also
    with ``bf16`` compression, and ``blocking-tcp`` (forced TCP). Prints one
    line per configuration and a summary with the ratios to ``blocking``.
``--accuracy``
    trains ``--epochs`` epochs from the same seed with
    ``grad_compression`` ``none``, ``fp16`` and ``bf16`` (fresh servers each)
    and evaluates the final parameters on ``test.parquet`` with
    ``elasticps.evaluate.evaluate``. Prints one line per compression.

Run:

    .venv/bin/python benchmarks/push_options.py --data data/mnist
    .venv/bin/python benchmarks/push_options.py --data data/mnist --accuracy --epochs 3
    .venv/bin/python benchmarks/push_options.py --quick      # a smoke run, a few seconds
    .venv/bin/python benchmarks/push_options.py --smoke      # the test suite's run, fewer steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
NUM_PS = 2
LR = 1e-3

CONFIGS: dict[str, dict[str, Any]] = {
    "blocking": {"overlap_push": False},
    "overlap": {"overlap_push": True},
    "blocking-bf16": {"overlap_push": False, "grad_compression": "bf16"},
    "overlap-bf16": {"overlap_push": True, "grad_compression": "bf16"},
    "blocking-tcp": {"overlap_push": False, "transport": "tcp"},
}


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


# --- parameter servers in processes of their own -----------------------------------------


def _ps_process(index: int, unix_path: str, conn: Connection) -> None:
    torch.set_num_threads(1)  # as the product's PS
    import threading

    from elasticps.config import OptimizerConfig, UpdateMode
    from elasticps.pserver.server import ParameterServer

    server = ParameterServer(
        index, UpdateMode.ASYNC, OptimizerConfig(name="adam", lr=LR), unix_path=unix_path
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn.send(server.address)
    with contextlib.suppress(EOFError):
        conn.recv()  # any message, or the pipe closing: stop
    server.stop()
    conn.close()
    os._exit(0)  # skip finalisation: daemon connection threads may be inside torch


@dataclass
class Servers:
    procs: list[mp.process.BaseProcess] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send("stop")
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)  # by PID, our own child
                proc.join(timeout=5)


def start_servers(workdir: Path, tag: str) -> Servers:
    """``NUM_PS`` servers, forked from a multiprocessing fork server that imported torch once.

    (As the product's launcher starts its roles: a server starts in well under
    a second instead of importing torch again.)
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "elasticps.pserver.server"])
    servers = Servers()
    try:
        for index in range(NUM_PS):
            parent, child = ctx.Pipe()
            path = str(workdir / f"{tag}-ps{index}.sock")
            proc = ctx.Process(target=_ps_process, args=(index, path, child), daemon=True)
            proc.start()
            servers.procs.append(proc)
            servers.conns.append(parent)
        for conn in servers.conns:
            if not conn.poll(120):
                raise RuntimeError("a parameter server did not start")
            servers.addresses.append(conn.recv())
    except BaseException:
        servers.stop()
        raise
    return servers


# --- the trainer loop ---------------------------------------------------------------------


class Trainer:
    """The worker's loop around one ParameterClient."""

    def __init__(
        self,
        model_path: Path,
        addresses: list[str],
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        trainer_id: int,
        options: dict[str, Any],
        *,
        push_every: int,
        pull_every: int,
    ) -> None:
        from elasticps.model_file import load_model_file
        from elasticps.trainer.client import ParameterClient
        from elasticps.trainer.flat import bind_flat_buffers

        self.spec = load_model_file(model_path)
        torch.manual_seed(0)
        self.flat = bind_flat_buffers(self.spec.build(), NUM_PS)
        self.client = ParameterClient(
            self.flat.placement,
            addresses,
            self.flat.params,
            self.flat.grads,
            trainer_id,
            **options,
        )
        self.client.hello(initialize=True)
        self.batches = batches
        self.push_every = push_every
        self.pull_every = pull_every
        self.cursor = 0
        self.accumulated = 0
        self.samples = 0
        self.acknowledged = 0

    def _acked(self) -> None:
        self.acknowledged += 1  # where a worker would report progress

    def run(self, steps: int) -> float:
        """Train ``steps`` mini-batches; return the seconds taken."""
        t0 = time.perf_counter()
        for _ in range(steps):
            inputs, targets = self.batches[self.cursor % len(self.batches)]
            self.cursor += 1
            loss = self.spec.loss(self.flat.model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            self.accumulated += 1
            self.samples += len(targets)
            if self.accumulated % self.push_every == 0:
                if self.accumulated > 1:
                    self.flat.grads.div_(self.accumulated)
                want = self.cursor % self.pull_every == 0
                # The callback makes an overlap_push client send it in the background.
                self.client.push(self.samples, want_params=want, on_acknowledged=self._acked)
                self.flat.zero_grad()
                self.accumulated = self.samples = 0
            elif self.cursor % self.pull_every == 0:
                self.client.pull()
        self.client.flush()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()


def load_batches(path: Path, model_path: Path, batch_size: int) -> list[Any]:
    """Every mini-batch of a Parquet file, as the model file's tensors."""
    import pyarrow.parquet as pq

    from elasticps.model_file import load_model_file

    spec = load_model_file(model_path)
    table = pq.read_table(path, columns=list(spec.columns))
    return [
        spec.batch_to_tensors(table.slice(lo, batch_size))
        for lo in range(0, table.num_rows, batch_size)
    ]


# --- the two modes ------------------------------------------------------------------------


def throughput(args: argparse.Namespace, workdir: Path) -> None:
    batches = load_batches(args.data / "train.parquet", args.model, args.batch_size)
    servers = start_servers(workdir, "tp")
    trainers: dict[str, Trainer] = {}
    try:
        for i, name in enumerate(args.configs):
            trainers[name] = Trainer(
                args.model,
                servers.addresses,
                batches,
                i,
                CONFIGS[name],
                push_every=args.push_every,
                pull_every=args.pull_every,
            )
            trainers[name].run(args.warmup)
        rates: dict[str, list[float]] = {name: [] for name in trainers}
        names = list(trainers)
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                seconds = trainers[name].run(args.steps)
                rates[name].append(args.steps * args.batch_size / seconds)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        for name, r in rates.items():
            emit(
                {
                    "bench": "push_options",
                    "config": name,
                    "samples_per_s": round(medians[name], 1),
                    "min": round(min(r), 1),
                    "max": round(max(r), 1),
                    "transports": trainers[name].client.transports,
                    "acknowledged_pushes": trainers[name].client.acknowledged_pushes,
                }
            )
        base = medians.get("blocking")
        emit(
            {
                "summary": True,
                "bench": "push_options",
                "model": args.model.name,
                "push_every": args.push_every,
                "pull_every": args.pull_every,
                "steps": args.steps,
                "reps": args.reps,
                "loadavg": [round(x, 2) for x in os.getloadavg()],
                "samples_per_s": {k: round(v, 1) for k, v in medians.items()},
                "over_blocking": (
                    {k: round(v / base, 3) for k, v in medians.items()} if base else None
                ),
                "server_pids": [p.pid for p in servers.procs],
            }
        )
    finally:
        for trainer in trainers.values():
            trainer.close()
        servers.stop()


def accuracy(args: argparse.Namespace, workdir: Path) -> None:
    from elasticps.evaluate import evaluate

    batches = load_batches(args.data / "train.parquet", args.model, args.batch_size)
    results: dict[str, float] = {}
    for compression in args.compressions:
        servers = start_servers(workdir, f"acc-{compression}")
        trainer: Trainer | None = None
        try:
            trainer = Trainer(
                args.model,
                servers.addresses,
                batches,
                0,
                {"grad_compression": compression},
                push_every=args.push_every,
                pull_every=args.pull_every,
            )
            seconds = trainer.run(args.epochs * len(batches))
            trainer.client.pull()
            state = {k: v.detach().clone() for k, v in trainer.flat.model.state_dict().items()}
            scores = evaluate(trainer.spec, state, args.data / "test.parquet")
        finally:
            if trainer is not None:
                trainer.close()
            servers.stop()
        results[compression] = scores["accuracy"]
        emit(
            {
                "bench": "push_options",
                "accuracy_run": True,
                "model": args.model.name,
                "grad_compression": compression,
                "epochs": args.epochs,
                "test_accuracy": round(scores["accuracy"], 4),
                "test_loss": round(scores["loss"], 4),
                "train_s": round(seconds, 2),
            }
        )
    emit({"summary": True, "bench": "push_options", "test_accuracy": results,
          "server_pids": []})  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="dir of `elasticps data mnist`")
    parser.add_argument("--model", type=Path, default=BENCH / "models" / "mlp_small.py")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--push-every", type=int, default=1)
    parser.add_argument("--pull-every", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400, help="mini-batches per repetition")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--accuracy", action="store_true", help="compression accuracy runs")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--compressions", default="none,fp16,bf16")
    parser.add_argument("--quick", action="store_true", help="a smoke run of both modes")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: --quick with 4 steps per configuration and accuracy runs of "
        "256 training rows (figures mean nothing)",
    )
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    args.configs = args.configs.split(",")
    for name in args.configs:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    args.compressions = args.compressions.split(",")
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workdir = Path(tempfile.mkdtemp(prefix="elasticps-bench-push-"))
    try:
        if args.data is None:
            from elasticps.data.mnist import prepare_mnist

            args.data = workdir / "mnist"
            prepare_mnist(args.data)
        if args.smoke:  # the first rows only
            import pyarrow.parquet as pq

            small = workdir / "mnist-smoke"
            small.mkdir()
            for name in ("train", "test"):
                table = pq.read_table(args.data / f"{name}.parquet").slice(0, 256)
                pq.write_table(table, small / f"{name}.parquet")
            args.data = small
        if args.quick:
            args.steps, args.reps, args.warmup = (4, 1, 1) if args.smoke else (20, 1, 2)
            throughput(args, workdir)
            args.epochs = 1
            args.compressions = ["none", "bf16"]  # fp16 takes bf16's path
            accuracy(args, workdir)
        elif args.accuracy:
            accuracy(args, workdir)
        else:
            throughput(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
