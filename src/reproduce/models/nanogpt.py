"""nanoGPT's GPT (karpathy/nanoGPT @ 3adf61e, model.py), written from its code, not copied, with its names, so a run's
model.pt loads into nanoGPT's `GPT` strictly (`python -m reproduce.models.nanogpt RUN_DIR OUT_DIR` writes the
ckpt.pt its `sample.py` reads). One difference: `forward(tokens)` returns every position's logits (B, T, V).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's GPTConfig fields and defaults (GPT-2 124M, the vocabulary padded to 50304)."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)
                 for t in self.c_attn(x).split(width, dim=2))
        q, k, v = heads
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, length, width)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            "ln_f": LayerNorm(config.n_embd, bias=config.bias),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one tensor, two names in the state_dict
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameters as nanoGPT prints them: without the position embeddings unless `non_embedding=False`."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.transformer.wpe.weight.numel() if non_embedding else total

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.block_size:
            raise ValueError(f"a sequence of {length} tokens is longer than block_size {self.config.block_size}")
        positions = torch.arange(length, dtype=torch.long, device=tokens.device)
        x = self.transformer.drop(self.transformer.wte(tokens) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def main(argv: list[str] | None = None) -> int:
    """`python -m reproduce.models.nanogpt RUN_DIR OUT_DIR --n-head H [--dataset NAME]`: a run's model.pt as the
    ckpt.pt of nanoGPT's sample.py (`python sample.py --out_dir=OUT_DIR`, from nanoGPT's folder)."""
    parser = argparse.ArgumentParser(prog="python -m reproduce.models.nanogpt", description=main.__doc__)
    parser.add_argument("run", type=Path, help="the run's folder (holding model.pt) or the model.pt file")
    parser.add_argument("out", type=Path, help="folder to write ckpt.pt into (nanoGPT's out_dir)")
    parser.add_argument("--n-head", type=int, required=True, help="attention heads (not readable from the shapes)")
    parser.add_argument("--dataset", default=None, help="nanoGPT data folder name for meta.pkl: shakespeare_char")
    args = parser.parse_args(argv)
    source = args.run / "model.pt" if args.run.is_dir() else args.run
    if not source.is_file():
        print(f"error: {source}: no such file (a run's model.pt)", file=sys.stderr)
        return 2
    state = torch.load(source, map_location="cpu", weights_only=True)
    if "transformer.wte.weight" not in state or "lm_head.weight" not in state:
        print(f"error: {source}: not a nanogpt model's state (no transformer.wte.weight / lm_head.weight)",
              file=sys.stderr)
        return 2
    vocab, width = state["transformer.wte.weight"].shape  # the config from the shapes
    layers = 1 + max(int(key.split(".")[2]) for key in state if key.startswith("transformer.h."))
    config = GPTConfig(block_size=state["transformer.wpe.weight"].shape[0], vocab_size=vocab, n_layer=layers,
                       n_head=args.n_head, n_embd=width, dropout=0.0, bias="transformer.ln_f.bias" in state)
    target = args.out / "ckpt.pt"
    if target.exists():
        print(f"error: {target} exists; choose another folder", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    # what nanoGPT's sample.py reads; `config.dataset` names where its meta.pkl is (else GPT-2's BPE)
    torch.save({"model_args": asdict(config), "model": state, "iter_num": 0, "best_val_loss": float("nan"),
                "config": {"dataset": args.dataset} if args.dataset else {}}, target)
    print(f"wrote {target}: {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
