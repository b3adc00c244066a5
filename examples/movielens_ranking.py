"""DeepFM click-through-rate model on MovieLens-100K, with sparse embedding tables.

An elasticps model file (``docs/model-contract.md``: ``COLUMNS``, ``Model``,
``loss``, ``batch_to_tensors``) for the Parquet files of ``elasticps data
movielens``: predict whether a user likes a movie (``label``: rating >= 4)
from the user, the movie, the movie's genres and the user's occupation,
age and gender.

The model is DeepFM (Guo et al. 2017, "DeepFM: A Factorization-Machine based
Neural Network for CTR Prediction"): four fields embedded in ``DIM``
dimensions (``user``, ``movie``, ``genre`` as the mean over the movie's
genres, ``occupation``), a first-order term (one weight per user and per
movie), the factorization machine's pairwise interactions
``sum_{i<j} <e_i, e_j>`` (Rendle 2010) and an MLP over the concatenated
embeddings and three dense features; the sum is one logit, trained with
binary cross-entropy. The tables are ``elasticps.nn`` sparse modules:
trainers fetch only the rows a mini-batch uses and push one gradient row per
id; the MLP is the dense part.

Reference (single process, plain PyTorch): the same architecture with
``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` and ``torch.optim.Adam``
(lr 1e-3, batch 256, 5 epochs), on the default split of ``elasticps data
movielens`` (each user's newest 20 % of ratings as the test set), reaches a
**test AUC of 0.792** (scikit-learn ``roc_auc_score``; 0.7915, 0.7918 and
0.7917 with seeds 0, 1 and 2; 0.776 after 1 epoch, 0.793 after 10). The
sparse path in one process (``--backend sparse``: elasticps tables with lazy
Adam, ``torch.optim.Adam`` for the MLP) reaches 0.785-0.786 with the same
seeds: lazy Adam moves a row only when its id is in the batch, where dense
Adam keeps moving every row with its momentum. Measured 2026-11-25 on a
2-core machine, about 15 s a run. Run:

    .venv/bin/elasticps data movielens --output data/movielens
    .venv/bin/python examples/movielens_ranking.py --data data/movielens --backend torch

which prints one JSON line with the test AUC and log loss.

As an elasticps job, with 2 trainers and 2 parameter servers holding the
tables by row (each mini-batch pulls and pushes only the rows of its ids;
the servers run lazy Adam on the rows, Adam on the MLP)::

    .venv/bin/elasticps train --model examples/movielens_ranking.py \
        --data data/movielens --trainers 2 --ps 2 --mode sync --epochs 2 \
        --batch-size 256 --optimizer adam --lr 0.002 --output runs/movielens

The job's final line reports the test AUC (``auc``) of the trained tables;
the stated threshold, checked in sync and in async mode by
``tests/integration/test_movielens_example.py``, is ``AUC_BAR`` (0.765). The
measured figures are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor, nn

import elasticps.nn as enn
from elasticps.data.movielens import GENRES, NUM_MOVIES, NUM_USERS, OCCUPATIONS

AUC_BAR = 0.765
"""Test AUC an elasticps job of this model (``JOB_ARGS``) reaches, in sync and async mode."""

JOB_ARGS = ("--trainers", "2", "--ps", "2", "--epochs", "2", "--batch-size", "256",
            "--optimizer", "adam", "--lr", "0.002")  # fmt: skip
"""The ``elasticps train`` flags of that job (besides ``--mode``)."""

COLUMNS = ("user_id", "movie_id", "genres", "occupation", "age", "gender", "release_year", "label")

DIM = 16
HIDDEN = 64
INIT_SCALE = 0.05  # N(0, 0.05^2) rows: small, as FM and MLP layers want


def _table(num: int, dim: int, name: str, *, sparse: bool, bag: bool = False) -> nn.Module:
    """A sparse elasticps table, or the equivalent plain torch module with the same start."""
    if sparse:
        if bag:
            return enn.EmbeddingBag(
                num, dim, name=name, mode="mean", feature=name, init_scale=INIT_SCALE
            )
        return enn.Embedding(num, dim, name=name, feature=name, init_scale=INIT_SCALE)
    module: nn.Module = nn.EmbeddingBag(num, dim, mode="mean") if bag else nn.Embedding(num, dim)
    with torch.no_grad():
        module.weight.normal_(0.0, INIT_SCALE)  # type: ignore[operator]
    return module


class Model(nn.Module):
    """DeepFM over user, movie, genre and occupation embeddings plus three dense features.

    Args:
        sparse: elasticps sparse tables (the default, for elasticps jobs) or
            plain ``torch.nn`` embeddings (the single-process reference).

    Input: the dict of :func:`batch_to_tensors`. Output: float32 ``[B]`` logits.
    """

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.user = _table(NUM_USERS, DIM, "user", sparse=sparse)
        self.movie = _table(NUM_MOVIES, DIM, "movie", sparse=sparse)
        self.genre = _table(len(GENRES), DIM, "genres", sparse=sparse, bag=True)
        self.occupation = _table(len(OCCUPATIONS), DIM, "occupation", sparse=sparse)
        self.user_bias = _table(NUM_USERS, 1, "user_bias", sparse=sparse)
        self.movie_bias = _table(NUM_MOVIES, 1, "movie_bias", sparse=sparse)
        if sparse:  # the bias tables share the id columns of the embedding tables
            self.user_bias.feature = "user"  # type: ignore[assignment]
            self.movie_bias.feature = "movie"  # type: ignore[assignment]
        self.mlp = nn.Sequential(
            nn.Linear(4 * DIM + 3, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, 1),
        )  # fmt: skip
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: dict[str, Tensor | tuple[Tensor, Tensor]]) -> Tensor:
        user, movie = x["user"], x["movie"]
        genres, offsets = x["genres"]
        assert isinstance(user, Tensor) and isinstance(movie, Tensor)
        fields = torch.stack(
            [
                self.user(user),
                self.movie(movie),
                self.genre(genres, offsets),
                self.occupation(x["occupation"]),
            ],
            dim=1,
        )  # [B, 4, DIM]
        first = self.user_bias(user)[:, 0] + self.movie_bias(movie)[:, 0]
        # FM: sum_{i<j} <e_i, e_j> = ((sum e)^2 - sum e^2) / 2, summed over dimensions.
        fm = 0.5 * (fields.sum(1).pow(2) - fields.pow(2).sum(1)).sum(1)
        dense = x["dense"]
        assert isinstance(dense, Tensor)
        deep = self.mlp(torch.cat([fields.flatten(1), dense], dim=1))[:, 0]
        return self.bias + first + fm + deep


def loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Binary cross-entropy of logits ``[B]`` against labels ``[B]`` (0.0 or 1.0), mean."""
    return nn.functional.binary_cross_entropy_with_logits(outputs, targets)


