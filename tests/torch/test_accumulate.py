"""`reproduce.Accumulator` (src/reproduce/accumulate.py), the exact window for a user's own loop: its accumulated
gradient equals the one-pass large batch's in float64 to 1e-12 on unequal token counts, a partial last window and
two processes (gloo, DDP averaging or summing); its out-of-memory recovery splits the window again and stays exact;
a plain loop written with it trains to the weights `reproduce run` trains to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import reproduce
from helpers import SGD, TESTS, assert_same_weights, lm_recipe, plain_optimizer, run_accumulated
from reproduce.data.batches import fetch
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.tracker import MemoryTracker

sys.path.insert(0, str(TESTS))
import accumulator_worker as worker  # noqa: E402  (tests/: the loop the two-process test runs too)

WORKER = TESTS / "accumulator_worker.py"


def assert_same(ours: list, reference: list) -> None:
    for got, want in zip(ours, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_unequal_token_counts_and_a_partial_last_window_give_the_one_pass_gradient(one_thread):
    _, _, targets = worker.model_and_data()
    windows = worker.windows()
    assert [len(w) for w in windows] == [8, 8, 6]  # the last window is partial
    counts = [worker.tokens_of(targets[m]) for m in torch.split(windows[0], worker.MICRO_BATCH)]
    assert len(set(counts)) == len(counts)  # the micro-batches' token counts differ
    reference_grads, reference = worker.one_pass()
    grads, weights = worker.accumulated()
    assert len(grads) == 3
    for ours, one_pass in zip(grads, reference_grads, strict=True):
        assert_same(ours, one_pass)
    assert_same(list(weights.values()), list(reference.values()))
    # the clip bound (so the accumulated norm was the large batch's) and the weights moved
    model, _, _ = worker.model_and_data()
    assert not torch.allclose(model.state_dict()["head.weight"], weights["head.weight"])


def test_the_mean_of_micro_batch_means_is_not_the_one_pass_gradient(one_thread):
    """What the window replaces (Accelerate's and Lightning's division by N) differs: this test can fail."""
    model, tokens, targets = worker.model_and_data()
    indices = worker.windows()[0]
    micro_batches = list(torch.split(indices, worker.MICRO_BATCH))
    for m in micro_batches:
        mean = worker.summed_loss(model, tokens[m], targets[m]) / worker.tokens_of(targets[m])
        (mean / len(micro_batches)).backward()
    averaged = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (worker.summed_loss(model, tokens[indices], targets[indices]) / worker.tokens_of(targets[indices])).backward()
    assert max(float((a - p.grad).abs().max()) for a, p in zip(averaged, model.parameters(), strict=True)) > 1e-4


@pytest.mark.distributed
@pytest.mark.subprocess
def test_two_processes_give_the_one_pass_gradient(tmp_path):
    """Each rank holds its share of every window in micro-batches of 3 (1 to 2 per rank, unequal tokens); the
    window's count is summed over the ranks before the first backward, DDP reduces once per window (no_sync on
    the others), and both DDP's averaging hook and a summing one give the one-pass gradient to 1e-12."""
    out = tmp_path / "ddp.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(WORKER),
               str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = torch.load(out, weights_only=True)
    reference_grads, reference = worker.one_pass()
    for name in ("averaged", "summed"):
        grads, weights = saved[name]
        for ours, one_pass in zip(grads, reference_grads, strict=True):
            assert_same(ours, one_pass)
        assert_same(list(weights.values()), list(reference.values()))
    # 3 windows of 2 micro-batches on rank 0 (3 + 1 sequences... each share split by 3): one reduction per window
    assert saved["reductions"].count(0) == len(worker.windows())


