"""`format: tokens`: a flat binary file of token ids (nanoGPT's train.bin / val.bin), memory-mapped; sample i is the
span of `sequence_length` tokens at i x sequence_length, its targets shifted by one: the samples tile the file."""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .builtin import TokenWindows

DEFAULT_DTYPE = "uint16"  # nanoGPT's choice for GPT-2's 50,257 ids


class TokenFile(TokenWindows):
    """TokenWindows of a memory-mapped token file: slices of the page cache, which a loader worker would only copy
    (over 10x fewer samples/s, bench/README.md)."""

    def __init__(self, path: Path, sequence_length: int, dtype: str = DEFAULT_DTYPE, field: str = "data.path"):
        self.path, self.length, self.dtype = Path(path), sequence_length, np.dtype(dtype)
        if not self.path.exists():
            raise UserError(f"{field}: {self.path}: no such file (expected a binary file of {dtype} token ids)")
        if not self.path.is_file():
            raise UserError(f"{field}: {self.path}: is a folder; expected a binary file of {dtype} token ids "
                            "(such as nanoGPT's train.bin)")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise UserError(f"{field}: {self.path}: {size} bytes is not a whole number of {dtype} tokens "
                            f"({self.dtype.itemsize} bytes each); is data.dtype right?")
        self.tokens = size // self.dtype.itemsize
        self.count = max(0, (self.tokens - 1) // sequence_length)
        if self.count == 0:
            raise UserError(f"{field}: {self.path}: {self.tokens} tokens, fewer than one sample of sequence_length "
                            f"{sequence_length} + 1 (the next token of the last input)")
        self._memmap: np.memmap | None = None

    @property
    def memmap(self) -> np.memmap:
        """Opened on first use in each process (a worker maps the file itself)."""
        if self._memmap is None:
            self._memmap = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))
        return self._memmap

    def with_sequence_length(self, sequence_length: int) -> TokenFile:
        return TokenFile(self.path, sequence_length, self.dtype.name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_memmap": None}

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64) * self.length
        if len(starts) and (starts.min() < 0 or starts.max() >= self.count * self.length):
            raise IndexError(f"sample index out of range for {self.count} samples")
        spans = self.memmap[starts[:, None] + np.arange(self.length + 1)[None, :]]
        chunks = torch.from_numpy(spans.astype(np.int64))
        return chunks[:, :-1], chunks[:, 1:]


MAX_ID_CHUNK = 1 << 26  # token ids read per step of the maximum's pass: 128 MiB of uint16


def max_token_id(path: Path, dtype: str) -> int:
    """The largest token id in the file, cached beside it (`.NAME.max-id.json`, keyed by size and mtime)."""
    stat = path.stat()
    cache = path.with_name(f".{path.name}.max-id.json")
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": dtype}
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(cache.read_text(encoding="utf-8"))
        if isinstance(saved, dict) and saved.get("key") == key and isinstance(saved.get("max_id"), int):
            return saved["max_id"]
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    largest = max((int(tokens[i:i + MAX_ID_CHUNK].max()) for i in range(0, len(tokens), MAX_ID_CHUNK)), default=0)
    del tokens
    with contextlib.suppress(OSError):
        cache.write_text(json.dumps({"key": key, "max_id": largest}) + "\n", encoding="utf-8")
    return largest


class _PlainData(pickle.Unpickler):
    """meta.pkl holds plain data: no class is ever loaded."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl names {module}.{name}; only plain data is read")


def meta_vocab_size(folder: Path) -> int | None:
    """`vocab_size` from nanoGPT's meta.pkl (prepare.py writes it beside train.bin), or None."""
    meta = folder / "meta.pkl"
    try:
        with open(meta, "rb") as handle:
            data = _PlainData(handle).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
        return None
    vocab = data.get("vocab_size") if isinstance(data, dict) else None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def build_tokens(recipe: Any) -> dict:
    spec, length = recipe.data, recipe.batch.sequence_length
    dtype = spec.dtype or DEFAULT_DTYPE
    train_path, eval_path = Path(spec.path), Path(spec.eval_path) if spec.eval_path is not None else None
    if train_path.is_dir():
        if not (train_path / "train.bin").is_file():
            raise UserError(f"data.path: {train_path}: a folder without train.bin; expected a token file or a nanoGPT "
                            "data folder (train.bin, val.bin)")
        if eval_path is None and (train_path / "val.bin").is_file():
            eval_path = train_path / "val.bin"
        train_path = train_path / "train.bin"
    data: dict = {"train": TokenFile(train_path, length, dtype)}
    if eval_path is not None:
        data["eval"] = TokenFile(eval_path, length, dtype, field="data.eval_path")
    data["info"] = {
        "name": spec.name or train_path.parent.name or "tokens", "format": "tokens", "path": str(train_path),
        "eval_path": str(eval_path) if eval_path else None, "dtype": dtype, "tokens": data["train"].tokens,
        "sequences": len(data["train"]),
        "max_token_id": max_token_id(train_path, dtype),  # models.check_vocabulary reads it
        "meta_vocab_size": meta_vocab_size(train_path.parent),
    }
    if eval_path is not None:
        data["info"]["eval_max_token_id"] = max_token_id(eval_path, dtype)
    return data
