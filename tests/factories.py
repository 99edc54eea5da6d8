"""Factories used by tests through recipes' `factory: "factories:NAME"` (tests/ is on sys.path under pytest)."""

from __future__ import annotations

import torch


def variable_lm(items: int = 48, vocab: int = 32, min_length: int = 3, max_length: int = 16, seed: int = 0) -> dict:
    """Sequences of different lengths from a fixed generator; targets are the next token, -100 on the last."""
    generator = torch.Generator().manual_seed(seed)
    train = []
    for _ in range(items):
        length = int(torch.randint(min_length, max_length + 1, (1,), generator=generator))
        tokens = torch.randint(0, vocab, (length + 1,), generator=generator)
        target = tokens[1:].clone()
        target[-1] = -100 if length % 3 == 0 else target[-1]  # some rows carry an ignored position too
        train.append((tokens[:-1], target))
    return {"train": train, "info": {"name": "variable-lm", "vocab_size": vocab}}


def tiny_gpt(vocab: int = 32, block_size: int = 16) -> torch.nn.Module:
    from reproduce.models.small import GPT

    return GPT(vocab_size=vocab, block_size=block_size, layers=1, heads=2, dim=16, dropout=0.0)


def not_a_module() -> str:
    return "this is not a model"


class SlowDigits(torch.utils.data.Dataset):
    """The digits, each item taking `delay` seconds to fetch (a loader that cannot keep up)."""

    def __init__(self, delay: float):
        from reproduce.data.builtin import digits

        self.data, self.delay = digits()["train"], delay

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        import time

        time.sleep(self.delay)
        return self.data[index]


def slow_digits(delay: float = 0.002) -> dict:
    return {"train": SlowDigits(delay), "info": {"name": "slow-digits", "classes": 10}}


# The papers' architectures through `factory:` (random initialisation from a config, never downloaded), until the
# built-ins of the same names exist. Their sizes are arguments so tests can build small ones of the same code.


def hf_gpt2(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, n_positions: int = 1024, vocab_size: int = 50257,
            dropout: float = 0.0, activation: str = "gelu_new") -> torch.nn.Module:
    """transformers' GPT-2 (124M with the defaults), logits only."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from reproduce.models.hf import HFLogits

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                        vocab_size=vocab_size, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        activation_function=activation)
    return HFLogits(GPT2LMHeadModel(config), "causal-lm")


def hf_llama(layers: int = 32, hidden: int = 4096, intermediate: int = 11008, heads: int = 32,
             vocab_size: int = 32000, max_positions: int = 2048) -> torch.nn.Module:
    """transformers' LLaMA (7B with the defaults), logits only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from reproduce.models.hf import HFLogits

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab_size,
                         max_position_embeddings=max_positions)
    return HFLogits(LlamaForCausalLM(config), "causal-lm")


def torchvision_resnet50(classes: int = 1000) -> torch.nn.Module:
    from torchvision.models import resnet50

    return resnet50(weights=None, num_classes=classes)


def numbered_documents(documents: int = 6, sentences: int = 9) -> list[list[list[int]]]:
    """Documents whose sentences are runs of consecutive ids, unique across the corpus: any token says where it
    comes from (document d's sentence s holds 10 * (10 * d + s) + 0..k); sentences of 2 to 5 tokens."""
    return [[[10 * (10 * d + s) + k for k in range(2 + (s + d) % 4)] for s in range(sentences)]
            for d in range(documents)]


NUMBERED_VOCAB = {"size": 2100, "pad": 2000, "cls": 2001, "sep": 2002, "mask": 2003, "words": 2000}


def bert_pairs(sequence_length: int = 32, documents: int = 20, dupe_factor: int = 4) -> dict:
    """BERT sentence pairs of many lengths (short documents of short sentences), for the window-count tests."""
    from reproduce.data.pairs import SentencePairs, Vocabulary

    vocab = Vocabulary(**NUMBERED_VOCAB)
    train = SentencePairs(numbered_documents(documents), sequence_length, vocab, dupe_factor=dupe_factor)
    return {"train": train, "info": {"name": "numbered-pairs", "vocab_size": vocab.size}}


def transformers_gpt2(n_layer: int = 1, n_embd: int = 16, vocab_size: int = 512) -> torch.nn.Module:
    """transformers' GPT-2 itself, as a user's factory returns it: its forward returns a ModelOutput."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, n_positions=256,
                                      vocab_size=vocab_size))


def gpt2_from_pretrained(folder: str) -> torch.nn.Module:
    """A factory that loads weights itself (from_pretrained): it cannot be built on the meta device."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)


class OutputOfGpt2(torch.nn.Module):
    """A module that wraps transformers' GPT-2 and returns its ModelOutput, not the logits."""

    def __init__(self):
        super().__init__()
        self.inner = transformers_gpt2()

    def forward(self, ids):
        return self.inner(input_ids=ids)


def gpt2_output_wrapper() -> torch.nn.Module:
    return OutputOfGpt2()


def train_only_digits() -> dict:
    """The digits training set alone: no evaluation set and no info, the least a data factory may return."""
    from reproduce.data.builtin import digits

    return {"train": digits()["train"]}
