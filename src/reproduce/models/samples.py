"""Pretrained-model folders to try `--weights` on, made on this machine (random weights: nothing is downloaded).

    python -m reproduce.models.samples DIR [--max-bytes N] [--limit N]

writes DIR/tiny-llama and DIR/tiny-gpt2 (`save_pretrained` folders, with a BPE tokenizer trained on the standard
library's sources), DIR/alpaca.json and DIR/guanaco.jsonl (records from its docstrings) for docs/own-weights.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..data.samples import MAX_BYTES, docstring_records, train_tokenizer

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
GPT2 = {"n_positions": 512, "n_embd": 32, "n_layer": 2, "n_head": 2}


def _save(kind: str, defaults: dict, folder: Path, tokenizer: Path, seed: int, config: dict, **kwargs) -> dict:
    """transformers' `kind` model (seeded random weights) saved with save_pretrained, `tokenizer` beside it."""
    import torch
    import transformers
    from transformers.utils import logging

    from ..data.text import load_tokenizer

    loaded = load_tokenizer(str(tokenizer))
    torch.manual_seed(seed)
    settings = {**defaults, "vocab_size": len(loaded), "eos_token_id": loaded.eos_token_id,
                "bos_token_id": loaded.eos_token_id, **config}
    model = getattr(transformers, f"{kind}ForCausalLM" if kind == "Llama" else "GPT2LMHeadModel")(
        getattr(transformers, f"{kind}Config")(**settings))
    logging.disable_progress_bar()
    model.save_pretrained(str(folder), **kwargs)
    transformers.AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).save_pretrained(str(folder))
    return {"folder": str(folder), "parameters": sum(p.numel() for p in model.parameters())}


def write_llama(folder: Path, tokenizer: Path, seed: int = 0, **config) -> dict:
    return _save("Llama", LLAMA, folder, tokenizer, seed, config)


def write_gpt2(folder: Path, tokenizer: Path, seed: int = 0, shard: str = "100KB", **config) -> dict:
    return _save("GPT2", GPT2, folder, tokenizer, seed, config, max_shard_size=shard)


def write_alpaca_json(path: Path, limit: int = 200) -> dict:
    records = docstring_records(limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return {"path": str(path), "records": len(records)}


def write_guanaco_jsonl(path: Path, limit: int = 40) -> dict:
    records = docstring_records(limit)
    lines = [json.dumps({"text": f"### Human: {r['instruction']}### Assistant: {r['output'][:200]}"}) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"path": str(path), "records": len(lines)}


def write_all(folder: Path, max_bytes: int = MAX_BYTES, limit: int = 200) -> dict:
    tokenizer = folder / "tokenizer"
    made = {"tokenizer": train_tokenizer(tokenizer, max_bytes=max_bytes)}
    made["tiny-llama"] = write_llama(folder / "tiny-llama", tokenizer)
    made["tiny-gpt2"] = write_gpt2(folder / "tiny-gpt2", tokenizer)
    made["alpaca.json"] = write_alpaca_json(folder / "alpaca.json", limit)
    made["guanaco.jsonl"] = write_guanaco_jsonl(folder / "guanaco.jsonl")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduce.models.samples", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="standard-library source bytes to use")
    parser.add_argument("--limit", type=int, default=200, help="most docstring records")
    args = parser.parse_args(argv)
    for name, made in write_all(args.folder, args.max_bytes, args.limit).items():
        print(f"{name}: {json.dumps(made)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
