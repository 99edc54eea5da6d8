"""BatchNorm in the plan, without torch: the model's BatchNorm layers, the run's BN batch against the paper's, and
the choices that bring it closer (`model.batchnorm: keep | sync | frozen | group`).

Accumulation makes a window's gradient the large batch's, but BatchNorm still normalises each forward's samples:
over the micro-batch (keep), all processes' micro-batches (sync), or no batch at all (frozen, GroupNorm). The layers
are counted in the model (known here for the built-ins, `counted` by the torch layer otherwise), and only failing
both read from the recipe's `model.norm_layers` label."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import MicroBatchError

BatchnormMode = Literal["keep", "sync", "frozen", "group"]  # model.batchnorm, model.paper_batchnorm
MODES: tuple[BatchnormMode, ...] = typing.get_args(BatchnormMode)
# BatchNorm layers of each built-in as built (no auxiliary head); tests/torch/plan/test_batchnorm_plan.py counts them
BUILTIN_LAYERS = {
    "mlp": 0, "cnn-bn": 3, "cnn-gn": 0, "gpt": 0,
    "resnet50": 53, "vit-b16": 0, "deit-b": 0,
    "deeplabv3-resnet50": 60, "deeplabv3-resnet101": 111, "fcn-resnet50": 54, "lraspp-mobilenet-v3-large": 47,
    "mae-vit-large-patch16": 0, "gpt2-124m": 0, "gpt3-small": 0, "gpt2-medium": 0, "gpt-char": 0, "bert-base": 0,
    "bert-large": 0, "roberta-base": 0, "llama-7b": 0, "nanogpt": 0,
}
AUX_HEAD_LAYERS = 1  # torchvision's FCNHead: conv, BatchNorm, ReLU, dropout, conv
# BatchNorm over a 1 x 1 map (DeepLabV3's ASPP image pooling): one value per channel for a BN batch of 1, which
# PyTorch refuses in training ("Expected more than 1 value per channel")
POOLED_BATCHNORM = ("deeplabv3-resnet50", "deeplabv3-resnet101")
GROUPNORM_SOURCE = "Wu & He 2018 (arXiv 1803.08494): GroupNorm's statistics do not depend on the batch"


class BatchNormPlan(BaseModel):
    """The BatchNorm part of a plan: what the run normalises over, against the paper, and the options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: BatchnormMode  # the run's: keep | sync | frozen | group
    paper_mode: BatchnormMode  # the paper's (model.paper_batchnorm, else model.batchnorm)
    layers: int | None  # BatchNorm layers of the model as the paper built it (None: not known)
    found: str  # where that count comes from
    micro_batch: int
    processes: int
    run_batch: int | None  # the samples one BN layer normalises over in a training forward (None: no batch stats)
    paper_batch: int | None
    lines: list[str] = []  # what the plan prints about it
    options: list[str] = []  # the choices that would bring the BN batch closer to the paper's, and what each needs

    @property
    def summary(self) -> str:
        return self.lines[0] if self.lines else ""

    @property
    def note(self) -> str | None:
        """The warning when BatchNorm normalises over another batch than the paper's (None when it is the paper's,
        or when the run's model has no batch statistics)."""
        if self.run_batch is None or self.run_batch == self.paper_batch:
            return None
        paper = (f"the paper's {self.paper_batch}" if self.paper_batch and self.paper_mode == "sync" else
                 f"the paper's per-device {self.paper_batch}" if self.paper_batch else
                 "the paper's per-device batch (not stated)")
        over = (f"micro-batches of {self.micro_batch} samples" if self.mode == "keep" else
                f"{self.processes} synced micro-batches of {self.micro_batch} = {self.run_batch} samples")
        return (f"BatchNorm statistics will be computed over {over} instead of {paper}: normalisation and running "
                "statistics differ from the paper's" + (" (see the BatchNorm options)" if self.options else ""))


