"""Text to train on (`format: instructions`, `format: chat`, hf-datasets' text), tokenised once with a local
tokenizer, truncated to `data.max_length`.

Instructions follow Alpaca's `train.py`: template + output + EOS, the prompt's tokens -100, so the loss and its count
are over the response only. A conversation is rendered by the tokenizer's chat template, the loss on the assistant
turns.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UserError
from ..plan.builtin_names import hf_model_folder
from ..plan.recipe import TextData
from ..plan.weightfiles import inspect
from .batches import IGNORE_INDEX

# Stanford Alpaca's PROMPT_DICT (tatsu-lab/stanford_alpaca's train.py @ 761dc5bfbdeeffa89b8bff5d038781a4055f796a, the
# commit papers/taori2023-alpaca-7b.yaml cites), word for word: with a non-empty input, and without.
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
RECORD_FIELDS = ("instruction", "input", "output")
# data.template -> (its prompt with a non-empty input, without one, what goes before the response)
TEMPLATES = {
    "alpaca": (ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT, ""),
    # Alpaca-LoRA's templates/alpaca.json: Stanford's with a newline after "### Response:"
    "alpaca-lora": (ALPACA_PROMPT_INPUT + "\n", ALPACA_PROMPT_NO_INPUT + "\n", ""),
    # microsoft/LoRA's E2E encoding (src/gpt2_encode.py --add_bos --add_eos): the context, then <|endoftext|>; it
    # encodes ' ' + completion
    "e2e": ("{instruction}\n{input}{eos}", "{instruction}{eos}", " "),
}


class TokenisedTexts(Dataset):
    """Examples as flat ids beside a flat mask of the tokens that bear loss (after the prompt, or `masks`)."""

    in_memory = True  # items are slices of memory: loader workers would only add copying

    def __init__(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int] = (),
                 masks: Sequence[Sequence[bool]] | None = None):
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
        self.offsets = torch.zeros(len(sequences) + 1, dtype=torch.long)
        self.offsets[1:] = torch.cumsum(lengths, 0)
        flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int32, count=int(lengths.sum()))
        self.ids = torch.from_numpy(flat)
        if masks is None:
            position = torch.arange(len(self.ids)) - torch.repeat_interleave(self.offsets[:-1], lengths)
            self.mask = position >= torch.repeat_interleave(torch.tensor(list(prompt_lengths), dtype=torch.long),
                                                            lengths)
        else:
            self.mask = torch.tensor([bit for mask in masks for bit in mask], dtype=torch.bool)
        self.lengths = lengths
        # targets are labels[1:]: an example's first token bears none
        borne = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(self.mask, 0)])
        self.counts = (borne[self.offsets[1:]] - borne[(self.offsets[:-1] + 1).clamp(max=len(self.ids))]).clamp(min=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        tokens = self.ids[start:end].long()
        labels = torch.where(self.mask[start:end], tokens, torch.full_like(tokens, IGNORE_INDEX))
        return tokens[:-1], labels[1:]

    def target_counts(self, indices: torch.Tensor) -> torch.Tensor:
        return self.counts[indices]

    def input_lengths(self) -> torch.Tensor:
        return self.lengths - 1

    def longest_item(self) -> int:
        return int(torch.argmax(self.lengths))

    def sequence(self, index: int) -> list[int]:
        return self.ids[int(self.offsets[index]):int(self.offsets[index + 1])].tolist()

    def select(self, indices: Sequence[int]) -> TokenisedTexts:
        masks = [self.mask[int(self.offsets[i]):int(self.offsets[i + 1])].tolist() for i in indices]
        return TokenisedTexts([self.sequence(i) for i in indices], masks=masks)


def hold_out(data: dict, recipe: Any) -> dict:
    """data.eval_size (or eval_fraction) of the examples held out with the recipe's seed, as Alpaca-LoRA does."""
    train, share = data["train"], recipe.data.eval_fraction
    field = "data.eval_size" if share is None else "data.eval_fraction"
    if not hasattr(train, "select"):
        raise UserError(f"{field}: holds out text examples; this data is not text (give eval_path)")
    size = recipe.data.eval_size if share is None else max(1, round(share * len(train)))
    if size >= len(train):
        raise UserError(f"{field}: {size} examples held out of {recipe.data.path}, which has {len(train)}: none would "
                        "be left to train on")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(recipe.seed))
    held, kept = sorted(order[:size].tolist()), sorted(order[size:].tolist())
    data["train"], data["eval"] = train.select(kept), train.select(held)
    data["info"].update({"eval_size": size, "train_examples": len(kept), "eval_examples": size})
    return data


