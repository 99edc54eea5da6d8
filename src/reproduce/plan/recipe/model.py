"""The recipe's `model:` and `loss:` sections: what is built, in which dtype, with which memory options."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import Field, model_validator

from ..batchnorm import BatchnormMode, batchnorm_in_run
from .common import Builder, Names, Strict

# torchvision's segmentation models (reproduce.models.segmentation): the built-ins that read model.output_stride and
# model.aux_weight; builtin_names lists them among the built-ins
SEGMENTATION_MODELS = ("deeplabv3-resnet50", "deeplabv3-resnet101", "fcn-resnet50", "lraspp-mobilenet-v3-large")
NormLayer = Literal["batchnorm", "layernorm", "rmsnorm", "groupnorm", "none"]
WeightDtype = Literal["fp32", "bf16", "fp16"]
QuantizedBase = Literal["int8", "nf4"]  # bitsandbytes' LLM.int8() and 4-bit NormalFloat (models/quantize.py)
QUANTIZED_BASES: tuple[QuantizedBase, ...] = typing.get_args(QuantizedBase)


Normalization = Literal["window-tokens", "micro-batch-mean"]


class Loss(Builder):
    """Task custom: its loss (`builtin` or `factory`). Any task: how each micro-batch's loss is normalised
    (`normalization`; micro-batch-mean is the arithmetic of papers run on the Hugging Face Trainer before v4.46.0,
    Alpaca-LoRA and QLoRA among them)."""

    normalization: Normalization = Field(
        default="window-tokens", description="window-tokens: the large batch's mean over its loss-bearing items "
        "(exact); micro-batch-mean: the mean of each micro-batch's own mean, as the Hugging Face Trainer before "
        "transformers v4.46.0 (PR #34191) averaged a window",
    )


class Lora(Strict):
    """Low-rank adapters (Hu et al. 2021) through peft on the modules named: only the adapters train. B starts
    at zero, so the adapted model W + (alpha / r) B A starts as the base model."""

    r: int = Field(gt=0, description="rank of each adapter")
    alpha: float | None = Field(default=None, gt=0, description="the update is scaled by alpha / r (default: r)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Annotated[Names[str], Field(min_length=1)] = Field(
        description="names (or name endings) of the modules to adapt, e.g. [q_proj, v_proj]"
    )
    dtype: Literal["fp32", "bf16"] = Field(
        default="fp32", description="the adapters' weights (and so their gradients and optimizer state): fp32, "
        "peft's default; bf16 as QLoRA's qlora.py casts them under --bf16",
    )

    @property
    def lora_alpha(self) -> float:
        """alpha, r when not given: peft's `lora_alpha`."""
        return self.alpha if self.alpha is not None else self.r


