"""The recipe's `data:` section: a union on `format`, one class a format with only the fields it reads, and
`NamedData` (no format: built-in or factory data, or a name for plan-only data); `BaseData` holds the common fields."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from .common import Builder, Sides, Strict

DataFormat = Literal["imagefolder", "tokens", "instructions", "chat", "hf-datasets", "segmentation"]
DATA_FORMATS: tuple[DataFormat, ...] = typing.get_args(DataFormat)
SegmentationLayout = Literal["voc", "images-masks", "cityscapes"]
DEFAULT_IGNORE_INDEX = 255  # the mask value that bears no loss (VOC's borders, Cityscapes' void), as in MMSegmentation
TokenDtype = Literal["uint8", "uint16", "int32", "uint32", "int64"]
# hf-datasets: which columns hold what; one of these sets of keys (`input` is optional beside instruction/output)
HF_COLUMN_SETS = ({"text"}, {"instruction", "output"}, {"instruction", "input", "output"}, {"image", "label"},
                  {"input", "label"})
# data.template: how a record's fields become the prompt and the response (data/text.py)
Template = Literal["alpaca", "alpaca-lora", "e2e"]
TEMPLATES: tuple[Template, ...] = typing.get_args(Template)
PromptTemplate = Annotated[Template | None, Field(
    description="alpaca: Stanford Alpaca's prompt; alpaca-lora: Alpaca-LoRA's (a newline after '### Response:'); e2e: "
    "microsoft/LoRA's E2E encoding (context, <|endoftext|>, ' ' + completion)")]  # instructions, hf-datasets
PackingWay = Literal["none", "sorted", "packed"]  # data.packing (data/packing.py)
PACKING_WAYS: tuple[PackingWay, ...] = typing.get_args(PackingWay)
INSTRUCTION_COLUMN_SETS = ({"instruction", "output"}, {"instruction", "input", "output"})


class BaseData(Strict):
    """What any data takes: its name, whether it is on this machine, its sizes, and how a window reads it."""

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
    packing: PackingWay | None = Field(
        default=None, description="how a window's samples group into micro-batches (data/packing.py): none (the "
        "plan's micro-batch of m samples), sorted (by length, micro-batches of at most data.token_budget tokens), "
        "packed (rows of samples with position ids restarting at each); the window's samples are the same with each. "
        "Default for instruction and chat data (default_packing): packed for the built-in GPT-2 and LLaMA, sorted for "
        "other models; else none")
    token_budget: int | None = Field(
        default=None, gt=0, description="sorted / packed: tokens per micro-batch, padding included (default: the "
        "largest the probe measured to fit for sorted, else the micro-batch x the longest example)")
    ignore_index: int | None = Field(
        default=None, ge=0, description="segmentation: the mask value that bears no loss and no metric (default 255)")

    @model_validator(mode="before")
    @classmethod
    def _fields_of_other_formats(cls, value: Any) -> Any:
        """A field another format reads, given to this one: one line saying which formats take it. Left unset
        (null, as a dump of another format holds it), it is dropped."""
        if isinstance(value, dict):
            others = [key for key in value if isinstance(key, str) and key not in cls.model_fields and (
                key in FIELD_FORMATS or key in Builder.model_fields)]
            for key in others:
                if value[key] is not None and key in FIELD_FORMATS:
                    raise ValueError(cls._not_taken(key, value.get("format")))
            value = {key: item for key, item in value.items() if key not in others or item not in (None, {})}
        return value

    @classmethod
    def _not_taken(cls, field: str, format: Any) -> str:
        return f"{field}: only used with format {' or '.join(FIELD_FORMATS[field])} (format is {format})"

    @property
    def text_columns(self) -> bool:
        """Whether the data is text to tokenise (instructions, chat, or hf-datasets text/instruction columns)."""
        return False

    @property
    def images(self) -> bool:
        """Whether samples are images cropped or resized to data.image_size (imagefolder, an hf-datasets image
        column)."""
        return False

    @property
    def files(self) -> list[str | None]:
        """The training and evaluation paths of data in a format; none for built-in or factory data."""
        return []

    @property
    def made_by(self) -> str | None:
        """The built-in's name or the factory that makes the data; None for data in a format."""
        return None


