"""The estimate counted as CUDA runs the step (probe/gpu_like.py): attention kernels, dropout masks, autocast dtypes.

Hand counts on single operations under the tracker, the kernel choice against the rules of PyTorch's
sdp_utils.cpp, and whole steps: where the GPU's kernel is the CPU's (flash attention without dropout, bf16),
the fake GPU-like step counts what a real CPU step counts; with dropout it counts less, by what the
CPU's math path and noise tensors add.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from reproduce.hardware.catalog import lookup
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.fake_step import run_fake_step
from reproduce.probe.gpu_like import GpuKind, as_on_gpu, attention_kernel, cuda_autocast_names
from reproduce.probe.meters import CpuMeter, EstimateMeter
from reproduce.probe.tracker import MemoryTracker, rounded
from reproduce.probe.workload import Workload

A100, V100, RTX4090 = (GpuKind(lookup(name).capability) for name in ("a100-80gb", "v100-32gb", "rtx4090"))
B, H, S, D = 2, 4, 64, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def lm(**changes) -> dict:
    recipe = {
        "batch": {"effective": 4096, "unit": "tokens", "sequence_length": 32},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 32, "vocab_size": 64, "dropout": 0.0}},
        "data": {"name": "a corpus we do not have", "available": False},
        "optimizer": {"name": "adamw", "lr": 1.0e-3},
        "schedule": {"total": {"steps": 10}},
    }
    for key, value in changes.items():
        recipe[key] = {**recipe[key], **value} if isinstance(value, dict) else value
    return recipe


def live_after(operation, gpu: GpuKind | None, *inputs: torch.Tensor) -> int:
    """Bytes an operation leaves live on fake tensors (its outputs and what autograd saved), inputs not counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = MemoryTracker()
    semantics = as_on_gpu(gpu) if gpu else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        inputs = [fake.from_tensor(t) for t in inputs]
        with semantics, tracker:
            kept = operation(*inputs)
        live = tracker.live
        del kept
    return live


# ---- the kernel CUDA picks (sdp_utils.cpp, select_sdp_backend) ----------------------------------------------


@pytest.mark.parametrize(
    "gpu, dtype, mask, head, expected",
    [
        (A100, torch.bfloat16, False, 64, "flash"),
        (A100, torch.float16, False, 128, "flash"),
        (A100, torch.float32, False, 64, "efficient"),  # flash is fp16/bf16 only
        (A100, torch.bfloat16, True, 64, "efficient"),  # flash takes no attn_mask
        (A100, torch.bfloat16, False, 320, "efficient"),  # flash: head dim <= 256
        (V100, torch.float16, False, 64, "efficient"),  # flash: sm80 and later
        (V100, torch.bfloat16, False, 64, "math"),  # the efficient kernel has no bf16 before sm80
        (RTX4090, torch.bfloat16, False, 200, "efficient"),  # sm89: no flash backward for head dims (192, 224]
        (RTX4090, torch.bfloat16, False, 128, "flash"),
        (GpuKind((6, 0)), torch.float32, False, 64, "efficient"),  # P100
    ],
)
def test_attention_kernel_follows_pytorchs_rules(gpu, dtype, mask, head, expected):
    assert attention_kernel(gpu, dtype, mask, head, head, True, 0.1, True) == expected


# ---- hand counts on one operation ---------------------------------------------------------------------------


def attention(q):
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)


def test_fused_attention_keeps_output_and_logsumexp_not_the_scores():
    q = torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)
    philox = 2 * rounded(8)  # the flash kernel's random seed and offset, one uint64 block each
    assert live_after(attention, A100, q) == rounded(B * H * S * D * 2) + rounded(B * H * S * 4) + philox
    # the CPU takes the math path with dropout: at least the fp32 softmax and the dropout noise, B x H x S x S each
    assert live_after(attention, None, q) >= 2 * B * H * S * S * 4


def test_efficient_attention_pads_its_logsumexp_to_32():
    q = torch.randn(B, H, 40, D, dtype=torch.float32, requires_grad=True)
    kept = live_after(attention, A100, q)
    assert kept == rounded(B * H * 40 * D * 4) + rounded(B * H * 64 * 4) + 2 * rounded(8)


def test_dropout_keeps_a_one_byte_mask_on_a_gpu():
    x = torch.randn(1000, 64, requires_grad=True)

    def dropout(t):
        return F.dropout(t * 1.0, p=0.1, training=True)  # (t * 1.0 is not kept: dropout saves no input)

    output = rounded(1000 * 64 * 4)
    assert live_after(dropout, A100, x) == output + rounded(1000 * 64)  # and a bool mask, as native_dropout keeps
    assert live_after(dropout, None, x) == output + rounded(1000 * 64 * 4)  # and the CPU's fp32 noise