def test_step_recovers_from_out_of_memory_with_the_same_update(one_thread):
    """`Accumulator.step` under a memory budget between the peaks of micro-batch 4 and 8: micro-batch 8 runs out
    of memory (the tracker raises torch.OutOfMemoryError as CUDA does), the window is split again at 4, and the
    update is the one-pass update."""

    def peak(micro_batch: int, budget: int | None = None) -> tuple[int, reproduce.Accumulator, list, dict]:
        model, tokens, targets = worker.model_and_data()
        optimizer, scheduler = worker.optimizer_of(model)
        acc = reproduce.Accumulator(model, optimizer, scheduler=scheduler, clip_grad_norm=worker.CLIP)
        indices = worker.windows()[0]
        with MemoryTracker(budget) as tracker:
            acc.step((tokens[indices], targets[indices]), micro_batch, lambda m: worker.summed_loss(model, *m),
                     lambda m: worker.tokens_of(m[1]), divides=len(indices))
        return tracker.peak, acc, optimizer.kept, model.state_dict()

    low, high = peak(4)[0], peak(8)[0]
    assert low < high
    _, acc, grads, weights = peak(8, (low + high) // 2)
    assert acc.micro_batch == 4
    reference_grads, _ = worker.one_pass()
    assert len(grads) == 1
    assert_same(grads[0], reference_grads[0])


def test_a_window_given_fewer_losses_than_counts_refuses_and_steps_nothing(one_thread):
    model, tokens, targets = worker.model_and_data()
    optimizer, _ = worker.optimizer_of(model)
    acc = reproduce.Accumulator(model, optimizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match="2 counts and 1 backward calls"):
        with acc.window([3, 4]) as window:
            window.backward(worker.summed_loss(model, tokens[:1], targets[:1]))
    assert optimizer.kept == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_plain_loop_with_the_accumulator_trains_to_the_run_s_weights(tmp_path, one_thread):
    """`reproduce run` of a token-normalised recipe (micro-batch 4, N 4) and the same windows through the library
    in a 10-line loop: the same weights, float64."""
    recipe_data = lm_recipe(SGD)
    plan, _, ran, data = run_accumulated(recipe_data, micro_batch=4, tmp_path=tmp_path)
    recipe = parse_recipe(recipe_data)
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, data.info).double()
    optimizer = plain_optimizer(recipe, model)
    acc = reproduce.Accumulator(model, optimizer, clip_grad_norm=recipe.clip_grad_norm)
    effective = plan.effective_batch
    for step in range(plan.optimizer_steps):
        inputs, targets = fetch(data.train, torch.arange(step * effective, (step + 1) * effective))
        micro_batches = list(zip(inputs.split(plan.micro_batch), targets.split(plan.micro_batch), strict=True))
        with acc.window([int((t != -100).sum()) for _, t in micro_batches]) as window:
            for x, t in micro_batches:
                window.backward(F.cross_entropy(model(x).flatten(0, 1), t.flatten(), ignore_index=-100,
                                                reduction="sum"))
    assert_same_weights(model.state_dict(), ran, rtol=1e-10, atol=1e-12)


def test_a_grad_scaler_scales_for_backward_and_unscales_before_the_clip(one_thread):
    """fp16's GradScaler (here on float64 weights, where its power-of-two scale is exact): the losses are scaled for
    backward and the gradients unscaled before clipping, so the norms and the update are the unscaled window's."""

    def train(scaler) -> tuple[list, dict, list[float]]:
        model, tokens, targets = worker.model_and_data()
        optimizer, scheduler = worker.optimizer_of(model)
        acc = reproduce.Accumulator(model, optimizer, scheduler=scheduler, clip_grad_norm=worker.CLIP, scaler=scaler)
        norms = []
        for indices in worker.windows():
            micro_batches = list(torch.split(indices, worker.MICRO_BATCH))
            with acc.window([worker.tokens_of(targets[m]) for m in micro_batches]) as window:
                for m in micro_batches:
                    window.backward(worker.summed_loss(model, tokens[m], targets[m]))
            norms.append(window.grad_norm)
        return optimizer.kept, model.state_dict(), norms

    plain_grads, plain, plain_norms = train(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    grads, weights, norms = train(scaler)
    assert scaler.get_scale() == 2.0**10  # no overflow: every step was taken
    assert norms == plain_norms and min(norms) > worker.CLIP  # unscaled before the norm, and the clip bound
    for ours, reference in zip(grads, plain_grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    assert all(torch.equal(value, plain[name]) for name, value in weights.items())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # (by design here)
def test_a_non_finite_window_leaves_the_weights_alone_and_the_scheduler_steps(one_thread):
    """docs/library.md: `w.finite` is False, the weights are untouched, the scheduler still steps, the gradients
    are zeroed."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = reproduce.Accumulator(model, optimizer, scheduler, clip_grad_norm=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with acc.window([2]) as window:
        window.backward(model(torch.randn(2, 3)).sum() * float("nan"))
    assert window.finite is False and window.count == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert all(p.grad is None for p in model.parameters())
