"""Token ids against the model's vocabulary: data whose ids the embedding cannot look up is refused before a step.

Without this check a GPT-2 `.bin` given to a 65-character model (or a text file read as token ids) trains until
the embedding raises `IndexError: index out of range in self`. Token data (`data/tokens.py`) puts the largest id of
each file in its info; the model's vocabulary is the row count of its input embedding.
"""

from __future__ import annotations

from torch import nn

from ..errors import UserError

# attribute names of a token embedding, for models that do not say (`get_input_embeddings`)
TOKEN_EMBEDDING_NAMES = ("token", "tokens", "wte", "tok_emb", "tok_embeddings", "token_embedding", "embed_tokens",
                         "word_embeddings", "embedding", "embeddings")


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's token embedding: as a Hugging Face model names it, by a usual name, or its only nn.Embedding."""
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter):
            try:
                found = getter()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(found, nn.Embedding):
                return found
    embeddings = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for name, module in embeddings:
        if name.rsplit(".", 1)[-1] in TOKEN_EMBEDDING_NAMES:
            return module
    return embeddings[0][1] if len(embeddings) == 1 else None


def check_vocabulary(model: nn.Module, info: dict | None) -> None:
    """Refuse token data with ids the model's embedding has no row for, naming the file, the id and the vocabulary."""
    info = info or {}
    if "max_token_id" not in info:
        return
    embedding = input_embedding(model)
    if embedding is None:
        return
    vocab = embedding.num_embeddings
    meta = info.get("meta_vocab_size")
    meta_note = f"; meta.pkl beside it says vocab_size {meta}" if meta else ""
    for field, path, key in (("data.path", info.get("path"), "max_token_id"),
                             ("data.eval_path", info.get("eval_path"), "eval_max_token_id")):
        largest = info.get(key)
        if largest is not None and largest >= vocab:
            raise UserError(
                f"{field}: {path}: token ids up to {largest}, but the model's vocabulary has {vocab} ids "
                f"(0-{vocab - 1}){meta_note}: is this data tokenised for this model (data.dtype {info.get('dtype')})?"
            )
    if meta and meta > vocab:
        raise UserError(f"data.path: {info.get('path')}: meta.pkl beside it says vocab_size {meta}, but the model's "
                        f"vocabulary has {vocab} ids")
