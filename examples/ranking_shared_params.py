"""Three towers sharing their parameters: the ranking example of the PaddlePaddle API design.

The PaddlePaddle v2 API design ("Design Doc: PaddlePaddle API", ``doc/design/api.md``)
shows parameter sharing with a ranking model built from one function ``f``::

    def f(input):
        e = paddle.layer.embedding(input, parameter_name="embedding")
        o = paddle.layer.softmax(e, parameter_name="semantic")
        return o

    fA = f(paddle.layer.data(input_name="A"))
    fB = f(paddle.layer.data(input_name="B"))
    fQ = f(paddle.layer.data(input_name="Q"))
    topology = paddle.layer.less_than(
        paddle.layer.cross_entropy(fA, fQ), paddle.layer.cross_entropy(fB, fQ))
    parameters = paddle.parameters.create(topology)
    paddle.train(topology, parameters, reader=read_ranking_model_data)
    print paddle.infer(fA(testA), parameters)

Here the three towers (query Q, a relevant document A, an irrelevant
document B) are three :class:`Tower` objects holding the **same** two
modules, registered once in :class:`Ranking` under the names a lone
``Tower`` uses: ``embedding.weight``, ``semantic.weight``, ``semantic.bias``.
Three parameters, not nine: the parameter servers hold each once, and
:func:`elasticps.infer` runs a single tower with the trained set.

Synthetic data: ``TOPICS`` topics, each owning a disjoint slice of the
vocabulary; a query and its relevant document draw tokens from one topic
(plus noise tokens), the irrelevant document from another. The loss is
RankNet's logistic pairwise loss on ``CE(fA, fQ) - CE(fB, fQ)`` (Burges et
al. 2005), and accuracy is the fraction of held-out triples ranked right.

Run: ``.venv/bin/python examples/ranking_shared_params.py [--cluster none|local]``.
It prints one JSON line; the stated threshold is accuracy >= 0.9 on held-out triples.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import torch
from torch import Tensor, nn

import elasticps

VOCAB = 64
TOPICS = 8
DIM = 16
TOKENS = 6  # tokens per query or document
ACCURACY_BAR = 0.9


class Tower(nn.Module):
    """``f(input)`` of the design: embedding (mean of a bag of tokens), then a softmax projection.

    Args:
        embedding: share this embedding (a new one if None).
        semantic: share this projection (a new one if None).

    Input: int64 ``[batch, TOKENS]`` token ids. Output: float32 ``[batch, TOPICS]``
    probabilities.
    """

    def __init__(self, embedding: nn.EmbeddingBag | None = None, semantic: nn.Linear | None = None):
        super().__init__()
        self.embedding = embedding if embedding is not None else nn.EmbeddingBag(VOCAB, DIM)
        self.semantic = semantic if semantic is not None else nn.Linear(DIM, TOPICS)

    def forward(self, tokens: Tensor) -> Tensor:
        return nn.functional.softmax(self.semantic(self.embedding(tokens)), dim=-1)


class Ranking(nn.Module):
    """The ranking topology: three towers over (Q, A, B) that share every parameter.

    Input: int64 ``[batch, 3, TOKENS]`` (query, relevant, irrelevant). Output:
    float32 ``[batch]``, ``CE(fA, fQ) - CE(fB, fQ)`` (negative when ranked right).
    """

    def __init__(self) -> None:
        super().__init__()
        q = Tower()
        # The shared modules are registered once, under a lone Tower's names.
        self.embedding = q.embedding
        self.semantic = q.semantic
        # A plain tuple: the towers are not registered again (no duplicate names).
        self.towers = (q, Tower(q.embedding, q.semantic), Tower(q.embedding, q.semantic))

    def forward(self, triples: Tensor) -> Tensor:
        f_q, f_a, f_b = (tower(triples[:, i]) for i, tower in enumerate(self.towers))
        return cross_entropy(f_a, f_q) - cross_entropy(f_b, f_q)


def cross_entropy(p: Tensor, q: Tensor) -> Tensor:
    """``-sum(q * log p)`` per row: float32 ``[batch]``."""
    return -(q * torch.log(p + 1e-9)).sum(dim=-1)


def ranknet_loss(margin: Tensor, targets: Tensor) -> Tensor:
    """Logistic pairwise loss ``log(1 + exp(margin))``, mean over the batch (targets unused)."""
    return nn.functional.softplus(margin).mean()


def make_triples(n: int, seed: int) -> Tensor:
    """``n`` synthetic (query, relevant, irrelevant) token triples: int64 ``[n, 3, TOKENS]``."""
    g = torch.Generator().manual_seed(seed)
    per_topic = VOCAB // TOPICS
    topic = torch.randint(TOPICS, (n,), generator=g)
    other = (topic + torch.randint(1, TOPICS, (n,), generator=g)) % TOPICS

    def bag(t: Tensor) -> Tensor:
        tokens = t[:, None] * per_topic + torch.randint(per_topic, (n, TOKENS), generator=g)
        noise = torch.rand(n, TOKENS, generator=g) < 0.3
        return torch.where(noise, torch.randint(VOCAB, (n, TOKENS), generator=g), tokens)

    return torch.stack([bag(topic), bag(topic), bag(other)], dim=1)


def make_reader(triples: Tensor, batch_size: int = 32):  # type: ignore[no-untyped-def]
    """A reader function over ``triples``: batches of ``(triples, dummy targets)``."""

    def reader() -> Iterator[tuple[Tensor, Tensor]]:
        for i in range(0, len(triples), batch_size):
            chunk = triples[i : i + batch_size]
            yield chunk, torch.zeros(len(chunk))

    return reader


def accuracy(model: nn.Module, parameters: elasticps.ParameterSet, triples: Tensor) -> float:
    """Fraction of triples where the relevant document is ranked above the irrelevant one."""
    margin = elasticps.infer(model, parameters, triples)
    assert isinstance(margin, Tensor)
    return float((margin < 0).float().mean())


def run(
    cluster: elasticps.Local | None, *, train_size: int = 2048, num_passes: int = 3, seed: int = 0
) -> dict[str, object]:
    """Train the ranking model; return parameter names, accuracies and the final cost."""
    torch.manual_seed(seed)
    model = Ranking()
    costs: list[float] = []

    def on_event(event: elasticps.events.TrainingEvent) -> None:
        if isinstance(event, elasticps.events.EndPass):
            costs.append(event.cost)

    parameters = elasticps.train(
        model,
        ranknet_loss,
        make_reader(make_triples(train_size, seed)),
        updater=elasticps.updater.Adam(lr=0.05),
        event_handler=on_event,
        num_passes=num_passes,
        cluster=cluster,
    )
    test = make_triples(1000, seed + 1)
    # Inference with one tower only: the design's paddle.infer(fA(testA), parameters).
    topics = elasticps.infer(Tower(), parameters, test[:5, 1])
    assert isinstance(topics, Tensor)
    return {
        "parameters": parameters.names(),
        "numel": parameters.numel(),
        "pass_costs": [round(c, 4) for c in costs],
        "accuracy": accuracy(model, parameters, test),
        "tower_output_shape": list(topics.shape),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", choices=["none", "local"], default="local")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    cluster = elasticps.Local(trainers=2, ps=2, mode="sync") if args.cluster == "local" else None
    result = run(cluster, num_passes=args.passes)
    print(json.dumps(result))
    return 0 if float(result["accuracy"]) >= ACCURACY_BAR else 1  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
