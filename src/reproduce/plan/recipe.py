"""The recipe: one paper's batch recipe as published, read from YAML and validated strictly.

No torch here. `load_recipe(path)` returns a `Recipe` or raises one `UserError` listing every problem
in the file, one line each: `papers/x.yaml: batch.effective: must be > 0 (got -3)`.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from ..errors import UserError
from .batchnorm import MODES, batchnorm_in_run
from .validation import format_validation_errors, read_yaml

# the built-ins that read model.output_stride and model.aux_weight (builtin_names.SEGMENTATION_MODELS, which imports
# this module: tests/torch/models/test_segmentation_models.py keeps the two equal)
SEGMENTATION_MODELS = ("deeplabv3-resnet50", "deeplabv3-resnet101", "fcn-resnet50", "lraspp-mobilenet-v3-large")

OPTIMIZERS = ("sgd", "nesterov", "adam", "adamw", "lamb", "lars", "adafactor")
SGD_FAMILY = ("sgd", "nesterov", "lars")
ADAM_FAMILY = ("adam", "adamw", "lamb", "adafactor")
OPTIMIZER_IMPLEMENTATIONS = ("foreach", "fused", "for-loop")
IMPLEMENTED_BY_TORCH = ("sgd", "nesterov", "adam", "adamw", "adafactor")
NORM_LAYERS = ("batchnorm", "layernorm", "rmsnorm", "groupnorm", "none")
BATCHNORM_CHOICES = MODES  # model.batchnorm: keep | sync | frozen | group (plan/batchnorm.py)
LENGTH_UNITS = ("steps", "epochs", "samples", "tokens")
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")
QUANTIZED_BASES = ("int8", "nf4")  # bitsandbytes' LLM.int8() and 4-bit NormalFloat (models/quantize.py)

Name = TypeVar("Name")


def _one_or_many(value: Any) -> Any:
    """A single name where a list of names is expected: `norm_layers: batchnorm` reads as `[batchnorm]`."""
    return [value] if isinstance(value, str) else value


# A list of names that also accepts one name written alone (YAML users write `no_decay: bias` as often as `[bias]`).
Names = Annotated[list[Name], BeforeValidator(_one_or_many)]


class Strict(BaseModel):
    # no field takes inf or nan; a number is never `true` (pydantic would read it as 1)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and _numeric(field.annotation):
                    raise ValueError(f"{name}: expected a number (got {value!r})")
        return data


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes a number and not a boolean (int, float, or an optional one)."""
    kinds, stack = set(), [annotation]
    while stack:
        kind = stack.pop()
        arguments = typing.get_args(kind)
        if arguments:
            stack.extend(arguments)
        else:
            kinds.add(kind)
    return bool(kinds & {int, float}) and bool not in kinds


class Paper(Strict):
    title: str
    authors: Names[str] = []
    year: int | None = Field(default=None, ge=1950, le=2100)
    url: str | None = None
    arxiv: str | None = None
    notes: str | None = None


class Length(Strict):
    """A length in exactly one unit: optimizer steps, epochs, samples (sequences) or tokens."""

    steps: int | None = Field(default=None, ge=0)
    epochs: float | None = Field(default=None, ge=0)
    samples: int | None = Field(default=None, ge=0)
    tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_unit(self) -> Length:
        given = self.units_given
        if len(given) != 1 and not self._allows_none():
            raise ValueError(f"give exactly one of steps, epochs, samples, tokens (got {', '.join(given) or 'none'})")
        return self

    def _allows_none(self) -> bool:
        return False

    @property
    def units_given(self) -> list[str]:
        return [unit for unit in LENGTH_UNITS if getattr(self, unit) is not None]

    @property
    def unit(self) -> str:
        return self.units_given[0]

    @property
    def value(self) -> float:
        value: float = getattr(self, self.unit)
        return value

    def label(self) -> str:
        """The length as written in messages and tables: "90 epochs", "4e+09 tokens"."""
        return f"{self.value:g} {self.unit}"


class BatchPhase(Length):
    """One phase of a batch that changes during training: its length (none for the last phase, which runs to the
    end of schedule.total), its effective batch and its sequence length (default: the batch's own)."""

    effective: int = Field(gt=0, description="effective batch per optimizer step in this phase, in batch.unit")
    sequence_length: int | None = Field(default=None, gt=0, description="tokens per sequence in this phase")
    # A schedule of its own (docs/schedules.md): the LR restarts at the phase's first step, lengths in its own units
    lr: float | None = Field(default=None, gt=0, description="this phase's peak LR (default: optimizer.lr)")
    warmup: Warmup | None = None
    decay: Decay | None = None

    def _allows_none(self) -> bool:
        return True  # the last phase has no length; Batch checks which phases need one

    @property
    def has_schedule(self) -> bool:
        """Whether the phase starts a schedule of its own (lr, warmup or decay given)."""
        return self.lr is not None or self.warmup is not None or self.decay is not None


class BatchRamp(Strict):
    """A batch-size warm-up (Brown et al. 2020, sec. 2.3): the effective batch grows linearly, with the data read,
    from `start` to batch.effective over `length`; each step's batch is rounded down to whole micro-batches."""

    start: int = Field(gt=0, description="the first step's effective batch, in batch.unit")
    length: Length
    granularity: int | None = Field(
        default=None, gt=0, description="each step's batch is a multiple of this, in batch.unit (default: one "
        "sequence per process); fixed by the recipe, so the ramp does not depend on the micro-batch")


