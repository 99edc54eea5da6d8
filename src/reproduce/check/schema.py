"""The check file's schema: a recipe, a budget, optional runs, and the checks (plan, verify, metric, compare); one line
per validation error of a check file: `file: checks[1].min: must be ... (got ...)`."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from ..errors import UserError
from ..plan.recipe import Strict
from ..plan.units import parse_size
from ..plan.validation import error_message, is_union_tag, unknown_key

DEFAULT_FOLDER = "reproduce"
WORK_MARKER = ".reproduce-check-work"
MAIN = "main"
AGGREGATES = ("mean", "min", "max")


class Budget(Strict):
    """What the checks run with: the micro-batch (or the memory it was measured for), device, and length."""

    micro_batch_max: int | None = Field(default=None, gt=0, description="largest micro-batch that fits")
    memory: str | None = Field(default=None, description="the device memory micro_batch_max is declared for")
    world_size: int = Field(default=1, gt=0)
    policy: Literal["exact", "fast"] = "exact"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    max_steps: int | None = Field(default=None, gt=0, description="stop runs after this many optimizer steps")
    max_epochs: float | None = Field(default=None, gt=0, description="stop runs after this many epochs")
    seeds: list[int] | None = Field(default=None, min_length=1, description="one run per seed")

    @model_validator(mode="after")
    def _consistent(self) -> Budget:
        if self.max_steps is not None and self.max_epochs is not None:
            raise ValueError("give max_steps or max_epochs, not both")
        if self.memory is not None:
            try:
                parse_size(self.memory, "memory")
            except UserError as error:
                raise ValueError(error.lines[0]) from None
        return self


class RunSpec(Strict):
    recipe: str | None = Field(default=None, description="another recipe (default: the file's)")
    overrides: dict[str, Any] = Field(default={}, description="merged into the recipe; null removes a key")
    budget: dict[str, Any] = Field(default={}, description="fields of the file's budget to change")


class Drift(Strict):
    """`drift:` of a metric or compare check: its value within the mean of the same check's last `last` passing
    values +- the widest of `tolerance`, `rel_tolerance` x |mean| and `sigmas` x their standard deviation."""

    last: int = Field(default=5, ge=1, description="the band is made of the check's last K passing values")
    tolerance: float | None = Field(default=None, gt=0, description="mean +- tolerance")
    rel_tolerance: float | None = Field(default=None, gt=0, description="mean +- rel_tolerance x |mean|")
    sigmas: float | None = Field(default=None, gt=0, description="mean +- sigmas x the values' standard deviation")
    min_runs: int = Field(default=2, ge=1, description="with fewer values in the history, not checked yet")

    @model_validator(mode="after")
    def _a_band(self) -> Drift:
        if self.tolerance is None and self.rel_tolerance is None and self.sigmas is None:
            raise ValueError("give tolerance, rel_tolerance or sigmas (the band's half-width around the history's "
                             "mean)")
        if self.min_runs > self.last:
            raise ValueError(f"min_runs: {self.min_runs} is more than the last {self.last} values the band is made of")
        if self.sigmas is not None and self.min_runs < 2:
            raise ValueError("min_runs: sigmas needs a standard deviation, of 2 values at least")
        return self


class _Check(Strict):
    name: str | None = None


class PlanCheck(_Check):
    kind: Literal["plan"]
    run: str = MAIN
    expect: dict[str, Any] = {}


class VerifyCheck(_Check):
    kind: Literal["verify"]
    run: str = MAIN
    samples: int | None = Field(default=None, gt=0)
    tolerance: float | None = Field(default=None, gt=0)
    dtype: Literal["float64", "float32", "bf16", "fp16"] = "float64"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    expect: Literal["equivalent", "not-equivalent"] = "equivalent"


class MetricCheck(_Check):
    kind: Literal["metric"]
    run: str = MAIN
    metric: str
    aggregate: Literal[AGGREGATES] = "mean"  # type: ignore[valid-type]
    scale: float = Field(default=1.0, gt=0, description="multiply the measured value first (fraction -> %)")
    min: float | None = None
    max: float | None = None
    baseline: str | None = Field(default=None, description="a value from the run's summary to divide by")
    min_ratio: float | None = None
    max_ratio: float | None = None
    reported: str | None = Field(default=None, description="a metric in the recipe's `reported` list")
    tolerance: float | None = Field(default=None, ge=0)
    drift: Drift | None = Field(default=None, description="stay within a band of this check's own history")

    @model_validator(mode="after")
    def _something_to_check(self) -> MetricCheck:
        if all(v is None for v in (self.min, self.max, self.min_ratio, self.max_ratio, self.reported, self.drift)):
            raise ValueError("give min, max, baseline with min_ratio/max_ratio, reported, or drift")
        if (self.min_ratio is not None or self.max_ratio is not None) and self.baseline is None:
            raise ValueError("baseline: required with min_ratio or max_ratio")
        if self.baseline is not None and self.min_ratio is None and self.max_ratio is None:
            raise ValueError("baseline: give min_ratio or max_ratio with it")
        if self.tolerance is not None and self.reported is None:
            raise ValueError("tolerance: only used with reported")
        return self


class CompareCheck(_Check):
    kind: Literal["compare"]
    a: str
    b: str
    metric: str = "loss"
    aggregate: Literal[AGGREGATES] = "mean"  # type: ignore[valid-type]
    tolerance: float | None = Field(default=None, ge=0, description="|a - b| <= tolerance")
    rel_tolerance: float | None = Field(default=None, ge=0, description="|a - b| <= rel_tolerance x |b|")
    at_least: float | None = Field(default=None, description="a - b >= at_least")
    at_most: float | None = Field(default=None, description="a - b <= at_most")
    drift: Drift | None = Field(default=None, description="a - b stays within a band of this check's own history")

    @model_validator(mode="after")
    def _something_to_check(self) -> CompareCheck:
        if all(v is None for v in (self.tolerance, self.rel_tolerance, self.at_least, self.at_most, self.drift)):
            raise ValueError("give tolerance, rel_tolerance, at_least, at_most or drift")
        return self


AnyCheck = Annotated[PlanCheck | VerifyCheck | MetricCheck | CompareCheck, Field(discriminator="kind")]
CHECKS = {  # each check kind's class, in the union's order (messages list the kinds so)
    cls.model_fields["kind"].annotation.__args__[0]: cls for cls in (PlanCheck, VerifyCheck, MetricCheck, CompareCheck)
}


class CheckFile(Strict):
    description: str | None = None
    recipe: str
    sample_data: Literal["segmentation"] | None = Field(
        default=None, description="data the checks build first, as `python -m reproduce.data.samples KIND DIR` "
        "writes it, in a temporary folder given to every run as data.path")
    budget: Budget = Budget()
    runs: dict[str, RunSpec] = {}
    checks: list[AnyCheck] = Field(min_length=1)


def format_errors(exc: ValidationError, source: str, root: type[BaseModel] = CheckFile) -> list[str]:
    """recipe.format_validation_errors' style for check files: `file: checks[1].min: must be ... (got ...)`."""
    lines = []
    for error in exc.errors(include_url=False):
        kind = error["type"]
        parts = list(error["loc"])
        key = [parts.pop()] if kind == "extra_forbidden" and parts else []  # the file's own key, whatever it reads
        loc = [part for part in parts if not (isinstance(part, str) and is_union_tag(part))] + key
        if kind == "union_tag_not_found":
            loc, message = [*loc, "kind"], f"required: one of {', '.join(CHECKS)}"
        elif kind == "union_tag_invalid":
            tag = error.get("ctx", {}).get("tag")
            close = difflib.get_close_matches(str(tag), list(CHECKS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            loc, message = [*loc, "kind"], f"expected one of {', '.join(CHECKS)} (got {tag!r}{hint})"
        elif kind == "extra_forbidden":
            message = unknown_key(str(loc[-1]), _fields_at(root, loc[:-1]))
        else:
            message = error_message(error, root)
            head = message.split(":", 1)[0]
            if ":" in message and " " not in head and head in _fields_at(root, loc):
                loc, message = [*loc, head], message.split(":", 1)[1].strip()
        line = f"{source}: {_walk(root, loc)[0]}: {message}"
        if line not in lines:
            lines.append(line)
    return lines


def _walk(root: type[BaseModel], loc: list) -> tuple[str, Any]:
    """`loc` as a dotted path (checks[1].min) and the annotation it leads to; the kind tag pydantic adds inside the
    union of checks picks its member and is left out of the path."""
    text, node = "", root
    for part in loc:
        if node == AnyCheck and part in CHECKS:
            node = CHECKS[part]
            continue
        node = _step(node, part)
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)", node


def _fields_at(root: type[BaseModel], loc: list) -> list[str]:
    node = _walk(root, loc)[1]
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _step(node: Any, part: Any) -> Any:
    """The annotation found one step into `node` (a model, list, dict, or union of them)."""
    if node is None:
        return None
    origin, args = getattr(node, "__origin__", None), getattr(node, "__args__", ())
    if isinstance(node, type) and issubclass(node, BaseModel):
        field_info = node.model_fields.get(str(part))
        return field_info.annotation if field_info else None
    if origin is list and isinstance(part, int):
        return args[0] if args else None
    if origin is dict and isinstance(part, str):
        return args[1] if len(args) > 1 else None
    for arg in args:  # Optional / Union / Annotated: the first member that knows the part
        found = _step(arg, part)
        if found is not None:
            return found
    return None
