"""Checkpoints, resuming a run from one, and a finished run's end checked against its last checkpoint.

`checkpoints/last.pt` (sealed, written atomically, loaded with `weights_only=True`) holds the step, the scheduler,
scaler and RNG states, metrics.jsonl and summary.json so far, and the model and optimizer unless sharded (FSDP:
`checkpoints/sharded-step-N/`, which last.pt names once every rank has written), so a resume at the last step
writes again, byte for byte, what of the run's end differs (`end_problem`).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..observe.noise import NoiseScale
from ..observe.outputs import SHARDED_PREFIX, loss_document, missing_final_outputs, read_metrics
from ..observe.reference import DivergenceWatch
from ..plan.planfile import changed_fields
from ..plan.planner import Plan
from ..storage.files import check_torch_file, file_digest, write_torch_file
from .distributed import processes as distributed
from .setup import Setup

END_FIELDS = ("adapter", "merged", "plot")  # what finish_run adds to the checkpoint's summary: paths under --out


@dataclass
class Resumed:
    """Where a run starts: step 0 of a fresh run, or the step its checkpoint was written after."""

    seed: int  # the data order and dropout streams: the run's own on resume
    first_step: int = 0
    metrics: bytes | int | None = None  # metrics.jsonl at the checkpoint (or its length: `kept_metrics`)
    lowered: dict = field(default_factory=dict)  # sequence length -> the micro-batch an out-of-memory error set
    state: dict | None = None  # the checkpoint's (None for a fresh run)
    rebuild: str | None = None  # at the last step: the end of the run to write again, and why


def resume_run(plan: Plan, out: Path, setup: Setup, noise: NoiseScale | None, seed: int, asked_seed: int | None,
               total: int, max_steps: int | None, checkpoint: Path | None = None) -> Resumed:
    """Load `out`'s checkpoint (or a gate's) into `setup` and `noise`; the run must have steps left."""
    state = load_checkpoint(setup, checkpoint or out / "checkpoints" / "last.pt",
                            lambda saved: check_same_plan(saved, plan, out))
    if noise is not None and state["extra"].get("noise_scale"):
        noise.load_state_dict(state["extra"]["noise_scale"])
    first_step, rebuild = state["step"], None
    saved_seed = state["extra"].get("seed", seed)
    if asked_seed is not None and asked_seed != saved_seed:
        raise UserError(f"the run in {out} was started with seed {saved_seed} (got {asked_seed})", field="seed")
    if first_step >= total:
        rebuild = end_problem(out, state) if first_step == total else None  # checked, not trusted
        planned = plan.optimizer_steps
        if rebuild is None and max_steps is not None and planned is not None and first_step < planned:
            more = min(first_step + max_steps, planned)  # (a resume past its max_steps never rewrites the end)
            raise UserError(f"`max_steps`: {out} has already run {first_step} of {total} optimizer steps; `max_steps` "
                            f"counts from the start of the run (of {planned} steps): to run {more - first_step} more, "
                            f"give `max_steps` {more}")
        if rebuild is None:
            raise UserError(f"`resume`: {out} has already run {first_step} of {total} optimizer steps; nothing to do")
    # the run had lowered the micro-batch after running out of memory (by sequence length)
    lowered = {int(k) if k != "None" else None: v for k, v in state["extra"].get("lowered", {}).items()}
    saved_micro_batch = state.get("micro_batch")  # without extra["lowered"], the only trace of a lowered one
    if "lowered" not in state["extra"] and saved_micro_batch and not plan.has_phases and (
            saved_micro_batch < plan.micro_batch and plan.per_rank_batch % saved_micro_batch == 0):
        lowered = {plan.recipe.batch.sequence_length: saved_micro_batch}
    return Resumed(saved_seed, first_step, kept_metrics(state), lowered, state, rebuild)


def check_same_plan(state: dict, plan: Plan, out: Path) -> None:
    """A resume trains its checkpoint's plan: one line naming each field that changes the
    computation and differs (plan/planfile.py); a checkpoint that kept no plan is not checked."""
    recorded = state.get("extra", {}).get("plan")
    if not isinstance(recorded, str):
        return
    changed = changed_fields(recorded, plan)
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise UserError(f"{out / 'plan.yaml'} differs from the plan {out / 'checkpoints' / 'last.pt'} was trained "
                        f"with: {shown}; a resumed run trains its checkpoint's plan: put plan.yaml back as it was "
                        "(the micro-batch and the processes have their own options: `micro_batch_max`, "
                        "`nproc_per_node`), or start a new run with the new plan", field="resume")


def earlier_segments(out: Path, state: dict | None, first_step: int) -> tuple[dict, DivergenceWatch, dict]:
    """What the calls before this one did (seconds, samples, tokens), their divergence watch, and the
    record of the checkpoint's step (the end's `final`): from the checkpoint, or metrics.jsonl for an older one."""
    totals = {"seconds": 0.0, "samples": 0, "tokens": 0}
    if state is None:
        return totals, DivergenceWatch(), {}
    extra, records = state["extra"], []
    if not {"run_totals", "divergence", "last_record"} <= extra.keys():
        records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r and r.get("step", 0) <= first_step]
    if "run_totals" in extra:
        totals.update(extra["run_totals"])
    else:
        totals = {key: sum(r.get(key, zero) for r in records) for key, zero in totals.items()}
    if "divergence" in extra:
        watch = DivergenceWatch()
        watch.load_state_dict(extra["divergence"])
    else:
        watch = DivergenceWatch.from_records(records)
    last = [r for r in records if r.get("step") == first_step]
    return totals, watch, extra["last_record"] if "last_record" in extra else last[-1] if last else {}


def kept_summary(state: dict | None) -> dict | None:
    """summary.json as the run's last checkpoint computed it (without the END_FIELDS), or None when it has none."""
    kept = (state or {}).get("extra", {}).get("summary")
    return json.loads(kept) if isinstance(kept, str) else None


