"""A variable-length attention for `data.packing: packed`, registered with transformers' AttentionInterface.

A packed micro-batch is one row of samples back to back, position ids restarting at each (data/packing.py).
`varlen_attention` attends within each sample without a dense (T x T) mask, the bounds handed down by the collator
(`sample_sizes`, `cu_seq_lens_*`) or read from the position ids:
- CUDA in bf16 / fp16 with flash-attention installed: transformers' flash-attention varlen path (not run here);
- otherwise: SDPA `is_causal` on each sample's slice, exact (docs/packing.md has the measurements); in the last
  layer, from each sample's first kept logit on (`rows_kept_from`: the rows before feed nothing); under a sliding
  window (Mistral, Qwen2, Gemma 3) shorter than the sample, each row on its last `window` keys, as transformers' mask.
Anything else (an attention mask, no position ids, a cache, fake position ids) falls back to transformers' sdpa.
build_model calls `use_varlen` for a packed recipe, so run, verify and the probe run the same kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .weights import transformers_inside

VARLEN = "reproduce_varlen"
# the last layer's rows skipped before a sample's first kept logit: at least this many and a quarter of the sample
# (below that the explicit mask costs what the rows save: docs/packing.md)
FEWEST_SKIPPED = 40
CALLS = {"cut": 0, "whole": 0}  # attention calls that cut their rows at the samples, and those that did not


def segments(position_ids: torch.Tensor, rows: int, width: int) -> list[int]:
    """Each sample's start in the flattened (rows x width) tokens, then the end: position 0 or a row starts one
    (real position ids read as such under the estimate meter's fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flat = position_ids.expand(rows, width).reshape(-1)
        starts = set((flat == 0).nonzero().flatten().tolist()) | set(range(0, rows * width, width))
    return sorted(starts) + [rows * width]


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, H, T, D), key and value (B, Hkv, T, D); returns (B, T, H, D)."""
    from torch._subclasses.fake_tensor import is_fake
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    from transformers.utils import is_flash_attn_2_available

    position_ids = kwargs.get("position_ids")
    window = kwargs.get("sliding_window")  # Mistral's, or Qwen2's and Gemma's sliding layers': the last `window` keys
    rows, heads, width, dim = query.shape
    if (attention_mask is not None or position_ids is None or key.shape[2] != width or width == 1
            or is_fake(position_ids) or position_ids.device.type == "meta" or not getattr(module, "is_causal", True)):
        CALLS["whole"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    CALLS["cut"] += 1
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16) and is_flash_attn_2_available():
        from transformers.integrations.flash_attention import flash_attention_forward

        kwargs.pop("sample_sizes", None)  # (flash-attention reads the same bounds: cu_seq_lens_q / _k)
        kwargs.pop("rows_kept_from", None)
        return flash_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                       **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    sizes = kwargs.get("sample_sizes")  # the tokens of each sample: the collator's, else the position ids'
    firsts = kwargs.get("rows_kept_from") if last_layer(module) else None
    if sizes is None or sum(sizes) != rows * width:
        bounds = segments(position_ids, rows, width)
        sizes, firsts = [end - start for start, end in zip(bounds, bounds[1:], strict=False)], None
    # torch.split, not slices: its backward is one concatenation, where each slice's would zero-fill the whole row
    flat = [torch.split(t.transpose(0, 1).reshape(1, heads, rows * width, dim), sizes, dim=2)
            for t in (query, key, value)]
    pieces = [sample_attention(q, k, v, dropout, scaling, window, firsts[i] if firsts else 0)
              for i, (q, k, v) in enumerate(zip(*flat, strict=True))]  # each (1, L, H, D), straight into (B, T, H, D)
    out = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous()
    return out.reshape(rows, width, heads, dim), None


def last_layer(module: nn.Module) -> bool:
    """Whether `module` is the attention of the last layer of a model whose outputs after it are each token's own
    (transformers' LLaMA and GPT-2: projections, MLP, norms), so a row whose logit is not kept feeds nothing."""
    config = getattr(module, "config", None)
    return (getattr(config, "model_type", None) in ("llama", "gpt2")
            and getattr(module, "layer_idx", None) == getattr(config, "num_hidden_layers", 0) - 1)


def sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: float | None,
                     window: int | None, first: int) -> torch.Tensor:
    """One sample's causal attention (1, H, L, D) -> (1, L, H, D), each row on its last `window` keys (if fewer than
    L). From row `first` on only, the rows before it zero, where `first` is a large enough share of the sample to pay
    for the explicit mask (rows [first, L) on the keys each attends to, as in the causal call); else every row."""
    length = q.shape[2]
    attend = torch.nn.functional.scaled_dot_product_attention
    first = 0 if first < FEWEST_SKIPPED or 4 * first < length else first
    window = window if window is not None and window < length else length  # (all: the causal call's arithmetic)
    if window == length and not first:
        return attend(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling).transpose(1, 2)
    if first >= length:
        return q.new_zeros(1, length, q.shape[1], q.shape[3])
    ones = torch.ones(length - first, length, dtype=torch.bool, device=q.device)  # row i: keys (i - window, i]
    band = ones.tril(first) & ~ones.tril(first - window)  # (transformers' sliding_window_overlay)
    rows = attend(q[:, :, first:], k, v, attn_mask=band, dropout_p=dropout, scale=scaling).transpose(1, 2)
    return torch.cat([rows.new_zeros(1, first, q.shape[1], q.shape[3]), rows], dim=1) if first else rows


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """VARLEN's mask: none for packed rows, else sdpa's (an explicit 2D attention mask keeps its meaning)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)  # type: ignore[no-any-return]


def register() -> None:
    """VARLEN in transformers' attention and mask interfaces (once; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if VARLEN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN, varlen_attention)
        AttentionMaskInterface.register(VARLEN, varlen_mask)


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation the transformers model in `model` runs (config._attn_implementation)."""
    name = getattr(getattr(transformers_inside(model)[1], "config", None), "_attn_implementation", None)
    return name if isinstance(name, str) else None


def use_varlen(model: nn.Module) -> bool:
    """Switch the model from `sdpa` to VARLEN (another attention is kept); whether it now runs a varlen one."""
    if attention_of(model) == "sdpa":
        set_attention(model, VARLEN)
    return runs_varlen(model)


def set_attention(model: nn.Module, name: str) -> None:
    """The model switched to the attention `name` (VARLEN or sdpa: throughput/ways.py times each way)."""
    if attention_of(model) != name:
        if name == VARLEN:
            register()
        transformers_inside(model)[1].set_attn_implementation(name)  # type: ignore[union-attr,operator]


def runs_varlen(model: nn.Module) -> bool:
    """Whether the transformers model in `model` attends through a varlen attention (VARLEN or flash-attention)."""
    name = attention_of(model)
    return name is not None and (name == VARLEN or name.startswith("flash_attention"))
