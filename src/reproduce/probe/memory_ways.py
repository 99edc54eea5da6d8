"""The ways out of "does not fit": each a change to the recipe or the options, measured at micro-batch 1 on the
meter that refused it (`WayOut`; probe/advice.py lists them), and here the memory knobs: activation checkpointing,
sharded gradients, CPU offload, combined; and, on one process, the chunked language-model loss and activation
offloading.

Each is computed on the user's own configuration: checkpointing changes the step, so it is a new trial of the
changed recipe; sharded gradients and CPU offload change only what an FSDP rank keeps of the measured step, so they
are computed from its parts (probe/sharded_memory.py). Where one alone is not enough they are combined. Each way out
carries the recipe fields it sets (`changes`); the plan takes checkpointing and sharded gradients
(`plan_memory_change`), never offload (a slower run the user chooses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..plan.recipe import Recipe, parse_recipe
from ..plan.units import format_size
from .sharded_memory import Blocks, StepMemory, shard, sharded_peak, smallest_world_size

CHECKPOINTING = {"model": {"activation_checkpointing": True}}
SHARDED_GRADIENTS = {"batch": {"sharded_gradients": True}}
OFFLOAD = {"batch": {"offload": "cpu"}}
RECOMPUTE_COST = "one more forward pass of each block in backward (about a third more compute)"
REDUCE_COST = "one reduce-scatter per micro-batch instead of one per optimizer step"
OFFLOAD_COST = ("each unit copied to the device in every forward and backward and the optimizer stepping on the "
                "CPU (much slower steps)")
OPTIONS = (("model", "activation_checkpointing", True, "--activation-checkpointing"),
           ("batch", "sharded_gradients", True, "--sharded-gradients"), ("batch", "offload", "cpu", "--offload cpu"))
PLANNED_KNOBS = {("model", "activation_checkpointing"), ("batch", "sharded_gradients")}
LOSS_CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss
CHUNKED_LOSS = {"model": {"loss_chunks": LOSS_CHUNKS}}
OFFLOAD_ACTIVATIONS = {"model": {"offload_activations": True}}
CHUNK_COST = f"one more output-head matmul in backward ({LOSS_CHUNKS} chunks, each recomputed)"
OFFLOAD_ACTIVATIONS_COST = "every saved activation copied to CPU memory in forward and back in backward"
SELECTIVE = {"model": {"activation_checkpointing": True, "selective_checkpointing": True}}
SELECTIVE_COST = "the ops between each block's matrix products recomputed in backward (less than whole blocks)"
KEPT_EMBEDDINGS = {"model": {"upcast_embeddings": False}}
KEPT_EMBEDDINGS_COST = "the frozen embeddings and head computed in the model's dtype instead of fp32 (QLoRA's choice)"


def merged(*changes: dict) -> dict:
    """Recipe changes merged section by section ({"model": {...}} + {"batch": {...}})."""
    result: dict = {}
    for change in changes:
        for key, value in change.items():
            result[key] = {**result.get(key, {}), **value} if isinstance(value, dict) else value
    return result


@dataclass(frozen=True)
class WayOut:
    change: str  # what to change, as the user would: an option or a recipe field
    fits: bool
    peak_bytes: int | None  # one device's peak at micro-batch 1 with the change, as the meter decides it
    detail: str
    changes: dict | None = None  # the recipe fields it sets ({"model": {"lora": ...}}), for a program to apply


def changed_recipe(recipe: Recipe, changes: dict) -> Recipe:
    """`recipe` with `changes` merged in ({"model": {"dtype": "bf16"}, "precision": "bf16"}), validated again."""
    return parse_recipe(merged(recipe.model_dump(mode="json", exclude_none=True), changes),
                        source="(probe: way out)")


def tried(meter: Any, gpu: Any, what: str, change: dict, detail: Callable[[Any], str] | None = None
          ) -> tuple[WayOut, Any]:
    """`change` as a way out: the trial of micro-batch 1 of the recipe with it, on `meter`'s budget and configuration,
    and the trial (None when it cannot be measured, which the way out says); `detail(trial)` follows its needs."""
    from .workload import Workload

    try:
        changed = changed_recipe(meter.workload.recipe, change)
    except UserError as error:
        return WayOut(what, False, None, f"not measured: {error.lines[0]}"), None
    workload = Workload(changed, meter.workload.data)
    # on the user's own configuration: the sharding and world size the failed trial was counted with
    kwargs = {"gpu": gpu, "sharding": meter.sharding, "world_size": meter.world_size} if meter.name == "estimate" \
        else {"time_steps": False}
    other = type(meter)(workload, meter.budget_bytes, 1 - meter.limit_bytes / meter.budget_bytes, cap=meter.cap,
                        **kwargs)
    try:
        trial = other.measure(1)
    except UserError as error:  # (a model with no blocks to checkpoint)
        return WayOut(what, False, None, f"not measured: {error.lines[0]}"), None
    finally:
        other.close()
    needs = (f"micro-batch 1 still does not fit ({trial.note})" if trial.peak_bytes is None
             else f"micro-batch 1 then needs {format_size(trial.peak_bytes)}")
    return WayOut(what, trial.fits, trial.peak_bytes, needs + (detail(trial) if detail else ""), changes=change), trial


def describe(change: dict) -> str:
    """The options a change stands for: --activation-checkpointing, --sharded-gradients, --offload cpu."""
    return " ".join(flag for section, name, value, flag in OPTIONS if change.get(section, {}).get(name) == value)


def plan_memory_change(ways_out: list[dict]) -> dict | None:
    """The first way out that fits and sets only knobs a plan takes by itself (checkpointing, sharded gradients)."""
    for way in ways_out:
        change = way.get("changes")
        if not way["fits"] or not change:
            continue
        fields = {(section, name) for section, values in change.items() if isinstance(values, dict)
                  for name in values}
        if fields and fields <= PLANNED_KNOBS and all(isinstance(v, dict) for v in change.values()):
            return change
    return None


def memory_ways_out(meter: Any, gpu: Any, first: Any, step: StepMemory, blocks: Blocks, compute: int, decide: Any,
                    tensor_limit: int, activations: int) -> list[WayOut]:
    """The memory knobs the recipe does not use yet, alone and combined (see the module's notes). `step` is the
    failed step as an FSDP rank computes it; `activations` those of the failed trial as `meter` counted them."""
    recipe = meter.workload.recipe
    sharded = getattr(meter, "sharding", "none") == "fsdp" and getattr(meter, "world_size", 1) > 1
    has_sg, has_offload = recipe.batch.sharded_gradients, recipe.batch.offload == "cpu"
    ways: list[WayOut] = []

    def arithmetic(rank: tuple, base: dict, what: str, sg: bool, offload: bool, cost: str) -> WayOut:
        step, blocks, compute, accumulates = rank  # one FSDP rank of a measured step (`parts`' `accumulates`)

        def peaks(sharded_gradients: bool, offloaded: bool) -> Any:
            return sharded_peak(step, blocks, meter.world_size, compute,
                                unsharded_window=accumulates and not sharded_gradients, offload=offloaded)

        peak = peaks(sg or has_sg, offload or has_offload)
        needed = decide(peak.peak)
        change = merged(base, SHARDED_GRADIENTS if sg else {}, OFFLOAD if offload else {})
        kept = []
        if sg:
            whole = blocks.with_gradients * 4
            own = shard(whole, max(1, meter.world_size))
            kept.append(f"each rank keeps its shard of the gradients ({format_size(own)}) instead "
                        f"of the whole model's ({format_size(whole)}) through the accumulation window")
        if offload:
            before = peaks(sg or has_sg, has_offload)
            moved = before.model_states + before.sharded_gradients - peak.model_states
            kept.append(f"{format_size(moved)} of parameters, gradients and optimizer state in CPU memory")
        detail = f"micro-batch 1 then needs {format_size(needed)}; " + "; ".join(kept) + f"; costs {cost}"
        return WayOut(what, peak.peak <= tensor_limit, needed, detail, changes=change)

    accumulates = bool((first.parts or {}).get("accumulates", meter.cap is None or first.micro_batch < meter.cap))
    rank = (step, blocks, compute, accumulates)
    if sharded and accumulates and not has_sg:
        ways.append(arithmetic(rank, {}, "--sharded-gradients (batch.sharded_gradients: true)", True, False,
                               REDUCE_COST))
    if sharded and not has_offload:
        ways.append(arithmetic(rank, {}, "--offload cpu (batch.offload: cpu)", False, True, OFFLOAD_COST))
    if not sharded:  # (neither is taken under FSDP here)
        ways.extend(_techniques(meter, gpu, first, activations))
    if not recipe.model.activation_checkpointing:
        ways.extend(_checkpointing(meter, gpu, first, activations, decide, tensor_limit, sharded, accumulates,
                                   has_sg, has_offload, arithmetic))
    return ways


def _techniques(meter: Any, gpu: Any, first: Any, activations: int) -> list[WayOut]:
    """The chunked language-model loss, activation offloading, selective checkpointing and (under a quantised base)
    the embeddings and head kept in the model's dtype: each a new trial of the changed recipe."""
    from ..train.losses import pretraining_loss

    recipe = meter.workload.recipe
    offers = []
    if recipe.task == "language-modeling" and not recipe.model.loss_chunks and pretraining_loss(recipe) is None:
        offers.append((f"model.loss_chunks: {LOSS_CHUNKS}", CHUNKED_LOSS, CHUNK_COST))
    if not recipe.model.offload_activations and meter.name != "cpu":  # (on a CPU there is nowhere to offload to)
        offers.append(("model.offload_activations: true", OFFLOAD_ACTIVATIONS, OFFLOAD_ACTIVATIONS_COST))
    if not recipe.model.activation_checkpointing:
        offers.append(("--activation-checkpointing with model.selective_checkpointing: true", SELECTIVE,
                       SELECTIVE_COST))
    if recipe.model.quantize and recipe.model.upcast_embeddings and recipe.model.dtype != "fp32":
        offers.append(("model.upcast_embeddings: false", KEPT_EMBEDDINGS, KEPT_EMBEDDINGS_COST))

    def saved(trial: Any, costs: str) -> str:
        after = (trial.parts or {}).get("step", {}).get("activations")
        shown = (f"; the activations of one sample {format_size(activations)} -> {format_size(after)}"
                 if after is not None else "")
        return f"{shown}; costs {costs}"

    return [tried(meter, gpu, what, change, lambda trial, costs=costs: saved(trial, costs))[0]
            for what, change, costs in offers]


def _checkpointing(meter, gpu, first, activations, decide, tensor_limit, sharded, accumulates, has_sg, has_offload,
                   arithmetic) -> list[WayOut]:
    what = "--activation-checkpointing (model.activation_checkpointing: true)"

    def saved(trial: Any) -> str:
        if trial.parts is not None:
            after = trial.parts["step"]["activations"]
            text = (f"the activations of one sample {format_size(activations)} -> {format_size(after)} "
                    f"(saves {format_size(activations - after)})")
        elif first.peak_bytes is not None and trial.peak_bytes is not None:
            text = f"saves {format_size(first.peak_bytes - trial.peak_bytes)} at micro-batch 1"
        else:
            text = "the activations of one block at a time"
        return f"; {text}; costs {RECOMPUTE_COST}"

    way, trial = tried(meter, gpu, what, CHECKPOINTING, saved)
    if trial is None:
        return [way]
    parts = trial.parts
    ways = [way]
    if trial.fits:
        return ways
    if not sharded:  # the user's run does not shard: with how many processes would sharding and checkpointing fit?
        ways.extend(_sharded_and_checkpointed(meter, gpu, first, accumulates))
        return ways
    if parts is None:
        return ways
    rank = (StepMemory(**parts["step"]), Blocks.of(parts), parts["compute_bytes"],
            parts.get("accumulates", parts.get("window", True)))
    cost = RECOMPUTE_COST
    if accumulates and not has_sg:  # checkpointing + sharded gradients
        ways.append(arithmetic(rank, CHECKPOINTING, "--activation-checkpointing --sharded-gradients", True, False,
                               f"{cost} and {REDUCE_COST}"))
        if ways[-1].fits:
            return ways
    if not has_offload:
        sg = accumulates and not has_sg
        what = "--activation-checkpointing" + (" --sharded-gradients" if sg else "") + " --offload cpu"
        ways.append(arithmetic(rank, CHECKPOINTING, what, sg, True, f"{cost}, {OFFLOAD_COST}"))
    return ways


def _sharded_and_checkpointed(meter: Any, gpu: Any, first: Any, accumulates: bool) -> list[WayOut]:
    """FSDP over the fewest processes that fit with checkpointing (and, if that is not enough, sharded gradients
    too): the checkpointed step measured as FSDP runs it (an estimate meter sharding over 2), then divided."""
    from .meters import sharding_meter
    from .workload import Workload

    workload = Workload(changed_recipe(meter.workload.recipe, CHECKPOINTING), meter.workload.data)
    sharder = sharding_meter(meter, gpu, workload)
    if sharder is None:  # (a budget below the estimate's margin: nothing to say)
        return []
    parts = sharder.measure(first.micro_batch).parts
    step, compute, blocks = StepMemory(**parts["step"]), parts["compute_bytes"], Blocks.of(parts)
    for sg in ((False, True) if accumulates else (False,)):
        window = accumulates and not sg
        ranks = smallest_world_size(step, blocks, sharder.tensor_limit(), compute, unsharded_window=window)
        if ranks is None:
            continue
        peak = sharded_peak(step, blocks, ranks, compute, unsharded_window=window)
        change = merged(CHECKPOINTING, {"batch": {"sharding": "fsdp", **({"sharded_gradients": True} if sg else {})}})
        what = f"--sharding fsdp --world-size {ranks} --activation-checkpointing" + (" --sharded-gradients" if sg
                                                                                     else "")
        cost = RECOMPUTE_COST + (f" and {REDUCE_COST}" if sg else "")
        return [WayOut(what, True, sharder.decided(peak.peak),
                       f"{ranks} processes (GPUs) with each block recomputed in backward: micro-batch 1 then needs "
                       f"{format_size(sharder.decided(peak.peak))} on each; costs {cost}", changes=change)]
    return [WayOut("--sharding fsdp --activation-checkpointing", False, None,
                   "no number of processes is enough even with checkpointing and sharded gradients")]