class Model(Builder):
    """A built-in, a factory, or `hf: NAME_OR_LOCAL_PATH` (a Hugging Face model, loaded from this machine only).

    With `hf`, `kind` picks the head (default from the task) and `kwargs` go to `from_pretrained`. `lora` freezes the
    weights (stored in `dtype`) and trains adapters. `weights` starts from pretrained weights (models/pretrained.py):
    a Hugging Face folder, whose config.json is then the architecture, or a state dict checked key by key."""

    hf: str | None = Field(default=None, description="Hugging Face model name or local folder")
    weights: str | None = Field(
        default=None, description="pretrained weights on this machine: a Hugging Face folder (config.json + "
        "safetensors, as save_pretrained writes it) or a state dict file (.safetensors, .pt, .pth)",
    )
    backbone_weights: str | None = Field(
        default=None, description="segmentation built-ins: an ImageNet-pretrained backbone on this machine (a "
        "torchvision / timm ResNet state dict, or an MMSegmentation / MMPretrain checkpoint's backbone.*), loaded "
        "into the model's backbone with a report; the heads start at random (models/segmentation.py)",
    )
    kind: Literal["causal-lm", "sequence-classification"] | None = None
    norm_layers: Names[NormLayer] = []
    batchnorm: BatchnormMode = Field(
        default="keep", description="BatchNorm when the micro-batch is below the paper's BN batch: keep (per "
        "micro-batch), sync (SyncBatchNorm over the processes, CUDA), frozen (FrozenBatchNorm2d), group (GroupNorm, "
        "a deviation); models/__init__.py",
    )
    paper_batchnorm: BatchnormMode | None = Field(
        default=None, description="how the paper normalised when the run's model.batchnorm differs (what "
        "--batchnorm records; default: model.batchnorm)",
    )
    batchnorm_momentum: float | None = Field(
        default=None, gt=0, lt=1, description="PyTorch's BatchNorm momentum for the running statistics, 1 - the "
        "decay TensorFlow papers give (DeepLabV3's decay 0.9997: 0.0003); default: each layer's own (0.1)",
    )
    output_stride: Literal[8, 16] | None = Field(
        default=None, description="segmentation models: input size / feature size, by dilating ResNet's last "
        "stages (torchvision's default 8)",
    )
    aux_weight: float | None = Field(
        default=None, ge=0, description="segmentation models: build the auxiliary head (FCN on ResNet's layer3) "
        "and weigh its loss by this (MMSegmentation: 0.4); not given: no auxiliary head",
    )
    dtype: WeightDtype = "fp32"
    lora: Lora | None = None
    quantize: QuantizedBase | None = Field(
        default=None, description="store the frozen base's linear layers in 8 bits (int8: LLM.int8(), Dettmers et "
        "al. 2022) or 4 bits (nf4 with double quantisation: QLoRA, Dettmers et al. 2023) through bitsandbytes; "
        "needs lora (only the adapters train)",
    )
    double_quant: bool | None = Field(
        default=None, description="quantize nf4: quantise the 4-bit blocks' absmax scales again, to 8 bits in blocks "
        "of 256 (QLoRA's --double_quant; about 0.37 bits a weight less); default true. BitsAndBytesConfig's own "
        "default is false",
    )
    upcast_embeddings: bool = Field(
        default=True, description="under a quantised base: peft's prepare_model_for_kbit_training casts every "
        "weight it did not quantise (embeddings, output head, norms) to fp32 (true, peft's and Alpaca-LoRA's way); "
        "false keeps the embeddings and head in model.dtype and the norms in fp32, as QLoRA's qlora.py does",
    )
    selective_checkpointing: bool = Field(
        default=False, description="with activation_checkpointing: each block keeps what its matrix products and "
        "attention return and recomputes only the ops between them (torchtitan's per-op policy; "
        "models/checkpointing.py): more memory than whole blocks, less recomputation; exact",
    )
    loss_chunks: int | None = Field(
        default=None, ge=2, description="language models: the output head and cross-entropy over this many chunks of "
        "tokens, each recomputed in backward, so the whole logits (and their fp32 copy) never exist at once "
        "(train/losses.py; torchtune's CEWithChunkedOutputLoss uses 8); exact",
    )
    offload_activations: bool = Field(
        default=False, description="copy what the model's forward saves for backward to CPU memory, and back when "
        "backward needs it (models/checkpointing.py; torch.autograd.graph.saved_tensors_hooks, as save_on_cpu); exact, "
        "slower steps",
    )
    activation_checkpointing: bool = Field(
        default=False, description="recompute each block's activations in backward instead of keeping them "
        "(models/checkpointing.py): less memory, about a third more compute",
    )
    description: str | None = None
    pretrained: str | None = Field(
        default=None, min_length=1,
        description="the pretrained weights the paper fine-tunes (a label: model.weights loads them from disk); "
        "marks a fine-tuning recipe, for which the probe offers LoRA when full training does not fit",
    )

    @model_validator(mode="after")
    def _has_source(self) -> Model:
        given = [name for name in ("builtin", "factory", "hf") if getattr(self, name) is not None]
        if not given:
            raise ValueError("give builtin: NAME, factory: 'package.module:function' or hf: NAME_OR_PATH")
        if len(given) > 1:
            raise ValueError(f"give only one of builtin, factory, hf (got {', '.join(given)})")
        if self.hf is not None and not self.hf.strip():
            raise ValueError(f"hf: give a model name or a local folder (got {self.hf!r})")
        if self.weights is not None and not self.weights.strip():
            raise ValueError(f"weights: give a folder or a state dict file (got {self.weights!r})")
        if self.kind is not None and self.hf is None:
            raise ValueError("kind: only used with hf (a Hugging Face model)")
        if self.quantize is not None and self.lora is None:
            raise ValueError(f"quantize: an {self.quantize} base cannot train (its weights are frozen integers); add "
                             "lora: {r: ..., target_modules: [...]} so that adapters train on top of it")
        if self.double_quant is not None and self.quantize != "nf4":
            raise ValueError(f"double_quant: only for quantize: nf4 (quantize is {self.quantize})")
        if self.selective_checkpointing and not self.activation_checkpointing:
            raise ValueError("selective_checkpointing: chooses what a checkpointed block keeps; set "
                             "activation_checkpointing: true (or `activation_checkpointing`) with it")
        if not self.upcast_embeddings and self.quantize is None:
            raise ValueError("upcast_embeddings: only for a quantised base (model.quantize: int8 or nf4); without one "
                             "the embeddings and head stay in model.dtype already")
        segmentation = ", ".join(SEGMENTATION_MODELS)
        if self.output_stride is not None and self.builtin not in SEGMENTATION_MODELS:
            raise ValueError(f"output_stride: only for the segmentation built-ins ({segmentation}); give your own "
                             "model's through model.kwargs")
        if self.backbone_weights is not None:
            if self.builtin not in SEGMENTATION_MODELS:
                raise ValueError(f"backbone_weights: only for the segmentation built-ins ({segmentation}); give a "
                                 "whole model's state dict as weights")
            if self.weights is not None:
                raise ValueError("backbone_weights: give one of weights (the whole model's, e.g. a run's model.pt) "
                                 "and backbone_weights (an ImageNet backbone under new heads)")
        if self.aux_weight is not None and self.builtin is not None and self.builtin not in SEGMENTATION_MODELS:
            raise ValueError(f"aux_weight: {self.builtin} has no auxiliary head (the segmentation built-ins do: "
                             f"{segmentation}; or your own model returning {{'out': ..., 'aux': ...}})")
        return self

    @property
    def has_batchnorm(self) -> bool:
        """The run's model normalises by batch statistics: BatchNorm layers found in the model (a built-in's known
        count; else the label), kept or synced (plan/batchnorm.py)."""
        return batchnorm_in_run(self)