class Batch(Strict):
    """The paper's effective batch and the hardware it was computed on.

    `phases` or `ramp` make the batch change during training; `effective` and `sequence_length` are then the
    paper's main batch (one of the phases, or the ramp's target), which `devices` and `per_device` describe.
    """

    effective: int = Field(gt=0, description="effective batch per optimizer step, in `unit`")
    unit: Literal["samples", "tokens"] = "samples"
    sequence_length: int | None = Field(default=None, gt=0, description="tokens per sequence")
    devices: int | None = Field(default=None, gt=0, description="data-parallel workers in the paper")
    per_device: int | None = Field(default=None, gt=0, description="per-device batch (also the BN batch)")
    accumulation: int | None = Field(default=None, gt=0, description="accumulation steps the paper used")
    device: str | None = None
    sharding: Literal["none", "fsdp"] = Field(
        default="none", description="fsdp: parameters, gradients and optimizer state sharded over the devices"
    )
    sharded_gradients: bool = Field(
        default=False, description="fsdp: reduce-scatter the gradients after every micro-batch, so they stay sharded "
        "through the accumulation window (one reduce-scatter per micro-batch instead of per window)",
    )
    offload: Literal["none", "cpu"] = Field(
        default="none", description="fsdp: cpu keeps parameters, gradients and optimizer state in CPU memory "
        "(FSDP2's CPUOffloadPolicy)",
    )
    phases: list[BatchPhase] | None = Field(default=None, description="the batch in phases (BERT's 128 then 512)")
    ramp: BatchRamp | None = Field(default=None, description="a linear batch-size warm-up (GPT-3)")

    @model_validator(mode="after")
    def _consistent(self) -> Batch:
        if self.unit == "tokens":
            if self.sequence_length is None:
                raise ValueError("sequence_length: required when unit is tokens (the batch is counted in tokens)")
            if self.effective % self.sequence_length:
                raise ValueError(
                    f"effective: {self.effective} tokens is not a whole number of sequences of "
                    f"sequence_length {self.sequence_length}"
                )
        if self.devices is not None and self.per_device is not None:
            product = self.devices * self.per_device * (self.accumulation or 1)
            if product != self.sequences:
                shown = f"{self.devices} x {self.per_device}" + (
                    f" x {self.accumulation}" if self.accumulation else ""
                )
                raise ValueError(
                    f"devices x per_device{' x accumulation' if self.accumulation else ''} = {shown} = "
                    f"{product}, but effective is {self.sequences} {self.count_unit}; state the paper's "
                    "accumulation steps or correct the numbers"
                )
        if self.sharding != "fsdp" and self.offload != "none":
            raise ValueError(f"offload: {self.offload} offloads FSDP2's sharded parameters, gradients and optimizer "
                             "state, and this batch does not shard (sharding none); set sharding: fsdp (with 2 or "
                             "more processes), or leave offload out")
        if self.sharding != "fsdp" and self.sharded_gradients:
            raise ValueError("sharded_gradients: keeps FSDP2's gradients sharded through the accumulation window, and "
                             "this batch does not shard (sharding none); set sharding: fsdp, or leave "
                             "sharded_gradients out")
        if self.phases is not None:
            self._check_phases(self.phases)
        if self.ramp is not None:
            self._check_ramp(self.ramp)
        return self

    def _check_phases(self, phases: list[BatchPhase]) -> None:
        if self.ramp is not None:
            raise ValueError("phases: give phases or ramp, not both")
        if len(phases) < 2:
            raise ValueError("phases: give two phases or more (one phase is batch.effective alone)")
        for index, phase in enumerate(phases):
            where = f"phases.{index}"
            last = index == len(phases) - 1
            given = phase.units_given
            if last and given:
                raise ValueError(f"{where}.{given[0]}: the last phase runs to the end of schedule.total; give it no "
                                 "length")
            if not last and len(given) != 1:
                raise ValueError(f"{where}: give its length: exactly one of steps, epochs, samples, tokens (got "
                                 f"{', '.join(given) or 'none'})")
            if phase.sequence_length is not None and self.sequence_length is None:
                raise ValueError(f"{where}.sequence_length: needs batch.sequence_length (the length of the other "
                                 "phases and of the main batch)")
            length = phase.sequence_length or self.sequence_length
            if self.unit == "tokens" and phase.effective % (phase.sequence_length or self.token_length):
                raise ValueError(f"{where}.effective: {phase.effective} tokens is not a whole number of sequences "
                                 f"of {length}")
            if phase.tokens is not None and length is None:
                raise ValueError(f"{where}.tokens: counted in tokens, which needs batch.sequence_length")
            self._check_phase_schedule(phase, where, index)
        if not any((p.effective, p.sequence_length or self.sequence_length) == (self.effective, self.sequence_length)
                   for p in phases):
            shown = ", ".join(f"{p.effective}" + (f" at {p.sequence_length or self.sequence_length} tokens"
                                                  if self.sequence_length else "") for p in phases)
            raise ValueError(
                f"effective: {self.effective}" + (f" at sequence_length {self.sequence_length}" if self.sequence_length
                                                  else "")
                + f" is none of the phases' batches ({shown}); batch.effective states the paper's main batch, one of "
                "its phases"
            )

    def _check_phase_schedule(self, phase: BatchPhase, where: str, index: int) -> None:
        """A phase's own schedule (lr, warmup, decay): from the second phase on, lengths it can count."""
        if not phase.has_schedule:
            return
        if index == 0:
            given = next(name for name in ("lr", "warmup", "decay") if getattr(phase, name) is not None)
            raise ValueError(f"{where}.{given}: the first phase's schedule is optimizer.lr and schedule.warmup / "
                             "decay; give a phase its own from the second phase on")
        decay = phase.decay
        if decay is not None and decay.kind == "plateau":
            raise ValueError(f"{where}.decay.kind: plateau applies to the whole run (schedule.decay), not to a phase")
        lengths = [("warmup", phase.warmup), ("decay.until", decay.until if decay else None),
                   ("decay.milestones", decay.milestones if decay else None)]
        for name, length in lengths:
            if length is not None and length.tokens is not None and self.sequence_length is None:
                raise ValueError(f"{where}.{name}.tokens: counted in tokens, which needs batch.sequence_length")

    def _check_ramp(self, ramp: BatchRamp) -> None:
        if ramp.start >= self.effective:
            raise ValueError(f"ramp.start: {ramp.start} must be below the batch it ramps up to, effective "
                             f"{self.effective}")
        if self.unit == "tokens" and ramp.start % self.token_length:
            raise ValueError(f"ramp.start: {ramp.start} tokens is not a whole number of sequences of "
                             f"{self.sequence_length}")
        if ramp.length.tokens is not None and self.sequence_length is None:
            raise ValueError("ramp.length.tokens: counted in tokens, which needs batch.sequence_length")
        if ramp.granularity is not None and self.unit == "tokens" and ramp.granularity % self.token_length:
            raise ValueError(f"ramp.granularity: {ramp.granularity} tokens is not a whole number of sequences of "
                             f"{self.sequence_length}")
        if ramp.granularity is not None and ramp.granularity >= self.effective:
            raise ValueError(f"ramp.granularity: {ramp.granularity} must be below the batch it ramps up to, "
                             f"effective {self.effective}")

    @property
    def sequences(self) -> int:
        """The effective batch in samples (sequences for token batches)."""
        return self.effective // self.token_length if self.unit == "tokens" else self.effective

    def phase_sequences(self, phase: BatchPhase) -> int:
        """A phase's effective batch in samples (sequences for token batches)."""
        return phase.effective // (phase.sequence_length or self.token_length) if self.unit == "tokens" else \
            phase.effective

    @property
    def token_length(self) -> int:
        """The sequence length a batch in tokens is counted in (`_consistent` requires one with unit tokens)."""
        if self.sequence_length is None:
            raise ValueError("sequence_length: required when unit is tokens (the batch is counted in tokens)")
        return self.sequence_length

    @property
    def sequence_lengths(self) -> list[int | None]:
        """The distinct sequence lengths the batch takes during training, shortest first (the main one alone
        without phases)."""
        lengths = {self.sequence_length} | {p.sequence_length or self.sequence_length for p in self.phases or []}
        return sorted(lengths, key=lambda length: length or 0)

    @property
    def longest_sequence_length(self) -> int | None:
        """The longest sequence of any phase: what a model's context must hold."""
        return self.sequence_lengths[-1]

    @property
    def count_unit(self) -> Literal["samples", "sequences"]:
        return "sequences" if self.unit == "tokens" else "samples"


