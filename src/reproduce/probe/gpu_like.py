"""The estimate's step made to allocate what a CUDA GPU allocates, on fake CPU tensors (fake CUDA tensors cannot
run a backward without a GPU). Inside `as_on_gpu(gpu)` three CPU behaviours follow CUDA's rules, read from PyTorch:

1. **Attention.** CUDA's SDPA picks (cuda/sdp_utils.cpp `select_sdp_backend`) flash on sm80 to sm121 for fp16/bf16
   without an `attn_mask` and head dim <= 256, else memory-efficient (sm50 to sm121; fp16/fp32, bf16 from sm80;
   masks allowed), else math. Fused kernels keep the output and a B x H x S fp32 logsumexp, never the B x H x S x S
   scores (a CPU with dropout takes the math path). Each call goes to that kernel's aten op (whose meta function
   gives the fake outputs); cuDNN attention keeps flash's outputs and is counted as flash. The fused backward's own
   allocations are a workspace of that moment (`kernel_workspaces`; flash_api.cpp `mha_bwd`, kernel_backward.h).
2. **Dropout.** CUDA's fused `native_dropout` keeps a `bool` mask, 1 byte an element (Dropout.cpp,
   `is_fused_kernel_acceptable`); a CPU keeps noise in the input's dtype. In-place dropout is unfused on both.
3. **Autocast.** CUDA runs ~50 ops in fp32 (autocast_mode.h `AT_FORALL_FP32`: pow, exp, log, the norms, the losses)
   and gives softmax, sum, cumsum, prod and the norms an fp32 output (`AT_FORALL_FP32_SET_OPT_DTYPE`); CPU autocast's
   lists are shorter. CUDA's policy is registered for the CPU autocast key during the step (GPT-2's tanh GELU keeps
   its fp32 `pow(x, 3)`).

What no rule sees is `UNSEEN_ACTIVATIONS`. Left as a CPU does it (each makes the estimate larger, never smaller):
ops CUDA casts down and a CPU does not (addmv, addr, mv, einsum, RNN cells), the math path where the GPU takes it
too (bf16 before Ampere, unaligned head dims), CUDA's `promote` list.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from .tracker import rounded

HALF = (torch.float16, torch.bfloat16)

# CUDA autocast's fp32 lists (autocast_mode.h), as aten "name.overload" (default overload when none).
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp",
)
CUDA_FP32_OUTPUT = (  # fp32_set_opt_dtype: run with dtype=float32 unless the call gives a dtype
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)


# The estimate's allowance for what a CUDA step allocates beyond the tensors operators return, as a share of the live
# activations (MemoryTracker.allowance): cuDNN's convolution workspaces (cudnn/Conv_v8.cpp), blocks the allocator
# hands out whole (CUDACachingAllocator.cpp, `should_split`), what older kernels save. Set from published peaks, not
# derived: the estimate's tensors were 0.84 to 0.98 of every published allocated peak checked
# (bench/published_memory.py), more apart at larger micro-batches; with activations ~85% of such a step, 1/0.84 - 1
# = 19% of the step is 22% of its activations, rounded up to 25% (MMSeg's DeepLabV3 rows 0.89 -> 1.08; torchtune's
# packed Llama 3.2 3B, within 1% without it, 1.17). Estimate meter only, before the 5% margin and --headroom.
UNSEEN_ACTIVATIONS = 0.25


@dataclass(frozen=True)
class GpuKind:
    """What decides the kernels: the CUDA compute capability (major, minor)."""

    capability: tuple[int, int]

    @property
    def flash(self) -> bool:
        return (8, 0) <= self.capability <= (12, 1)

    @property
    def efficient(self) -> bool:
        return (5, 0) <= self.capability <= (12, 1)


def attention_kernel(gpu: GpuKind, dtype: torch.dtype, has_mask: bool, head_dim: int, value_dim: int,
                     causal_square: bool, dropout: float, requires_grad: bool) -> str:
    """'flash', 'efficient' or 'math': the kernel CUDA's `select_sdp_backend` picks for dense inputs."""
    same_dims = head_dim == value_dim
    flash = gpu.flash and dtype in HALF and not has_mask and same_dims and head_dim <= 256 and causal_square
    if flash and requires_grad and gpu.capability in ((8, 6), (8, 7), (8, 8), (8, 9), (12, 0), (12, 1)):
        flash = head_dim <= 192 or (dropout == 0 and head_dim > 224)  # sm86/89/120: no backward in (192, 224]
    if flash:
        return "flash"
    efficient_dtypes = (torch.float16, torch.float32, torch.bfloat16) if gpu.capability >= (8, 0) else (
        torch.float16, torch.float32)
    tensor_cores = gpu.capability >= (8, 0) or (gpu.capability >= (7, 0) and dtype in HALF)
    alignment = max(4 if gpu.capability >= (8, 0) else 1, (8 if dtype in HALF else 4) if tensor_cores else 1)
    if gpu.efficient and dtype in efficient_dtypes and head_dim % alignment == 0 and value_dim % alignment == 0:
        return "efficient"
    return "math"


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DROPOUT_ARGS = ("input", "p", "training", "inplace")


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict, defaults: dict) -> dict:
    bound = dict(defaults)
    bound.update(zip(names[: len(args)], args, strict=True))
    bound.update(kwargs)
    return bound


