"""Update rules (elasticps.pserver.rules): bit-identical to torch.optim, without it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from elasticps.config import OptimizerConfig
from elasticps.errors import ConfigError
from elasticps.pserver.rules import (
    AdagradRule,
    AdamRule,
    SGDRule,
    TorchOptimizerRule,
    UpdateRule,
    make_update_rule,
)

pytestmark = pytest.mark.timeout(60)

NUMEL = 257
Reference = Callable[[torch.nn.Parameter], torch.optim.Optimizer]

CASES: list[tuple[str, OptimizerConfig, type[UpdateRule], Reference]] = [
    ("sgd", OptimizerConfig(name="sgd", lr=0.1), SGDRule, lambda p: torch.optim.SGD([p], lr=0.1)),
    (
        "sgd-wd-maximize",
        OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01, options='{"maximize": true}'),
        SGDRule,
        lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=0.01, maximize=True),
    ),
    (
        "momentum-dampening",
        OptimizerConfig(name="momentum", lr=0.1, momentum=0.8, options='{"dampening": 0.3}'),
        SGDRule,
        lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.8, dampening=0.3),
    ),
    (
        "nesterov-wd",
        OptimizerConfig(
            name="momentum", lr=0.1, momentum=0.9, weight_decay=0.05, options='{"nesterov": true}'
        ),
        SGDRule,
        lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.05, nesterov=True),
    ),
    (
        "adam",
        OptimizerConfig(name="adam", lr=0.05),
        AdamRule,
        lambda p: torch.optim.Adam([p], lr=0.05, fused=True),
    ),
    (
        "adam-options",
        OptimizerConfig(
            name="adam",
            lr=0.05,
            weight_decay=0.1,
            options='{"betas": [0.5, 0.9], "eps": 1e-6, "amsgrad": true, "maximize": true}',
        ),
        AdamRule,
        lambda p: torch.optim.Adam(
            [p],
            lr=0.05,
            weight_decay=0.1,
            betas=(0.5, 0.9),
            eps=1e-6,
            amsgrad=True,
            maximize=True,
            fused=True,
        ),
    ),
    (
        "adamw",
        OptimizerConfig(
            name="adam", lr=0.05, weight_decay=0.1, options='{"decoupled_weight_decay": true}'
        ),
        AdamRule,
        lambda p: torch.optim.AdamW([p], lr=0.05, weight_decay=0.1, fused=True),
    ),
    (
        "adagrad",
        OptimizerConfig(name="adagrad", lr=0.3),
        AdagradRule,
        lambda p: torch.optim.Adagrad([p], lr=0.3, fused=True),
    ),
    (
        "adagrad-options",
        OptimizerConfig(
            name="adagrad",
            lr=0.3,
            weight_decay=0.01,
            options='{"lr_decay": 0.1, "initial_accumulator_value": 0.5, "eps": 1e-8}',
        ),
        AdagradRule,
        lambda p: torch.optim.Adagrad(
            [p],
            lr=0.3,
            weight_decay=0.01,
            lr_decay=0.1,
            initial_accumulator_value=0.5,
            eps=1e-8,
            fused=True,
        ),
    ),
]


def _grads(n: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) for _ in range(n)]


def _init() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize(
    ("config", "kind", "reference"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_builtin_rule_is_bit_identical_to_torch_optim_with_changing_lr(
    config: OptimizerConfig, kind: type[UpdateRule], reference: Reference
) -> None:
    values = _init()
    rule = make_update_rule(values, config)
    assert type(rule) is kind
    ref = torch.nn.Parameter(_init())
    ref_opt = reference(ref)
    for i, grad in enumerate(_grads(6)):
        lr = config.lr * 0.7**i  # as a schedule would set it
        for group in ref_opt.param_groups:
            group["lr"] = lr
        sent = grad.clone()
        rule.step(sent, lr)
        ref.grad = grad.clone()
        ref_opt.step()
        assert torch.equal(values, ref.detach()), f"step {i}"
        assert torch.equal(sent, grad), "the rule modified the gradient"
    theirs = ref_opt.state_dict()["state"].get(0, {})
    mine = rule.state()
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), key


@pytest.mark.parametrize(
    ("config", "kind", "reference"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_state_loaded_into_a_new_rule_continues_exactly(
    config: OptimizerConfig, kind: type[UpdateRule], reference: Reference
) -> None:
    grads = _grads(5)
    values = _init()
    straight = make_update_rule(values, config)
    for grad in grads:
        straight.step(grad, config.lr)

    first = _init()
    before = make_update_rule(first, config)
    for grad in grads[:2]:
        before.step(grad, config.lr)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in before.state().items()}
    resumed_values = first.clone()
    after = make_update_rule(resumed_values, config)
    after.load_state(saved)
    for grad in grads[2:]:
        after.step(grad, config.lr)
    assert torch.equal(resumed_values, values)


def test_state_written_by_torch_optim_loads_into_the_builtin_rule() -> None:
    # A checkpoint saved before the built-in rules existed holds torch.optim's state.
    grads = _grads(4)
    ref = torch.nn.Parameter(_init())
    ref_opt = torch.optim.Adam([ref], lr=0.05, fused=True)
    for grad in grads[:2]:
        ref.grad = grad.clone()
        ref_opt.step()
    values = ref.detach().clone()
    rule = make_update_rule(values, OptimizerConfig(name="adam", lr=0.05))
    rule.load_state(ref_opt.state_dict()["state"][0])
    for grad in grads[2:]:
        ref.grad = grad.clone()
        ref_opt.step()
        rule.step(grad, 0.05)
    assert torch.equal(values, ref.detach())


def test_options_the_builtin_rules_do_not_take_run_through_torch_optim() -> None:
    values = _init()
    config = OptimizerConfig(name="adam", lr=0.05, options='{"foreach": false}')
    rule = make_update_rule(values, config)
    assert isinstance(rule, TorchOptimizerRule)
    ref = torch.nn.Parameter(_init())
    ref_opt = torch.optim.Adam([ref], lr=0.05, foreach=False)
    for grad in _grads(3):
        rule.step(grad, 0.05)
        ref.grad = grad.clone()
        ref_opt.step()
    torch.testing.assert_close(values, ref.detach())


def test_a_torch_optim_class_by_name_is_a_torch_rule() -> None:
    config = OptimizerConfig(name="torch", torch_class="RMSprop", lr=0.01)
    assert isinstance(make_update_rule(_init(), config), TorchOptimizerRule)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (OptimizerConfig(name="adam", options=json.dumps({"betas": [0.9, 1.5]})), "betas"),
        (OptimizerConfig(name="adam", options=json.dumps({"eps": -1})), "eps"),
        (
            OptimizerConfig(
                name="momentum", options=json.dumps({"dampening": 0.5, "nesterov": True})
            ),
            "Nesterov",
        ),
        (OptimizerConfig(name="sgd", options=json.dumps({"nesterov": True})), "Nesterov"),
        (OptimizerConfig(name="adagrad", options=json.dumps({"lr_decay": -0.1})), "lr_decay"),
        (OptimizerConfig(name="adam", options=json.dumps({"betas": "fast"})), "betas"),
    ],
    ids=["betas-range", "eps", "nesterov-dampening", "sgd-nesterov", "lr-decay", "betas-type"],
)
def test_bad_hyper_parameters_are_config_errors(config: OptimizerConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_update_rule(_init(), config)


@pytest.mark.parametrize(
    ("config", "state"),
    [
        (OptimizerConfig(name="adam"), {"exp_avg": torch.zeros(NUMEL)}),
        (OptimizerConfig(name="adagrad"), {"step": 1.0, "sum": torch.zeros(3)}),
        (OptimizerConfig(name="sgd"), {"momentum_buffer": torch.zeros(NUMEL)}),
        (
            OptimizerConfig(name="adam"),
            {"step": -1.0, "exp_avg": torch.zeros(NUMEL), "exp_avg_sq": torch.zeros(NUMEL)},
        ),
    ],
    ids=["adam-partial", "adagrad-size", "sgd-without-momentum", "negative-step"],
)
def test_state_a_rule_cannot_use_is_refused(
    config: OptimizerConfig, state: dict[str, torch.Tensor | float]
) -> None:
    rule = make_update_rule(_init(), config)
    with pytest.raises(ValueError):
        rule.load_state(state)


def test_builtin_rules_never_import_torch_dynamo() -> None:
    # Each parameter server would pay ~1.8 s of CPU for it at every start.
    code = (
        "import sys, torch\n"
        "from elasticps.config import OptimizerConfig\n"
        "from elasticps.pserver.shard import ParameterShard\n"
        "from elasticps.config import UpdateMode\n"
        "for name in ('sgd', 'momentum', 'adam', 'adagrad'):\n"
        "    layout = {'shard': 0, 'numel': 4, 'pieces': [['w', 0, 4]]}\n"
        "    s = ParameterShard(layout, 'f', OptimizerConfig(name=name), UpdateMode.ASYNC)\n"
        "    s.push(0, torch.ones(4), 0, 1)\n"
        "    s.load_state(*s.state())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