class Builder(Strict):
    """A built-in name, or `factory: "package.module:function"` with keyword arguments."""

    builtin: str | None = None
    factory: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_source(self) -> Builder:
        if self.builtin is not None and self.factory is not None:
            raise ValueError("give either builtin or factory, not both")
        return self


NORMALIZATIONS = ("window-tokens", "micro-batch-mean")


class Loss(Builder):
    """Task custom: its loss (`builtin` or `factory`). Any task: how each micro-batch's loss is normalised.

    window-tokens (the default): each micro-batch's summed loss / the loss-bearing items (target tokens, samples,
    pixels) of the whole window over every rank: the gradient of the large batch's mean, exactly. micro-batch-mean:
    each micro-batch's mean over its own items / (the window's micro-batches x ranks), what the Hugging Face Trainer
    computed before transformers v4.46.0 (PR #34191, October 2024) and so the arithmetic of the papers run on it
    (Alpaca-LoRA, QLoRA): with micro-batches of unequal token counts not the large batch's mean.
    """

    normalization: Literal[NORMALIZATIONS] = Field(  # type: ignore[valid-type]
        default="window-tokens", description="window-tokens: the large batch's mean over its loss-bearing items "
        "(exact); micro-batch-mean: the mean of each micro-batch's own mean, as the Hugging Face Trainer before "
        "transformers v4.46.0 (PR #34191) averaged a window",
    )