class GpuKernels(TorchFunctionMode):
    """Routes attention and dropout to the kernels CUDA runs (see the module's notes 1 and 2)."""

    def __init__(self, gpu: GpuKind):
        super().__init__()
        self.gpu = gpu
        self.kernels: dict[str, int] = {}  # attention calls by kernel, for the report and the tests

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(**_bind(_SDPA_ARGS, args, kwargs, {
                "attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}))
        if func is F.dropout or func is torch.dropout:
            names = _DROPOUT_ARGS if func is F.dropout else ("input", "p", "train")
            bound = _bind(names, args, kwargs, {"p": 0.5, "training": True, "inplace": False})
            training = bound.get("training", bound.get("train"))
            if training and not bound["inplace"] and 0 < bound["p"] < 1 and bound["input"].numel() > 0:
                return torch.ops.aten.native_dropout.default(bound["input"], bound["p"], True)[0]
        return func(*args, **kwargs)

    def attention(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if torch.is_autocast_enabled("cpu"):  # SDPA is lower_precision_fp on CUDA and CPU alike
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped-query attention: heads shared by groups
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        kernel = attention_kernel(
            self.gpu, query.dtype, attn_mask is not None, query.shape[-1], value.shape[-1],
            not is_causal or query.shape[-2] == key.shape[-2], dropout_p, requires_grad,
        )
        self.kernels[kernel] = self.kernels.get(kernel, 0) + 1
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention.default(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == "efficient":
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:  # as sdp::convert_boolean_attn_mask does
                bias = torch.where(bias, 0.0, -math.inf).to(query.dtype)
            if bias is not None and bias.shape[-1] % 16:  # the kernel wants the last dim aligned to 16
                pad = 16 - bias.shape[-1] % 16
                bias = F.pad(bias, (0, pad))[..., : bias.shape[-1]]
            return torch.ops.aten._scaled_dot_product_efficient_attention.default(
                query, key, value, bias, requires_grad, dropout_p, is_causal, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math.default(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale)[0]


def _flash_backward_workspace(args: tuple, kwargs: dict) -> int:
    """flash_api.cpp `mha_bwd`: fp32 dq_accum (B, S_q to 128, H, D to 32 or 64) and softmax_d (B, H, S_q)."""
    batch, heads, length, dim = args[1].shape
    length = rounded(length, 128)
    dim = rounded(rounded(dim, 8), 32 if rounded(dim, 8) <= 128 else 64)
    return 4 * batch * heads * length * (dim + 1)


def _efficient_backward_workspace(args: tuple, kwargs: dict) -> int:
    """kernel_backward.h: fp32 grad Q (B, H, S_q, D; `kNeedsAccumGradQ` from sm70) and `delta` (B, H, S_q)."""
    batch, heads, length, dim = args[1].shape
    return 4 * batch * heads * length * (dim + 1)


def kernel_workspaces() -> dict:
    """What CUDA's fused attention backward kernels allocate and free inside themselves: op -> bytes(args, kwargs)."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_workspace,
            aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_workspace}


def _fp32_kernel(op, set_dtype: bool):
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    arguments = [a.name for a in op._schema.arguments]
    dtype_at = arguments.index("dtype") if "dtype" in arguments else None

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if set_dtype:  # fp32_set_opt_dtype: an fp32 result unless the caller asked for a dtype
                given = kwargs.get("dtype", args[dtype_at] if dtype_at is not None and dtype_at < len(args) else None)
                floating = any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args)
                if given is None and floating and dtype_at is not None:
                    if dtype_at < len(args):
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.float() if t.dtype in HALF else t, (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def cuda_autocast_names() -> list[tuple[str, bool]]:
    """(op name, sets dtype) for CUDA's fp32 ops that CPU autocast leaves alone, in this PyTorch."""
    names = []
    for group, set_dtype in ((CUDA_FP32, False), (CUDA_FP32_OUTPUT, True)):
        for name in group:
            qualified = "aten::" + name
            try:
                on_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCUDA")
                on_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCPU")
            except RuntimeError:  # not an operator in this PyTorch
                continue
            if on_cuda and not on_cpu:  # where the CPU has a policy of its own it is fp32 too
                names.append((name, set_dtype))
    return names


@contextlib.contextmanager
def as_on_gpu(gpu: GpuKind) -> Iterator[GpuKernels]:
    """Attention, dropout and autocast as CUDA runs them on `gpu`, for a step on fake CPU tensors: `GpuKernels`, and
    CPU autocast with CUDA's fp32 lists (note 3), for the duration of the block only."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, set_dtype in cuda_autocast_names():
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            library.impl(name, _fp32_kernel(op, set_dtype), "AutocastCPU")
        kernels = GpuKernels(gpu)
        with kernels:
            yield kernels
    finally:
        library._destroy()
