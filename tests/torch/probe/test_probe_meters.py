"""The probe's torch side on tiny real models: the tracker, the cpu and estimate meters, the workload."""

from __future__ import annotations

import pytest
import torch

from reproduce.errors import UserError
from reproduce.models.small import GPT
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.meters import CpuMeter, CudaMeter, EstimateMeter, materialize
from reproduce.probe.tracker import GRANULE, MemoryTracker, rounded
from reproduce.probe.workload import SyntheticTokens, Workload

DIGITS = {
    "batch": {"effective": 2048, "unit": "samples"},
    "task": "classification",
    "model": {"builtin": "mlp", "kwargs": {"hidden": 32}},
    "data": {"builtin": "digits"},
    "optimizer": {"name": "adamw", "lr": 1.0e-3},
    "schedule": {"total": {"steps": 10}},
}
VARIABLE_LM = {
    "batch": {"effective": 64, "unit": "samples"},
    "task": "language-modeling",
    "model": {"factory": "factories:tiny_gpt"},
    "data": {"factory": "factories:variable_lm"},
    "optimizer": {"name": "adamw", "lr": 1.0e-3, "weight_decay": 0.1, "no_decay": ["1d"]},
    "schedule": {"total": {"steps": 10}},
    "clip_grad_norm": 1.0,
}
OFFLINE_LM = {
    "batch": {"effective": 4096, "unit": "tokens", "sequence_length": 32},
    "task": "language-modeling",
    "model": {"builtin": "gpt", "kwargs": {"layers": 1, "heads": 2, "dim": 32, "vocab_size": 64}},
    "data": {"name": "a corpus we do not have", "available": False},
    "optimizer": {"name": "adamw", "lr": 1.0e-3},
    "schedule": {"total": {"steps": 10}},
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    workload = Workload(parse_recipe(DIGITS, source="test"))
    return workload.prepare()


def param_bytes(model: torch.nn.Module) -> int:
    return sum(rounded(p.untyped_storage().nbytes()) for p in model.parameters())


# ---- the tracker --------------------------------------------------------------------------------------------


def test_tracker_counts_live_storage_rounded_and_releases_it():
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(100, dtype=torch.uint8)  # 100 B -> one 512 B block
        b = a.view(10, 10)  # a view: same storage, charged once
        c = torch.empty(1000)  # 4000 B -> 4096 B
        assert tracker.live == GRANULE + 4096
        del a, b
        assert tracker.live == 4096
        d = torch.empty(0)  # no storage bytes: nothing charged
    assert tracker.peak == GRANULE + 4096
    assert c.numel() == 1000 and d.numel() == 0


def test_adamw_step_peak_includes_its_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    inputs, target = torch.randn(8, 64), torch.randint(0, 10, (8,))
    params = param_bytes(model)
    tracker = MemoryTracker()
    with tracker:
        tracker.charge([*model.parameters(), inputs, target])
        for _ in range(2):  # a warm-up step allocates the state; the second one holds it throughout
            tracker.reset_peak()
            torch.nn.functional.cross_entropy(model(inputs), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    state = sum(rounded(t.untyped_storage().nbytes()) for s in optimizer.state.values() for t in s.values()
                if t.dim() > 0)
    assert state == 2 * params  # exp_avg and exp_avg_sq
    assert tracker.peak >= params + params + state  # parameters, gradients and state at the optimizer step


def test_exceeding_the_budget_raises_the_cuda_error_type():
    tracker = MemoryTracker(budget_bytes=10_000)
    with pytest.raises(torch.OutOfMemoryError, match="over the budget"):
        with tracker:
            [torch.empty(1000) for _ in range(3)]  # 4 KiB each: the third takes it to 12 KiB
    assert tracker.live == 0  # all of it released once the error is gone
    assert torch.OutOfMemoryError is torch.cuda.OutOfMemoryError


# ---- the cpu meter ------------------------------------------------------------------------------------------


def test_cpu_meter_measures_a_real_step(digits):
    meter = CpuMeter(digits, budget_bytes=64 * 2**20, headroom=0.1)
    small, large = meter.measure(4), meter.measure(64)
    assert small.fits and large.fits and small.note is None
    assert 0 < small.peak_bytes < large.peak_bytes <= meter.limit_bytes
    assert small.step_seconds > 0 and small.seconds > 0


def test_budget_just_below_a_measured_peak_makes_that_size_fail(digits):
    peak = CpuMeter(digits, 64 * 2**20, headroom=0.0).measure(32).peak_bytes
    at = CpuMeter(digits, peak, headroom=0.0).measure(32)
    assert at.fits and at.peak_bytes == peak
    below = CpuMeter(digits, peak - 1, headroom=0.0).measure(32)
    assert not below.fits and below.peak_bytes is None and "out of memory" in below.note
    over_headroom = CpuMeter(digits, peak, headroom=0.05).measure(32)
    assert not over_headroom.fits and over_headroom.peak_bytes == peak and "over the limit" in over_headroom.note


def test_an_out_of_memory_trial_leaves_nothing_behind(digits):
    meter = CpuMeter(digits, budget_bytes=2 * 2**20, headroom=0.0)
    before = meter.measure(16)
    assert not meter.measure(100_000).fits  # runs out of memory mid-step
    assert meter.measure(16).peak_bytes == before.peak_bytes


def test_cpu_meter_refuses_a_budget_beyond_free_ram(digits):
    with pytest.raises(UserError, match="`meter` estimate"):
        CpuMeter(digits, budget_bytes=2**60, headroom=0.1)


def test_variable_length_data_probes_its_longest_item():
    workload = Workload(parse_recipe(VARIABLE_LM, source="test")).prepare()
    inputs, target = workload.batch(5)
    longest = max(len(x) for x, _ in workload.data.train)
    assert inputs.shape == (5, longest) and target.shape == (5, longest)
    assert CpuMeter(workload, 16 * 2**20, 0.1).measure(5).fits


# ---- the estimate meter -------------------------------------------------------------------------------------


def test_estimate_matches_real_cpu_tensors(tensors_only):
    """Fake tensors count what real ones do; the estimate adds its stated margin for what it cannot see."""
    workload = Workload(parse_recipe(OFFLINE_LM, source="test")).prepare()
    assert isinstance(workload.data.train, SyntheticTokens) and workload.synthetic
    assert workload.batch(3)[0].shape == (3, 32)
    real = CpuMeter(workload, 64 * 2**20, 0.1, time_steps=False).measure(8)
    meter = EstimateMeter(workload, 256 * 2**20, 0.1)
    fake = meter.measure(8)
    assert fake.fits and fake.step_seconds is None
    assert abs(fake.tensor_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes  # foreach=True vs the CPU loop
    assert fake.peak_bytes == meter.decided(fake.tensor_bytes) > fake.tensor_bytes


def test_estimate_refuses_a_budget_smaller_than_its_margin():
    workload = Workload(parse_recipe(OFFLINE_LM, source="test"))
    with pytest.raises(UserError, match="`meter` cpu"):
        EstimateMeter(workload, 16 * 2**20, 0.1)


def test_materialize_keeps_tied_weights():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = GPT(vocab_size=32, block_size=8, layers=1, heads=2, dim=16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, torch.device("cpu"))
        assert model.head.weight is model.token.weight
        assert model.head.weight.device.type == "cpu"


def test_synthetic_data_needs_a_declared_shape():
    """A factory's model fixes nothing the probe knows, and an unknown dataset has no default shape: the recipe must
    declare one. A built-in model fixes its input (the MLP: 64 features); a known dataset has its shape."""
    unknown = {**DIGITS, "model": {"factory": "factories:tiny_gpt"}, "data": {"name": "my-scans", "available": False}}
    with pytest.raises(UserError, match="give data.channels, data.image_size, data.classes"):
        _ = Workload(parse_recipe(unknown, source="test")).data
    shaped = parse_recipe({**unknown, "data": {**unknown["data"], "kwargs": {"input_shape": [1, 8, 8]}}}, source="test")
    inputs, target = Workload(shaped).batch(4)
    assert inputs.shape == (4, 1, 8, 8) and target.shape == (4,)
    declared = parse_recipe({**unknown, "data": {**unknown["data"], "channels": 1, "image_size": 28, "classes": 10}},
                            source="test")
    inputs, target = Workload(declared).batch(2)
    assert inputs.shape == (2, 1, 28, 28) and int(target.max()) < 10
    mlp = parse_recipe({**DIGITS, "data": {"name": "imagenet", "available": False}}, source="test")
    assert Workload(mlp).batch(3)[0].shape == (3, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_meter_reserved_decides(digits):  # pragma: no cover - run on a GPU machine
    meter = CudaMeter(digits, budget_bytes=None, headroom=0.1)
    try:
        trial = meter.measure(32)
        assert trial.fits and trial.peak_bytes >= trial.tensor_bytes > 0
    finally:
        meter.close()


def test_accumulation_window_holds_gradients_through_a_forward():
    """From the second micro-batch of a window on, the forward runs beside the first one's gradients."""
    from reproduce.models import build_model

    workload = Workload(parse_recipe(OFFLINE_LM, source="test")).prepare()
    alone = CpuMeter(workload, 64 * 2**20, 0.1, time_steps=False, cap=8).measure(8)  # the whole batch: N = 1
    window = CpuMeter(workload, 64 * 2**20, 0.1, time_steps=False, cap=128).measure(8)  # N > 1
    gradients = param_bytes(build_model(workload.recipe, workload.data.info))
    assert window.peak_bytes - alone.peak_bytes >= gradients
