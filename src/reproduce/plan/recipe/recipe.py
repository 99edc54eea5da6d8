"""The recipe as a whole: `Recipe`, its sections, the rules that cross sections (task, data, precision), and reading
a recipe file (YAML reading and error formatting: plan/validation.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from ...errors import UserError
from ..validation import format_validation_errors, read_yaml
from .batch import Batch
from .common import Names, Strict
from .data import DEFAULT_IGNORE_INDEX, Data, HfDatasetsData, InstructionsData, TextData
from .evaluation import PLATEAU_METRICS, REPORTED_METRICS, Evaluation, Reported
from .gates import Gate, Reference, gates_problem
from .model import SEGMENTATION_MODELS, Loss, Model
from .optimizer import Optimizer
from .schedule import Schedule


class Paper(Strict):
    title: str
    authors: Names[str] = []
    year: int | None = Field(default=None, ge=1950, le=2100)
    url: str | None = None
    arxiv: str | None = None
    notes: str | None = None


class Budget(Strict):
    """`budget:`: what the user allows the whole run to cost, checked at `plan` time against the forecast
    (throughput/budget.py) and, during the run, by the cost gate. `budget: {gpu_hours: 40}` (GPUs x hours: 8 GPUs
    for 5 hours is 40), or `money: 500` with the price of one GPU-hour (`price:` here, or `reproduce plan --price`):
    no price is shipped as a fact, the user says what theirs is."""

    gpu_hours: float | None = Field(
        default=None, gt=0, description="the most GPU-hours (GPUs x hours) the whole run may take")
    money: float | None = Field(
        default=None, gt=0, description="the most money the whole run may cost, in `currency`: GPU-hours x the "
        "price of one (`price`, or `plan --price`)")
    price: float | None = Field(
        default=None, gt=0, description="the price of one GPU-hour, in `currency` (the user's own; none is shipped)")
    currency: str | None = Field(default=None, min_length=1, max_length=8, pattern=r"^\S+$",
                                 description="the unit `money` and `price` are in, as printed (USD, EUR, credits)")

    @model_validator(mode="after")
    def _something_bounded(self) -> Budget:
        if self.gpu_hours is None and self.money is None:
            raise ValueError("give gpu_hours or money (or both): the most the whole run may cost")
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
    # targets checked while the run goes, and earlier runs its curve must follow (recipe/gates.py)
    gates: list[Gate] = []
    reference: Reference | None = None
    budget: Budget | None = Field(default=None, description="the most the whole run may cost (GPU-hours, money): "
                                  "`plan` refuses a forecast beyond it")
    deviations: list[str] = Field(
        default=[], description="what this recipe cannot express or does differently from the paper, one sentence "
        "each: `plan` prints them as warnings, `papers show` below the recipe"
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        for index, text in enumerate(self.deviations):
            if not text.strip():
                raise ValueError(f"deviations.{index}: an empty sentence; say what differs from the paper")
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
        schedule = self.schedule
        self.batch.check_token_lengths({"schedule.total": schedule.total, "schedule.warmup": schedule.warmup,
                                        "schedule.decay.until": schedule.decay.until,
                                        "schedule.decay.milestones": schedule.decay.milestones})
        self._check_data_format()
        self._check_segmentation()
        self._check_metrics()
        problem = gates_problem(self.gates, self.task, PLATEAU_METRICS[self.task])
        if problem:
            raise ValueError(problem)
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

    def _check_metrics(self) -> None:
        """A plateau decay watches an evaluation metric: evaluations must happen, and report that metric. A reported
        metric the run evaluates is one the task computes; any other says `evaluated: false`."""
        decay = self.schedule.decay
        if decay.kind == "plateau":
            if self.evaluation.every_steps is None:
                raise ValueError("evaluation.every_steps: required by schedule.decay kind plateau (the LR can only "
                                 "drop at an evaluation)")
            for index, phase in enumerate(self.batch.phases or []):
                if phase.has_schedule:
                    raise ValueError(f"batch.phases.{index}: a phase's own schedule cannot follow schedule.decay kind "
                                     "plateau (whose decreases apply to the whole run)")
            if decay.metric not in PLATEAU_METRICS[self.task]:
                raise ValueError(f"schedule.decay.metric: unknown metric {decay.metric!r} for task {self.task}; "
                                 f"expected one of {', '.join(PLATEAU_METRICS[self.task])}")
        known = REPORTED_METRICS[self.task]
        for index, reported in enumerate(self.reported):
            if reported.evaluated and reported.metric not in known:
                raise ValueError(
                    f"reported.{index}.metric: unknown metric {reported.metric!r} for task {self.task}, which "
                    f"evaluates {', '.join(known)}; a figure the run does not measure (a downstream benchmark) "
                    "says evaluated: false")

    def _check_data_format(self) -> None:
        """What a data format needs from the rest of the recipe (the task; the sizes it cuts or tokenises to)."""
        data = self.data
        problem = packing_problem(self)
        if problem:
            raise ValueError(problem)
        if data.format is None:
            return
        task = {"hf-datasets": "language-modeling" if data.text_columns else "classification",
                "segmentation": "segmentation", "imagefolder": "classification"}.get(data.format, "language-modeling")
        columns = isinstance(data, (InstructionsData, HfDatasetsData)) and data.columns
        if self.task != "custom" and self.task != task:
            raise ValueError(f"data.format: {data.format} data{' with these columns' if columns else ''} is "
                             f"for task {task} (task is {self.task})")
        if data.format == "tokens" and self.batch.sequence_length is None:
            raise ValueError("batch.sequence_length: required with data.format tokens (each sample is that many "
                             "tokens)")
        if not data.available:
            return  # plan only until a path is given (reproduce run --data PATH)
        if data.images and data.image_size is None:
            raise ValueError("data.image_size: required for image data (the side images are cropped or resized "
                             "to; 224 for ImageNet)")
        if isinstance(data, TextData) and data.text_columns:
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
    if data.format in ("imagefolder", "segmentation", "tokens") or data.images:
        what = "token files of one length" if data.format == "tokens" else "image data"
        return (f"data.packing: {way} groups samples by their lengths, which {what} does not have (text "
                "only: format instructions, hf-datasets text, or a factory's token sequences); use packing: none")
    if batch.phases or batch.ramp or batch.unit != "samples" or recipe.task != "language-modeling":
        return (f"data.packing: {way} groups a window of samples of language-modeling text; not with "
                "batch.phases, batch.ramp, batch.unit tokens or another task")
    if recipe.loss is not None and recipe.loss.normalization == "micro-batch-mean":
        return (f"data.packing: {way} with loss.normalization micro-batch-mean: that mean is defined on the paper's "
                f"micro-batches of m samples, which {way} regroups (the update would be neither the Trainer's nor "
                "the exact window's); use data.packing: none, or loss.normalization: window-tokens")
    return None


# the built-in causal language models transformers runs (GPT-2 and LLaMA, models/architectures.py): packed attends
# through the varlen attention build_model registers for them (models/varlen.py)
VARLEN_MODELS = ("gpt2-124m", "gpt3-small", "gpt2-medium", "gpt-char", "llama-7b")


def default_packing(recipe: Recipe) -> str | None:
    """The way a recipe that leaves `data.packing` unset takes, or None.

    Instruction and chat text of a language-modeling run normalised by the window's tokens takes the fastest exact
    way measured (docs/packing.md): `packed` for VARLEN_MODELS (one row per micro-batch through varlen attention),
    `sorted` for any other model. Not with micro-batch-mean: its arithmetic is the paper's micro-batches'."""
    data = recipe.data
    if data.packing is not None or not data.text_columns:
        return None
    if recipe.loss is not None and recipe.loss.normalization != "window-tokens":
        return None
    if packing_problem(recipe, "sorted"):
        return None
    return "packed" if recipe.model.builtin in VARLEN_MODELS else "sorted"


def load_recipe(path: str | Path) -> Recipe:
    data = read_yaml(path)
    if data.get("format", "").startswith("reproduce-plan"):
        raise UserError(f"{path}: this is a plan file, not a recipe; give the recipe it was made from")
    from ..factory import remember_folder  # its factories are looked for beside it first

    remember_folder(path)
    return parse_recipe(data, source=str(path))


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(*format_validation_errors(exc, source, Recipe)) from None