def end_problem(out: Path, state: dict) -> str | None:
    """What of the finished run's end in `out` differs from its last checkpoint (`state`), naming the
    file; None when it is all the run's."""
    step, summary = state["step"], kept_summary(state)
    metrics, kept = out / "metrics.jsonl", kept_metrics(state)
    if isinstance(kept, bytes):
        held = metrics.read_bytes() if metrics.is_file() else None
        if held != kept:
            return f"{metrics} is " + ("missing" if held is None else "not the run's: the checkpoint's copy differs")
    if summary is None:
        return missing_final_outputs(out, step) or _model_problem(out, state)
    path = out / "summary.json"
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError) as error:
        return f"{path} is damaged: {str(error).splitlines()[0]}"
    if not isinstance(written, dict) or json.dumps({k: v for k, v in written.items() if k not in END_FIELDS},
                                                   sort_keys=True) != json.dumps(summary, sort_keys=True):
        return f"{path} is not the run's: it differs from the summary its checkpoint holds"
    problem = _model_problem(out, state)
    if problem:
        return problem
    plot = written.get("plot")
    if isinstance(plot, str) and plot.endswith(".svg"):
        svg = out / Path(plot).name
        if not svg.is_file():
            return f"{svg} is missing"
        if isinstance(kept, bytes) and svg.read_bytes() != loss_document(kept).encode("utf-8"):
            return f"{svg} is not the run's loss plot: it differs from the plot of the checkpoint's metrics"
    return next((f"{out / name} is missing" for name in ("adapter", "merged")
                 if written.get(name) and not (out / name).exists()), None)


def _model_problem(out: Path, state: dict) -> str | None:
    """model.pt damaged, or other weights than the checkpoint's (a sharded checkpoint holds none: its
    seal alone is checked)."""
    model = out / "model.pt"
    damaged = check_torch_file(model) if model.is_file() else "missing"
    if damaged:
        return f"{model} is {damaged}"
    expected = state.get("model")
    if expected is None:
        return None
    try:
        held = read_torch_file(model, "model.pt")
    except UserError as error:
        return str(error)
    same = held.keys() == expected.keys() and all(_same_tensor(held[k], expected[k]) for k in expected)
    return None if same else f"{model} holds other weights than the run's last checkpoint"


def _same_tensor(a: object, b: object) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:  # bitwise (a NaN is its own bits)
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:
        return torch.equal(a, b)


def finished_state(out: Path, max_steps: int | None, planned: int | None) -> tuple[str, str]:
    """For --auto-resume, from the last checkpoint (never summary.json): `finished` (its steps run
    and its end the run's) or `unfinished` (steps or an end left, or a checkpoint to judge), with a few words."""
    try:
        state = read_torch_file(out / "checkpoints" / "last.pt", "`resume`")
        step = int(state["step"])
    except (UserError, KeyError, TypeError, ValueError):
        return "unfinished", "a checkpoint to continue from"
    total = planned if max_steps is None or planned is None else min(max_steps, planned)
    if total is None or step < total:
        return "unfinished", "a checkpoint to continue from"
    if step == total:
        problem = end_problem(out, state)
        if problem is not None:
            return "unfinished", f"a finished run whose end is not whole ({problem})"
    return "finished", f"{step} of {planned} optimizer steps run"


def save_checkpoint(setup: Setup, path: Path, step: int, metrics: bytes, extra: dict) -> None:
    """Atomically replace the checkpoint; called on every rank (a sharded one needs every rank's
    shards). `metrics`: metrics.jsonl so far, kept compressed so a resume never depends on the file."""
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

    name = f"{SHARDED_PREFIX}{step:08d}"
    if setup.world.is_main:
        shutil.rmtree(folder / name, ignore_errors=True)  # left by a run killed while saving this same step
        folder.mkdir(parents=True, exist_ok=True)
    distributed.barrier(setup.world)
    model_state, optimizer_state = get_state_dict(setup.model, setup.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / name)
    distributed.barrier(setup.world)  # every rank's shards are on disk before rank 0 points last.pt at them
    return name


def load_checkpoint(setup: Setup, path: Path, check: Callable[[dict], None]) -> dict:
    """The checkpoint's state, loaded into `setup`; a damaged file is refused in one line, never
    trained on. `check(state)`: what must hold before anything is loaded (the plan it was trained with)."""
    state = read_torch_file(path, "`resume`", setup.device)
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
    """A torch file reproduce wrote, checked against its seal first; one line naming `option` and
    the file when it is damaged or not ours (never torch's advice to unpickle code)."""
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
    """Each rank reads the shards it now owns, once each shard file matches the SHA-256 last.pt keeps
    (`digests`: each rank checks its share, all agree)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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
    """The model's `state_dict` unsharded (FSDP: gathered onto rank 0's CPU; every rank calls
    this): model.pt's, loadable into a fresh model."""
    if not setup.sharded:
        return setup.unwrapped_model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(setup.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