def load_tokenizer(name: str, field: str = "data.tokenizer") -> Any:
    """A tokenizer from a local folder or tokenizer.json, or the local Hugging Face cache: never fetched."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(name).expanduser()
    looks_local = name.startswith(("/", ".", "~")) or path.exists()
    if looks_local and not path.exists():
        raise UserError(f"{field}: {name}: no such tokenizer folder (expected a folder with tokenizer.json, as "
                        "save_pretrained writes it)")
    try:
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        folder = hf_model_folder(name)  # a cached name is read from its snapshot: no request to the hub
        if folder is None:
            raise OSError("not in the local Hugging Face cache")
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        where = "folder" if path.is_dir() else "name (looked up in the local Hugging Face cache only)"
        raise UserError(f"{field}: {name}: cannot load a tokenizer from this {where}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")) from None


def read_records(path: Path, field: str, fields: dict[str, str] | None = None) -> list[dict]:
    """Alpaca records from JSON (a list) or JSONL; `fields`: our name -> the records' (data.columns)."""
    if not path.exists():
        raise UserError(f"{field}: {path}: no such file (expected JSON or JSONL records with instruction, input, "
                        "output)")
    if path.is_dir():
        raise UserError(f"{field}: {path}: is a folder; expected a JSON or JSONL file of records")
    rows = read_json_rows(path)
    if not rows:
        raise UserError(f"{path}: no records (expected JSON or JSONL records with instruction, input, output)")
    for place, record in rows:
        check_record(record, path, place, fields)
    return [record for _, record in rows]


