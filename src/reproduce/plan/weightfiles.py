"""Pretrained weights on disk (`model.weights`), read without torch: what the path is, its parameter count and a
content fingerprint, so that `plan` can describe them and `--resume` can refuse other weights.

A Hugging Face folder (config.json with safetensors, sharded or not, or pytorch_model.bin) or one state dict file.
The fingerprint avoids reading 13 GB: each file's name, size and header (safetensors' JSON header; a torch zip's
directory, with a CRC-32 of every tensor) and 16 blocks of 4 KiB spread over it, with config.json and the index."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any, Literal

from ..errors import UserError
from .split import Frozen
from .units import format_count, format_size

STATE_DICT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# the weight files of a Hugging Face folder, in the order transformers looks for them
FOLDER_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                  "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
SAMPLES, SAMPLE_BYTES = 16, 4096
FOLDER_HINT = "a Hugging Face model folder holds config.json and model.safetensors (or shards): save_pretrained's"


@dataclass(frozen=True)
class WeightsOnDisk:
    """What `model.weights` names: a Hugging Face folder (`config` is its config.json) or one state dict file."""

    path: Path
    files: tuple[Path, ...]  # the weight files (a folder's shards, or the one file)
    config: dict[str, Any] | None = None  # a folder's config.json
    index: Path | None = None  # a sharded folder's index

    @property
    def is_folder(self) -> bool:
        return self.config is not None

    @property
    def has_tokenizer(self) -> bool:
        return self.is_folder and any((self.path / name).is_file() for name in TOKENIZER_FILES)

    @property
    def size(self) -> int:
        return sum(file.stat().st_size for file in self.files)

    @property
    def architecture(self) -> str:
        """The folder's model class as its config names it (LlamaForCausalLM), else its model_type."""
        config = self.config or {}
        names = config.get("architectures") or []
        return names[0] if names else str(config.get("model_type", "model"))


def inspect(path: str, field: str = "model.weights") -> WeightsOnDisk:
    """What `path` holds; a missing path, a folder without config.json or weights, or a file of another kind is one
    line naming `field`."""
    found = Path(path).expanduser()
    if not found.exists():
        raise UserError(f"{field}: {path}: no such file or folder (expected a Hugging Face model folder or a state "
                        f"dict file: {', '.join(STATE_DICT_SUFFIXES)}); weights are read from this machine only")
    if found.is_file():
        if found.suffix not in STATE_DICT_SUFFIXES:
            raise UserError(f"{field}: {path}: expected a state dict file ({', '.join(STATE_DICT_SUFFIXES)}) or a "
                            f"Hugging Face model folder (got a {found.suffix or 'suffix-less'} file)")
        return WeightsOnDisk(found, (found,))
    config_file = found / "config.json"
    if not config_file.is_file():
        raise UserError(f"{field}: {path}: the folder has no config.json ({FOLDER_HINT})")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{field}: {config_file}: not a readable JSON config ({exc})") from None
    for name in FOLDER_WEIGHTS:
        candidate = found / name
        if not candidate.is_file():
            continue
        if not name.endswith(".index.json"):
            return WeightsOnDisk(found, (candidate,), config)
        return WeightsOnDisk(found, _shards(candidate, field), config, candidate)
    raise UserError(f"{field}: {path}: the folder has config.json but no weights ({', '.join(FOLDER_WEIGHTS)}); "
                    f"{FOLDER_HINT}")


def _shards(index: Path, field: str) -> tuple[Path, ...]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{field}: {index}: not a shard index with a weight_map ({type(exc).__name__}: {exc})"
                        ) from None
    names = sorted(set(weight_map.values()))
    missing = [name for name in names if not (index.parent / name).is_file()]
    if missing:
        raise UserError(f"{field}: {index}: names {len(missing)} shard(s) that are not in the folder: "
                        f"{', '.join(missing[:3])}")
    return tuple(index.parent / name for name in names)


