"""BERT's pre-training data, made as google-research/bert's create_pretraining_data.py makes it (Devlin et al. 2019,
sec. 3.1 and A.1): sentence pairs (B a random document's span half the time: NotNext) with 15% of the tokens masked
statically (80% [MASK], 10% random, 10% kept). Targets: the masked-LM labels, then the next-sentence label.
`pysource-pairs`: the standard library's sources, a line a sentence, byte ids; `text-pairs`: a text file in BERT's
layout with a local tokenizer.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..errors import UserError
from .batches import IGNORE_INDEX
from .builtin import stdlib_sources


@dataclass(frozen=True)
class Vocabulary:
    size: int
    pad: int
    cls: int
    sep: int
    mask: int
    words: int  # ids 0 .. words-1 are the ordinary tokens a random replacement draws from


BYTES = Vocabulary(size=260, pad=256, cls=257, sep=258, mask=259, words=256)
SHORT_SEQ_PROB, MASKED_LM_PROB = 0.1, 0.15  # create_pretraining_data.py's defaults


def _truncate_pair(a: list[int], b: list[int], limit: int, rng: random.Random) -> None:
    while len(a) + len(b) > limit:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(tokens: list[int], vocab: Vocabulary, most: int, rng: random.Random) -> tuple[list[int], list[int]]:
    candidates = [i for i, token in enumerate(tokens) if token not in (vocab.cls, vocab.sep)]
    rng.shuffle(candidates)
    chosen = candidates[: min(most, max(1, int(round(len(tokens) * MASKED_LM_PROB))))]
    output, labels = list(tokens), [IGNORE_INDEX] * len(tokens)
    for index in chosen:
        if rng.random() < 0.8:
            output[index] = vocab.mask
        elif rng.random() < 0.5:
            output[index] = tokens[index]
        else:
            output[index] = rng.randint(0, vocab.words - 1)
        labels[index] = tokens[index]
    return output, labels


def make_instances(documents: list[list[list[int]]], sequence_length: int, vocab: Vocabulary, seed: int,
                   dupe_factor: int) -> list[tuple[list[int], list[int], list[int], int]]:
    """(tokens, token types, masked-LM labels, next-sentence label) of every instance."""
    rng = random.Random(seed)
    most = math.ceil(MASKED_LM_PROB * sequence_length)
    limit = sequence_length - 3
    documents = [doc for doc in documents if doc]
    instances = []
    for _ in range(dupe_factor):
        for doc_index, document in enumerate(documents):
            target = rng.randint(2, limit) if rng.random() < SHORT_SEQ_PROB else limit
            chunk, length, i = [], 0, 0
            while i < len(document):
                chunk.append(document[i])
                length += len(document[i])
                if i == len(document) - 1 or length >= target:
                    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                    a = [t for sentence in chunk[:a_end] for t in sentence]
                    b: list[int] = []
                    random_next = len(chunk) == 1 or rng.random() < 0.5
                    if random_next and len(documents) > 1:
                        other = doc_index
                        for _ in range(10):
                            other = rng.randint(0, len(documents) - 1)
                            if other != doc_index:
                                break
                        picked = documents[other]
                        for sentence in picked[rng.randint(0, len(picked) - 1):]:
                            b.extend(sentence)
                            if len(b) >= target - len(a):
                                break
                        i -= len(chunk) - a_end  # the unused sentences are read again
                    else:
                        random_next = False
                        b = [t for sentence in chunk[a_end:] for t in sentence]
                    _truncate_pair(a, b, limit, rng)
                    if a and b:
                        tokens = [vocab.cls, *a, vocab.sep, *b, vocab.sep]
                        types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
                        masked, labels = _mask(tokens, vocab, most, rng)
                        instances.append((masked, types, labels, int(random_next)))
                    chunk, length = [], 0
                i += 1
    return instances


class SentencePairs(Dataset):
    """BERT pre-training instances at one sequence length, as padded tensors."""

    in_memory = True  # slices of tensors: loader workers would only add copying

    def __init__(self, documents: list[list[list[int]]], sequence_length: int, vocab: Vocabulary = BYTES,
                 seed: int = 12345, dupe_factor: int = 1):
        self.documents, self.length, self.vocab = documents, sequence_length, vocab
        self.seed, self.dupe_factor = seed, dupe_factor
        instances = make_instances(documents, sequence_length, vocab, seed, dupe_factor)
        count = len(instances)
        self.input_ids = torch.full((count, sequence_length), vocab.pad, dtype=torch.long)
        self.token_type_ids = torch.zeros((count, sequence_length), dtype=torch.long)
        self.attention_mask = torch.zeros((count, sequence_length), dtype=torch.long)
        self.labels = torch.full((count, sequence_length + 1), IGNORE_INDEX, dtype=torch.long)
        for row, (tokens, types, labels, next_label) in enumerate(instances):
            n = len(tokens)
            self.input_ids[row, :n] = torch.tensor(tokens)
            self.token_type_ids[row, :n] = torch.tensor(types)
            self.attention_mask[row, :n] = 1
            self.labels[row, :n] = torch.tensor(labels)
            self.labels[row, -1] = next_label

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[dict, torch.Tensor]:
        inputs, targets = self.batch(torch.tensor([index]))
        return {key: value[0] for key, value in inputs.items()}, targets[0]

    def batch(self, indices: torch.Tensor) -> tuple[dict, torch.Tensor]:
        inputs = {"input_ids": self.input_ids[indices], "token_type_ids": self.token_type_ids[indices],
                  "attention_mask": self.attention_mask[indices]}
        return inputs, self.labels[indices]

    def with_sequence_length(self, sequence_length: int) -> SentencePairs:
        return SentencePairs(self.documents, sequence_length, self.vocab, self.seed, self.dupe_factor)


def pysource_pairs(sequence_length: int = 128, max_bytes: int = 1_000_000, dupe_factor: int = 1,
                   seed: int = 12345) -> dict:
    train: list[list[list[int]]] = []  # documents: the stdlib's files, their non-blank lines as sentences
    valid: list[list[list[int]]] = []
    digest = hashlib.sha256()
    for index, path in enumerate(stdlib_sources(max_bytes)):
        raw = path.read_bytes()
        digest.update(raw)
        (valid if index % 10 == 9 else train).append([list(line) for line in raw.splitlines(keepends=True)
                                                      if line.strip()])
    if not train:
        raise FileNotFoundError("no Python standard library sources found for the pysource-pairs corpus")
    data = {"train": SentencePairs(train, sequence_length, BYTES, seed, dupe_factor=dupe_factor)}
    if valid:
        data["eval"] = SentencePairs(valid, sequence_length, BYTES, seed + 1, dupe_factor=dupe_factor)
    data["info"] = {"name": "pysource-pairs", "vocab_size": BYTES.size, "files": len(train) + len(valid),
                    "fingerprint": digest.hexdigest(), "sequences": len(data["train"])}
    return data


def read_documents(path: Path, tokenizer: Any, field: str) -> list[list[list[int]]]:
    """Documents of BERT's input layout, each sentence tokenised without special tokens."""
    if not path.is_file():
        raise UserError(f"{field}: {path}: no such file (expected text: one sentence per line, a blank line between "
                        "documents)")
    documents: list[list[list[int]]] = [[]]
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                if documents[-1]:
                    documents.append([])
                continue
            ids = tokenizer(line, add_special_tokens=False)["input_ids"]
            if ids:
                documents[-1].append(ids)
    documents = [document for document in documents if document]
    if not documents:
        raise UserError(f"{field}: {path}: no sentences (expected one sentence per line)")
    return documents


