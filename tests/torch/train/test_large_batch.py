"""LARS and LAMB: each step against the papers' formulas computed by hand in float64, the recipe's `no_decay`
parameters (trust ratio 1, no weight decay), accumulation equal to the large batch, resume, and FSDP2-style
DTensor shards giving the unsharded result."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    LAMB_SPEC,
    LARS_SPEC,
    assert_same_model,
    assert_same_weights,
    digits_recipe,
    run_accumulated,
    run_plain,
)
from reproduce.data import build_data
from reproduce.models import build_model
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.optim.large_batch import LAMB, LARS
from reproduce.train.optim.optimizers import build_optimizer, param_groups
from reproduce.train.trainer import RunRequest, train

TESTS = Path(__file__).parents[2]

# ---- the formulas, by hand: plain Python floats, element by element --------------------------------------


def norm(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def lars_by_hand(w, g, v, lr, momentum, decay, trust, adapt=True):
    """You et al. 2017, Algorithm 1, one tensor (flattened): returns the new weights and momentum."""
    if adapt:
        w_norm, g_norm = norm(w), norm(g)
        local = trust * w_norm / (g_norm + decay * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
        step = [lr * local * (gi + decay * wi) for wi, gi in zip(w, g, strict=True)]
    else:  # no_decay parameters: ratio 1, no weight decay
        step = [lr * gi for gi in g]
    v = [momentum * vi + si for vi, si in zip(v, step, strict=True)]
    return [wi - vi for wi, vi in zip(w, v, strict=True)], v


def lamb_by_hand(w, g, m, v, t, lr, beta1, beta2, eps, decay, adapt=True):
    """You et al. 2019, Algorithm 2, one tensor (flattened), step t (1-based)."""
    m = [beta1 * mi + (1 - beta1) * gi for mi, gi in zip(m, g, strict=True)]
    v = [beta2 * vi + (1 - beta2) * gi * gi for vi, gi in zip(v, g, strict=True)]
    r = [(mi / (1 - beta1**t)) / (math.sqrt(vi / (1 - beta2**t)) + eps) for mi, vi in zip(m, v, strict=True)]
    if adapt:
        u = [ri + decay * wi for ri, wi in zip(r, w, strict=True)]
        w_norm, u_norm = norm(w), norm(u)
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    else:
        u, ratio = r, 1.0
    return [wi - lr * ratio * ui for wi, ui in zip(w, u, strict=True)], m, v


GRADS = [  # three steps' gradients for a 2x3 weight and a 3-element bias
    ([[0.3, -0.2, 0.5], [0.1, 0.4, -0.6]], [0.05, -0.1, 0.2]),
    ([[-0.1, 0.25, 0.05], [0.3, -0.35, 0.2]], [0.0, 0.3, -0.15]),
    ([[0.02, 0.01, -0.04], [0.05, 0.0, 0.03]], [0.2, -0.05, 0.1]),
]
WEIGHT, BIAS = [[1.0, -2.0, 0.5], [0.25, 1.5, -1.0]], [0.1, 0.0, -0.3]


def params_and_groups(**adaptive):
    weight = torch.nn.Parameter(torch.tensor(WEIGHT, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.tensor(BIAS, dtype=torch.float64))
    groups = [{"params": [weight], **adaptive}, {"params": [bias], "weight_decay": 0.0, "layer_adaptation": False}]
    return weight, bias, groups


def flat(values) -> list[float]:
    return [float(x) for x in torch.tensor(values, dtype=torch.float64).flatten()]


def test_lars_each_step_is_algorithm_1():
    weight, bias, groups = params_and_groups(weight_decay=0.01)
    optimizer = LARS(groups, lr=2.0, momentum=0.9, trust_coefficient=0.02)
    w, b = flat(WEIGHT), flat(BIAS)
    vw, vb = [0.0] * 6, [0.0] * 3
    for grad_w, grad_b in GRADS:
        weight.grad, bias.grad = torch.tensor(grad_w, dtype=torch.float64), torch.tensor(grad_b, dtype=torch.float64)
        optimizer.step()
        w, vw = lars_by_hand(w, flat(grad_w), vw, 2.0, 0.9, 0.01, 0.02)
        b, vb = lars_by_hand(b, flat(grad_b), vb, 2.0, 0.9, 0.0, 0.02, adapt=False)
        torch.testing.assert_close(weight.detach().flatten(), torch.tensor(w, dtype=torch.float64), rtol=1e-12,
                                   atol=1e-15)
        torch.testing.assert_close(bias.detach(), torch.tensor(b, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # the trust ratio really scales: the weight moved far less than plain momentum SGD at lr 2 moves it
    plain, velocity = flat(WEIGHT), [0.0] * 6
    for grad_w, _ in GRADS:
        plain, velocity = lars_by_hand(plain, flat(grad_w), velocity, 2.0, 0.9, 0.0, 0.02, adapt=False)
    moved = max(abs(x - y) for x, y in zip(w, flat(WEIGHT), strict=True))
    assert moved < 0.2 * max(abs(x - y) for x, y in zip(plain, flat(WEIGHT), strict=True))


def test_lars_ratio_is_one_for_zero_weights_or_gradients():
    zero = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))  # zero-initialised: ||w|| = 0
    still = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    optimizer = LARS([zero, still], lr=0.5, weight_decay=0.1)
    zero.grad = torch.full((4,), 0.2, dtype=torch.float64)
    still.grad = torch.zeros(4, dtype=torch.float64)  # ||g|| = 0: ratio 1, the weight decay alone moves it
    optimizer.step()
    torch.testing.assert_close(zero.detach(), torch.full((4,), -0.1, dtype=torch.float64))  # -0.5 x 1 x 0.2
    torch.testing.assert_close(still.detach(), torch.full((4,), 0.95, dtype=torch.float64))  # 1 - 0.5 x 0.1 x 1


def test_lamb_each_step_is_algorithm_2():
    weight, bias, groups = params_and_groups(weight_decay=0.05)
    optimizer = LAMB(groups, lr=0.01, betas=(0.9, 0.99), eps=1e-6)
    w, b = flat(WEIGHT), flat(BIAS)
    mw, vw, mb, vb = [0.0] * 6, [0.0] * 6, [0.0] * 3, [0.0] * 3
    for t, (grad_w, grad_b) in enumerate(GRADS, start=1):
        weight.grad, bias.grad = torch.tensor(grad_w, dtype=torch.float64), torch.tensor(grad_b, dtype=torch.float64)
        optimizer.step()
        w, mw, vw = lamb_by_hand(w, flat(grad_w), mw, vw, t, 0.01, 0.9, 0.99, 1e-6, 0.05)
        b, mb, vb = lamb_by_hand(b, flat(grad_b), mb, vb, t, 0.01, 0.9, 0.99, 1e-6, 0.0, adapt=False)
        torch.testing.assert_close(weight.detach().flatten(), torch.tensor(w, dtype=torch.float64), rtol=1e-12,
                                   atol=1e-15)
        torch.testing.assert_close(bias.detach(), torch.tensor(b, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # the update's norm is lr x ||w|| (the trust ratio's point), not Adam's ~ lr x sqrt(numel)
    before = torch.tensor(w, dtype=torch.float64)
    weight.grad = torch.tensor(GRADS[0][0], dtype=torch.float64)
    optimizer.step()
    moved = float(torch.linalg.vector_norm(weight.detach().flatten() - before))
    assert moved == pytest.approx(0.01 * float(torch.linalg.vector_norm(before)), rel=1e-9)


def test_no_decay_parameters_get_ratio_one_and_no_decay_even_without_weight_decay():
    recipe = parse_recipe(digits_recipe({"name": "lamb", "lr": 1e-3, "no_decay": ["bias"]}))
    model = build_model(recipe)
    groups = param_groups(model, 0.0, ["bias"], layer_adaptation=True)  # weight_decay 0: still split
    assert [g["layer_adaptation"] for g in groups] == [True, False]
    biases = {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    assert {id(p) for p in groups[1]["params"]} == biases and groups[1]["weight_decay"] == 0.0
    lars = parse_recipe(digits_recipe({"name": "lars", "lr": 1.0, "momentum": 0.9, "weight_decay": 1e-4,
                                       "no_decay": ["bias"], "trust_coefficient": 0.01}))
    optimizer = build_optimizer(make_plan(lars, micro_batch_max=64), build_model(lars))
    assert isinstance(optimizer, LARS)
    assert [(g["weight_decay"], g["layer_adaptation"], g["trust_coefficient"]) for g in optimizer.param_groups] == [
        (1e-4, True, 0.01), (0.0, False, 0.01)]


@pytest.mark.parametrize("spec", [LARS_SPEC, LAMB_SPEC], ids=["lars", "lamb"])
def test_accumulation_equals_the_large_batch_float64(spec, tmp_path):
    recipe = digits_recipe(spec)
    plan, _, ours, data = run_accumulated(recipe, micro_batch=8, tmp_path=tmp_path)
    assert (plan.micro_batch, plan.accumulation_steps) == (8, 8)
    reference = run_plain(recipe, data, steps=6)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    torch.manual_seed(0)
    initial = build_model(parse_recipe(recipe)).state_dict()
    assert all(not torch.allclose(initial[k].double(), ours[k]) for k in ours)  # every tensor moved


def test_lamb_resume_is_bitwise(tmp_path):
    recipe = parse_recipe(digits_recipe(LAMB_SPEC, steps=6, data={"shuffle": True}))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=3), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)
    assert_same_model(tmp_path / "full", tmp_path / "split")


# ---- FSDP2's sharded parameters: DTensor shards over two processes ---------------------------------------

WORKER = TESTS / "sharded_optimizer_worker.py"


def unsharded_reference() -> dict:
    sys.path.insert(0, str(TESTS))
    from sharded_optimizer_worker import run_steps

    return run_steps(mesh=None)


@pytest.mark.distributed
@pytest.mark.subprocess
def test_dtensor_shards_over_two_processes_give_the_unsharded_update(tmp_path):
    """Each rank holds half of every tensor (an uneven half for the 5-element bias); the trust ratios come from the
    whole tensors' norms, so both optimizers match one process holding everything, in float64."""
    out = tmp_path / "sharded.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(WORKER),
               str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sharded = torch.load(out, weights_only=True)
    reference = unsharded_reference()
    assert sharded["state_is_dtensor"] is True
    for name in ("lars", "lamb"):
        for got, want in zip(sharded[name], reference[name], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # a shard's own norm would have given another update: the test tells the two apart
    assert not all(torch.allclose(a, b) for a, b in zip(sharded["lars"], reference["lars_local_norms"], strict=True))