def read_json_rows(path: Path) -> list[tuple[str, Any]]:
    """The values of a JSON list or JSONL file, each with its place ("record 3", "line 7")."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
        return [(f"record {number}", value) for number, value in enumerate(values, start=1)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: line {number}: not valid JSON ({exc.msg}); expected one JSON object a line "
                            "(JSONL)") from None
    return rows


def check_record(record: Any, path: Path | str, place: str, fields: dict[str, str] | None = None) -> None:
    fields = fields or {name: name for name in RECORD_FIELDS}
    if not isinstance(record, dict):
        raise UserError(f"{path}: {place}: expected a JSON object with instruction, input, output (got "
                        f"{type(record).__name__})")
    for name, column in fields.items():
        value = record.get(column)
        if value is None and name == "input":
            continue
        if value is None:
            raise UserError(f"{path}: {place}: missing {column!r} (records need instruction and output; input is "
                            "optional)")
        if not isinstance(value, str):
            raise UserError(f"{path}: {place}: {column!r} must be a string (got {type(value).__name__})")


def tokenise(tokenizer: Any, prompts: list[str], responses: list[str], max_length: int,
             train_on_inputs: bool = False) -> tuple[TokenisedTexts, dict]:
    """Alpaca's preprocessing (`train_on_inputs`: no mask, Alpaca-LoRA's default); examples under 2 tokens left out."""
    eos = tokenizer.eos_token or ""
    full = [prompt + response + eos for prompt, response in zip(prompts, responses, strict=True)]
    ids = tokenizer(full, truncation=True, max_length=max_length)["input_ids"]
    if any(prompts) and not train_on_inputs:
        prompt_lengths = [len(p) for p in tokenizer(prompts, truncation=True, max_length=max_length)["input_ids"]]
    else:
        prompt_lengths = [0] * len(full)
    kept = [i for i, sequence in enumerate(ids) if len(sequence) >= 2]
    dataset = TokenisedTexts([ids[i] for i in kept], [prompt_lengths[i] for i in kept])
    truncated = sum(
        1 for i in kept if len(ids[i]) == max_length
        and len(tokenizer(full[i], truncation=False)["input_ids"]) > max_length
    ) if kept else 0
    stats = {
        "examples": len(kept), "skipped_too_short": len(full) - len(kept), "truncated": truncated,
        "without_response_tokens": int((dataset.counts == 0).sum()), "eos_appended": bool(eos),
        "max_length": max_length, "vocab_size": len(tokenizer), "target_tokens": int(dataset.counts.sum()),
    }
    return dataset, stats


def check_targets(stats: dict, field: str, path: Path | str, train_on_inputs: bool) -> None:
    """A training set with no loss-bearing token is one line (it would train at loss 0 and exit 0)."""
    if stats["examples"] and stats["target_tokens"] == 0:
        why = ("train_on_inputs is false and no example keeps a response token within data.max_length "
               f"({stats['max_length']} tokens): raise data.max_length, or set data.train_on_inputs: true"
               if not train_on_inputs else f"no example has a token to predict within {stats['max_length']} tokens")
        raise UserError(f"{field}: {path}: none of its {stats['examples']} examples has a target token: {why}")


def instruction_texts(records: list[dict], template: str, fields: dict[str, str] | None = None, eos: str = ""
                      ) -> tuple[list[str], list[str]]:
    """(prompts, responses) of the records under `template` (`eos`: the tokenizer's, for e2e)."""
    fields = fields or {name: name for name in RECORD_FIELDS}
    with_input, without_input, prefix = TEMPLATES[template]
    prompts = []
    for record in records:
        given = record.get(fields.get("input", "input")) or ""
        prompt = with_input if given else without_input
        prompts.append(prompt.format(instruction=record[fields["instruction"]], input=given, eos=eos))
    return prompts, [prefix + r[fields["output"]] for r in records]


def tokenizer_name(recipe: Any) -> tuple[str, str]:
    """(the tokenizer, its field): data.tokenizer, else model.weights' folder, else model.hf's."""
    spec, model = recipe.data, recipe.model
    if isinstance(spec, TextData) and spec.tokenizer is not None:
        return spec.tokenizer, "data.tokenizer"
    if model.weights is not None:
        weights = inspect(model.weights)
        if weights.has_tokenizer:
            return str(weights.path), "model.weights (data.tokenizer's default)"
        if model.hf is None:
            raise UserError(f"data.tokenizer: required: {model.weights} holds no tokenizer (tokenizer.json, as "
                            "save_pretrained writes it) to default to; give data.tokenizer: a local tokenizer folder")
    return model.hf, "model.hf (data.tokenizer's default)"


def text_settings(recipe: Any) -> tuple[Any, int, str]:
    """(the tokenizer, the longest sequence, the tokenizer's name)."""
    name, field = tokenizer_name(recipe)
    return load_tokenizer(name, field), recipe.data.max_length or recipe.batch.sequence_length, name


def build_instructions(recipe: Any) -> dict:
    spec = recipe.data
    template = spec.template or "alpaca"
    paths = {"train": Path(spec.path)}
    if spec.eval_path is not None:
        paths["eval"] = Path(spec.eval_path)
    fields = dict(spec.columns) if spec.columns else None
    records = {split: read_records(path, "data.path" if split == "train" else "data.eval_path", fields)
               for split, path in paths.items()}
    tokenizer, max_length, name = text_settings(recipe)
    data: dict = {}
    stats: dict = {}
    for split, rows in records.items():
        texts = instruction_texts(rows, template, fields, tokenizer.eos_token or "")
        data[split], stats[split] = tokenise(tokenizer, *texts, max_length, bool(spec.train_on_inputs))
    if len(data["train"]) == 0:
        raise UserError(f"data.path: {paths['train']}: no example has two or more tokens to train on")
    check_targets(stats["train"], "data.path", paths["train"], bool(spec.train_on_inputs))
    data["info"] = {
        "name": spec.name or paths["train"].stem, "format": "instructions", "path": str(paths["train"]),
        "eval_path": spec.eval_path, "template": template, "tokenizer": name,
        "vocab_size": len(tokenizer), **{f"{split}_{key}": value for split, s in stats.items()
                                         for key, value in s.items() if key not in ("vocab_size",)},
    }
    return data


# ---- format: chat ---------------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def messages_of(record: Any, path: Path, place: str) -> list[dict]:
    if not isinstance(record, dict) or not isinstance(record.get("messages", record.get("conversations")), list):
        raise UserError(f"{path}: {place}: expected an object with a list of messages ({{\"messages\": [{{\"role\": "
                        "\"user\", \"content\": ...}, ...]}, or ShareGPT's \"conversations\" of from / value)")
    sharegpt = "messages" not in record
    turns = []
    for number, turn in enumerate(record["conversations"] if sharegpt else record["messages"], start=1):
        role_key, text_key = ("from", "value") if sharegpt else ("role", "content")
        role = turn.get(role_key) if isinstance(turn, dict) else None
        role = SHAREGPT_ROLES.get(role) if sharegpt else role
        if role not in ROLES:
            known = ", ".join(SHAREGPT_ROLES) if sharegpt else ", ".join(ROLES)
            raise UserError(f"{path}: {place}: message {number}: unknown {role_key} "
                            f"{turn.get(role_key) if isinstance(turn, dict) else turn!r} (expected {known})")
        if not isinstance(turn.get(text_key), str):
            raise UserError(f"{path}: {place}: message {number}: {text_key!r} must be a string")
        turns.append({"role": role, "content": turn[text_key]})
    if not any(turn["role"] == "assistant" for turn in turns):
        raise UserError(f"{path}: {place}: no assistant turn: nothing to train on (the loss covers the assistant's "
                        "messages)")
    return turns


def render(tokenizer: Any, messages: list[dict], max_length: int, train_on_inputs: bool) -> tuple[list, list, bool]:
    def ids(turns: list[dict], prompt: bool = False) -> list[int]:
        return list(tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=prompt,
                                                  return_dict=True)["input_ids"])

    full = ids(messages)
    mask = [train_on_inputs] * len(full)
    if not train_on_inputs:
        for index, turn in enumerate(messages):
            if turn["role"] == "assistant":
                start, end = len(ids(messages[:index], prompt=True)), len(ids(messages[:index + 1]))
                mask[start:end] = [True] * (end - start)
    return full[:max_length], mask[:max_length], len(full) > max_length


