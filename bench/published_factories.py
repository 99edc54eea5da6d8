"""The models and data of published memory measurements, for bench/published_memory.py (random weights, data made here).

Hugging Face's "Model training anatomy" / "efficient training on one GPU" pages: google-bert/bert-large-uncased with
a sequence-classification head (AutoModelForSequenceClassification: 2 labels), dummy data of 512 sequences of 512
token ids drawn from [100, 30000) with labels 0/1, trained by the Trainer's defaults (fp32, AdamW, clipping at 1.0).
"""

from __future__ import annotations

import torch


def bert_large_classifier(attention: str = "eager") -> torch.nn.Module:
    """bert-large-uncased's architecture (its config.json's figures), a 2-label classifier, as transformers builds it.
    `attention`: "eager" as transformers ran BERT when the page was measured (January 2022: scores, softmax and the
    attention dropout's mask materialised, B x 16 x 512 x 512 each); "sdpa" as transformers 5 runs it."""
    import transformers

    config = transformers.BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2,
                                     num_labels=2)
    config._attn_implementation = attention
    return transformers.BertForSequenceClassification(config)


def dummy_tokens(items: int = 512, length: int = 512, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(100, 30000, (items, length), generator=generator)
    labels = torch.randint(0, 2, (items,), generator=generator)
    return {"train": torch.utils.data.TensorDataset(tokens, labels), "info": {"name": "dummy tokens (HF docs)"}}