def test_cuda_autocast_runs_its_fp32_ops_in_fp32_and_only_inside_the_block():
    names = dict(cuda_autocast_names())
    assert {"pow.Tensor_Scalar", "layer_norm", "rsqrt", "exp"} <= names.keys() and names["softmax.int"] is True
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with as_on_gpu(A100), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.pow(x, 3.0).dtype == torch.float32 and (x ** 3.0).dtype == torch.float32
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert F.softmax(x, -1).dtype == torch.float32  # fp32_set_opt_dtype
        assert F.softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # a dtype given is kept
        assert F.linear(x.float(), x.float()).dtype == torch.bfloat16  # the lower-precision list is untouched
    with torch.autocast("cpu", dtype=torch.bfloat16):  # removed again: CPU autocast as it was
        assert torch.pow(x, 3.0).dtype == torch.bfloat16 and F.softmax(x, -1).dtype == torch.bfloat16


# ---- whole steps --------------------------------------------------------------------------------------------


def test_where_the_kernels_are_the_same_the_gpu_count_is_the_cpu_count(tensors_only):
    """bf16 without dropout: flash attention on both, the same autocast outcome: the real CPU step's peak."""
    workload = Workload(parse_recipe(lm(precision="bf16"), source="test")).prepare()
    real = CpuMeter(workload, 256 * 2**20, 0.0, time_steps=False).measure(8).peak_bytes
    window = [workload.batch(8), workload.batch(8)]
    cpu = run_fake_step(workload.plan, workload.data.info, window, gpu=None)
    gpu = run_fake_step(workload.plan, workload.data.info, window, gpu=A100)
    assert gpu.kernels == {"flash": 8}  # 2 blocks x 2 micro-batches x (warm-up + measured step)
    assert cpu.step.weight_copies == gpu.step.weight_copies and cpu.step.gradients == gpu.step.gradients
    # CUDA's flash kernel also keeps its random seed and offset (one 512 B block each) for the backward
    assert 0 <= gpu.peak - cpu.peak <= 2 * 2 * 2 * 512  # two blocks, two micro-batches
    assert abs(gpu.peak - real) <= 0.02 * real  # foreach=True here against the CPU's per-parameter loop


def test_dropout_costs_a_gpu_less_than_a_cpu_by_the_math_path_and_the_noise(tensors_only):
    recipe = lm(model={"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 32, "vocab_size": 64,
                                                    "dropout": 0.1}})
    workload = Workload(parse_recipe(recipe, source="test")).prepare()
    window = [workload.batch(8), workload.batch(8)]
    cpu = run_fake_step(workload.plan, workload.data.info, window, gpu=None).step.activations
    gpu = run_fake_step(workload.plan, workload.data.info, window, gpu=A100).step.activations
    scores = 8 * 2 * 32 * 32 * 4  # one attention's B x H x S x S in fp32
    assert cpu - gpu >= 2 * 2 * scores  # two blocks, each keeping at least softmax and noise on the math path


def test_estimate_meter_notes_and_parts():
    workload = Workload(parse_recipe(lm(precision="bf16"), source="test"))
    meter = EstimateMeter(workload, 256 * 2**20, 0.1, gpu=lookup("a100-40gb"))
    trial = meter.measure(4)
    assert trial.fits and trial.tensor_bytes == sum(trial.parts["at_peak"].values())
    assert trial.parts["attention"] == {"flash": 8} and trial.parts["blocks"]["sizes"] == [12_704] * 2
    assert "as CUDA runs them on NVIDIA A100 40GB" in meter.notes[0]


@pytest.mark.parametrize(
    "name, catalog, capability",
    [("A100-40GB", "a100-40gb", (8, 0)), ("A100-80GB", "a100-80gb", (8, 0)), ("V100-32GB", "v100-32gb", (7, 0)),
     ("V100", "v100-16gb", (7, 0)), ("A100", "a100-40gb", (8, 0)), ("RTX 4090", "rtx4090", (8, 9)),
     ("h100-80gb", "h100-80gb", (9, 0)), ("a10g", "a10g", (8, 6))],
)
def test_the_papers_device_names_resolve(name, catalog, capability):
    gpu = lookup(name)
    assert gpu.name == catalog and gpu.capability == capability


@pytest.mark.parametrize("name", ["Cloud TPU chip", "TPUv3", "tpu-v4"])
def test_a_tpu_is_refused_as_not_a_gpu(name):
    from reproduce.errors import UserError

    with pytest.raises(UserError, match="is a TPU, not a GPU"):
        lookup(name)
