"""What a checkpoint records of the plan it was trained with, and what a resume's plan changed of it (pure Python).

`computation(plan)` is the plan as every field that changes what the run computes, flattened to dotted paths (the
recipe's fields, the schedule in optimizer steps, the segments' batches, LRs and schedules, the epoch): each
checkpoint keeps it (`json` of it, train/checkpoint.py). A resume whose plan differs from it in any field is refused,
naming the fields (`changed_fields`): a plan.yaml edited by hand, or a flipped bit that still parses, never trains a
different model silently. Left out are the fields a resume may change on purpose by its own explicit way, which keeps
the large-batch updates exact (the micro-batch and accumulation steps: `--micro-batch-max`, an out-of-memory halving;
the number of processes: `--nproc-per-node`; and what follows from them: the BatchNorm plan's micro-batch, the
throughput policy's timings), the records checked by their own fingerprints (the weights and data files:
resume_rules), and words (the paper's title, warnings, notes, sources).
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from .planner import Plan

NOT_COMPUTATION = (
    "format", "recipe_path", "policy", "micro_batch_max", "alternative", "alternative.*", "batchnorm",
    "batchnorm.*", "batchnorm_warning", "warnings", "warnings.*", "throughput", "throughput.*", "memory_notes",
    "memory_notes.*", "weights", "weights.*", "data_fingerprint",
    "split.policy", "split.micro_batch", "split.accumulation_steps", "split.world_size",
    "segments.*.micro_batch", "segments.*.accumulation_steps", "segments.*.micro_batch_max",
    "lr_scaling.source", "lr_scaling.adam_option.source",
    "recipe.paper", "recipe.paper.*", "recipe.reported", "recipe.reported.*", "recipe.deviations",
    "recipe.deviations.*", "recipe.model.description", "recipe.model.pretrained", "recipe.model.pretrained.*",
)


def computation(plan: Plan) -> dict[str, Any]:
    """The plan's fields that change what the run computes, by dotted path (list items by their index)."""
    flat: dict[str, Any] = {}
    _flatten(plan.model_dump(mode="json"), "", flat)
    if flat.get("recipe.data.packing") is None and "recipe.data.packing" in flat:
        flat["recipe.data.packing"] = "none"  # (left unset, it ran `none`, which a re-plan writes: packing.py)
    return {path: value for path, value in flat.items()
            if not any(fnmatch.fnmatchcase(path, pattern) for pattern in NOT_COMPUTATION)}


def _flatten(value: Any, path: str, into: dict[str, Any]) -> None:
    """Each leaf by its dotted path; an empty mapping or list has none (its items, when it gets some, are named)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), into)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _flatten(item, f"{path}.{index}", into)
    else:
        into[path] = value


def as_record(plan: Plan) -> str:
    """`computation(plan)` as the JSON text a checkpoint keeps."""
    return json.dumps(computation(plan), sort_keys=True)


def changed_fields(recorded: str, plan: Plan) -> list[str]:
    """Each field whose value in `plan` differs from the checkpoint's record (`as_record`), as `path (A at the
    checkpoint, B now)`; a field only one of them has counts too."""
    then: dict[str, Any] = json.loads(recorded)
    now: dict[str, Any] = json.loads(as_record(plan))  # (through JSON as the record went: tuples, floats alike)
    missing = object()
    changed = []
    for path in sorted(then.keys() | now.keys()):
        before, after = then.get(path, missing), now.get(path, missing)
        if before != after:
            changed.append(f"{path} ({_shown(before, missing)} at the checkpoint, {_shown(after, missing)} now)")
    return changed


def _shown(value: Any, missing: object) -> str:
    if value is missing:
        return "absent"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."
