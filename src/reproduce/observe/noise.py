"""The gradient noise scale, measured during accumulation at no extra pass (McCandlish et al. 2018).

`B_simple = tr(Sigma) / |G|^2` (arXiv 1812.06162, eq. 2.9): tr(Sigma) the variance of one item's gradient (items:
what the loss averages over, samples or target tokens), G the true gradient. As E|G_B|^2 = |G|^2 + tr(Sigma) / B,
the squared norms of a small and a big batch gradient give unbiased estimates of both (their Appendix A.1):

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

B_big is the window: |G_big| is the step's norm (unscaled, before clipping). The small batches are groups of each
rank's micro-batches: the first half (rounded up) one group, its norm read from `.grad` with one fused norm; each of
the last half its own, its norm taken by a hook on every parameter before accumulation (and DDP's reduction), so
every group is one rank's local gradient. |G_small|^2 is the items-weighted average of the K groups' squared norms,
B_small = B_big / K (the paper's data-parallel recipe, groups as devices). Groups that make up the window cancel the
2 G.(noise) term the two norms share: tr(Sigma) is never negative and many times steadier (325% spread per window
with one small batch, 30% with 5 groups, on tests/torch/observe/test_noise_scale.py's language model). One
micro-batch per step on one process has no smaller batch, and under FSDP the hooks see no gradient: no estimate.

Drawing a window without replacement from n items shrinks its variance by (1 - B/n): |G|^2 comes out low by
tr(Sigma)/n, which is added back (+8% on the 1,437 digits early on; it keeps |G|^2 positive when B_simple nears n).
Each estimate has its own exponential moving average and the noise scale is their ratio, as the paper advises
(E[a/b] != E[a]/E[b]). Nothing here writes to a gradient or a weight.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Each window's estimates weigh 1 - EMA_FACTOR: 0.95 averages ~(1 + b) / (1 - b) = 39 windows, bringing the
# per-window spread on the built-in GPT (bench/noise_scale.py: 55% for |G|^2, 15% for tr(Sigma) late) under 10%,
# while the mean age, b / (1 - b) = 19 steps, stays short next to the noise scale's drift (~570 to ~9,100 tokens
# between the GPT's steps 60 and 300).
EMA_FACTOR = 0.95

# The share of a window's micro-batches (its last ones, at least one) the hooks measure one by one. A hooked
# micro-batch costs 1-2% of its forward and backward (the built-in GPT on a CPU, bench/noise_scale.py), so half keeps
# a step near 1%; fewer groups are noisier: tr(Sigma)'s spread per window on the digits MLP with N = 8 is 15% with
# every micro-batch alone, 19% with 5 groups (this share), 29% with 3, 41% with 2, 44% for the first one alone.
HOOKED_SHARE = 0.5


def estimates(small_sq: float, big_sq: float, b_small: float, b_big: float,
              population: float | None = None) -> tuple[float, float]:
    """The unbiased (|G|^2, tr(Sigma)) estimates of A.1, corrected for a finite `population` when given."""
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    if population:
        grad_sq += trace / population
    return grad_sq, trace


class NoiseScale:
    """Measures B_simple over a run: `start_window`, `after_backward` per micro-batch, `end_window` per step (the
    step's `noise_scale`, smoothed, and when measured its `noise_grad_sq`, `noise_trace`, `noise_b_small` in items)."""

    def __init__(self, setup: Any):
        self.setup, self.ema = setup, EMA_FACTOR
        self.dataset_size = len(setup.data.train)
        self.population: float | None = None  # the training set in items (tokens for a language model)
        # the window: this rank's items per micro-batch (None between windows), its global items, and its norms as
        # 0-d device tensors (nothing waits for the device until its end): |h| per parameter of the running
        # backward, |h_k|^2 per group k, and B_big / b_k (|g_k|^2 = |h_k|^2 (B_big / b_k)^2)
        self.counts: list[int] | None = None
        self.b_big, self.window_population = 0, self.population
        self.norms: list[torch.Tensor] = []
        self.groups: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.sink = None  # the running window's `norms.append`: the hooks' one attribute to look up
        self.grad_sq = self.trace = 0.0  # EMA sums (not bias-corrected: the ratio cancels the correction)
        self.measured = 0
        self.prefix = 0  # the window's first micro-batches, measured together from `.grad` after the last of them
        # The trainable parameters. Under FSDP2 the sharded ones are outside the autograd graph (the all-gathered
        # are in it), so their hooks are never called (checked with two gloo processes): `run` does not measure.
        self.watched = [p for p in setup.unwrapped_model.parameters() if p.requires_grad]
        self.hooks = [p.register_hook(self._gradient) for p in self.watched]

    def close(self) -> None:
        """Remove the parameter hooks (a model used after the run computes no norms)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def start_window(self, counts: list[int], count: int, samples: int) -> None:
        """Before the window's first backward: this rank's items per micro-batch, and the window's items and
        samples over all ranks (items per sample x the training set's samples = its items, for token counts)."""
        population = self.dataset_size * count / samples if samples else None
        self.population = population or self.population
        self.counts, self.b_big, self.window_population = list(counts), count, population
        self.norms, self.groups, self.weights = [], [], []
        # `.grad` holds the first micro-batches' sum when it starts empty (set_to_none): one fused norm. The last
        # `hooked` ones (DDP: always the synchronising last one) are measured by the hooks.
        hooked = max(1, int(len(counts) * HOOKED_SHARE))
        empty = all(p.grad is None for p in self.watched)
        self.prefix = len(counts) - hooked if empty else 0
        self.sink = None if self.prefix else self.norms.append

    def _gradient(self, grad: torch.Tensor) -> None:
        """A parameter's gradient from the current backward, before accumulation (and DDP's reduction): |g| as a
        0-d tensor, one reduction and no copy (the cheapest tried inside a backward on a CPU)."""
        sink = self.sink
        if sink is not None:
            sink(torch.linalg.vector_norm(grad))

    def after_backward(self, index: int) -> None:
        """After micro-batch `index`'s backward: its squared norm joins the window's small-batch sum."""
        counts = self.counts
        if counts is None:
            return
        if index < self.prefix - 1:  # the first micro-batches accumulate into one group
            return
        if index == self.prefix - 1:
            grads = [p.grad for p in self.watched if p.grad is not None]
            norms = [torch.nn.utils.get_total_norm(grads)] if grads else []
            items = sum(counts[: self.prefix])
            self.sink = self.norms.append  # the hooks take the next micro-batches
        else:
            norms = self.norms[:]
            self.norms.clear()  # in place: the hooks append to this list
            items = counts[index] if index < len(counts) else 0
        if items and norms:  # without loss-bearing items (or hooks that saw no gradient) there is nothing to weigh
            self.groups.append(torch.stack(norms).double().square().sum())
            self.weights.append(self.b_big / items)

    def end_window(self, big_norm: float, finite: bool, scale: float = 1.0) -> dict:
        """After the window's gradient norm (unscaled, before clipping; `scale`: the fp16 GradScaler's, which scaled
        the micro-batch norms): its estimates, folded into the averages. Under DDP every rank must call this."""
        counts, self.counts, self.sink = self.counts, None, None
        record: dict = {}
        if counts is not None:
            device = self.setup.device
            small = torch.zeros((), dtype=torch.float64, device=device)  # sum over i of (B_big / b_i) |h_i|^2
            if self.groups:
                squares = torch.stack(self.groups).double()
                small = (squares * torch.tensor(self.weights, dtype=torch.float64, device=device)).sum()
            groups = float(len(self.groups))
            if self.setup.world.distributed:  # every rank's micro-batches: the sum of the sums, and of their number
                totals = torch.stack([small, torch.tensor(groups, dtype=torch.float64, device=device)])
                torch.distributed.all_reduce(totals)
                small, groups = totals.tolist()
            if groups >= 2 and finite:
                b_small = self.b_big / groups
                grad_sq, trace = estimates(float(small) / scale**2, big_norm**2, b_small, self.b_big,
                                           self.window_population)
                if math.isfinite(grad_sq) and math.isfinite(trace):
                    self.grad_sq = self.ema * self.grad_sq + (1 - self.ema) * grad_sq
                    self.trace = self.ema * self.trace + (1 - self.ema) * trace
                    self.measured += 1
                    record = {"noise_grad_sq": grad_sq, "noise_trace": trace, "noise_b_small": b_small}
        # the smoothed B_simple, the ratio of the averages, undefined until both are positive
        if self.measured and self.grad_sq > 0 and self.trace > 0:
            record["noise_scale"] = self.trace / self.grad_sq
        return record

    def state_dict(self) -> dict:
        return {"grad_sq": self.grad_sq, "trace": self.trace, "measured": self.measured, "ema": self.ema,
                "population": self.population}  # (summary.json's train_size, when a resume runs no step)

    def load_state_dict(self, state: dict) -> None:
        self.grad_sq, self.trace = state["grad_sq"], state["trace"]
        self.measured, self.ema = state["measured"], state["ema"]
        self.population = state.get("population", self.population)


# ---- the run's summary and its sentence -------------------------------------------------------------------


def not_measured_reason(world_size: int, accumulation_steps: int, sharded: bool = False) -> str | None:
    """Why a run cannot measure the noise scale at all, or None (`accumulation_steps`: its largest N)."""
    if sharded:
        return ("FSDP's sharded parameters are outside the autograd graph, where the measurement's hooks would see "
                "each micro-batch's gradient")
    if world_size == 1 and accumulation_steps == 1:
        return ("one micro-batch per optimizer step on one process (accumulation 1) leaves no smaller batch to "
                "compare the window with")
    return None


# The fewest measured optimizer steps a verdict rests on: the last tenth of the run when it holds this many, else the
# EMA at the end when the run measured this many; with fewer, the sentence is withheld.
MIN_VERDICT_STEPS = 10


def summarise(records: list[dict], total_steps: int, task: str, reason: str | None = None, warmup_steps: int = 0,
              diverged: dict | None = None, train_size: int | None = None) -> dict:
    """summary.json's `noise_scale`: `final`, `last_tenth` (mean tr(Sigma) over mean |G|^2 in the last tenth's
    steps of metrics.jsonl, a resumed run's too) and the sentence, from the figure `verdict_from` names, or `withheld`.
    `reason`: why the run could not measure, said at its start; `train_size` bounds any larger batch it speaks of."""
    unit = {"classification": "samples", "language-modeling": "tokens"}.get(task, "items")
    steps = [r for r in records if "noise_trace" in r and "step" in r]
    if not steps:  # `noted`: the run said why at its start (once is enough)
        why = reason or "no optimizer step had two micro-batches and finite gradients to compare with its window"
        return {"measured_steps": 0, "unit": unit, "reason": why, "noted": reason is not None,
                "sentence": f"not measured: {why}"}
    first_of_tenth = total_steps - max(1, math.ceil(total_steps / 10)) + 1
    tenth = [r for r in steps if r["step"] >= first_of_tenth]
    mean = lambda key, rows: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    last_tenth = None
    if tenth and mean("noise_grad_sq", tenth) > 0 and mean("noise_trace", tenth) > 0:
        last_tenth = mean("noise_trace", tenth) / mean("noise_grad_sq", tenth)
    final = next((r.get("noise_scale") for r in reversed(records) if "step" in r and "loss" in r), None)
    summary = {
        "final": final,
        "last_tenth": last_tenth,
        "last_tenth_steps": [first_of_tenth, total_steps],
        "unit": unit,
        "effective_batch": mean("items", tenth or steps) if "items" in steps[0] else None,
        "small_batch": mean("noise_b_small", tenth or steps),
        "measured_steps": len(steps),
        "ema_factor": EMA_FACTOR,
        "train_size": train_size,
    }
    if last_tenth is not None and len(tenth) >= MIN_VERDICT_STEPS:
        summary["verdict_from"] = "last_tenth"
    elif len(steps) >= MIN_VERDICT_STEPS:
        summary["verdict_from"] = "final" if final is not None else None
    withheld = None  # why the noise scale says nothing about the run's batch
    if diverged:
        withheld = (f"the loss diverged (step {diverged['step']}): a noise scale measured on it says nothing of the "
                    "batch")
    elif total_steps <= warmup_steps:
        withheld = (f"the run ended at step {total_steps}, inside its warm-up of {warmup_steps} optimizer steps, where "
                    "the gradient's statistics are those of the start of training")
    elif "verdict_from" not in summary:
        withheld = (f"the measurement covers {len(steps)} optimizer steps ({len(tenth)} in the last tenth of the run), "
                    f"fewer than the {MIN_VERDICT_STEPS} a verdict needs")
    if withheld:
        summary.update(verdict_from=None, withheld=withheld, sentence=f"verdict withheld: {withheld}")
    else:
        summary["sentence"] = sentence(summary)
    return summary


def _number(value: float) -> str:
    """680, 12, 1.2, 0.0033: a measurement this noisy has no more digits to give."""
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def sentence(summary: dict) -> str:
    """The run's batch against the noise scale, in words (McCandlish et al. 2018, eqs. 2.11-2.12: a batch B needs
    S_min (1 + B_noise / B) steps and E_min (1 + B / B_noise) items; B_simple stands in for B_noise ~ B_crit)."""
    figure = summary.get("verdict_from", "last_tenth" if summary.get("last_tenth") else "final")
    noise = summary.get(figure) if figure else None
    batch, unit = summary.get("effective_batch"), summary["unit"]
    if noise is None:
        far = f" far above the effective batch {_number(batch)} {unit}" if batch else " larger than it can tell"
        return ("not resolved: the |G|^2 estimates averaged to <= 0 over the last tenth of the run, the gradient's "
                f"signal lost in its noise at this batch (as when training has converged): the noise scale is{far}")
    where = "over the last tenth of the run" if figure == "last_tenth" else "at the end"
    if batch is None:
        return f"~{_number(noise)} {unit} ({where})"
    ratio = batch / noise
    steps, data = 1 + 1 / ratio, 1 + ratio
    head = (f"the effective batch {_number(batch)} {unit} is {_number(ratio)}x the measured noise scale "
            f"~{_number(noise)} ({where})")
    if ratio > 2:
        return (f"{head}: past the critical batch; by McCandlish et al. 2018 it takes ~{_number(steps)}x the fewest "
                f"optimizer steps but ~{_number(data)}x the fewest {unit}: {unit} beyond ~{_number(noise)} per step "
                "buy little")
    train_size = summary.get("train_size")
    if ratio < 0.5 and train_size and batch >= train_size / 2:  # no batch twice this one exists in the data
        return (f"{head}: below the critical batch, but the training set holds only {_number(train_size)} {unit}: "
                f"no batch much larger than this one exists in it (the whole set is "
                f"{_number(train_size / batch)}x this batch)")
    if ratio < 0.5:
        larger = (f", up to the training set's {_number(train_size)} {unit}," if train_size and noise > train_size
                  else "")
        return (f"{head}: below the critical batch; by McCandlish et al. 2018 a larger batch{larger} would still cut "
                f"the optimizer steps almost in proportion (this one takes ~{_number(steps)}x the fewest steps, "
                f"~{_number(data)}x the fewest {unit})")
    return (f"{head}: near the critical batch, McCandlish et al. 2018's balance of steps and {unit} "
            f"(~{_number(steps)}x the fewest optimizer steps, ~{_number(data)}x the fewest {unit})")
