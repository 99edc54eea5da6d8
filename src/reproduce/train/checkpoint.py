"""Checkpoints: written atomically (a crash leaves the previous one whole), loaded with `weights_only=True`.

`checkpoints/last.pt` holds the step, scheduler, scaler, RNG states and metrics offset. Unsharded runs keep the
model and optimizer in it too (rank 0 writes it). Sharded (FSDP) runs save them with torch.distributed.checkpoint
into `checkpoints/sharded-step-N/`, each rank writing its own shards (no rank ever holds the whole model); last.pt
then names that folder and is renamed into place only after every rank has written, so a crash mid-save leaves
the previous pair whole. DCP reshards on load: a run can resume on another number of processes.
"""

from __future__ import annotations

import pickle
import random
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import UserError
from ..storage.files import check_torch_file, file_digest, write_torch_file
from .setup import Setup

SHARDED_PREFIX = "sharded-step-"


def save_checkpoint(setup: Setup, path: Path, step: int, metrics: bytes, extra: dict) -> None:
    """Atomically: write a temporary file, then rename over the previous checkpoint. Called on every rank (rank 0
    alone writes an unsharded checkpoint; a sharded one needs every rank's shards). `metrics`: metrics.jsonl as
    written so far, kept (compressed) so that a resume never depends on the file (observe/outputs.MetricsLog)."""
    if not (setup.world.is_main or setup.sharded):
        return
    state = {
        "step": step,
        "scheduler": setup.scheduler.state_dict(),
        "scaler": setup.scaler.state_dict() if setup.scaler else None,
        "rng_torch": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if setup.device.type == "cuda" else None,
        "rng_python": list(random.getstate()[1]),
        "metrics_offset": len(metrics),
        "metrics": torch.frombuffer(bytearray(zlib.compress(metrics)), dtype=torch.uint8),
        "micro_batch": extra.get("micro_batch"),
        "world_size": setup.world.size,
        "extra": extra,
    }
    if setup.sharded:
        state["sharded"] = _save_sharded(setup, path.parent, step)
        if setup.world.is_main:  # each shard file's SHA-256, in last.pt (sealed): checked before a resume loads them
            folder = path.parent / state["sharded"]
            state["sharded_digests"] = {str(p.relative_to(folder)): file_digest(p)
                                        for p in sorted(folder.rglob("*")) if p.is_file()}
    else:
        state.update(model=setup.unwrapped_model.state_dict(), optimizer=setup.optimizer.state_dict())
    if not setup.world.is_main:
        return
    write_torch_file(path, lambda handle: torch.save(state, handle))  # sealed: its SHA-256 in its zip comment
    if setup.sharded:  # only now is the previous sharded folder no longer named by last.pt
        for old in path.parent.glob(f"{SHARDED_PREFIX}*"):
            if old.name != state["sharded"]:
                shutil.rmtree(old, ignore_errors=True)


def _save_sharded(setup: Setup, folder: Path, step: int) -> str:
    """Every rank writes its shards of the model and optimizer into a new folder; returns the folder's name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .distributed import processes as distributed

    name = f"{SHARDED_PREFIX}{step:08d}"
    if setup.world.is_main:
        shutil.rmtree(folder / name, ignore_errors=True)  # left by a run killed while saving this same step
        folder.mkdir(parents=True, exist_ok=True)
    distributed.barrier(setup.world)
    model_state, optimizer_state = get_state_dict(setup.model, setup.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / name)
    distributed.barrier(setup.world)  # every rank's shards are on disk before rank 0 points last.pt at them
    return name


def load_checkpoint(setup: Setup, path: Path, check: Callable[[dict], None] | None = None) -> dict:
    """The checkpoint's state, loaded into `setup`; a damaged file (a byte that differs from its SHA-256 seal, or a
    record from its stored checksum) is refused in one line, never trained on. `check(state)`: what must hold
    before anything is loaded (the plan it was trained with: train/resume.py)."""
    state = read_torch_file(path, "`resume`", setup.device)
    if check is not None:
        check(state)
    sharded = state.get("sharded")
    if bool(sharded) != setup.sharded:
        was, now = ("fsdp", "none") if sharded else ("none", "fsdp")
        raise UserError(f"{path} was written by a run with sharding {was}; this one has {now}", field="resume")
    if sharded:
        _load_sharded(setup, path.parent / sharded, state.get("sharded_digests"))
    else:
        setup.unwrapped_model.load_state_dict(state["model"])
        setup.optimizer.load_state_dict(state["optimizer"])
    setup.scheduler.load_state_dict(state["scheduler"])
    if setup.scaler and state["scaler"]:
        setup.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng_torch"].cpu())
    if state["rng_cuda"] is not None and setup.device.type == "cuda":
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])
    random.setstate((3, tuple(state["rng_python"]), None))
    return state


def read_torch_file(path: Path, option: str, device: torch.device | str = "cpu") -> dict:
    """A torch file reproduce wrote (a checkpoint, model.pt), checked against its stored checksums first; one line
    naming `option` and the file when it is damaged or not one of ours (never torch's advice to unpickle code)."""
    damaged = check_torch_file(path)
    if damaged:
        raise UserError(f"{option}: {path} is {damaged}" if damaged.startswith("damaged") else
                        f"{option}: {path}: {damaged}")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{option}: {path}: holds Python objects besides tensors: not a file reproduce wrote, and it "
                        "is not unpickled") from None
    except Exception as exc:
        raise UserError(f"{option}: {path}: cannot load: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise UserError(f"{option}: {path}: holds a {type(state).__name__}, not a checkpoint")
    return state


def kept_metrics(state: dict) -> bytes | int:
    """metrics.jsonl as the checkpoint kept it, or its length when the checkpoint holds only `metrics_offset`."""
    kept = state.get("metrics")
    return zlib.decompress(kept.cpu().numpy().tobytes()) if kept is not None else state["metrics_offset"]


def _load_sharded(setup: Setup, folder: Path, digests: dict | None = None) -> None:
    """Each rank reads the shards it now owns (DCP reshards when the number of processes changed), once every shard
    file matches the SHA-256 last.pt keeps of it (`digests`; each rank checks its share, all agree)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .distributed import processes as distributed

    if not folder.is_dir():
        raise UserError(f"{folder} (named by last.pt) is missing: the sharded checkpoint cannot be read",
                        field="resume")
    if digests:
        world = setup.world
        names = sorted(digests)[world.rank::world.size]
        bad = next((name for name in names if not (folder / name).is_file()
                    or file_digest(folder / name) != digests[name]), None)
        if distributed.any_rank(world, bad is not None, setup.device):
            raise UserError(f"{folder / bad if bad else folder}: " + (
                "damaged or missing: it does not match the SHA-256 last.pt keeps of it" if bad else
                "a shard file is damaged or missing (another rank found it)"), field="resume")
    model_state, optimizer_state = get_state_dict(setup.model, setup.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(setup.model, setup.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def full_model_state(setup: Setup) -> dict:
    """The model's own `state_dict`, unsharded (FSDP: gathered once, onto rank 0's CPU; every rank must call this);
    what model.pt holds, loadable into a fresh unsharded model."""
    if not setup.sharded:
        return setup.unwrapped_model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(setup.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
