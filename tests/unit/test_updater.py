"""Tests of ``elasticps.updater``: updater configs and learning-rate schedules (pure)."""

from __future__ import annotations

import json

import pytest
import torch

from elasticps import updater
from elasticps.config import OptimizerConfig
from elasticps.errors import ConfigError


def test_step_decay_multiplies_by_gamma_every_n_versions() -> None:
    schedule = updater.StepDecay(every_versions=10, gamma=0.5)
    assert [schedule.factor(v) for v in (0, 9, 10, 19, 20, 35)] == [1, 1, 0.5, 0.5, 0.25, 0.125]


def test_exponential_decay_is_smooth_in_the_version() -> None:
    schedule = updater.ExponentialDecay(gamma=0.25, every_versions=4)
    assert schedule.factor(0) == 1.0
    assert schedule.factor(2) == pytest.approx(0.5)
    assert schedule.factor(4) == pytest.approx(0.25)


def test_warmup_ramps_linearly_then_hands_over_without_shifting_the_version() -> None:
    schedule = updater.Warmup(versions=4, then=updater.StepDecay(every_versions=6, gamma=0.1))
    assert [schedule.factor(v) for v in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule.factor(5) == 1.0
    assert schedule.factor(6) == pytest.approx(0.1)


def test_piecewise_table_applies_each_factor_up_to_its_boundary() -> None:
    schedule = updater.Piecewise(boundaries=(100, 500), factors=(1.0, 0.1, 0.01))
    assert [schedule.factor(v) for v in (0, 99, 100, 499, 500, 10**6)] == [
        1.0,
        1.0,
        0.1,
        0.1,
        0.01,
        0.01,
    ]


@pytest.mark.parametrize(
    "schedule",
    [
        updater.Constant(),
        updater.StepDecay(every_versions=3, gamma=0.7),
        updater.ExponentialDecay(gamma=0.9, every_versions=2),
        updater.Warmup(versions=5, then=updater.ExponentialDecay(gamma=0.99)),
        updater.Piecewise(boundaries=(10,), factors=(1.0, 0.5)),
    ],
    ids=["constant", "step", "exponential", "warmup", "piecewise"],
)
def test_schedule_survives_a_json_round_trip(schedule: updater.Schedule) -> None:
    text = json.dumps(schedule.to_json())
    again = updater.schedule_from_json(text)
    assert again == schedule
    assert [again.factor(v) for v in range(20)] == [schedule.factor(v) for v in range(20)]


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"kind": "cosine"}',
        '{"kind": "step"}',
        '{"kind": "step", "every_versions": 0}',
        '{"kind": "step", "every_versions": 2, "gamma": 2.0}',
        '{"kind": "step", "every_versions": "2"}',
        '{"kind": "piecewise", "boundaries": [5, 3], "factors": [1, 1, 1]}',
        '{"kind": "piecewise", "boundaries": [5], "factors": [1]}',
        '{"kind": "warmup", "versions": 3, "then": {"kind": "nope"}}',
    ],
)
def test_invalid_schedule_json_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        updater.schedule_from_json(text)


def test_negative_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version"):
        updater.StepDecay(every_versions=1).factor(-1)


def test_updater_lr_at_scales_the_base_lr_by_the_schedule() -> None:
    sgd = updater.SGD(lr=0.2, schedule=updater.StepDecay(every_versions=100, gamma=0.5))
    assert sgd.lr_at(0) == pytest.approx(0.2)
    assert sgd.lr_at(250) == pytest.approx(0.05)
    assert updater.lr_at(sgd.to_config(), 250) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("made", "expected"),
    [
        (updater.SGD(lr=0.1), OptimizerConfig(name="sgd", lr=0.1)),
        (
            updater.Momentum(lr=0.1, momentum=0.8),
            OptimizerConfig(name="momentum", lr=0.1, momentum=0.8),
        ),
        (updater.Adam(lr=0.01), OptimizerConfig(name="adam", lr=0.01)),
        (updater.AdaGrad(lr=0.3), OptimizerConfig(name="adagrad", lr=0.3)),
        (
            updater.Adam(lr=0.01, betas=(0.8, 0.9), eps=1e-6),
            OptimizerConfig(name="adam", lr=0.01, options='{"betas":[0.8,0.9],"eps":1e-06}'),
        ),
        (
            updater.Optimizer(torch.optim.RMSprop, lr=0.01, alpha=0.9),
            OptimizerConfig(name="torch", lr=0.01, torch_class="RMSprop", options='{"alpha":0.9}'),
        ),
    ],
    ids=["sgd", "momentum", "adam", "adagrad", "adam-betas", "rmsprop"],
)
def test_updater_to_config_gives_the_ps_optimizer_config(
    made: updater.Updater, expected: OptimizerConfig
) -> None:
    assert made.to_config() == expected