def model_layers(model: Any, counted: int | None = None) -> tuple[int | None, str]:
    """(BatchNorm layers of the model as its own architecture has them, how they were found)."""
    if counted is not None:
        return counted, "counted in the built model"
    if model.builtin in BUILTIN_LAYERS:
        aux = AUX_HEAD_LAYERS if getattr(model, "aux_weight", None) is not None else 0
        return BUILTIN_LAYERS[model.builtin] + aux, f"known for the built-in {model.builtin}"
    if model.norm_layers:
        return None, "the recipe's label (model.norm_layers; the model is not counted until it is built)"
    return None, "not known (the model is counted when the probe or the run builds it)"


def batchnorm_in_run(model: Any, counted: int | None = None) -> bool:
    """Whether the run's model normalises by batch statistics: BatchNorm layers (found in the model, else the
    label) kept as BatchNorm or synced, not frozen or replaced by GroupNorm."""
    if getattr(model, "batchnorm", "keep") in ("frozen", "group"):
        return False
    layers, _ = model_layers(model, counted)
    return layers > 0 if layers is not None else "batchnorm" in model.norm_layers


def paper_mode(model: Any) -> BatchnormMode:
    paper: Any = getattr(model, "paper_batchnorm", None)
    mode: BatchnormMode = paper or getattr(model, "batchnorm", "keep")
    return mode


def paper_batch(recipe: Any) -> int | None:
    """The paper's BN batch: its per-device batch, times its devices with SyncBN; None with frozen BN or GroupNorm
    (no batch statistics) or when the recipe does not state the per-device batch."""
    mode, batch = paper_mode(recipe.model), recipe.batch
    if mode in ("frozen", "group") or batch.per_device is None:
        return None
    if mode == "sync":
        return batch.per_device * batch.devices if batch.devices else None
    per_device: int = batch.per_device
    return per_device


def preferred_micro_batch(recipe: Any, world_size: int) -> int | None:
    """The micro-batch per process that gives the paper's BN batch (keep: its per-device batch; sync: that batch over
    the processes), for the exact split to prefer; None when BatchNorm does not depend on it."""
    if not batchnorm_in_run(recipe.model):
        return None
    target = paper_batch(recipe)
    if target is None:
        per_device: int | None = recipe.batch.per_device
        return per_device
    if recipe.model.batchnorm == "sync":
        return target // world_size if target % world_size == 0 else None
    return target


def label_disagreement(model: Any, counted: int | None = None) -> str | None:
    """One line when the recipe's `model.norm_layers` disagrees with the BatchNorm found in the model."""
    layers, found = model_layers(model, counted)
    if layers is None or not model.norm_layers:
        return None
    labelled = "batchnorm" in model.norm_layers
    name = model.builtin or model.factory or getattr(model, "hf", None) or "the model"
    if layers and not labelled:
        return (f"model.norm_layers: the recipe labels {name} {list(model.norm_layers)}, but it has {layers} "
                f"BatchNorm layers ({found}): planned as a BatchNorm model")
    if not layers and labelled:
        return f"model.norm_layers: the recipe lists batchnorm, but {name} has no BatchNorm layer ({found})"
    return None


