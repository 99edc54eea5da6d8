"""Conversations to train on: `data.format: chat`, a JSON (a list) or JSONL file of records

    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

(OpenAI's fine-tuning layout), or ShareGPT's `{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}`
(its names read as user / assistant / system). Each conversation is rendered by the tokenizer's own chat template
(`apply_chat_template`, as transformers formats it for the model) and truncated to `data.max_length`. The loss covers
the assistant turns' tokens only (each from the end of the prompt the template gives before it, with
`add_generation_prompt`, to the end of the turn: the template's end-of-turn token included), or every token with
`train_on_inputs`. A record without an assistant turn, an unknown role, or a tokenizer without a chat template is
one line naming the file and the record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .text import TokenisedTexts, check_targets, read_json_rows, text_settings, tokenizer_name

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class MaskedTexts(TokenisedTexts):
    """Examples whose loss-bearing tokens are any subset (the assistant turns), held as one flat mask beside the ids."""

    def __init__(self, sequences: list[list[int]], masks: list[list[bool]]):
        super().__init__(sequences, [0] * len(sequences))
        self.mask = torch.tensor([bit for mask in masks for bit in mask], dtype=torch.bool)
        self.counts = torch.tensor([sum(mask[1:]) for mask in masks], dtype=torch.long)  # targets are labels[1:]

    def select(self, indices: list[int]) -> MaskedTexts:
        masks = [self.mask[int(self.offsets[i]):int(self.offsets[i + 1])].tolist() for i in indices]
        return MaskedTexts([self.sequence(i) for i in indices], masks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        tokens = self.ids[start:end].long()
        labels = torch.where(self.mask[start:end], tokens, torch.full_like(tokens, -100))
        return tokens[:-1], labels[1:]


def messages_of(record: Any, path: Path, place: str) -> list[dict]:
    """The record's turns as [{"role", "content"}], ShareGPT's `conversations` read as such; a record without an
    assistant turn, with an unknown role or without text is one line."""
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
    """(token ids, loss mask, truncated) of one conversation under the tokenizer's chat template."""
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
    tokenizer, max_length = text_settings(recipe)
    name = tokenizer_name(recipe)[0]
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
        dataset = MaskedTexts([ids for ids, _ in kept], [mask for _, mask in kept])
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