@pytest.mark.parametrize(
    ("made", "reference"),
    [
        (
            updater.Adam(lr=0.05, betas=(0.5, 0.9)),
            lambda p: torch.optim.Adam([p], lr=0.05, betas=(0.5, 0.9)),
        ),
        (
            updater.Momentum(lr=0.1, nesterov=True),
            lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True),
        ),
        (
            updater.AdaGrad(lr=0.1, initial_accumulator_value=0.5),
            lambda p: torch.optim.Adagrad([p], lr=0.1, initial_accumulator_value=0.5),
        ),
        (
            updater.Optimizer(torch.optim.Adamax, lr=0.02, betas=[0.8, 0.95]),
            lambda p: torch.optim.Adamax([p], lr=0.02, betas=(0.8, 0.95)),
        ),
    ],
    ids=["adam-betas", "nesterov", "adagrad-init", "adamax"],
)
def test_built_optimizer_steps_like_the_torch_optim_it_names(
    made: updater.Updater, reference: object
) -> None:
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(8, generator=gen) for _ in range(3)]
    mine = torch.nn.Parameter(torch.ones(8))
    theirs = torch.nn.Parameter(torch.ones(8))
    opt = updater.make_torch_optimizer([mine], made.to_config())
    ref = reference(theirs)  # type: ignore[operator]
    for g in grads:
        mine.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(mine.detach(), theirs.detach())


def test_updater_config_survives_the_cli_flags_it_travels_by() -> None:
    from elasticps.cli import _optimizer, build_parser

    config = updater.Optimizer(
        torch.optim.RMSprop, lr=0.01, schedule=updater.Warmup(versions=3), alpha=0.9
    ).to_config()
    args = build_parser().parse_args(
        ["ps", "--optimizer", config.name, "--lr", repr(config.lr),
         "--optimizer-class", config.torch_class, "--optimizer-options", config.options,
         "--lr-schedule", config.schedule, "--frozen", "D.*", "E.*", "--max-staleness", "3"]
    )  # fmt: skip
    assert _optimizer(args) == config
    assert args.frozen == ["D.*", "E.*"]
    assert args.max_staleness == 3


def test_ps_flags_rebuild_the_same_config_through_the_ps_parser() -> None:
    from elasticps.cli import _optimizer, build_parser

    for made in (
        updater.SGD(lr=0.1),
        updater.Adam(lr=0.01, betas=(0.8, 0.9), schedule=updater.Warmup(versions=10)),
        updater.Optimizer(torch.optim.Adadelta, lr=1.0, rho=0.8),
    ):
        config = made.to_config()
        args = build_parser().parse_args(["ps", *updater.ps_flags(config)])
        assert _optimizer(args) == config


def test_frozen_patterns_come_from_the_environment_comma_separated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elasticps.cli import build_parser

    monkeypatch.setenv("ELASTICPS_FROZEN", "D.*,emb.weight")
    monkeypatch.setenv("ELASTICPS_MAX_STALENESS", "4")
    args = build_parser().parse_args(["ps"])
    assert args.frozen == ["D.*", "emb.weight"]
    assert args.max_staleness == 4


class NotAnOptimizer:
    pass


class MyOptimizer(torch.optim.SGD):
    pass


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: updater.Optimizer(NotAnOptimizer), "subclass"),  # type: ignore[arg-type]
        (lambda: updater.Optimizer(MyOptimizer), "not in torch.optim"),
        (lambda: updater.Optimizer(torch.optim.LBFGS), "cannot run"),
        (lambda: updater.Optimizer(torch.optim.RMSprop, alphaa=0.9), "alphaa"),
        (lambda: updater.Optimizer(torch.optim.RMSprop, alpha=object()), "JSON"),  # type: ignore[arg-type]
        (lambda: updater.Adam(betas=(0.9, 1.5)), "betas"),
        (lambda: updater.SGD(lr=0), "lr"),
    ],
    ids=["not-optimizer", "not-torch-optim", "lbfgs", "unknown-kwarg", "not-json", "betas", "lr"],
)
def test_invalid_updaters_raise_config_errors(build: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "torch"},
        {"name": "adam", "torch_class": "RMSprop"},
        {"name": "torch", "torch_class": "Nope"},
        {"name": "adam", "options": "[1]"},
        {"name": "adam", "options": '{"lr": 1}'},
        {"name": "adam", "schedule": '{"kind": "x"}'},
    ],
)
def test_optimizer_config_validates_its_extensions(kwargs: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        OptimizerConfig(**kwargs)  # type: ignore[arg-type]
