"""Checkpoints: written atomically (a crash leaves the previous one whole), loaded with `weights_only=True`."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from ..errors import UserError
from .setup import Setup


def save_checkpoint(setup: Setup, path: Path, step: int, metrics_offset: int, extra: dict) -> None:
    """Atomically: write a temporary file, then rename over the previous checkpoint."""
    state = {
        "step": step,
        "model": setup.core.state_dict(),
        "optimizer": setup.optimizer.state_dict(),
        "scheduler": setup.scheduler.state_dict(),
        "scaler": setup.scaler.state_dict() if setup.scaler else None,
        "rng_torch": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if setup.device.type == "cuda" else None,
        "rng_python": list(random.getstate()[1]),
        "metrics_offset": metrics_offset,
        "micro_batch": extra.get("micro_batch"),
        "extra": extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(setup: Setup, path: Path) -> dict:
    try:
        state = torch.load(path, map_location=setup.device, weights_only=True)
    except Exception as exc:
        raise UserError(f"{path}: cannot load checkpoint: {type(exc).__name__}: {exc}") from None
    setup.core.load_state_dict(state["model"])
    setup.optimizer.load_state_dict(state["optimizer"])
    setup.scheduler.load_state_dict(state["scheduler"])
    if setup.scaler and state["scaler"]:
        setup.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng_torch"].cpu())
    if state["rng_cuda"] is not None and setup.device.type == "cuda":
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])
    random.setstate((3, tuple(state["rng_python"]), None))
    return state
