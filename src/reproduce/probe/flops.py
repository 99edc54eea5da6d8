"""The model FLOPs of one training sample: `torch.utils.flop_counter.FlopCounterMode` on fake tensors (no GPU).

One forward and backward pass's matrix products, convolutions and fused attention (2 FLOPs per multiply-add): the
"model FLOPs" of MFU (PaLM, Chowdhery et al. 2022, appendix B), without elementwise ops, the optimizer or
recomputation. Attention runs as on CUDA (gpu_like.py); a causal kernel counts its whole S x S product, as PaLM's
formula does. FLOPs are linear in the micro-batch, so one count per sample serves every split; variable-length text
counts its longest item (an upper bound).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_map_only

if TYPE_CHECKING:
    from ..data import Datasets

COUNTED_AT = 1  # samples in the counted micro-batch


@dataclass(frozen=True)
class SampleFlops:
    per_sample: float  # forward + backward FLOPs of one sample
    by_op: dict[str, float]  # per sample, by aten op
    sequence_length: int | None
    weight_bytes: int = 0  # the parameters as stored (what each micro-step reads from memory)

    @property
    def convolution_share(self) -> float:
        """The share of the FLOPs in convolutions (run in TF32 by cuDNN's default on fp32 inputs)."""
        total = sum(self.by_op.values())
        conv = sum(v for k, v in self.by_op.items() if "convolution" in k)
        return conv / total if total else 0.0

    @property
    def per_token(self) -> float | None:
        return self.per_sample / self.sequence_length if self.sequence_length else None

    def to_json(self) -> dict:
        return {**asdict(self), "per_token": self.per_token}


def count_flops(recipe, data_info: dict | None, batch: tuple) -> SampleFlops:
    """FLOPs per sample of a forward and backward of `batch` on an Ampere card's attention kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from ..hardware.catalog import DEFAULT_CAPABILITY
    from ..models import build_on_meta
    from ..train.losses import build_loss
    from .fake_step import materialize, unpacked_sequences
    from .gpu_like import GpuKind, as_on_gpu

    model = build_on_meta(recipe, data_info)
    samples = len(batch[1]) if hasattr(batch[1], "__len__") else COUNTED_AT
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    counter = FlopCounterMode(display=False)
    with unpacked_sequences(), fake, as_on_gpu(GpuKind(DEFAULT_CAPABILITY)):
        materialize(model, torch.device("cpu"))
        model.train()
        inputs, targets = tree_map_only(torch.Tensor, fake.from_tensor, batch)
        loss_fn = build_loss(recipe, model)
        with counter:
            loss_fn(model(inputs), targets).backward()
    by_op = {str(op): count / samples for op, count in counter.get_flop_counts().get("Global", {}).items()}
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return SampleFlops(per_sample=counter.get_total_flops() / samples, by_op=by_op,
                       sequence_length=recipe.batch.sequence_length, weight_bytes=weights)


def recipe_flops(recipe, data: Datasets | None = None) -> SampleFlops:
    """`count_flops` on one sample of the recipe's data (its own when available here, else synthetic); on two where
    BatchNorm cannot train on one (DeepLabV3's image pooling normalises a 1 x 1 map: batchnorm.POOLED_BATCHNORM)."""
    from ..plan.batchnorm import POOLED_BATCHNORM, batchnorm_in_run
    from .workload import Workload

    workload = Workload(recipe, data)
    samples = 2 if recipe.model.builtin in POOLED_BATCHNORM and batchnorm_in_run(recipe.model) else COUNTED_AT
    return count_flops(recipe, workload.data.info, workload.batch(samples))