def plan_batchnorm(recipe: Any, micro_batch: int, micro_batch_max: int, world_size: int,
                   counted: int | None = None) -> BatchNormPlan | None:
    """The BatchNorm part of a plan; None for a model without BatchNorm (by its count, else its label)."""
    model = recipe.model
    layers, found = model_layers(model, counted)
    if (layers == 0) or (layers is None and "batchnorm" not in model.norm_layers):
        return None
    mode, paper = model.batchnorm, paper_mode(model)
    run = {"keep": micro_batch, "sync": micro_batch * world_size}.get(mode)
    if run == 1 and model.builtin in POOLED_BATCHNORM:
        raise MicroBatchError(f"model.batchnorm: {model.batchnorm} with a micro-batch of 1: {model.builtin}'s image "
                              "pooling normalises a 1 x 1 map, and BatchNorm needs 2 samples or more to train it; "
                              "give `micro_batch_max` 2 or more, or `model.batchnorm` group | frozen")
    target = paper_batch(recipe)
    how = {"keep": f"normalise each micro-batch of {run} per device",
           "sync": f"as SyncBatchNorm over {world_size} process(es): BN batch {micro_batch} x {world_size} = {run}",
           "frozen": "as FrozenBatchNorm2d: no batch statistics",
           "group": "as GroupNorm: statistics per sample, no BN batch"}
    count = f"{layers} BatchNorm layers" if layers is not None else "BatchNorm"
    lines = [f"BatchNorm ({mode}): {count} ({found}) {how[mode]}; {_paper_words(recipe, paper, target)}"]
    if mode == "sync" and world_size < 2:
        lines.append("sync on one process normalises over its micro-batch alone, and `reproduce run` refuses it: "
                     "give --world-size N (N CUDA processes) or --batchnorm keep | frozen | group")
    pretrained = getattr(model, "weights", None) or getattr(model, "backbone_weights", None)
    if mode == "frozen" and pretrained is None:  # model.weights, model.backbone_weights: pretrained statistics
        lines.append("frozen: FrozenBatchNorm2d keeps the running statistics and affine parameters it starts with; "
                     "from random weights they are mean 0, variance 1, scale 1, shift 0 (meaningless: freeze a "
                     "pretrained model's)")
    if mode == "group" and paper != "group":
        lines.append(f"deviation from the paper: GroupNorm in place of its BatchNorm ({GROUPNORM_SOURCE})")
    options = (_options(recipe, mode, target, micro_batch, micro_batch_max, world_size)
               if target and run != target else [])
    return BatchNormPlan(mode=mode, paper_mode=paper, layers=layers, found=found, micro_batch=micro_batch,
                         processes=world_size, run_batch=run, paper_batch=target, lines=lines, options=options)


def _paper_words(recipe: Any, mode: str, target: int | None) -> str:
    batch = recipe.batch
    if mode in ("frozen", "group"):
        return f"the paper: {mode} (no batch statistics)"
    if target is None:
        return "the paper's BN batch: not stated (give batch.per_device)"
    if mode == "sync":
        return f"the paper's BN batch: {batch.per_device} per device, synced over {batch.devices} = {target}"
    return f"the paper's BN batch: {target} per device"


def _options(recipe: Any, mode: str, target: int, micro: int, fits: int, world_size: int) -> list[str]:
    """The choices that bring the BN batch to the paper's, each with the micro-batch it needs against what fits."""
    per_rank = recipe.batch.sequences // world_size if recipe.batch.sequences % world_size == 0 else None
    options = []
    keep_fits = "fits" if target <= fits else f"the largest that fits is {fits}"
    keep_exact = per_rank is not None and per_rank % target == 0
    options.append(f"keep with micro-batch {target} per device: the paper's BN batch ({keep_fits}"
                   + ("" if keep_exact else f"; {target} does not split the batch exactly") + ")")
    if mode == "keep" and world_size > 1:  # the run's own processes, synced: a larger BN batch at no memory cost
        synced = micro * world_size
        closer = "the paper's BN batch" if synced == target else f"against the paper's {target}"
        options.append(f"sync over the run's {world_size} CUDA processes (--batchnorm sync): BN batch {micro} x "
                       f"{world_size} = {synced}, {closer}")
    # the fewest processes whose micro-batches, synced, make the paper's BN batch with a micro-batch that fits
    processes = next((k for k in range(2, target + 1) if target % k == 0 and target // k <= fits), None) if (
        target > fits) else None
    if processes is not None:
        options.append(f"sync over {processes} CUDA processes (--world-size {processes} --batchnorm sync): "
                       f"micro-batch {target // processes} x {processes} = {target}, the paper's BN batch")
    if mode != "group":
        options.append(f"group (--batchnorm group): no BN batch, any micro-batch (up to {fits}); {GROUPNORM_SOURCE}; "
                       "a deviation")
    if mode != "frozen":
        options.append("frozen (--batchnorm frozen): no BN batch, any micro-batch; only meaningful from pretrained "
                       "weights (Detectron2's practice when fine-tuning)")
    return options
