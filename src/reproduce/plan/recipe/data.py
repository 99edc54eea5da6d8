"""The recipe's `data:` section: the built-in data by name, a factory, or data on disk in one of the formats."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import Field, model_validator

from .common import Builder

DataFormat = Literal["imagefolder", "tokens", "instructions", "chat", "hf-datasets", "segmentation"]
DATA_FORMATS: tuple[DataFormat, ...] = typing.get_args(DataFormat)
SegmentationLayout = Literal["voc", "images-masks", "cityscapes"]
SEGMENTATION_LAYOUTS: tuple[SegmentationLayout, ...] = typing.get_args(SegmentationLayout)
DEFAULT_IGNORE_INDEX = 255  # the mask value that bears no loss (VOC's borders, Cityscapes' void), as in MMSegmentation
TokenDtype = Literal["uint8", "uint16", "int32", "uint32", "int64"]
TOKEN_DTYPES: tuple[TokenDtype, ...] = typing.get_args(TokenDtype)
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
Template = Literal["alpaca", "alpaca-lora", "e2e"]
TEMPLATES: tuple[Template, ...] = typing.get_args(Template)
PackingWay = Literal["none", "sorted", "packed"]  # data.packing (data/packing.py)
PACKING_WAYS: tuple[PackingWay, ...] = typing.get_args(PackingWay)
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
    format: DataFormat | None = None
    path: str | None = Field(default=None, description="the training data: a folder or a file")
    eval_path: str | None = Field(default=None, description="the evaluation data, in the same format")
    eval_size: int | None = Field(default=None, gt=0, description="text: examples held out of data.path for "
                                  "evaluation, drawn with the seed (Alpaca-LoRA's val_set_size: 2000)")
    eval_fraction: float | None = Field(default=None, gt=0, lt=1, description="text: the share of data.path's "
                                        "examples held out for evaluation (rounded, at least one), drawn with the seed")
    augment: Literal["imagenet", "none"] | None = None
    dtype: TokenDtype | None = None
    template: Template | None = Field(
        default=None, description="alpaca: Stanford Alpaca's prompt; alpaca-lora: Alpaca-LoRA's (a newline after "
        "'### Response:'); e2e: microsoft/LoRA's E2E encoding (context, <|endoftext|>, ' ' + completion)",
    )
    train_on_inputs: bool | None = Field(
        default=None, description="the loss covers the prompt's tokens too (Alpaca-LoRA's train_on_inputs, its "
        "default); default false: only the response's",
    )
    tokenizer: str | None = Field(default=None, description="a local tokenizer folder (tokenizer.json)")
    packing: PackingWay | None = Field(
        default=None, description="how a window's samples group into micro-batches (data/packing.py): none (the "
        "plan's micro-batch of m samples), sorted (by length, micro-batches of at most data.token_budget tokens), "
        "packed (rows of samples with position ids restarting at each); the window's samples are the same with each. "
        "Default: sorted for instruction and chat data (default_packing), else none")
    token_budget: int | None = Field(
        default=None, gt=0, description="sorted / packed: tokens per micro-batch, padding included (default: the "
        "largest the probe measured to fit for sorted, else the micro-batch x the longest example)")
    columns: dict[str, str] | None = None
    # format segmentation (docs/segmentation.md): images with a mask of class ids each, cut and flipped together
    layout: SegmentationLayout | None = Field(
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