class Lora(Strict):
    """Low-rank adapters (Hu et al. 2021) through peft on the modules named: only the adapters train.

    Each adapted weight W gets W + (alpha / r) B A with A (r x in) and B (out x r); B starts at zero, so the
    adapted model starts as the base model.
    """

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

    With `hf`, `kind` says which head (default from the task: causal-lm for language-modeling,
    sequence-classification for classification) and `kwargs` go to `from_pretrained` (e.g. num_labels).
    `dtype` is the dtype the weights are stored in (bf16/fp16: as fine-tuning recipes load a base model);
    `lora` freezes them and trains low-rank adapters instead. `weights` starts the run from pretrained weights on this
    machine (models/pretrained.py): a Hugging Face folder, whose own config.json is then the architecture, or one
    state dict file loaded into the built-in (or factory) model, keys and shapes checked strictly.
    """

    hf: str | None = Field(default=None, description="Hugging Face model name or local folder")
    weights: str | None = Field(
        default=None, description="pretrained weights on this machine: a Hugging Face folder (config.json + "
        "safetensors, as save_pretrained writes it) or a state dict file (.safetensors, .pt, .pth)",
    )
    backbone_weights: str | None = Field(
        default=None, description="segmentation built-ins: an ImageNet-pretrained backbone on this machine (a "
        "torchvision / timm ResNet state dict, or an MMSegmentation / MMPretrain checkpoint's backbone.*), loaded "
        "into the model's backbone with a report; the heads start at random (models/backbone.py)",
    )
    kind: Literal["causal-lm", "sequence-classification"] | None = None
    norm_layers: Names[Literal[NORM_LAYERS]] = []  # type: ignore[valid-type]
    batchnorm: Literal[BATCHNORM_CHOICES] = Field(  # type: ignore[valid-type]
        default="keep", description="BatchNorm when the micro-batch is below the paper's BN batch: keep (per "
        "micro-batch), sync (SyncBatchNorm over the processes, CUDA), frozen (FrozenBatchNorm2d), group (GroupNorm, "
        "a deviation); models/normalization.py",
    )
    paper_batchnorm: Literal[BATCHNORM_CHOICES] | None = Field(  # type: ignore[valid-type]
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
    dtype: Literal[WEIGHT_DTYPES] = "fp32"  # type: ignore[valid-type]
    lora: Lora | None = None
    quantize: Literal[QUANTIZED_BASES] | None = Field(  # type: ignore[valid-type]
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
        "(train/chunked_loss.py; torchtune's CEWithChunkedOutputLoss uses 8); exact",
    )
    offload_activations: bool = Field(
        default=False, description="copy what the model's forward saves for backward to CPU memory, and back when "
        "backward needs it (models/offload.py; torch.autograd.graph.saved_tensors_hooks, as save_on_cpu); exact, "
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


DATA_FORMATS = ("imagefolder", "tokens", "instructions", "chat", "hf-datasets", "segmentation")
SEGMENTATION_LAYOUTS = ("voc", "images-masks", "cityscapes")
DEFAULT_IGNORE_INDEX = 255  # the mask value that bears no loss (VOC's borders, Cityscapes' void), as in MMSegmentation
TOKEN_DTYPES = ("uint8", "uint16", "int32", "uint32", "int64")
# hf-datasets: which columns hold what; one of these sets of keys (`input` is optional beside instruction/output)
HF_COLUMN_SETS = ({"text"}, {"instruction", "output"}, {"instruction", "input", "output"}, {"image", "label"},
                  {"input", "label"})
# the fields only some formats use: field -> the formats that read it
FORMAT_FIELDS = {
    "augment": ("imagefolder", "hf-datasets"),
    "dtype": ("tokens",),
    "template": ("instructions", "hf-datasets"),
    "train_on_inputs": ("instructions", "chat", "hf-datasets"),
    "tokenizer": ("instructions", "chat", "hf-datasets"),
    "eval_size": ("instructions", "chat", "hf-datasets"),
    "eval_fraction": ("instructions", "chat", "hf-datasets"),
    "columns": ("hf-datasets", "instructions"),
    "layout": ("segmentation",),
    "crop": ("segmentation",),
    "scale": ("segmentation",),
    "flip": ("segmentation",),
    "pad": ("segmentation",),
    "split": ("segmentation",),
    "eval_split": ("segmentation",),
    "masks": ("segmentation",),
    "loss_pixels": ("segmentation",),
}
# data.template: how a record's fields become the prompt and the response (data/text.py)
TEMPLATES = ("alpaca", "alpaca-lora", "e2e")
PACKING_WAYS = ("none", "sorted", "packed")  # data.packing (data/packing.py)
INSTRUCTION_COLUMN_SETS = ({"instruction", "output"}, {"instruction", "input", "output"})


class Data(Builder):
    name: str | None = None
    available: bool = True
    train_size: int | None = Field(default=None, gt=0, description="training samples (sequences) per epoch")
    shuffle: bool = True
    drop_last: bool = True
    # The shape of image samples: what an image-folder run resizes to, and what the probe builds when the data
    # is not on this machine (defaults for the datasets the papers use come from the data's name).
    image_size: int | None = Field(default=None, gt=0, description="image height and width in pixels")
    channels: int | None = Field(default=None, gt=0, description="image channels (3 for RGB)")
    classes: int | None = Field(default=None, gt=1, description="number of classes (classification; segmentation: "
                                "the mask's class ids 0 .. classes - 1, background included: 21 for Pascal VOC)")
    max_length: int | None = Field(
        default=None, gt=0, description="longest sequence in tokens (variable-length text is truncated to it)"
    )
    # Data on disk in a standard layout (`reproduce run --data PATH` / `--eval-data PATH` replace the paths).
    format: Literal[DATA_FORMATS] | None = None  # type: ignore[valid-type]
    path: str | None = Field(default=None, description="the training data: a folder or a file")
    eval_path: str | None = Field(default=None, description="the evaluation data, in the same format")
    eval_size: int | None = Field(default=None, gt=0, description="text: examples held out of data.path for "
                                  "evaluation, drawn with the seed (Alpaca-LoRA's val_set_size: 2000)")
    eval_fraction: float | None = Field(default=None, gt=0, lt=1, description="text: the share of data.path's "
                                        "examples held out for evaluation (rounded, at least one), drawn with the seed")
    augment: Literal["imagenet", "none"] | None = None
    dtype: Literal[TOKEN_DTYPES] | None = None  # type: ignore[valid-type]
    template: Literal[TEMPLATES] | None = Field(  # type: ignore[valid-type]
        default=None, description="alpaca: Stanford Alpaca's prompt; alpaca-lora: Alpaca-LoRA's (a newline after "
        "'### Response:'); e2e: microsoft/LoRA's E2E encoding (context, <|endoftext|>, ' ' + completion)",
    )
    train_on_inputs: bool | None = Field(
        default=None, description="the loss covers the prompt's tokens too (Alpaca-LoRA's train_on_inputs, its "
        "default); default false: only the response's",
    )
    tokenizer: str | None = Field(default=None, description="a local tokenizer folder (tokenizer.json)")
    packing: Literal[PACKING_WAYS] | None = Field(  # type: ignore[valid-type]
        default=None, description="how a window's samples group into micro-batches (data/packing.py): none (the "
        "plan's micro-batch of m samples), sorted (by length, micro-batches of at most data.token_budget tokens), "
        "packed (rows of samples with position ids restarting at each); the window's samples are the same with each. "
        "Default: sorted for instruction and chat data (default_packing), else none")
    token_budget: int | None = Field(
        default=None, gt=0, description="sorted / packed: tokens per micro-batch, padding included (default: the "
        "largest the probe measured to fit for sorted, else the micro-batch x the longest example)")
    columns: dict[str, str] | None = None
    # format segmentation (docs/segmentation.md): images with a mask of class ids each, cut and flipped together
    layout: Literal[SEGMENTATION_LAYOUTS] | None = Field(  # type: ignore[valid-type]
        default=None, description="segmentation: voc (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/), "
        "images-masks (images/ and masks/ of the same names, or their train/ and val/ sub-folders) or cityscapes "
        "(leftImg8bit/ and gtFine/ *_labelTrainIds.png); default: found from the folder")
    crop: tuple[int, int] | None = Field(
        default=None, description="segmentation: the training crop, [height, width] or one side (513, [512, 1024])")
    scale: tuple[float, float] | None = Field(
        default=None, description="segmentation: the random rescale range before the crop, [low, high] (the papers' "
        "[0.5, 2.0]); default: no rescale")
    flip: bool | None = Field(default=None, description="segmentation: random horizontal flip (default true)")
    pad: bool | None = Field(
        default=None, description="segmentation: pad an image smaller than the crop (image 0 after normalisation, mask "
        "ignore_index), as DeepLabV3 and MMSegmentation do; default false: such an image is an error")
    ignore_index: int | None = Field(
        default=None, ge=0, description="segmentation: the mask value that bears no loss and no metric (default 255)")
    split: str | None = Field(default=None, min_length=1, description="segmentation, voc layout: the training list "
                              "ImageSets/Segmentation/SPLIT.txt (default train; DeepLabV3: trainaug)")
    eval_split: str | None = Field(default=None, min_length=1, description="segmentation, voc layout: the evaluation "
                                   "list (default val), read from eval_path's folder, or path's")
    loss_pixels: Literal["valid", "all"] | None = Field(
        default=None, description="segmentation: the pixels the loss is averaged over, across the window: valid (not "
        "ignore_index, default: F.cross_entropy's and torchvision's reference) or all (every pixel of every crop, "
        "ignored ones as zeros: MMSegmentation's default avg_non_ignore=False)")
    masks: str | None = Field(default=None, min_length=1, pattern=r"^[^/\\]+$", description="segmentation, voc "
                              "layout: the training masks' folder beside JPEGImages/ (default SegmentationClass; "
                              "DeepLabV3's trainaug: SegmentationClassAug); evaluation reads SegmentationClass/")

    @model_validator(mode="before")
    @classmethod
    def _one_side(cls, value: Any) -> Any:
        """`crop: 513` reads as [513, 513]."""
        if isinstance(value, dict) and isinstance(value.get("crop"), int) and not isinstance(value["crop"], bool):
            value = {**value, "crop": [value["crop"], value["crop"]]}
        return value

    @model_validator(mode="after")
    def _segmentation_fields(self) -> Data:
        if self.crop is not None and min(self.crop) <= 0:
            raise ValueError(f"crop: height and width must be > 0 (got {list(self.crop)})")
        if self.scale is not None and not 0 < self.scale[0] <= self.scale[1]:
            raise ValueError(f"scale: expected [low, high] with 0 < low <= high (got {list(self.scale)})")
        if self.layout == "images-masks" and (self.split or self.eval_split or self.masks):
            name = "split" if self.split else "eval_split" if self.eval_split else "masks"
            raise ValueError(f"{name}: only used with layout voc (its ImageSets/Segmentation/ lists) or cityscapes "
                             "(its split folders); images-masks reads every image of images/, or of images/train/ "
                             "and images/val/ (the evaluation folder: eval_path)")
        if self.layout == "cityscapes" and self.masks:
            raise ValueError("masks: only used with layout voc; cityscapes reads gtFine/'s *_labelTrainIds.png")
        if self.format == "segmentation" and self.crop is None:
            raise ValueError("crop: required for segmentation data: the training crop every sample is cut to "
                             "(513 for DeepLabV3 on VOC, [512, 1024] for MMSegmentation on Cityscapes)")
        return self

    @property
    def flips(self) -> bool:
        return self.flip is not False

    @property
    def pads(self) -> bool:
        return bool(self.pad)

    @model_validator(mode="after")
    def _has_source(self) -> Data:
        if self.format is not None and (self.builtin is not None or self.factory is not None):
            raise ValueError("format: give format (with path) or builtin/factory, not both")
        for name in ("path", "eval_path", "tokenizer"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}: give a file or folder (got {value!r})")
        if self.format is None:
            given = [n for n in ("path", "eval_path", *FORMAT_FIELDS) if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given[0]}: only used with format: {' | '.join(DATA_FORMATS)}")
        else:
            for name, formats in FORMAT_FIELDS.items():
                if getattr(self, name) is not None and self.format not in formats:
                    raise ValueError(f"{name}: only used with format {' or '.join(formats)} (format is {self.format})")
        held = [name for name in ("eval_size", "eval_fraction") if getattr(self, name) is not None]
        if len(held) > 1:
            raise ValueError("eval_fraction: give eval_size (examples) or eval_fraction (a share), not both")
        if held and self.eval_path is not None:
            raise ValueError(f"{held[0]}: holds examples out of data.path; not with eval_path (give one or the other)")
        if self.format == "hf-datasets":
            if self.columns is None:
                raise ValueError("columns: required for format hf-datasets (which column holds what, e.g. "
                                 "{text: content} or {image: img, label: label})")
            if set(self.columns) not in HF_COLUMN_SETS:
                shown = ", ".join(f"{{{', '.join(sorted(s))}}}" for s in HF_COLUMN_SETS)
                raise ValueError(f"columns: expected the keys of one of {shown} (got {sorted(self.columns)})")
            if self.augment is not None and "image" not in self.columns:
                raise ValueError("augment: only used with an image column (columns: {image: ..., label: ...})")
            if self.template is not None and "instruction" not in self.columns:
                raise ValueError("template: only used with instruction columns (columns: {instruction: ..., ...})")
        if self.format == "instructions" and self.columns is not None and set(self.columns) not in (
                INSTRUCTION_COLUMN_SETS):
            raise ValueError(f"columns: the record fields that hold instruction and output (and input), e.g. "
                             f"{{instruction: context, output: completion}} (got {sorted(self.columns)})")
        if self.builtin is None and self.factory is None and self.name is None and self.format is None:
            raise ValueError("give builtin: NAME, factory: 'package.module:function', format: with path:, or name: "
                             "for plan-only data")
        if self.available and self.builtin is None and self.factory is None and self.path is None:
            if self.format is not None:
                raise ValueError(f"path: required for {self.format} data (a folder or file), or set available: "
                                 "false and give it on the command line: reproduce run `data_path` PATH")
            raise ValueError(f"available: data {self.name!r} has no builtin or factory; set available: false")
        return self

    @property
    def text_columns(self) -> bool:
        """Whether the data is text to tokenise (instructions, chat, or hf-datasets text/instruction columns)."""
        return self.format in ("instructions", "chat") or (
            self.format == "hf-datasets" and self.columns is not None and "label" not in self.columns
        )


class Optimizer(Strict):
    name: Literal[OPTIMIZERS]  # type: ignore[valid-type]
    lr: float = Field(gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    no_decay: Names[Literal["bias", "norm", "embedding", "1d"]] = []
    trust_coefficient: float | None = Field(
        default=None, gt=0, description="lars: eta, the trust coefficient of You et al. 2017 (default 0.001)"
    )
    state_bits: Literal[32, 8] = Field(
        default=32, description="adam/adamw: 8 keeps the two moments in 8 bits, blockwise quantised (bitsandbytes' "
        "AdamW8bit, Dettmers et al. 2022, arXiv 2110.02861): about 2 bytes a parameter instead of 8",
    )
    paged: bool = Field(
        default=False, description="adam/adamw: bitsandbytes' paged optimizer (QLoRA's paged_adamw_32bit): its state "
        "in CUDA unified memory, paged out to the CPU when the GPU runs short instead of running out of memory",
    )
    implementation: Literal[OPTIMIZER_IMPLEMENTATIONS] | None = Field(  # type: ignore[valid-type]
        default=None, description="torch.optim's kernels (sgd, nesterov, adam, adamw, adafactor): foreach (one "
        "kernel over a list of tensors: temporaries the size of all the parameters), fused (one kernel per "
        "parameter group, no such temporaries; adam, adamw, sgd) or for-loop (one parameter at a time); default: "
        "PyTorch's choice, foreach on CUDA, for-loop on a CPU",
    )
    in_backward: bool = Field(
        default=False, description="step the optimizer inside backward, each parameter as its gradient is made "
        "(torchtune's optimizer_in_bwd): not with gradient accumulation, refused",
    )

    @model_validator(mode="after")
    def _betas(self) -> Optimizer:
        for beta in self.betas:
            if not 0 <= beta < 1:
                raise ValueError(f"betas: each must be in [0, 1) (got {list(self.betas)})")
        if self.name == "nesterov" and self.momentum == 0:
            raise ValueError("momentum: nesterov needs momentum > 0")
        if self.trust_coefficient is not None and self.name != "lars":
            raise ValueError(f"trust_coefficient: only used by lars (name is {self.name})")
        if self.in_backward:
            raise ValueError(
                "in_backward: an optimizer stepped in backward frees each gradient as soon as it is made, and "
                "accumulation needs every micro-batch's gradients held until the window ends: the two cannot be "
                "exact together; leave in_backward out (activation checkpointing, a chunked loss or offloading save "
                "memory and keep the accumulation exact)")
        if self.implementation is not None and self.name not in IMPLEMENTED_BY_TORCH:
            raise ValueError(f"implementation: only for torch.optim's {', '.join(IMPLEMENTED_BY_TORCH)} "
                             f"(name is {self.name}, whose step is train/large_batch.py's own)")
        if self.implementation == "fused" and self.name not in ("sgd", "nesterov", "adam", "adamw"):
            raise ValueError(f"implementation: fused: torch.optim has no fused {self.name} (fused: adam, adamw, sgd)")
        if self.implementation is not None and self.bitsandbytes:
            raise ValueError("implementation: bitsandbytes' paged and 8-bit optimizers step with their own kernels "
                             "(one parameter at a time); leave implementation out")
        if (self.paged or self.state_bits != 32) and self.name not in ("adam", "adamw"):
            field = "paged" if self.paged else "state_bits"
            raise ValueError(f"{field}: bitsandbytes' paged and 8-bit optimizers are adam and adamw (name is "
                             f"{self.name})")
        return self

    @property
    def bitsandbytes(self) -> bool:
        """Stepped by a bitsandbytes optimizer (paged, or 8-bit state) rather than torch.optim's."""
        return self.paged or self.state_bits != 32

    @property
    def bitsandbytes_class(self) -> str | None:
        """The bitsandbytes.optim class that steps it (PagedAdamW32bit, AdamW8bit, PagedAdam8bit, ...), or None."""
        if not self.bitsandbytes:
            return None
        return ("Paged" if self.paged else "") + ("AdamW" if self.name == "adamw" else "Adam") + (
            "8bit" if self.state_bits == 8 else "32bit" if self.paged else "")

    @property
    def family(self) -> str:
        return "sgd" if self.name in SGD_FAMILY else "adam"