class NamedData(BaseData, Builder):
    """No format: a built-in (`builtin: digits`), a factory, or a name alone for plan-only data (available: false)."""

    format: None = None

    @classmethod
    def _not_taken(cls, field: str, format: Any) -> str:
        return f"{field}: only used with format: {' | '.join(DATA_FORMATS)}"

    @model_validator(mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        """A format this union does not know comes here (`_data_kind`): name the ones it knows."""
        if isinstance(value, dict) and value.get("format") is not None:
            shown = ", ".join(repr(name) for name in DATA_FORMATS[:-1]) + f" or {DATA_FORMATS[-1]!r}"
            raise ValueError(f"format: expected one of {shown} (got {value['format']!r})")
        return value

    @model_validator(mode="after")
    def _has_source(self) -> NamedData:
        if self.builtin is None and self.factory is None and self.name is None:
            raise ValueError("give builtin: NAME, factory: 'package.module:function', format: with path:, or name: "
                             "for plan-only data")
        if self.available and self.builtin is None and self.factory is None:
            raise ValueError(f"available: data {self.name!r} has no builtin or factory; set available: false")
        return self

    @property
    def made_by(self) -> str | None:
        return self.builtin or self.factory


class FileData(BaseData):
    """Data on disk in a standard layout (`reproduce run --data PATH` / `--eval-data PATH` replace the paths)."""

    format: DataFormat
    path: str | None = Field(default=None, description="the training data: a folder or a file")
    eval_path: str | None = Field(default=None, description="the evaluation data, in the same format")

    @model_validator(mode="before")
    @classmethod
    def _no_builder(cls, value: Any) -> Any:
        if isinstance(value, dict) and (value.get("builtin") is not None or value.get("factory") is not None):
            raise ValueError("format: give format (with path) or builtin/factory, not both")
        if isinstance(value, dict) and value.get("kwargs"):
            raise ValueError(f"kwargs: only used with builtin or factory data (format is {value.get('format')})")
        return value

    @model_validator(mode="after")
    def _has_path(self) -> FileData:
        for name in ("path", "eval_path"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}: give a file or folder (got {value!r})")
        if self.available and self.path is None:
            raise ValueError(f"path: required for {self.format} data (a folder or file), or set available: "
                             "false and give it on the command line: reproduce run `data_path` PATH")
        return self

    @property
    def files(self) -> list[str | None]:
        return [self.path, self.eval_path]


class ImageFolderData(FileData):
    """torchvision's ImageFolder: one sub-folder of images a class."""

    format: Literal["imagefolder"]
    augment: Literal["imagenet", "none"] | None = None

    @property
    def images(self) -> bool:
        return True


class TokensData(FileData):
    """A binary file of token ids (nanoGPT's train.bin / val.bin), cut into samples of batch.sequence_length."""

    format: Literal["tokens"]
    dtype: TokenDtype | None = None


class TextData(FileData):
    """Text to tokenise (instructions, chat, hf-datasets text columns): its tokenizer and held-out examples."""

    train_on_inputs: bool | None = Field(
        default=None, description="the loss covers the prompt's tokens too (Alpaca-LoRA's train_on_inputs, its "
        "default); default false: only the response's",
    )
    tokenizer: str | None = Field(default=None, description="a local tokenizer folder (tokenizer.json)")
    eval_size: int | None = Field(default=None, gt=0, description="text: examples held out of data.path for "
                                  "evaluation, drawn with the seed (Alpaca-LoRA's val_set_size: 2000)")
    eval_fraction: float | None = Field(default=None, gt=0, lt=1, description="text: the share of data.path's "
                                        "examples held out for evaluation (rounded, at least one), drawn with the seed")

    @model_validator(mode="after")
    def _held_out(self) -> TextData:
        if self.tokenizer is not None and not self.tokenizer.strip():
            raise ValueError(f"tokenizer: give a file or folder (got {self.tokenizer!r})")
        held = [name for name in ("eval_size", "eval_fraction") if getattr(self, name) is not None]
        if len(held) > 1:
            raise ValueError("eval_fraction: give eval_size (examples) or eval_fraction (a share), not both")
        if held and self.eval_path is not None:
            raise ValueError(f"{held[0]}: holds examples out of data.path; not with eval_path (give one or the other)")
        return self

    @property
    def text_columns(self) -> bool:
        return True


class InstructionsData(TextData):
    """JSON / JSONL records of instruction, input and output (Alpaca's), rendered by a template."""

    format: Literal["instructions"]
    template: PromptTemplate = None
    columns: dict[str, str] | None = None

    @model_validator(mode="after")
    def _columns(self) -> InstructionsData:
        if self.columns is not None and set(self.columns) not in INSTRUCTION_COLUMN_SETS:
            raise ValueError(f"columns: the record fields that hold instruction and output (and input), e.g. "
                             f"{{instruction: context, output: completion}} (got {sorted(self.columns)})")
        return self


class ChatData(TextData):
    """JSONL conversations, rendered by the tokenizer's chat template."""

    format: Literal["chat"]


class HfDatasetsData(TextData):
    """A Hugging Face dataset on disk (save_to_disk folder, parquet or JSONL), its columns named in `columns`."""

    format: Literal["hf-datasets"]
    augment: Literal["imagenet", "none"] | None = None
    template: PromptTemplate = None
    columns: dict[str, str] | None = None

    @model_validator(mode="after")
    def _columns(self) -> HfDatasetsData:
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
        return self

    @property
    def text_columns(self) -> bool:
        return self.columns is not None and "label" not in self.columns

    @property
    def images(self) -> bool:
        return self.columns is not None and "image" in self.columns


class SegmentationData(FileData):
    """Format segmentation (docs/segmentation.md): images with a mask of class ids each, cut and flipped together."""

    format: Literal["segmentation"]
    layout: SegmentationLayout | None = Field(
        default=None, description="segmentation: voc (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/), "
        "images-masks (images/ and masks/ of the same names, or their train/ and val/ sub-folders) or cityscapes "
        "(leftImg8bit/ and gtFine/ *_labelTrainIds.png); default: found from the folder")
    crop: Sides = Field(
        default=None, description="segmentation: the training crop, [height, width] or one side (513, [512, 1024])")
    scale: tuple[float, float] | None = Field(
        default=None, description="segmentation: the random rescale range before the crop, [low, high] (the papers' "
        "[0.5, 2.0]); default: no rescale")
    flip: bool | None = Field(default=None, description="segmentation: random horizontal flip (default true)")
    pad: bool | None = Field(
        default=None, description="segmentation: pad an image smaller than the crop (image 0 after normalisation, mask "
        "ignore_index), as DeepLabV3 and MMSegmentation do; default false: such an image is an error")
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

    @model_validator(mode="after")
    def _segmentation_fields(self) -> SegmentationData:
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
        if self.crop is None:
            raise ValueError("crop: required for segmentation data: the training crop every sample is cut to "
                             "(513 for DeepLabV3 on VOC, [512, 1024] for MMSegmentation on Cityscapes)")
        return self

    @property
    def flips(self) -> bool:
        return self.flip is not False

    @property
    def pads(self) -> bool:
        return bool(self.pad)


FORMATS: dict[str, type[FileData]] = {
    "imagefolder": ImageFolderData, "tokens": TokensData, "instructions": InstructionsData, "chat": ChatData,
    "hf-datasets": HfDatasetsData, "segmentation": SegmentationData,
}
# the fields only some kinds of data read: field -> the formats that read it (NamedData's builtin, factory, kwargs
# are refused by FileData._no_builder)
FIELD_FORMATS: dict[str, tuple[str, ...]] = {
    field: tuple(name for name, kind in FORMATS.items() if field in kind.model_fields)
    for kind in FORMATS.values() for field in kind.model_fields
    if field not in BaseData.model_fields and field != "format"
}


def _data_kind(value: Any) -> str:
    """The union's member for a `data:` mapping (or a Data): its format's, or NamedData's when unset or unknown."""
    given = value.get("format") if isinstance(value, dict) else getattr(value, "format", None)
    return f"format[{given}]" if given in FORMATS else "format[none]"


# pydantic picks the member by `_data_kind`; the tags' brackets keep them out of error paths (validation.py)
Data = Annotated[
    Annotated[ImageFolderData, Tag("format[imagefolder]")] | Annotated[TokensData, Tag("format[tokens]")]
    | Annotated[InstructionsData, Tag("format[instructions]")] | Annotated[ChatData, Tag("format[chat]")]
    | Annotated[HfDatasetsData, Tag("format[hf-datasets]")] | Annotated[SegmentationData, Tag("format[segmentation]")]
    | Annotated[NamedData, Tag("format[none]")],
    Discriminator(_data_kind),
]
