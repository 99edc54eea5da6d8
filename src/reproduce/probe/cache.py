"""The probe's cache, so `run` after `plan` does not probe again: one JSON file per (recipe, device, budget, torch
version, ...) in `$REPRODUCE_CACHE_DIR` or `~/.cache/reproduce/probe`. No torch. A cache that cannot be read or
written is skipped. A user's model factory is keyed by the recipe, not its code: after editing it, `--no-cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..plan.planfile import write_text_atomic

CACHE_ENV = "REPRODUCE_CACHE_DIR"
FORMAT = "reproduce-probe/2"  # part of every key: a change in what a probe measures changes it (2: the estimate's
# allowance on the activations and the attention workspaces, gpu_like.UNSEEN_ACTIVATIONS)


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "reproduce" / "probe"


def cache_key(fields: dict) -> str:
    text = json.dumps({"format": FORMAT, **fields}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def library_versions() -> dict[str, str | None]:
    """The versions of the libraries that define the models, from their metadata (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("torch", "torchvision", "transformers", "peft"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def load(key: str, folder: Path | None = None) -> dict | None:
    path = (folder or cache_dir()) / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def store(key: str, data: dict, folder: Path | None = None) -> Path | None:
    """Write `data` under `key`; the path, or None when the cache folder is not writable."""
    path = (folder or cache_dir()) / f"{key}.json"
    try:
        write_text_atomic(path, json.dumps({"format": FORMAT, **data}, indent=1) + "\n")
    except OSError:
        return None
    return path