class Warmup(Length):
    """Linear warm-up from `start_lr` (or `start_factor` x lr; default 0) to the peak LR.

    Its length is one of steps, epochs, samples, tokens, or `ratio` of the total.
    """

    ratio: float | None = Field(default=None, gt=0, lt=1)
    start_lr: float | None = Field(default=None, ge=0)
    start_factor: float | None = Field(default=None, ge=0, le=1)

    @model_validator(mode="after")
    def _one_length(self) -> Warmup:
        given = self.units_given
        if self.ratio is not None and given:
            raise ValueError(f"give ratio or one of steps, epochs, samples, tokens, not both (got ratio, {given[0]})")
        if self.start_lr is not None and self.start_factor is not None:
            raise ValueError("give start_lr or start_factor, not both")
        return self

    def _allows_none(self) -> bool:
        return self.ratio is not None


class Milestones(Length):
    steps: list[int] | None = None  # type: ignore[assignment]
    epochs: list[float] | None = None  # type: ignore[assignment]
    samples: list[int] | None = None  # type: ignore[assignment]
    tokens: list[int] | None = None  # type: ignore[assignment]

    @property
    def values(self) -> list[float]:
        return list(getattr(self, self.unit))

    @model_validator(mode="after")
    def _increasing(self) -> Milestones:
        values = self.values
        if any(v < 0 for v in values) or values != sorted(set(values)):
            raise ValueError(f"{self.unit}: milestones must be increasing and >= 0 (got {values})")
        return self


