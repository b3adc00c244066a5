"""Baseline trainer for ``benchmarks/training.py``: torch DDP, or one process alone.

Run under torchrun, it is one DDP worker (gloo backend):

    torchrun --standalone --nproc_per_node 2 benchmarks/ddp_worker.py \\
        --model benchmarks/models/mlp_20m.py --data DIR --epochs 4 --out result.json

Run without torchrun (no ``WORLD_SIZE`` in the environment), it trains in one
process with ``--threads`` torch threads: the "compute limit" case. With
``--shard R/W`` it trains only the rows rank ``R`` of ``W`` would, with no
communication at all: two such processes side by side are the "compute-2x1"
case (what 2 one-thread trainers could do if synchronising were free).

Both read the same Parquet file and the same model file as an elasticps job
(``elasticps.model_file``), build the model under the same seed, call the model
file's ``batch_to_tensors`` on every mini-batch as an elasticps trainer does,
and step the optimizer locally (DDP averages the gradients first):
``--optimizer adam`` (``torch.optim.Adam``, the default) or ``sgd`` (plain
``torch.optim.SGD``: no momentum, no weight decay, as ``elasticps train
--optimizer sgd``). Rank
``r`` of ``w`` trains rows ``[r * n / w, (r + 1) * n / w)`` of every epoch, in
file order (the file is pre-shuffled), ``--batch-size`` rows per step.

Rank 0 writes ``--out``: a JSON object with ``steps`` (one
``[unix time s, samples done by all ranks]`` per step), the per-epoch test
accuracy if ``--eval-each-epoch`` (with ``elasticps.evaluate.evaluate``, the
code ``elasticps train`` evaluates with), and, with ``--target-accuracy``,
the time the target was first reached; training stops at the end of that epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticps.evaluate import evaluate
from elasticps.model_file import load_model_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="dir with train/test.parquet")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per step per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--eval-each-epoch", action="store_true")
    parser.add_argument("--target-accuracy", type=float, default=None)
    parser.add_argument("--shard", default="0/1", help="R/W: without torchrun, train rank R's rows")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    started = time.time()
    torch.set_num_threads(args.threads)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = (int(x) for x in args.shard.split("/"))
    spec = load_model_file(args.model, "Model")
    model = spec.instantiate(args.seed)
    net: torch.nn.Module = DistributedDataParallel(model) if distributed else model
    optimizer: torch.optim.Optimizer
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    table = pq.read_table(args.data / "train.parquet", columns=list(spec.columns))
    lo, hi = rank * table.num_rows // world, (rank + 1) * table.num_rows // world
    mine = table.slice(lo, hi - lo)
    ready = time.time()

    steps: list[tuple[float, int]] = []
    evals: list[dict[str, float]] = []
    reached_s: float | None = None
    samples = 0
    for epoch in range(args.epochs):
        for start in range(0, mine.num_rows, args.batch_size):
            inputs, targets = spec.batch_to_tensors(mine.slice(start, args.batch_size))
            loss = spec.loss(net(inputs), targets)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            samples += len(targets) * (world if distributed else 1)
            steps.append((time.time(), samples))
        if args.eval_each_epoch and rank == 0:
            tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
            result = evaluate(spec, tensors, args.data / "test.parquet")
            evals.append({"epoch": epoch + 1, "time": time.time(), **result})
            if args.target_accuracy is not None and result["accuracy"] >= args.target_accuracy:
                reached_s = time.time() - started
        if args.target_accuracy is not None:
            flag = torch.tensor([1 if reached_s is not None else 0])
            if distributed:
                dist.broadcast(flag, src=0)
            if int(flag.item()):
                break
    if rank == 0 or not distributed:
        args.out.write_text(
            json.dumps(
                {
                    "world_size": world,
                    "distributed": distributed,
                    "threads": args.threads,
                    "batch_size": args.batch_size,
                    "optimizer": args.optimizer,
                    "lr": args.lr,
                    "started": started,
                    "ready": ready,
                    "finished": time.time(),
                    "samples": samples,
                    "steps": steps,
                    "evals": evals,
                    "target_reached_s": reached_s,
                }
            )
        )
    if distributed:
        dist.barrier()  # rank 0 has written its results
        dist.destroy_process_group()
    # Skip interpreter finalization: gloo's threads can abort the process at
    # exit ("terminate called without an active exception"), which torchrun
    # would report as a failed worker after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