def batch_to_tensors(batch: pa.Table) -> tuple[dict[str, Tensor | tuple[Tensor, Tensor]], Tensor]:
    """One mini-batch of ``elasticps data movielens`` rows to the model's inputs and labels.

    Returns:
        ``(inputs, labels)``: ``inputs`` maps ``user``, ``movie``,
        ``occupation`` to int64 ``[B]``, ``genres`` to ``(ids int64 [N],
        offsets int64 [B])`` and ``dense`` to float32 ``[B, 3]`` (age / 100,
        gender, (release_year - 1900) / 100, 0 when unknown); ``labels`` is
        float32 ``[B]``.
    """

    def column(name: str) -> np.ndarray:
        # Zero-copy through DLPack (the columns have no nulls): pyarrow's
        # to_numpy() imports pandas, about a second of a trainer's first batch.
        return np.from_dlpack(batch.column(name).combine_chunks())

    def ints(name: str) -> Tensor:
        return torch.from_numpy(column(name).astype(np.int64))

    genres = batch.column("genres").combine_chunks()
    # The bags' starts from the list offsets (the slice's, so minus the first).
    starts = np.from_dlpack(genres.offsets)
    offsets = (starts[:-1] - starts[0]).astype(np.int64)
    values = np.from_dlpack(genres.flatten()).astype(np.int64)
    year = column("release_year").astype(np.float32)
    dense = np.stack(
        [
            column("age").astype(np.float32) / 100.0,
            column("gender").astype(np.float32),
            np.where(year > 0, (year - 1900.0) / 100.0, 0.0).astype(np.float32),
        ],
        axis=1,
    )
    inputs: dict[str, Tensor | tuple[Tensor, Tensor]] = {
        "user": ints("user_id"),
        "movie": ints("movie_id"),
        "genres": (torch.from_numpy(values), torch.from_numpy(offsets)),
        "occupation": ints("occupation"),
        "dense": torch.from_numpy(dense),
    }
    labels = torch.from_numpy(column("label").astype(np.float32))
    return inputs, labels


# --- the single-process reference ----------------------------------------------------------


def train_in_process(
    data: Path, *, backend: str = "torch", epochs: int = 5, batch_size: int = 256,
    lr: float = 1e-3, seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Train in this process and measure the test AUC (the reference of the docstring).

    Args:
        data: the directory of ``elasticps data movielens``.
        backend: ``torch`` (``nn.Embedding``, dense Adam) or ``sparse``
            (elasticps tables with lazy Adam, dense Adam for the MLP).
        epochs: passes over the training file.
        batch_size: rows per mini-batch.
        lr: Adam's learning rate.
        seed: seed of the model's initialisation and of the batch order.

    Returns:
        ``test_auc``, ``test_logloss``, ``train_rows``, ``test_rows``.
    """
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    from elasticps.pserver.sparse import SparseAdam

    torch.manual_seed(seed)
    model = Model(sparse=backend == "sparse")
    dense_opt = torch.optim.Adam(model.parameters(), lr=lr)
    sparse_opt = enn.SparseOptimizer(model, SparseAdam(), lr=lr) if backend == "sparse" else None
    train = pq.read_table(data / "train.parquet", columns=list(COLUMNS))
    test = pq.read_table(data / "test.parquet", columns=list(COLUMNS))
    order = np.random.default_rng(seed)
    for _ in range(epochs):
        perm = order.permutation(train.num_rows)
        for start in range(0, train.num_rows, batch_size):
            inputs, labels = batch_to_tensors(train.take(perm[start : start + batch_size]))
            dense_opt.zero_grad()
            loss(model(inputs), labels).backward()
            dense_opt.step()
            if sparse_opt is not None:
                sparse_opt.step()
    model.eval()
    with torch.no_grad():
        inputs, labels = batch_to_tensors(test)
        logits = model(inputs)
        test_loss = float(loss(logits, labels))
    return {
        "test_auc": round(float(roc_auc_score(labels.numpy(), logits.numpy())), 4),
        "test_logloss": round(test_loss, 4),
        "train_rows": train.num_rows,
        "test_rows": test.num_rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Train the single-process reference and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--backend", choices=["torch", "sparse"], default="torch")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = train_in_process(args.data, backend=args.backend, epochs=args.epochs, seed=args.seed)
    print(json.dumps({"backend": args.backend, "epochs": args.epochs, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
