"""The built-in data, trained on two CPU cores in minutes: `digits` (scikit-learn's 1,797 8x8 digits, a fixed
stratified 80/20 split) and `pysource` (the bytes of the standard library's top-level `*.py` files, every tenth
for validation, its SHA-256 fingerprint recorded)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset


def stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's top-level Python files, sorted, up to about `max_bytes` in total."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    train, test = train_test_split(list(range(len(bunch.target))), test_size=test_fraction, random_state=seed,
                                   stratify=bunch.target)
    return bunch, sorted(train), sorted(test)


def digits(test_fraction: float = 0.2, seed: int = 0) -> dict:
    bunch, train, test = digits_split(test_fraction, seed)
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train_idx, test_idx = torch.tensor(train), torch.tensor(test)
    return {
        "train": TensorDataset(images[train_idx], labels[train_idx]),
        "eval": TensorDataset(images[test_idx], labels[test_idx]),
        "info": {"name": "digits", "source": "sklearn.datasets.load_digits", "classes": 10, "channels": 1,
                 "image_size": 8},
    }


class TokenWindows(Dataset):
    """Non-overlapping windows of `sequence_length + 1` bytes: input is the first L, target the last L."""

    in_memory = True  # slices of one tensor: loader workers would only add copying

    def __init__(self, data: torch.Tensor, sequence_length: int):
        self.data, self.length = data, sequence_length
        self.count = (len(data) - 1) // sequence_length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(torch.tensor([index]))
        return inputs[0], targets[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = indices.view(-1, 1) * self.length + torch.arange(self.length + 1).view(1, -1)
        chunks = self.data[offsets].long()
        return chunks[:, :-1], chunks[:, 1:]

    def target_counts(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.full((len(indices),), self.length, dtype=torch.long)

    def with_sequence_length(self, sequence_length: int) -> TokenWindows:
        return TokenWindows(self.data, sequence_length)


def pysource(sequence_length: int = 64, max_bytes: int = 2_000_000, validation_every: int = 10) -> dict:
    files = stdlib_sources(max_bytes)
    if not files:
        raise FileNotFoundError("no Python standard library sources found for the pysource corpus")
    train, valid = bytearray(), bytearray()
    for index, path in enumerate(files):
        (valid if index % validation_every == validation_every - 1 else train).extend(path.read_bytes())
    fingerprint = hashlib.sha256(bytes(train) + b"\0" + bytes(valid)).hexdigest()
    train_t, valid_t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone() for raw in (train, valid))
    counts = torch.bincount(train_t.long(), minlength=256).double()
    probs = counts[counts > 0] / counts.sum()
    unigram = float(-(probs * probs.log()).sum())  # entropy of the byte distribution, in nats
    return {
        "train": TokenWindows(train_t, sequence_length),
        "eval": TokenWindows(valid_t, sequence_length),
        "info": {
            "name": "pysource", "files": len(files), "train_bytes": len(train), "eval_bytes": len(valid),
            "fingerprint": fingerprint, "vocab_size": 256, "unigram_loss": unigram,
        },
    }


DATA = {"digits": digits, "pysource": pysource}