def build_chat(recipe: Any) -> dict:
    spec = recipe.data
    paths = {"train": Path(spec.path)}
    if spec.eval_path is not None:
        paths["eval"] = Path(spec.eval_path)
    tokenizer, max_length, name = text_settings(recipe)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"data.tokenizer: {name} has no chat template (chat_template in its tokenizer_config.json), "
                        "which format chat renders conversations with; give a tokenizer that has one, or use format "
                        "instructions")
    data: dict = {}
    info: dict = {"name": spec.name or paths["train"].stem, "format": "chat", "path": str(paths["train"]),
                  "eval_path": spec.eval_path, "tokenizer": name, "vocab_size": len(tokenizer)}
    for split, path in paths.items():
        field = "data.path" if split == "train" else "data.eval_path"
        if not path.is_file():
            raise UserError(f"{field}: {path}: no such file (expected a JSON or JSONL file of {{\"messages\": [...]}} "
                            "records)")
        rows = read_json_rows(path)
        if not rows:
            raise UserError(f"{field}: {path}: no records")
        rendered = [render(tokenizer, messages_of(record, path, place), max_length, bool(spec.train_on_inputs))
                    for place, record in rows]
        kept = [(ids, mask) for ids, mask, _ in rendered if len(ids) >= 2]
        dataset = TokenisedTexts([ids for ids, _ in kept], masks=[mask for _, mask in kept])
        stats = {"examples": len(kept), "skipped_too_short": len(rendered) - len(kept),
                 "truncated": sum(cut for _, _, cut in rendered), "max_length": max_length,
                 "without_response_tokens": int((dataset.counts == 0).sum()),
                 "target_tokens": int(dataset.counts.sum())}
        if split == "train":
            check_targets(stats, field, path, bool(spec.train_on_inputs))
        data[split] = dataset
        info.update({f"{split}_{key}": value for key, value in stats.items()})
    data["info"] = info
    return data