def text_pairs(path: str, tokenizer: str, sequence_length: int = 128, eval_path: str | None = None,
               dupe_factor: int = 1, seed: int = 12345) -> dict:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("data.builtin: text-pairs needs transformers for its tokenizer (pip install transformers)"
                        ) from None
    try:
        loaded = AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"data.kwargs.tokenizer: cannot load a tokenizer from {tokenizer!r} (a local folder): "
                        f"{type(exc).__name__}") from None
    names = {"cls": "cls_token_id", "sep": "sep_token_id", "mask": "mask_token_id", "pad": "pad_token_id"}
    missing = [f"[{name.upper()}]" for name, attribute in names.items() if getattr(loaded, attribute) is None]
    if missing:
        raise UserError(f"data.kwargs.tokenizer: {tokenizer} has no {', '.join(missing)} token (BERT's pairs need "
                        "[CLS], [SEP], [MASK] and [PAD])")
    vocab = Vocabulary(size=len(loaded), words=len(loaded),
                       **{name: int(getattr(loaded, attribute)) for name, attribute in names.items()})
    train = read_documents(Path(path).expanduser(), loaded, "data.kwargs.path")
    data = {"train": SentencePairs(train, sequence_length, vocab, seed, dupe_factor=dupe_factor)}
    if eval_path is not None:
        valid = read_documents(Path(eval_path).expanduser(), loaded, "data.kwargs.eval_path")
        data["eval"] = SentencePairs(valid, sequence_length, vocab, seed + 1, dupe_factor=dupe_factor)
    data["info"] = {"name": Path(path).name, "vocab_size": vocab.size, "documents": len(train),
                    "sequences": len(data["train"])}
    return data
