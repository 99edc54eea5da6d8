"""The run's forecast cost, and the recipe's `budget:` checked against it before anything runs (`plan`'s cost row,
`plan --json`'s `forecast`). Values and one-line refusals; nothing printed, no torch.

The forecast is the predicted time (predicted_time.py) x the GPUs, from the probe's measured step (`measured`) or
the FLOPs model (`datasheet`); money is GPU-hours x the price the user gives (`--price`, `budget.price`): none is
shipped. Beyond the budget, the refusal names the cheapest exact split or GPU count that fits: on measured times a
split costs its micro-batch's time per sample (cost.py; the all-reduce not counted), so a GPU count changes the
GPU-hours only through the micro-batches it allows; the FLOPs model's are the same for every split and count.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..plan.planner import Plan
from ..plan.split import exact_choice
from ..probe.runner import ProbeResult
from .cost import cost, format_duration
from .predicted_time import _flops_model, total_samples  # (_flops_model: the FLOPs model on one catalog card)
from .splits import exact_splits

MOST_GPUS = 4096  # the GPU counts weighed for a cheaper way: 1 .. this many (those that divide the batch)


@dataclass(frozen=True)
class Way:
    """One exact way to run the recipe: `world_size` GPUs at micro_batch x accumulation_steps, and what it costs."""

    world_size: int
    micro_batch: int
    accumulation_steps: int
    gpu_hours: float

    def text(self) -> str:
        return (f"{self.world_size} GPU{'s' if self.world_size > 1 else ''} at {self.micro_batch} x "
                f"{self.accumulation_steps} ({hours(self.gpu_hours)} GPU-hours)")


def forecast(plan: Plan, result: ProbeResult | None, prediction: dict, price: float | None = None) -> dict:
    """`plan --json`'s `forecast`: the run's GPU-hours and money, their basis, and the budget's verdict; a budget
    exceeded (naming what fits), or a money budget without a price, is a UserError."""
    check_price(price)
    budget = plan.recipe.budget
    gpu_hours = prediction.get("gpu_hours")
    basis = prediction.get("predicted_basis")
    kind = None if basis is None else "measured" if basis.startswith("measured") else "datasheet"
    price_from = "price" if price is not None else "budget.price" if budget and budget.price is not None else None
    if price is None and budget is not None:
        price = budget.price
    money = gpu_hours * price if gpu_hours is not None and price is not None else None
    out: dict = {
        "gpu_hours": gpu_hours, "gpus": plan.world_size, "seconds": prediction.get("predicted_seconds"),
        "basis": basis, "basis_kind": kind, "price": price, "price_from": price_from,
        "currency": budget.currency if budget else None, "money": money,
        "budget": budget.model_dump(mode="json", exclude_none=True) if budget else None,
        "paper_gpu_hours": prediction.get("paper_gpu_hours"), "paper_basis": prediction.get("paper_basis"),
        "within_budget": None, "notes": [],
    }
    if budget is None:
        return out
    if budget.money is not None and price is None:
        raise UserError("a money budget needs the price of one GPU-hour: give `price` P (per GPU-hour) or "
                        "budget.price", field="budget.money")
    if gpu_hours is None:
        out["notes"].append("budget not checked: no forecast of the whole run's GPU-hours (" + "; ".join(
            prediction.get("notes") or ["no predicted time"]) + ")")
        return out
    # the most GPU-hours the budget allows: its GPU-hours, or its money at the price, whichever is less
    limit = min(([budget.gpu_hours] if budget.gpu_hours is not None else [])
                + ([budget.money / price] if budget.money is not None and price is not None else []))
    out["within_budget"] = gpu_hours <= limit
    if out["within_budget"]:
        return out
    ways = cheaper_ways(plan, result) if kind == "measured" else []
    fitting = [way for way in ways if way.gpu_hours <= limit]
    over = "budget.gpu_hours" if budget.gpu_hours is not None and gpu_hours > budget.gpu_hours else "budget.money"
    raise UserError(over_budget_line(plan, out, limit, ways, fitting, prediction), field=over)


def check_price(price: float | None) -> None:
    if price is not None and not price > 0:
        raise UserError(f"expected the price of one GPU-hour, > 0 (got {price:g})", field="price")


def hours_and_money(out: dict, gpu_hours: float) -> str:
    """`gpu_hours` in GPU-hours, and in money at the price (the forecast's, or the least budget that holds them)."""
    money = f" = {money_text(gpu_hours * out['price'], out['currency'])}" if out["price"] is not None else ""
    return f"{hours(gpu_hours)} GPU-hours{money}"


def over_budget_line(plan: Plan, out: dict, limit: float, ways: list[Way], fitting: list[Way],
                     prediction: dict) -> str:
    """The refusal: the forecast against the budget, its basis, and the cheapest way that fits, or none."""
    budget = plan.recipe.budget
    assert budget is not None
    spent = hours_and_money(out, out["gpu_hours"])  # the forecast: its money is out["money"], the same product
    allowed = " and ".join(
        ([f"{hours(budget.gpu_hours)} GPU-hours"] if budget.gpu_hours is not None else [])
        + ([money_text(budget.money, out["currency"])] if budget.money is not None else []))
    line = (f"the forecast of the whole run is {spent} ({plan.world_size} GPU{'s' if plan.world_size > 1 else ''} at "
            f"{plan.micro_batch} x {plan.accumulation_steps}, {out['basis']}), over the budget of {allowed}")
    if fitting:
        way = fitting[0]
        default = exact_choice(plan.recipe, plan.micro_batch_max, way.world_size)  # what the plan takes by itself
        how = f"`world_size` {way.world_size}" + (
            "" if default is not None and default.micro_batch == way.micro_batch
            else f" and `micro_batch_max` {way.micro_batch}")
        return f"{line}; the cheapest exact split that fits: {way.text()} ({how})"
    if out["basis_kind"] == "measured":
        if plan.has_phases:
            return (f"{line}; no other split is forecast for a plan with batch phases; raise the budget to at least "
                    f"{spent}")
        cheapest = ways[0] if ways else None
        own = cheapest is not None and (cheapest.world_size, cheapest.micro_batch) == (plan.world_size,
                                                                                       plan.micro_batch)
        least = ("this plan's is the cheapest" if own else f"the cheapest is {cheapest.text()}" if cheapest
                 else "none was timed")
        return (f"{line}; no exact split or GPU count fits ({least}, on the probe's step times); raise the budget "
                f"to at least {hours_and_money(out, cheapest.gpu_hours if cheapest else out['gpu_hours'])}")
    head = f"{line}; no split or GPU count fits: the FLOPs model's GPU-hours are the same for all of them"
    if prediction.get("flops_per_sample") is None or total_samples(plan) is None:
        return f"{head}; raise the budget to at least {spent}, or plan for a faster GPU (`gpu`)"
    card = faster_card(plan, prediction, limit)
    if card is None:
        return f"{head}, nor does another GPU of the catalog; raise the budget to at least {spent}"
    return (f"{head}; the catalog's {card[0]} would ({hours(card[1])} GPU-hours at its datasheet peak; `gpu` "
            f"{card[0]} plans it, memory included), or raise the budget to at least {spent}")


def faster_card(plan: Plan, prediction: dict, limit: float) -> tuple[str, float] | None:
    """The catalog's card whose datasheet peak (the prediction's precision, its MFU) runs the whole schedule in the
    fewest GPU-hours, with them, when they are within `limit`; None when no card's are."""
    from ..hardware.catalog import GPUS

    samples, per_sample = total_samples(plan), prediction["flops_per_sample"]
    fits = []
    for entry in GPUS.values():
        seconds = _flops_model(entry, 1, prediction["precision"], samples, per_sample, prediction["mfu_assumed"])[0]
        if seconds is not None and seconds / 3600 <= limit:
            fits.append((seconds / 3600, entry.name))
    return (min(fits)[1], min(fits)[0]) if fits else None


def cheaper_ways(plan: Plan, result: ProbeResult | None) -> list[Way]:
    """Every exact way to split the plan's batch on 1 .. MOST_GPUS GPUs, on the step times the probe measured (the
    throughput search's when it timed whole steps), cheapest first; ties: the plan's own GPU count, then fewer."""
    if result is None or plan.has_phases or plan.optimizer_steps is None:
        return []
    candidates = plan.throughput.candidates if plan.throughput else []
    timings = [(c.micro_batch, c.micro_step_seconds) for c in candidates if c.repeats] or result.timings()
    recipe, cap, steps = plan.recipe, plan.micro_batch_max, plan.optimizer_steps
    paper_batch = recipe.batch.sequences
    ways: dict[tuple[int, int], Way] = {}
    for gpus in exact_splits(paper_batch, MOST_GPUS):  # the GPU counts that divide the batch
        per_rank = paper_batch // gpus
        for top in exact_splits(per_rank, cap):
            choice = exact_choice(recipe, top, gpus)  # the planner's own choice under that cap (BatchNorm's batch)
            if choice is None or (gpus, choice.micro_batch) in ways:
                continue
            spent = cost(timings, choice.micro_batch, choice.accumulation_steps, choice.effective_batch,
                         recipe.batch.sequence_length, steps)
            if spent is None or spent.total_seconds is None:
                continue
            ways[gpus, choice.micro_batch] = Way(gpus, choice.micro_batch, choice.accumulation_steps,
                                                 spent.total_seconds * gpus / 3600)
    return sorted(ways.values(), key=lambda w: (float(f"{w.gpu_hours:.6g}"), w.world_size != plan.world_size,
                                                w.world_size, -w.micro_batch))


def hours(value: float) -> str:
    return f"{value:.3g}"


def money_text(value: float, currency: str | None) -> str:
    shown = f"{value:,.2f}" if value >= 1 else f"{value:.3g}"  # cents, or 3 figures of a small amount
    return shown + (f" {currency}" if currency else "")


def forecast_cells(forecast: dict) -> tuple[str, str]:
    """The plan table's `cost (forecast)` cells: the same model on the paper's own hardware, when stated; this
    plan's GPU-hours on their basis, the money, the budget's verdict."""
    paper = "" if forecast["paper_gpu_hours"] is None else (
        f"{hours(forecast['paper_gpu_hours'])} GPU-hours ({forecast['paper_basis']})")
    if forecast["gpu_hours"] is None:
        text = "unknown (no predicted time: give `gpu` NAME, or probe with `meter` cuda or cpu)"
    else:
        wall = f"{forecast['gpus']} GPU{'s' if forecast['gpus'] > 1 else ''} x {format_duration(forecast['seconds'])}"
        text = f"{hours(forecast['gpu_hours'])} GPU-hours ({wall}; {forecast['basis']})"
    if forecast["price"] is not None:
        rate = f"at {money_text(forecast['price'], forecast['currency'])} per GPU-hour"
        text += f"\n= {money_text(forecast['money'], forecast['currency'])} {rate}" if forecast["money"] is not None \
            else f"\n{rate}: money unknown"
    budget = forecast["budget"]
    if budget is not None:
        allowed = " and ".join(
            ([f"{hours(budget['gpu_hours'])} GPU-hours"] if "gpu_hours" in budget else [])
            + ([money_text(budget["money"], forecast["currency"])] if "money" in budget else []))
        verdict = {True: "within", False: "OVER", None: "not checked"}[forecast["within_budget"]]
        text += f"\nbudget {allowed}: {verdict}"
    return paper, text
