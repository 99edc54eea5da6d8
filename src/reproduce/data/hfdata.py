"""`format: hf-datasets`: a `save_to_disk` folder, or local parquet / JSONL files (never `load_dataset`, which could
reach the Hub), read by `data.columns`: `text`, `instruction` / `input` / `output`, `image` and `label`, or `input`
(numeric vectors) and `label`. A DatasetDict gives `train`, and `validation` (or `test`) without `data.eval_path`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..errors import UserError
from .text import check_record, check_targets, instruction_texts, read_json_rows, text_settings, tokenise

EVAL_SPLITS = ("validation", "valid", "val", "test")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("data.format: hf-datasets needs the datasets package "
                        "(pip install 'reproduce-large-batch[datasets]')") from None
    return datasets


def open_dataset(path: Path, field: str, names: list[str]) -> tuple[Any, Any]:
    """(a `datasets.Dataset` from a save_to_disk folder, parquet or JSONL; the DatasetDict it is the first of `names`
    of, or None)."""
    datasets = _datasets()
    if not path.exists():
        raise UserError(f"{field}: {path}: no such file or folder (expected a save_to_disk folder, parquet or JSONL)")
    saved = path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())
    if saved:
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # a damaged or foreign folder: whatever datasets raises is the input's problem
            raise UserError(f"{field}: {path}: cannot open as a save_to_disk dataset: {type(exc).__name__}: {exc}"
                            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            found = next((name for name in names if name in loaded), None)
            if found is None:
                raise UserError(f"{field}: {path}: no {' or '.join(names)} split (splits: {', '.join(loaded)})")
            return loaded[found], loaded
        return loaded, None
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    parquet = [f for f in files if f.suffix == ".parquet"]
    jsonl = [f for f in files if f.suffix in (".jsonl", ".json")]
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.concat_tables([pq.read_table(f) for f in parquet])
        except (pa.ArrowInvalid, OSError) as exc:
            raise UserError(f"{field}: {path}: cannot read as parquet: {exc}") from None
        return datasets.Dataset(table), None
    if jsonl:
        records = []
        for f in jsonl:
            for place, row in read_json_rows(f):
                if not isinstance(row, dict):
                    raise UserError(f"{f}: {place}: expected a JSON object (one row, its columns as keys), got "
                                    f"{type(row).__name__}")
                records.append(row)
        if not records:
            raise UserError(f"{field}: {path}: no rows")
        return datasets.Dataset.from_list(records), None
    raise UserError(f"{field}: {path}: expected a save_to_disk folder (dataset_dict.json or state.json), .parquet "
                    "or .jsonl files")


class ImageRows(Dataset):
    """Rows of (image, label), decoded and transformed when fetched."""

    def __init__(self, table: Any, image: str, labels: torch.Tensor, transform: Any, mode: str):
        self.table, self.image, self.labels, self.transform, self.mode = table, image, labels, transform, mode

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        picture = self.table[index][self.image]
        try:
            picture = picture.convert(self.mode)
        except (OSError, ValueError) as exc:
            raise UserError(f"row {index}: cannot read the image: {exc}") from None
        return self.transform(picture), self.labels[index]


def _labels(table: Any, column: str, path: Path, classes: int | None) -> tuple[torch.Tensor, int]:
    values = list(table[column])
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise UserError(f"data.columns: {path}: column {column!r} must hold integer class labels")
    labels = torch.tensor(values, dtype=torch.long)
    count = classes or getattr(table.features.get(column), "num_classes", None) or int(labels.max()) + 1
    if int(labels.min()) < 0 or int(labels.max()) >= count:
        raise UserError(f"data.columns: {path}: labels in {column!r} run from {int(labels.min())} to "
                        f"{int(labels.max())}, outside 0..{count - 1} (data.classes {count})")
    return labels, count


def _split(recipe: Any, table: Any, path: Path, train: bool, tokenizer: Any = None, max_length: int | None = None,
           classes: int | None = None) -> tuple[Any, dict]:
    spec, columns = recipe.data, recipe.data.columns
    if "text" in columns:
        texts = list(table[columns["text"]])
        if not all(isinstance(t, str) for t in texts):
            raise UserError(f"data.columns: {path}: column {columns['text']!r} must hold text (strings)")
        return tokenise(tokenizer, [""] * len(texts), texts, max_length)
    if "instruction" in columns:
        fields = {name: columns[name] for name in ("instruction", "input", "output") if name in columns}
        values = [list(table[column]) for column in fields.values()]
        records = [dict(zip(fields.values(), row, strict=True)) for row in zip(*values, strict=True)]
        for number, record in enumerate(records, start=1):
            check_record(record, path, f"row {number}", fields)
        texts = instruction_texts(records, spec.template or "alpaca", fields, tokenizer.eos_token or "")
        return tokenise(tokenizer, *texts, max_length, bool(spec.train_on_inputs))
    labels, count = _labels(table, columns["label"], path, classes or spec.classes)
    if "image" in columns:
        from .images import transforms_for  # torchvision only for image data

        datasets = _datasets()
        image = columns["image"]
        if not isinstance(table.features[image], datasets.Image):
            table = table.cast_column(image, datasets.Image())  # bytes or paths: decoded when fetched
        channels = spec.channels or 3
        transform = transforms_for(spec.augment or "imagenet", spec.image_size, channels, train)
        rows = ImageRows(table.select_columns([image]), image, labels, transform, "L" if channels == 1 else "RGB")
        return rows, {"examples": len(rows), "classes": count}
    values = list(table[columns["input"]])
    try:
        inputs = torch.tensor(np.asarray(values, dtype=np.float32))
    except (ValueError, TypeError):
        raise UserError(f"data.columns: {path}: column {columns['input']!r} must hold numbers or equal-length lists "
                        "of numbers") from None
    return TensorDataset(inputs, labels), {"examples": len(labels), "classes": count}


def build_hf_datasets(recipe: Any) -> dict:
    spec = recipe.data
    train_path = Path(spec.path)
    train, saved = open_dataset(train_path, "data.path", ["train"])
    tables = {"train": train}
    eval_path = Path(spec.eval_path) if spec.eval_path is not None else None
    if eval_path is not None:
        tables["eval"] = open_dataset(eval_path, "data.eval_path", [*EVAL_SPLITS, "train"])[0]
    elif saved is not None:  # a DatasetDict's own evaluation split
        found = next((name for name in EVAL_SPLITS if name in saved), None)
        if found is not None:
            tables["eval"], eval_path = saved[found], train_path / found
    paths = {"train": train_path, "eval": eval_path}
    for split, table in tables.items():  # the data's own problems first, before loading a tokenizer
        for column in spec.columns.values():  # (every column `_split` reads)
            if column not in table.column_names:
                raise UserError(f"data.columns: {paths[split]}: no column {column!r} (columns: "
                                f"{', '.join(table.column_names)})")
    tokenizer = max_length = None
    if spec.text_columns:
        tokenizer, max_length, _ = text_settings(recipe)
    data: dict = {}
    stats: dict = {}
    classes = None
    for split, table in tables.items():
        if len(table) == 0:
            raise UserError(f"{'data.path' if split == 'train' else 'data.eval_path'}: {paths[split]}: the dataset "
                            "has no rows")
        data[split], stats[split] = _split(recipe, table, paths[split], split == "train", tokenizer, max_length,
                                           classes)
        classes = stats[split].get("classes", classes)
    if "target_tokens" in stats["train"]:  # tokenised text
        check_targets(stats["train"], "data.path", train_path, bool(spec.train_on_inputs) or "text" in spec.columns)
    info = {"name": spec.name or train_path.stem, "format": "hf-datasets", "path": str(train_path),
            "eval_path": str(eval_path) if eval_path else None, "columns": dict(spec.columns),
            **{f"{split}_{key}": value for split, s in stats.items() for key, value in s.items()
               if key not in ("vocab_size", "classes")}}
    if tokenizer is not None:
        info["vocab_size"] = len(tokenizer)
    if classes is not None:
        info["classes"] = classes
    data["info"] = info
    return data
