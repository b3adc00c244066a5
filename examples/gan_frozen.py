"""A 1-D GAN trained in alternating jobs, each freezing the other network.

The generator ``G`` maps noise to numbers; the discriminator ``D`` tells real
numbers (drawn from N(MEAN, STD)) from generated ones. Both live in one
module, so every parameter has one name: ``G.*`` or ``D.*``. A round is two
:func:`elasticps.train` jobs that pass the parameters on:

1. the **D step** (:class:`DStep`) trains ``D`` on real vs generated
   samples with ``frozen_parameters={"G.*"}``;
2. the **G step** (:class:`GStep`) trains ``G`` to fool ``D`` with
   ``frozen_parameters={"D.*"}``.

The loss is the least-squares GAN loss (Mao et al. 2017, "Least Squares
Generative Adversarial Networks"): D regresses 1 on real and 0 on generated
samples, G pushes D's output on its samples to 1. It oscillates far less than
the cross-entropy loss of Goodfellow et al. 2014 when, as here, every job
starts a fresh Adam state (a ParameterSet carries values, not optimizer
state). D gets twice G's mini-batches per round and twice its learning rate.

Frozen parameters are pulled but never updated: the trainer zeroes their
gradients, the parameter servers refuse non-zero ones and write them back
after every optimizer step, so they are bit-identical before and after the
step that froze them (:func:`check_frozen` asserts it).

Run: ``.venv/bin/python examples/gan_frozen.py [--rounds 20] [--cluster none|local]``.
It prints one JSON line; the stated threshold: the generated mean is within 0.5 of
MEAN and the generated standard deviation within [0.4, 2.5].
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

import elasticps

MEAN = 4.0
STD = 1.25
NOISE = 4
BATCH = 64
D_BATCHES = 16  # mini-batches of a D step
G_BATCHES = 8  # mini-batches of a G step
D_LR = 1e-2
G_LR = 5e-3
MEAN_TOLERANCE = 0.5
DEFAULT_ROUNDS = 20


def _mlp(n_in: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, 32), nn.LeakyReLU(0.2), nn.Linear(32, n_out))


class GAN(nn.Module):
    """Both networks.

    ``G``: float32 noise ``[b, NOISE]`` -> samples ``[b, 1]``;
    ``D``: samples ``[b, 1]`` -> score ``[b, 1]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.G = _mlp(NOISE, 1)
        self.D = _mlp(1, 1)


class DStep(GAN):
    """The D step: input float32 ``[b, 1 + NOISE]`` (real sample, then noise); output ``[2b]``."""

    def forward(self, inputs: Tensor) -> Tensor:
        real, z = inputs[:, :1], inputs[:, 1:]
        return torch.cat([self.D(real), self.D(self.G(z))]).squeeze(-1)


class GStep(GAN):
    """The G step: input float32 noise ``[b, NOISE]``; D's outputs on generated samples ``[b]``."""

    def forward(self, z: Tensor) -> Tensor:
        return self.D(self.G(z)).squeeze(-1)


class Generator(nn.Module):
    """``G`` alone, under the same names (``G.*``), for :func:`elasticps.infer`."""

    def __init__(self) -> None:
        super().__init__()
        self.G = _mlp(NOISE, 1)

    def forward(self, z: Tensor) -> Tensor:
        return self.G(z)


def least_squares(outputs: Tensor, targets: Tensor) -> Tensor:
    """The LSGAN loss: mean of ``(D output - target) ** 2`` (float32 scalar)."""
    return ((outputs - targets) ** 2).mean()


def d_reader(seed: int) -> Callable[[], Iterator[tuple[Tensor, Tensor]]]:
    """Batches of (real sample + noise, targets: 1 for each real, then 0 for each generated)."""

    def reader() -> Iterator[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(seed)
        for _ in range(D_BATCHES):
            real = MEAN + STD * torch.randn(BATCH, 1, generator=g)
            z = torch.randn(BATCH, NOISE, generator=g)
            yield torch.cat([real, z], dim=1), torch.cat([torch.ones(BATCH), torch.zeros(BATCH)])

    return reader


def g_reader(seed: int) -> Callable[[], Iterator[tuple[Tensor, Tensor]]]:
    """Batches of (noise, targets 1: G wants D to call its samples real)."""

    def reader() -> Iterator[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(seed)
        for _ in range(G_BATCHES):
            yield torch.randn(BATCH, NOISE, generator=g), torch.ones(BATCH)

    return reader


def check_frozen(
    before: Mapping[str, Tensor], after: Mapping[str, Tensor], prefix: str
) -> tuple[int, int]:
    """Assert that parameters under ``prefix`` are bit-identical and that some others changed.

    Returns:
        (frozen tensors checked, trained tensors that changed).
    """
    frozen = [n for n in before if n.startswith(prefix)]
    for name in frozen:
        if not torch.equal(before[name], after[name]):
            raise AssertionError(f"frozen parameter {name} changed")
    changed = sum(
        1 for n in before if not n.startswith(prefix) and not torch.equal(before[n], after[n])
    )
    if changed == 0:
        raise AssertionError("the trained network did not change")
    return len(frozen), changed


def train_round(
    parameters: elasticps.ParameterSet,
    round_id: int,
    cluster: elasticps.Local | None,
) -> elasticps.ParameterSet:
    """One D step (G frozen), then one G step (D frozen); checks both freezes."""
    after_d = elasticps.train(
        DStep(), least_squares, d_reader(2 * round_id),
        updater=elasticps.updater.Adam(lr=D_LR, betas=(0.5, 0.999)),
        frozen_parameters={"G.*"}, cluster=cluster, parameters=parameters,
    )  # fmt: skip
    check_frozen(parameters, after_d, "G.")
    after_g = elasticps.train(
        GStep(), least_squares, g_reader(2 * round_id + 1),
        updater=elasticps.updater.Adam(lr=G_LR, betas=(0.5, 0.999)),
        frozen_parameters={"D.*"}, cluster=cluster, parameters=after_d,
    )  # fmt: skip
    check_frozen(after_d, after_g, "D.")
    return after_g


def generated_stats(parameters: elasticps.ParameterSet, n: int = 4000) -> tuple[float, float]:
    """Mean and standard deviation of ``n`` generated samples (G alone, via ``infer``)."""
    z = torch.randn(n, NOISE, generator=torch.Generator().manual_seed(12345))
    samples = elasticps.infer(Generator(), parameters.select({"G.*"}), z)
    assert isinstance(samples, Tensor)
    return float(samples.mean()), float(samples.std())


def run(rounds: int, cluster: elasticps.Local | None = None, seed: int = 0) -> dict[str, object]:
    """Train ``rounds`` rounds from a seeded GAN; return the generated statistics."""
    torch.manual_seed(seed)
    parameters = elasticps.parameters.create(GAN())
    start = generated_stats(parameters)
    for r in range(rounds):
        parameters = train_round(parameters, r, cluster)
    mean, std = generated_stats(parameters)
    return {
        "rounds": rounds,
        "start_mean": round(start[0], 3),
        "mean": round(mean, 3),
        "std": round(std, 3),
        "target_mean": MEAN,
        "target_std": STD,
        "ok": abs(mean - MEAN) < MEAN_TOLERANCE and 0.4 <= std <= 2.5,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--cluster", choices=["none", "local"], default="none")
    args = parser.parse_args(argv)
    cluster = elasticps.Local(trainers=1, ps=2) if args.cluster == "local" else None
    result = run(args.rounds, cluster)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
