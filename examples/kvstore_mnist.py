"""MNIST with the MXNet-style KVStore API, on one machine or as a distributed job.

Run it as::

    python examples/kvstore_mnist.py --kvstore dist_sync --workers 2
    python examples/kvstore_mnist.py --kvstore dist_async --workers 2
    python examples/kvstore_mnist.py --kvstore local

With a ``dist_*`` store the script calls :func:`elasticps.dist.dist_train`,
which starts etcd and the parameter servers, then runs this same script
``--workers`` times as trainers (``ELASTICPS_ROLE=trainer``, rank in
``ELASTICPS_RANK``). Each worker trains a small MLP on its share of the
4,000 training images (rows ``rank::num_workers``) in mini-batches of
``--batch-size``: forward, backward, ``kv.push`` of every gradient,
``kv.pull`` of every parameter. The servers run SGD with momentum and a
step-decay schedule by model version. In ``dist_sync`` the servers average
the workers' gradients, so the global batch is ``workers x --batch-size``;
in ``dist_async`` each push is one update.

Rank 0 evaluates the final parameters on the 1,000 held-out images and
prints one JSON line, e.g. ``{"kvstore": "dist_sync", "accuracy": 0.91,
...}`` (prefixed ``worker-0|`` by the launcher). The data come from
``elasticps.data.mnist`` (``elasticps data mnist``), prepared once by the
launcher into ``--data``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)
from torch import nn

from elasticps import kvstore, updater
from elasticps.data.mnist import MNIST_MEAN, MNIST_STD, PIXELS_PER_IMAGE, prepare_mnist
from elasticps.dist import LaunchResult, dist_train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kvstore", choices=["local", "dist_sync", "dist_async"], default="dist_sync"
    )
    parser.add_argument("--workers", type=int, default=2, help="trainer processes (dist_*)")
    parser.add_argument("--ps", type=int, default=2, help="parameter servers (dist_*)")
    parser.add_argument("--data", type=Path, default=Path("data/mnist"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    return parser.parse_args(argv)


def make_updater(lr: float) -> updater.Updater:
    """The optimizer the parameter servers run: momentum SGD, halved every 150 versions."""
    return updater.Momentum(
        lr=lr, momentum=0.9, schedule=updater.StepDecay(every_versions=150, gamma=0.5)
    )


class MLP(nn.Module):
    """784 -> 128 -> 10, ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(PIXELS_PER_IMAGE, 128)
        self.out = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(F.relu(self.hidden(x)))
        return logits


def load(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Images float32 [N, 784] (normalized) and labels int64 [N] from an MNIST Parquet file."""
    table = pq.read_table(path, columns=["pixels", "label"])
    flat = table.column("pixels").combine_chunks().values.to_numpy(zero_copy_only=False)
    pixels = torch.from_numpy(np.asarray(flat, dtype=np.float32).reshape(-1, PIXELS_PER_IMAGE))
    images = (pixels / 255.0 - MNIST_MEAN) / MNIST_STD
    labels = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    return images, labels


def train(args: argparse.Namespace) -> dict[str, object]:
    """One worker's training loop with the KVStore API."""
    torch.set_num_threads(1)
    kv = kvstore.create(args.kvstore)
    images, labels = load(args.data / "train.parquet")
    mine = slice(kv.rank, None, kv.num_workers)  # this worker's share of the rows
    images, labels = images[mine], labels[mine]

    torch.manual_seed(0)
    model = MLP()
    params = dict(model.named_parameters())
    names = sorted(params)
    # MXNet style: init every key, set the optimizer, then pull (rank 0's values win).
    kv.init(names, [params[n].detach() for n in names])
    kv.set_optimizer(make_updater(args.lr))
    kv.pull(names, out=[params[n].data for n in names])

    started = time.monotonic()
    gen = torch.Generator().manual_seed(1000 + kv.rank)
    steps = 0
    loss = torch.tensor(0.0)
    for _ in range(args.epochs):
        order = torch.randperm(len(labels), generator=gen)
        for lo in range(0, len(order), args.batch_size):
            batch = order[lo : lo + args.batch_size]
            model.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            grads = [params[n].grad for n in names]
            kv.push(
                names,
                [
                    g if g is not None else torch.zeros_like(params[n])
                    for n, g in zip(names, grads, strict=True)
                ],
            )
            kv.pull(names, out=[params[n].data for n in names])
            steps += 1
    kv.barrier()  # every worker's last push is in before rank 0 evaluates
    kv.pull(names, out=[params[n].data for n in names])
    result: dict[str, object] = {
        "kvstore": args.kvstore,
        "rank": kv.rank,
        "workers": kv.num_workers,
        "steps": steps,
        "last_loss": round(float(loss.detach()), 4),
        "train_s": round(time.monotonic() - started, 2),
    }
    if kv.rank == 0:
        test_images, test_labels = load(args.data / "test.parquet")
        with torch.no_grad():
            predicted = model(test_images).argmax(dim=1)
        result["accuracy"] = round(float((predicted == test_labels).float().mean()), 4)
        result["test_samples"] = len(test_labels)
        print(json.dumps(result), flush=True)
    kv.close()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.data / "train.parquet").exists():
        prepare_mnist(args.data)  # the launcher does it before the workers start
    if args.kvstore == "local":
        train(args)
        return 0
    outcome = dist_train(
        lambda: train(args),
        workers=args.workers,
        ps=args.ps,
        mode="sync" if args.kvstore == "dist_sync" else "async",
        updater=make_updater(args.lr),
        timeout_s=args.timeout_s,
    )
    if isinstance(outcome, LaunchResult):
        print(json.dumps({"job": outcome.job, "wall_s": round(outcome.wall_s, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