PLATEAU_FIELDS = ("patience", "metric", "mode", "threshold", "threshold_mode", "cooldown")


class Decay(Strict):
    kind: Literal["constant", "step", "cosine", "linear", "polynomial", "plateau"] = "constant"
    milestones: Milestones | None = None
    factor: float = Field(default=0.1, gt=0, le=1, description="step decay: multiply the LR by this at each milestone")
    min_lr: float | None = Field(default=None, ge=0, description="cosine/linear/polynomial: the final LR")
    min_ratio: float | None = Field(default=None, ge=0, le=1, description="the final LR as a fraction of the peak")
    power: float = Field(default=1.0, gt=0, description="polynomial decay power")
    until: Length | None = None
    # kind plateau: torch.optim.lr_scheduler.ReduceLROnPlateau at each evaluation (docs/schedules.md)
    patience: int | None = Field(default=None, gt=0, description="plateau: evaluations without improvement before "
                                 "the LR is multiplied by factor")
    metric: str | None = Field(default=None, description="plateau: the evaluation metric watched (eval_loss, ...)")
    mode: Literal["min", "max"] | None = Field(default=None, description="plateau: min or max is better (default: "
                                               "from the metric)")
    threshold: float | None = Field(default=None, ge=0, description="plateau: the least change that counts as an "
                                    "improvement (default 1e-4)")
    threshold_mode: Literal["rel", "abs"] | None = None
    cooldown: int | None = Field(default=None, ge=0, description="plateau: evaluations to wait after a decrease")

    @model_validator(mode="after")
    def _fields_for_kind(self) -> Decay:
        plateau_given = [name for name in PLATEAU_FIELDS if getattr(self, name) is not None]
        if self.kind != "plateau" and plateau_given:
            raise ValueError(f"{plateau_given[0]}: only used by kind plateau (kind is {self.kind})")
        if self.kind == "plateau":
            for name in ("patience", "metric"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: required for kind plateau (the paper's or your choice: evaluations "
                                     "without improvement, and the metric watched)" if name == "patience" else
                                     f"{name}: required for kind plateau (eval_loss, eval_accuracy or eval_error)")
            if self.factor >= 1:
                raise ValueError(f"factor: must be < 1 for kind plateau (got {self.factor})")
            if self.until is not None:
                raise ValueError("until: not used by kind plateau (its decreases happen at evaluations)")
        if self.kind == "step" and self.milestones is None:
            raise ValueError("milestones: required for kind step")
        if self.kind != "step" and self.milestones is not None:
            raise ValueError(f"milestones: only used by kind step (kind is {self.kind})")
        if self.min_lr is not None and self.min_ratio is not None:
            raise ValueError("give min_lr or min_ratio, not both")
        return self


class Schedule(Strict):
    warmup: Warmup | None = None
    decay: Decay = Decay()
    total: Length


class Reported(Strict):
    metric: str
    value: float
    split: str | None = None
    tolerance: float | None = Field(default=None, ge=0)
    notes: str | None = None
    evaluated: bool = Field(
        default=True, description="false: a figure the run does not measure (a downstream benchmark, BLEU after "
        "generation), kept as documentation; true: one of the metrics the task evaluates, compared with the run's")


LOSS_METRICS = ("val_loss", "eval_loss", "loss")
# The `reported:` metrics the run evaluates, by task (reported.py puts them beside the run's values)
REPORTED_METRICS = {
    "classification": (*LOSS_METRICS, "top1_accuracy", "accuracy", "top1_error", "eval_accuracy"),
    "language-modeling": LOSS_METRICS,
    "custom": LOSS_METRICS,
    "segmentation": (*LOSS_METRICS, "miou", "pixel_accuracy", "eval_miou", "eval_pixel_accuracy"),
}


# The evaluation metrics a plateau decay can watch, by task (train/evaluation.evaluate; eval_error = 1 - eval_accuracy)
PLATEAU_METRICS = {
    "classification": ("eval_loss", "eval_accuracy", "eval_error"),
    "language-modeling": ("eval_loss",),
    "custom": ("eval_loss",),
    "segmentation": ("eval_loss", "eval_miou", "eval_pixel_accuracy"),
}


class Evaluation(Strict):
    every_steps: int | None = Field(default=None, gt=0, description="evaluate every K optimizer steps")
    at_end: bool = True
    # segmentation (docs/segmentation.md): how the evaluation images go through the model, as MMSegmentation's
    # test_cfg says (mode='whole' | 'slide', crop_size, stride), and at which output stride (DeepLabV3: 8)
    mode: Literal["whole", "slide"] = Field(
        default="whole", description="segmentation: whole (each image at its size) or slide (MMSegmentation's "
        "sliding window: crops of `crop` every `stride` pixels, the overlapping logits averaged)")
    crop: tuple[int, int] | None = Field(default=None, description="slide: the window, [height, width] or one side")
    stride: tuple[int, int] | None = Field(default=None, description="slide: the step between windows, [height, "
                                           "width] or one side")
    output_stride: Literal[8, 16] | None = Field(
        default=None, description="segmentation built-ins: evaluate at this output stride (DeepLabV3 trains at 16, "
        "evaluates at 8, sec. 4.1); the same weights, ResNet's dilation and ASPP's rates set for it")

    @model_validator(mode="before")
    @classmethod
    def _sides(cls, value: Any) -> Any:
        """`crop: 512` reads as [512, 512], likewise `stride`."""
        if isinstance(value, dict):
            value = {**value, **{key: [value[key], value[key]] for key in ("crop", "stride")
                                 if isinstance(value.get(key), int) and not isinstance(value[key], bool)}}
        return value

    @model_validator(mode="after")
    def _slide(self) -> Evaluation:
        if self.mode == "slide" and (self.crop is None or self.stride is None):
            raise ValueError("mode: slide needs crop and stride (MMSegmentation's test_cfg crop_size and stride, "
                             "[height, width] or one side)")
        if self.mode == "whole" and (self.crop is not None or self.stride is not None):
            raise ValueError("crop, stride: only used with mode: slide")
        if self.crop is not None and min(self.crop) <= 0 or self.stride is not None and min(self.stride) <= 0:
            raise ValueError("crop, stride: height and width must be > 0")
        return self


class Recipe(Strict):
    paper: Paper | None = None
    batch: Batch
    task: Literal["classification", "language-modeling", "custom", "segmentation"]
    model: Model
    data: Data
    loss: Loss | None = None
    optimizer: Optimizer
    schedule: Schedule
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    clip_grad_norm: float | None = Field(default=None, gt=0)
    scaling_rule: Literal["auto", "linear", "sqrt", "none"] = "auto"
    seed: int = Field(default=0, ge=0, le=2**64 - 1)  # what torch.manual_seed takes
    evaluation: Evaluation = Evaluation()
    reported: list[Reported] = []
    deviations: list[str] = Field(
        default=[], description="what this recipe cannot express or does differently from the paper, one sentence "
        "each: `plan` prints them as warnings, `papers show` below the recipe"
    )

    @model_validator(mode="after")
    def _deviations_written(self) -> Recipe:
        for index, text in enumerate(self.deviations):
            if not text.strip():
                raise ValueError(f"deviations.{index}: an empty sentence; say what differs from the paper")
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        loss_named = self.loss is not None and (self.loss.builtin or self.loss.factory)
        if self.task == "custom" and not loss_named:
            raise ValueError("loss: task custom needs loss: {builtin: NAME} or {factory: 'package.module:function'}")
        if self.task != "custom" and loss_named:
            raise ValueError(f"loss: builtin and factory only with task custom (task is {self.task}); any task takes "
                             "loss.normalization")
        weights = self.model.dtype
        if weights != "fp32" and self.precision != weights:
            raise ValueError(
                f"model.dtype: {weights} weights compute under precision: {weights} (autocast), not "
                f"{self.precision}" + (" (fp16 autocast would keep an fp16 copy of every bf16 weight for the backward)"
                                       if self.precision == "fp16" else "")
            )
        if self.model.loss_chunks and self.task != "language-modeling":
            raise ValueError(f"model.loss_chunks: chunks a language model's next-token loss (task is {self.task})")
        for name in ("loss_chunks", "offload_activations"):
            if getattr(self.model, name) and self.batch.sharding == "fsdp":
                raise ValueError(f"model.{name}: not with batch.sharding: fsdp here (FSDP2 shards the head's weight "
                                 "outside its forward, and the offload hooks are untested under it); use DDP")
        if self.model.quantize is not None and self.batch.sharding == "fsdp":
            raise ValueError(f"model.quantize: an {self.model.quantize} base is not sharded with fsdp here (FSDP2 "
                             "cannot shard bitsandbytes' packed weights); use batch.sharding: none")
        if self.model.lora is not None and self.model.lora.dtype == "bf16" and self.precision != "bf16":
            raise ValueError(f"model.lora.dtype: bf16 adapters compute under precision: bf16, not {self.precision}")
        if weights == "fp16" and self.model.lora is None:
            raise ValueError(
                "model.dtype: fp16 weights can only stay frozen under model.lora (a GradScaler cannot unscale fp16 "
                "gradients); train all weights in bf16 or fp32"
            )
        if self.batch.sequence_length is None:
            schedule = self.schedule
            named = [
                ("schedule.total", schedule.total), ("schedule.warmup", schedule.warmup),
                ("schedule.decay.until", schedule.decay.until),
                ("schedule.decay.milestones", schedule.decay.milestones),
            ]
            for name, length in named:
                if length is not None and length.tokens is not None:
                    raise ValueError(f"{name}: counted in tokens, which needs batch.sequence_length")
        self._check_data_format()
        self._check_segmentation()
        self._check_plateau()
        self._check_reported()
        return self

    @property
    def ignore_index(self) -> int:
        """Task segmentation: the mask value that bears no loss and no metric."""
        given = self.data.ignore_index
        return DEFAULT_IGNORE_INDEX if given is None else given

    def _check_segmentation(self) -> None:
        data = self.data
        if self.task != "segmentation":
            if data.ignore_index is not None:
                raise ValueError(f"data.ignore_index: only used with task segmentation (task is {self.task})")
            if self.evaluation.mode != "whole" or self.evaluation.output_stride is not None:
                raise ValueError(f"evaluation.mode, output_stride: only used with task segmentation (task is "
                                 f"{self.task})")
            return
        if data.classes is None:
            raise ValueError("data.classes: required for task segmentation: the class ids 0 .. classes - 1 a mask "
                             "holds, background included (21 for Pascal VOC, 19 for Cityscapes)")
        evaluation = self.evaluation
        if evaluation.output_stride is not None and self.model.builtin not in SEGMENTATION_MODELS:
            raise ValueError("evaluation.output_stride: only for the segmentation built-ins "
                             f"({', '.join(SEGMENTATION_MODELS)})")
        if evaluation.output_stride == 8 and self.model.builtin == "lraspp-mobilenet-v3-large":
            raise ValueError("evaluation.output_stride: lraspp-mobilenet-v3-large is built at 16 only (MobileNetV3's "
                             "last block dilated, Howard et al. 2019 sec. 6.2)")
        outputs = self.model.kwargs.get("num_classes")
        if self.model.builtin in SEGMENTATION_MODELS and outputs is not None and outputs != data.classes:
            raise ValueError(f"model.kwargs.num_classes: {outputs} output channels, but data.classes is "
                             f"{data.classes}: the model predicts one channel per class (remove num_classes: it "
                             "follows data.classes)")
        if self.ignore_index < data.classes:
            raise ValueError(f"data.ignore_index: {self.ignore_index} is one of the {data.classes} class ids "
                             f"0 .. {data.classes - 1}; the ignored value must be none of them (255 by default)")

    def _check_reported(self) -> None:
        """A reported metric the run evaluates is one the task computes; any other says `evaluated: false`."""
        known = REPORTED_METRICS[self.task]
        for index, reported in enumerate(self.reported):
            if reported.evaluated and reported.metric not in known:
                raise ValueError(
                    f"reported.{index}.metric: unknown metric {reported.metric!r} for task {self.task}, which "
                    f"evaluates {', '.join(known)}; a figure the run does not measure (a downstream benchmark) "
                    "says evaluated: false")

    def _check_plateau(self) -> None:
        """A plateau decay watches an evaluation metric: evaluations must happen, and report that metric."""
        decay = self.schedule.decay
        if decay.kind != "plateau":
            return
        if self.evaluation.every_steps is None:
            raise ValueError("evaluation.every_steps: required by schedule.decay kind plateau (the LR can only drop "
                             "at an evaluation)")
        for index, phase in enumerate(self.batch.phases or []):
            if phase.has_schedule:
                raise ValueError(f"batch.phases.{index}: a phase's own schedule cannot follow schedule.decay kind "
                                 "plateau (whose decreases apply to the whole run)")
        known = PLATEAU_METRICS[self.task]
        if decay.metric not in known:
            raise ValueError(f"schedule.decay.metric: unknown metric {decay.metric!r} for task {self.task}; "
                             f"expected one of {', '.join(known)}")

    def _check_data_format(self) -> None:
        """What a data format needs from the rest of the recipe (the task; the sizes it cuts or tokenises to)."""
        data = self.data
        problem = packing_problem(self)
        if problem:
            raise ValueError(problem)
        if data.format is None:
            return
        if data.format == "hf-datasets":
            task = "language-modeling" if data.text_columns else "classification"
        elif data.format == "segmentation":
            task = "segmentation"
        else:
            task = "classification" if data.format == "imagefolder" else "language-modeling"
        if self.task != "custom" and self.task != task:
            raise ValueError(f"data.format: {data.format} data{' with these columns' if data.columns else ''} is "
                             f"for task {task} (task is {self.task})")
        if data.format == "tokens" and self.batch.sequence_length is None:
            raise ValueError("batch.sequence_length: required with data.format tokens (each sample is that many "
                             "tokens)")
        if not data.available:
            return  # plan only until a path is given (reproduce run --data PATH)
        images = data.format == "imagefolder" or (data.columns is not None and "image" in data.columns)
        if images and data.image_size is None:
            raise ValueError("data.image_size: required for image data (the side images are cropped or resized "
                             "to; 224 for ImageNet)")
        if data.text_columns:
            if data.tokenizer is None and self.model.hf is None and self.model.weights is None:
                raise ValueError("data.tokenizer: required for text data: a local tokenizer folder (default: the "
                                 "model's own with model.hf, or the folder of model.weights)")
            if data.max_length is None and self.batch.sequence_length is None:
                raise ValueError("data.max_length: required for text data: the longest sequence in tokens, longer "
                                 "ones are truncated (Alpaca: 512)")


def packing_problem(recipe: Recipe, way: str | None = None) -> str | None:
    """Why the recipe's `data.packing` (or `way`) cannot group its windows (data/packing.py), or None."""
    data, batch = recipe.data, recipe.batch
    way = way or data.packing
    if data.token_budget is not None and way not in ("sorted", "packed"):
        return "data.token_budget: only used with data.packing sorted or packed"
    if way not in ("sorted", "packed"):
        return None
    if data.format in ("imagefolder", "segmentation", "tokens") or "image" in (data.columns or {}):
        what = "token files of one length" if data.format == "tokens" else "image data"
        return (f"data.packing: {way} groups samples by their lengths, which {what} does not have (text "
                "only: format instructions, hf-datasets text, or a factory's token sequences); use packing: none")
    if batch.phases or batch.ramp or batch.unit != "samples" or recipe.task != "language-modeling":
        return (f"data.packing: {way} groups a window of samples of language-modeling text; not with "
                "batch.phases, batch.ramp, batch.unit tokens or another task")
    return None


def default_packing(recipe: Recipe) -> str | None:
    """The way a recipe that leaves `data.packing` unset takes, or None (`none`, as for any other data).

    Instruction and chat text (format instructions or chat, hf-datasets text) of a language-modeling run whose loss
    is normalised by the window's tokens: `sorted`, the fastest exact way on the attention the run uses. Its
    micro-batches are right-padded rows with no mask, which sdpa runs with `is_causal` (flash attention on a GPU);
    `packed` rows need transformers' block mask over each whole row, which a dense kernel computes in full, so it
    is faster only with a varlen kernel (flash_attention_2), which no run here selects (docs/packing.md has the
    measurements). Not with `loss.normalization: micro-batch-mean`: its arithmetic is the paper's micro-batches'.
    """
    data = recipe.data
    if data.packing is not None or not data.text_columns:
        return None
    if recipe.loss is not None and recipe.loss.normalization != "window-tokens":
        return None
    return None if packing_problem(recipe, "sorted") else "sorted"


# ---- reading a file (YAML reading and error formatting: validation.py) -------------------------------


def load_recipe(path: str | Path) -> Recipe:
    data = read_yaml(path)
    if data.get("format", "").startswith("reproduce-plan"):
        raise UserError(f"{path}: this is a plan file, not a recipe; give the recipe it was made from")
    from .factory import remember_folder  # its factories are looked for beside it first

    remember_folder(path)
    return parse_recipe(data, source=str(path))


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(*format_validation_errors(exc, source, Recipe)) from None
