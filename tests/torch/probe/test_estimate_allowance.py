"""What the estimate adds for a CUDA step beyond the tensors operators return: the fused attention
backward's workspaces (probe/gpu_like.kernel_workspaces) and the allowance on the activations (UNSEEN_ACTIVATIONS),
counted by the tracker at its peak. Without them the estimate was under every published allocated peak checked
(bench/published_memory.py), which lets the probe pick a micro-batch that runs out of memory."""

from __future__ import annotations

import math

import pytest
import torch

import reproduce.probe.fake_step as fake_step
from reproduce.hardware.catalog import lookup
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.fake_step import run_fake_step
from reproduce.probe.gpu_like import UNSEEN_ACTIVATIONS, GpuKind, kernel_workspaces
from reproduce.probe.meters import EstimateMeter
from reproduce.probe.tracker import ACTIVATIONS, ALLOWANCE, WEIGHTS, MemoryTracker
from reproduce.probe.workload import Workload

A100 = GpuKind(lookup("a100-80gb").capability)
pytestmark = pytest.mark.usefixtures("one_thread")


def lm(dropout: float = 0.0) -> dict:
    return {
        "batch": {"effective": 4096, "unit": "tokens", "sequence_length": 32},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 32, "vocab_size": 64,
                                               "dropout": dropout}},
        "data": {"name": "a corpus we do not have", "available": False},
        "optimizer": {"name": "adamw", "lr": 1.0e-3},
        "schedule": {"total": {"steps": 10}},
        "precision": "bf16",
    }


def test_a_workspace_counts_at_its_moment_only_and_the_allowance_on_the_live_activations():
    tracker = MemoryTracker()
    with tracker:
        weights = torch.empty(1024)  # 4 KiB
        tracker.retag([weights], WEIGHTS)
        kept = torch.empty(2048)  # 8 KiB of activations
        assert tracker.peak == tracker.live == 12288
        tracker.workspace(1000)  # rounded to 1024, then freed
        assert tracker.peak == 12288 + 1024 and tracker.live == 12288
        tracker.allowance = 0.5
        tracker.reset_peak()  # the allowance on the 8 KiB of activations live now: 4 KiB
        assert tracker.peak == 12288 + 4096 and tracker.peak_by[ALLOWANCE] == 4096
        del kept
        weights.resize_(4096)  # 16 KiB of weights, no activations: as much as the moment before with its allowance
        assert tracker.peak == 16384 and tracker.peak_by[ALLOWANCE] == 4096  # not a new peak
        more = torch.empty(4096)  # + 16 KiB of activations, + 8 KiB of allowance
        assert tracker.peak == 16384 + 16384 + 8192 and tracker.peak_by == {
            WEIGHTS: 16384, ACTIVATIONS: 16384, ALLOWANCE: 8192}
        del more


def test_flash_backward_workspace_is_flash_apis_dq_accum_and_softmax_d():
    """flash_api.cpp mha_bwd: dq_accum (B, S rounded to 128, H, D rounded to 8 then 32) and softmax_d (B, H, S
    rounded), both fp32."""
    sizer = kernel_workspaces()[torch.ops.aten._scaled_dot_product_flash_attention_backward.default]
    query = torch.empty(2, 3, 100, 40)  # B, H, S, D as SDPA passes them
    assert sizer((None, query), {}) == 4 * 2 * 3 * 128 * 64 + 4 * 2 * 3 * 128


def attention_peak(workspaces: dict) -> int:
    """The tracker's peak over a causal bf16 attention's forward and backward on fake tensors, as an A100 runs it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from reproduce.probe.gpu_like import as_on_gpu

    tracker = MemoryTracker()
    tracker.workspaces = workspaces
    with FakeTensorMode(allow_non_fake_inputs=True), as_on_gpu(A100) as kernels, tracker:
        q, k, v = (torch.empty(2, 2, 256, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert kernels.kernels == {"flash": 1}
    return tracker.peak


def test_the_flash_backward_workspace_is_counted_at_the_backward():
    workspace = 4 * 2 * 256 * 2 * 64 + 4 * 2 * 2 * 256  # dq_accum and softmax_d: S 256 and D 64 already rounded
    assert attention_peak(kernel_workspaces()) - attention_peak({}) == workspace


def test_the_gpu_step_adds_the_allowance_on_its_activations(monkeypatch):
    workload = Workload(parse_recipe(lm(), source="test")).prepare()
    window = [workload.batch(8), workload.batch(8)]
    full = run_fake_step(workload.plan, workload.data.info, window, gpu=A100)
    monkeypatch.setattr(fake_step, "UNSEEN_ACTIVATIONS", 0.0)
    without = run_fake_step(workload.plan, workload.data.info, window, gpu=A100)
    assert ALLOWANCE not in without.at_peak and without.unseen_bytes == 0
    activations = full.at_peak[ACTIVATIONS]
    assert full.at_peak[ALLOWANCE] == math.ceil(UNSEEN_ACTIVATIONS * activations) > 0
    assert full.peak == sum(full.at_peak.values()) >= without.peak + full.at_peak[ALLOWANCE]
    assert full.unseen_bytes == math.ceil(UNSEEN_ACTIVATIONS * without.step.activations)
    assert full.step.activations == without.step.activations + full.unseen_bytes


def test_the_cpu_rules_add_nothing():
    """The cpu meter's split and the checks against real CPU tensors: no allowance, no workspaces."""
    workload = Workload(parse_recipe(lm(), source="test")).prepare()
    result = run_fake_step(workload.plan, workload.data.info, [workload.batch(8)], gpu=None)
    assert ALLOWANCE not in result.at_peak and result.unseen_bytes == 0


def test_the_estimate_meter_decides_with_the_allowance_and_says_so():
    workload = Workload(parse_recipe(lm(dropout=0.1), source="test"))
    meter = EstimateMeter(workload, 256 * 2**20, 0.1, gpu=lookup("a100-40gb"))
    trial = meter.measure(8)
    at_peak = trial.parts["at_peak"]
    assert at_peak[ALLOWANCE] == math.ceil(UNSEEN_ACTIVATIONS * at_peak[ACTIVATIONS])
    assert trial.peak_bytes == meter.decided(trial.tensor_bytes) and trial.tensor_bytes == sum(at_peak.values())
    assert f"(tracked tensors + {UNSEEN_ACTIVATIONS:.0%} of the activations)" in meter.notes[0]
