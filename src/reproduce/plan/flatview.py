"""The plan's flat view: the fields of a `reproduce-plan/1` file, one level deep. Pure Python, no torch.

`plan --json`, which CI pipelines read, keeps reproduce-plan/1's flat names and order: `flat_fields(plan)` writes
them from the parts of a reproduce-plan/2 Plan; `parts_from_flat(data)` reads an old reproduce-plan/1 file as parts."""

from __future__ import annotations

from typing import Any

from .planner import Plan

FLAT_FORMAT = "reproduce-plan/1"  # the flat view's field names and order are the first plan format's
FLAT_FIELDS = (  # its keys, in order: what `plan --json` shows and a plan check's `expect` may name
    "format", "recipe_path", "policy", "micro_batch_max", "micro_batch", "accumulation_steps", "world_size", "unit",
    "effective_batch", "effective_tokens", "paper_effective_batch", "exact", "batch_factor", "base_lr", "lr",
    "lr_factor", "lr_rule", "lr_rule_source", "adam_option", "dataset_size", "steps_per_epoch", "partial_window",
    "optimizer_steps", "warmup_steps", "warmup_start_lr", "decay_kind", "decay_milestones", "decay_factor",
    "decay_end_step", "min_lr", "batchnorm", "norm", "alternative", "warnings", "phases", "throughput", "memory",
    "weights", "data_fingerprint",
)
# named alike in the flat view and the schedule part
SCHEDULE_FIELDS = ("warmup_steps", "warmup_start_lr", "decay_kind", "decay_milestones", "decay_factor",
                   "decay_end_step", "min_lr")
KEPT = ("recipe_path", "recipe", "policy", "micro_batch_max", "alternative", "dataset_size", "steps_per_epoch",
        "partial_window", "throughput", "weights", "data_fingerprint")  # named alike in the flat view and the parts


def flat_fields(plan: Plan) -> dict[str, Any]:
    """The plan as JSON in `reproduce-plan/1`'s fields and order, without the recipe: the split's fields and the
    plan's own (its `policy` over the split's), the rest named as v1 named them."""
    parts = plan.model_dump(mode="json", exclude={"recipe", "segments"})
    schedule, scaling = parts["schedule"], parts["lr_scaling"]
    values = {
        **parts["split"], **parts, "format": FLAT_FORMAT, "unit": plan.unit, "effective_tokens": plan.effective_tokens,
        "paper_effective_batch": plan.paper_effective_batch, "base_lr": plan.recipe.optimizer.lr,
        "lr_rule": scaling["rule"], "lr_rule_source": scaling["source"], "adam_option": scaling["adam_option"],
        "optimizer_steps": schedule["end_step"], **{key: schedule[key] for key in SCHEDULE_FIELDS},
        "batchnorm": plan.batchnorm_warning, "norm": parts["batchnorm"], "memory": parts["memory_notes"],
        "phases": [segment.model_dump(mode="json") for segment in plan.segments] if plan.has_phases else [],
    }
    return {key: values[key] for key in FLAT_FIELDS}


def parts_from_flat(data: dict[str, Any]) -> dict[str, Any]:
    """A `reproduce-plan/1` file's fields as `reproduce-plan/2`'s parts; what is missing or wrong is left for
    `Plan`'s validation (and planfile.check_plan) to name. The v1 fields that the parts derive from the recipe
    (unit, effective_tokens, paper_effective_batch, base_lr) are not kept: `Plan` reads them from its recipe."""
    given = data.get("recipe")
    recipe: dict[str, Any] = given if isinstance(given, dict) else {}
    decay = (recipe.get("schedule") or {}).get("decay") or {}
    policy = data.get("policy")
    split = {key: data.get(key) for key in ("micro_batch", "accumulation_steps", "world_size", "effective_batch",
                                             "exact", "batch_factor", "lr", "lr_factor")}
    split["policy"] = "fast" if policy == "fast" else "exact"
    schedule = {**{key: data.get(key) for key in SCHEDULE_FIELDS}, "decay_milestones": data.get("decay_milestones", []),
                "start_step": 0, "end_step": data.get("optimizer_steps"), "lr": data.get("lr"),
                "power": decay.get("power", 1.0)}
    phases = data.get("phases") or []
    segments = phases or [{
        "kind": "whole", "start_step": 0, "micro_batch_max": data.get("micro_batch_max"),
        "micro_batch": split["micro_batch"], "accumulation_steps": split["accumulation_steps"],
        "effective_batch": split["effective_batch"], "paper_effective_batch": data.get("paper_effective_batch"),
        "sequence_length": (recipe.get("batch") or {}).get("sequence_length"), "exact": split["exact"],
        "lr_factor": split["lr_factor"], "dataset_size": data.get("dataset_size"),
        "steps_per_epoch": data.get("steps_per_epoch"),
    }]
    return {
        **{key: data.get(key) for key in KEPT}, "format": "reproduce-plan/2", "split": split, "schedule": schedule,
        "lr_scaling": {"rule": data.get("lr_rule"), "source": data.get("lr_rule_source"),
                       "adam_option": data.get("adam_option")},
        "segments": segments, "batchnorm": data.get("norm"), "batchnorm_warning": data.get("batchnorm"),
        "warnings": data.get("warnings", []), "memory_notes": data.get("memory", []),
    }