def safetensors_header(path: Path) -> dict[str, Any]:
    """A .safetensors file's header: {name: {dtype, shape, data_offsets}} (and __metadata__), read without torch."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise UserError(f"model.weights: {path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise UserError(f"model.weights: {path}: not a safetensors file (header length {length})")
        try:
            header: dict[str, Any] = json.loads(handle.read(length))
            return header
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"model.weights: {path}: not a safetensors file (its header is not JSON)") from None


def parameter_count(weights: WeightsOnDisk) -> int | None:
    """The parameters stored in the safetensors files (tied weights are stored once); None for other formats."""
    if not all(file.suffix == ".safetensors" for file in weights.files):
        return None
    return sum(math.prod(int(dim) for dim in entry["shape"]) for file in weights.files
               for name, entry in safetensors_header(file).items() if name != "__metadata__")


def _file_summary(path: Path) -> bytes:
    """What describes one weight file's content: its header or zip directory, and sampled blocks."""
    parts = [path.name.encode(), str(path.stat().st_size).encode()]
    if path.suffix == ".safetensors":
        parts.append(json.dumps(safetensors_header(path), sort_keys=True).encode())
    elif zipfile.is_zipfile(path):  # torch.save's format: the directory holds each record's CRC-32
        with zipfile.ZipFile(path) as archive:
            parts += [f"{info.filename}:{info.CRC}:{info.file_size}".encode() for info in archive.infolist()]
    size = path.stat().st_size
    with open(path, "rb") as handle:
        for index in range(SAMPLES):
            handle.seek(max(0, (size - SAMPLE_BYTES) * index // (SAMPLES - 1)))
            parts.append(handle.read(SAMPLE_BYTES))
    return b"\0".join(parts)


@lru_cache(maxsize=16)
def _fingerprint(path: str, stamp: tuple[object, ...]) -> str:
    weights = inspect(path)
    digest = hashlib.sha256()
    for extra in ((weights.path / "config.json",) if weights.is_folder else ()) + ((weights.index,) if
                                                                                     weights.index else ()):
        digest.update(extra.read_bytes())
    for file in weights.files:
        digest.update(_file_summary(file))
    return "sha256:" + digest.hexdigest()[:16]


def fingerprint_of(weights: WeightsOnDisk) -> str:
    """A content fingerprint of the weights (sha256 of their headers, sizes and sampled blocks, see the module)."""
    described = (*weights.files, *((weights.path / "config.json",) if weights.is_folder else ()))
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in described)  # (recomputed on a change)
    return _fingerprint(str(weights.path), stamp)


DATA_FILES_AT_MOST = 1000  # a data folder of more files (ImageNet's 1.28M images) is not fingerprinted


def data_fingerprint(paths: list[str | None]) -> str | None:
    """A content fingerprint of data files (data.path, data.eval_path: each file's name, size and sampled blocks, a
    folder's files by their names within it), or None where there is none, or a folder holds too many files."""
    digest, found = hashlib.sha256(), False
    for given in paths:
        if given is None:
            continue
        path = Path(given).expanduser()
        files = sorted(islice((f for f in path.rglob("*") if f.is_file()), DATA_FILES_AT_MOST + 1)) if (
            path.is_dir()) else [path]
        if len(files) > DATA_FILES_AT_MOST or not all(f.is_file() for f in files):
            return None
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
            digest.update(_file_summary(file))
            found = True
    return "sha256:" + digest.hexdigest()[:16] if found else None


class WeightsRecord(Frozen):
    """What a plan (plan.yaml's `weights`) says of the weights it starts from: `--resume` refuses other ones."""

    path: str
    kind: Literal["folder", "state-dict"]
    bytes: int
    fingerprint: str
    architecture: str | None = None  # a folder's model class (LlamaForCausalLM)
    parameters: int | None = None  # counted in the safetensors headers
    differs: list[str] = []  # the folder's config fields unlike the recipe's built-in's: "hidden_size 32 (4096)"
    vocab_size: int | None = None  # model.kwargs' vocab_size where it widens the folder's embeddings (Alpaca's [PAD])

    def line(self, builtin: str | None) -> str:
        """The plan's line about them: "llama-7b's architecture from PATH's config.json (LlamaForCausalLM, 6.74B
        parameters), differing from the built-in in hidden_size 32 (4096), ..."."""
        count = f", {format_count(self.parameters)} parameters" if self.parameters else ""
        if self.kind == "state-dict":
            return (f"weights: {self.path} ({format_size(self.bytes)}{count}) loaded into {builtin or 'the model'}, "
                    f"keys and shapes checked; fingerprint {self.fingerprint}")
        who = f"{builtin}'s architecture" if builtin else "architecture"
        differs = (f", differing from the built-in {builtin} in {', '.join(self.differs)}" if self.differs and builtin
                   else "")
        widened = (f"; model.kwargs vocab_size {self.vocab_size} widens its embeddings, the new rows the mean of the "
                   "others" if self.vocab_size else "")
        return (f"weights: {who} from {self.path}'s config.json ({self.architecture}{count}){differs}{widened}; "
                f"{format_size(self.bytes)}, fingerprint {self.fingerprint}")


def record(path: str, builtin_config: dict[str, Any] | None = None, vocab_size: int | None = None) -> WeightsRecord:
    """The record of the weights at `path`; `builtin_config`: the recipe's built-in configuration, to name what a
    folder's config changes of it; `vocab_size`: the recipe's model.kwargs', which widens a folder's embeddings."""
    weights = inspect(path)
    differs, config = [], weights.config or {}
    if weights.is_folder and builtin_config:
        differs = [f"{key} {config[key]} ({value})" for key, value in builtin_config.items()
                   if key in config and config[key] != value]
    if not weights.is_folder or vocab_size == config.get("vocab_size"):
        vocab_size = None
    return WeightsRecord(path=str(weights.path), kind="folder" if weights.is_folder else "state-dict",
                         bytes=weights.size, fingerprint=fingerprint_of(weights),
                         architecture=weights.architecture if weights.is_folder else None,
                         parameters=parameter_count(weights), differs=differs, vocab_size=vocab_size)
