"""The gradient noise scale, measured during accumulation at no extra pass (McCandlish et al. 2018).

The simple noise scale `B_simple = tr(Sigma) / |G|^2` (arXiv 1812.06162, eq. 2.9) compares the variance of one
item's gradient, tr(Sigma), with the squared norm of the true gradient G. Items are what the loss is averaged
over: samples, or target tokens for language models. For a batch of B items, E|G_B|^2 = |G|^2 + tr(Sigma) / B, so
the squared norms of a small and a big batch gradient give unbiased estimates of both (their Appendix A.1):

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Accumulation computes both anyway, with no extra pass and no copy of any gradient. B_big is the window (the
effective batch): |G_big| is the norm the step takes (unscaled, before clipping). The small batches are groups of
each rank's micro-batches: the first half (rounded up) is one group, measured from `.grad` after their backward
passes with one fused norm; each of the last half is its own, its norm taken by a hook on every parameter before
the gradient is accumulated (and, under DDP, reduced: the first half never synchronises), so every group is one
rank's local gradient and a sum over ranks joins them. |G_small|^2 is the items-weighted average of the K groups'
squared norms, with B_small = B_big / K: the paper's data-parallel recipe with groups as the devices. Averaging
groups that make up the window cancels the 2 G.(noise) term |G_small|^2 and |G_big|^2 share: the tr(Sigma) estimate
is never negative and many times steadier (325% spread per window with one small batch, 30% with 5 groups, on the
language model of tests/torch/observe/test_noise_scale.py). One micro-batch per step on one process has no smaller
batch, and under FSDP the hooks see no gradient: no estimate (the run says so at its start).

A window is drawn without replacement from n items, which shrinks a batch's variance by (1 - B/n): the |G|^2
estimate comes out low by tr(Sigma)/n, which is added back (nothing on large data, +8% on the 1,437 digits early on,
and it keeps |G|^2 positive late, when B_simple nears n). Each estimate is smoothed by its own exponential moving
average and the noise scale is the ratio of the two averages, as the paper advises (E[a/b] != E[a]/E[b]). Nothing
here writes to a gradient or a weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# The EMA factor: each window's estimates weigh 1 - EMA_FACTOR. 0.95 averages the equivalent of (1 + b) / (1 - b)
# = 39 windows, which brings the per-window spread measured on the built-in GPT (bench/noise_scale.py: 55% for
# |G|^2, 15% for tr(Sigma) late in its run) under 10%, while the mean age of what it averages, b / (1 - b) = 19
# optimizer steps, stays short next to how the noise scale drifts in training (it grows as the loss falls: ~570 to
# ~9,100 tokens between the GPT's steps 60 and 300).
EMA_FACTOR = 0.95

# The share of a window's micro-batches (its last ones, at least one) whose norms the parameter hooks take one by
# one; the micro-batches before them form one more group, measured from `.grad` after their backward passes with
# one fused norm. A hooked micro-batch costs a reduction per parameter tensor inside its backward, 1-2% of its
# forward and backward for the built-in GPT on a CPU (bench/noise_scale.py), so hooking half keeps a step near 1%. The
# N/2 + 1 groups cancel the 2 G.noise term all the same; fewer groups leave the tr(Sigma) estimate noisier: on
# the digits MLP with N = 8, its spread per window is 15% with every micro-batch on its own, 19% with 5 groups
# (this share), 29% with 3 and 41% with 2, against 44% for the first micro-batch alone.
HOOKED_SHARE = 0.5


def estimates(small_sq: float, big_sq: float, b_small: float, b_big: float,
              population: float | None = None) -> tuple[float, float]:
    """The unbiased (|G|^2, tr(Sigma)) estimates from the squared norms of a small and a big batch gradient (A.1),
    for batches drawn without replacement from `population` items when it is given (see the module docstring)."""
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    if population:
        grad_sq += trace / population
    return grad_sq, trace


@dataclass
class Window:
    """One window: this rank's items per micro-batch, the global items, and the norms gathered so far (0-d
    tensors on the device: nothing waits for the device until the window's end)."""

    counts: list[int]
    b_big: int
    population: float | None  # the training set's items, for the finite-population correction
    parameters: list[torch.Tensor] = field(default_factory=list)  # |h| per parameter, of the running backward
    groups: list[torch.Tensor] = field(default_factory=list)  # |h_k|^2 of each group k of micro-batches with items
    weights: list[float] = field(default_factory=list)  # B_big / b_k: |g_k|^2 = |h_k|^2 (B_big / b_k)^2


class NoiseScale:
    """Measures B_simple over a run: `start_window`, `after_backward` per micro-batch, `end_window` per step.

    `end_window` returns the fields for the step's metrics record: `noise_scale` (the smoothed B_simple, from the
    first measured step on, while it is defined), and for a measured step its raw pieces: `noise_grad_sq` and
    `noise_trace` (the step's unbiased |G|^2 and tr(Sigma) estimates, gradients of the mean loss per item) and
    `noise_b_small` (B_small in items).
    """

    def __init__(self, setup: Any, ema: float = EMA_FACTOR, hooked_share: float = HOOKED_SHARE):
        self.setup, self.ema, self.hooked_share = setup, ema, hooked_share
        self.dataset_size = len(setup.data.train)
        self.population: float | None = None  # the training set in items (tokens for a language model)
        self.window: Window | None = None
        self.sink = None  # the running window's `parameters.append`: the hooks' one attribute to look up
        self.grad_sq = self.trace = 0.0  # EMA sums (not bias-corrected: the ratio cancels the correction)
        self.measured = 0
        self.prefix = 0  # the window's first micro-batches, measured together from `.grad` after the last of them
        self.watched = self.parameters_to_watch()
        self.hooks = [p.register_hook(self._gradient) for p in self.watched]

    def parameters_to_watch(self) -> list[torch.Tensor]:
        """The tensors whose per-micro-batch gradients make up the model's gradient: its trainable parameters.

        Under FSDP2 the sharded parameters are not in the autograd graph (the all-gathered unsharded ones are), so
        hooks on them are never called (checked with two gloo processes) and `reproduce run` does not measure under
        FSDP. A sharded path would watch the unsharded parameters, and read the first half's group from the
        unsharded accumulation FSDP keeps with its gradient sync off.
        """
        return [p for p in self.setup.unwrapped_model.parameters() if p.requires_grad]

    def close(self) -> None:
        """Remove the parameter hooks (a model used after the run computes no norms)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    # ---- the hooks the optimizer step calls ------------------------------------------------------------

    def start_window(self, counts: list[int], count: int, samples: int) -> None:
        """Before the window's first backward: this rank's items per micro-batch, and the window's items and
        samples over all ranks (items per sample x the training set's samples = its items, for token counts)."""
        population = self.dataset_size * count / samples if samples else None
        self.population = population or self.population
        self.window = Window(list(counts), count, population)
        # The first micro-batches' summed gradient is what `.grad` holds after their backward passes when it starts
        # empty (set_to_none): one fused norm, no hooks. The last `hooked` ones (DDP: always the synchronising last
        # one) are measured one by one by the hooks.
        hooked = max(1, int(len(counts) * self.hooked_share))
        empty = all(p.grad is None for p in self.watched)
        self.prefix = len(counts) - hooked if empty else 0
        self.sink = None if self.prefix else self.window.parameters.append

    def _gradient(self, grad: torch.Tensor) -> None:
        """A parameter's gradient from the current backward, before it is accumulated (and, under DDP, reduced).
        Called once per parameter and micro-batch, so it does as little as it can: |g| as a 0-d tensor on its
        device, one reduction and no copy (of those tried inside a backward on a CPU, the cheapest; half precision
        accumulates in float32). A rank's slice of a parameter (FSDP) would give a partial norm, its squares to be
        summed over the ranks."""
        sink = self.sink
        if sink is not None:
            sink(torch.linalg.vector_norm(grad))

    def after_backward(self, index: int) -> None:
        """After micro-batch `index`'s backward: its squared norm joins the window's small-batch sum."""
        window = self.window
        if window is None:
            return
        if index < self.prefix - 1:  # the first micro-batches accumulate into one group
            return
        if index == self.prefix - 1:
            grads = [p.grad for p in self.watched if p.grad is not None]
            norms = [torch.nn.utils.get_total_norm(grads)] if grads else []
            items = sum(window.counts[: self.prefix])
            self.sink = window.parameters.append  # the hooks take the next micro-batches
        else:
            norms = window.parameters[:]
            window.parameters.clear()  # in place: the hooks append to this list
            items = window.counts[index] if index < len(window.counts) else 0
        if items and norms:  # without loss-bearing items (or hooks that saw no gradient) there is nothing to weigh
            window.groups.append(torch.stack(norms).double().square().sum())
            window.weights.append(window.b_big / items)

    def end_window(self, big_norm: float, finite: bool, scale: float = 1.0) -> dict:
        """After the window's gradient norm (unscaled, before clipping): its estimates, folded into the averages.

        `scale` is the fp16 GradScaler's scale during the window (the micro-batch norms were taken scaled).
        Under DDP every rank must call this: it sums the ranks' micro-batch norms.
        """
        window, self.window, self.sink = self.window, None, None
        estimate = self._estimate(window, big_norm, finite, scale) if window is not None else None
        record: dict = {}
        if estimate is not None:
            grad_sq, trace, b_small = estimate
            self.grad_sq = self.ema * self.grad_sq + (1 - self.ema) * grad_sq
            self.trace = self.ema * self.trace + (1 - self.ema) * trace
            self.measured += 1
            record = {"noise_grad_sq": grad_sq, "noise_trace": trace, "noise_b_small": b_small}
        # the smoothed B_simple: the ratio of the two averages (their bias corrections cancel), undefined until both
        # are positive (a |G|^2 not yet resolved above the noise)
        if self.measured and self.grad_sq > 0 and self.trace > 0:
            record["noise_scale"] = self.trace / self.grad_sq
        return record

    def _estimate(self, window: Window, big_norm: float, finite: bool, scale: float):
        device = self.setup.device
        small = torch.zeros((), dtype=torch.float64, device=device)  # sum over i of (B_big / b_i) |h_i|^2
        if window.groups:
            squares = torch.stack(window.groups).double()
            small = (squares * torch.tensor(window.weights, dtype=torch.float64, device=device)).sum()
        groups = float(len(window.groups))
        if self.setup.world.distributed:  # every rank's micro-batches: the sum of the sums, and of their number
            totals = torch.stack([small, torch.tensor(groups, dtype=torch.float64, device=device)])
            torch.distributed.all_reduce(totals)
            small, groups = totals.tolist()
        if groups < 2 or not finite:
            return None
        small_sq = float(small) / scale**2
        b_big = window.b_big
        b_small = b_big / groups
        grad_sq, trace = estimates(small_sq, big_norm**2, b_small, b_big, window.population)
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return None
        return grad_sq, trace, b_small

    # ---- resuming -----------------------------------------------------------------------------------------
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
                "each micro-batch's gradient (see NoiseScale.parameters_to_watch)")
    if world_size == 1 and accumulation_steps == 1:
        return ("one micro-batch per optimizer step on one process (accumulation 1) leaves no smaller batch to "
                "compare the window with")
    return None


# The fewest measured optimizer steps a verdict rests on: the last tenth of the run when it holds this many, else the
# EMA at the end when the run measured this many; with fewer, the sentence is withheld.
MIN_VERDICT_STEPS = 10


def summarise(records: list[dict], total_steps: int, task: str, ema: float = EMA_FACTOR,
              reason: str | None = None, warmup_steps: int = 0, diverged: dict | None = None,
              train_size: int | None = None) -> dict:
    """summary.json's `noise_scale`: its value at the end, over the last tenth of the run, and the sentence
    (`reason`: why the run could not measure it, already said at its start). `verdict_from` names the figure the
    sentence used (`last_tenth` or `final`); the verdict is `withheld` (`withheld_reason`). `train_size` (the
    training set, in the same unit) bounds any larger batch the sentence speaks of. `last_tenth` is the ratio of the
    mean tr(Sigma) and |G|^2 estimates over the last tenth's steps, read from metrics.jsonl (a resumed run's too).
    """
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
        "ema_factor": ema,
        "train_size": train_size,
    }
    if last_tenth is not None and len(tenth) >= MIN_VERDICT_STEPS:
        summary["verdict_from"] = "last_tenth"
    elif len(steps) >= MIN_VERDICT_STEPS:
        summary["verdict_from"] = "final" if final is not None else None
    withheld = withheld_reason(summary, len(tenth), total_steps, warmup_steps, diverged)
    if withheld:
        summary.update(verdict_from=None, withheld=withheld, sentence=f"verdict withheld: {withheld}")
    else:
        summary["sentence"] = sentence(summary)
    return summary


def withheld_reason(summary: dict, tenth_steps: int, total_steps: int, warmup_steps: int,
                    diverged: dict | None) -> str | None:
    """Why the run's noise scale says nothing about its batch, or None."""
    if diverged:
        return f"the loss diverged (step {diverged['step']}): a noise scale measured on it says nothing of the batch"
    if total_steps <= warmup_steps:
        return (f"the run ended at step {total_steps}, inside its warm-up of {warmup_steps} optimizer steps, where the "
                "gradient's statistics are those of the start of training")
    if "verdict_from" not in summary:
        return (f"the measurement covers {summary['measured_steps']} optimizer steps ({tenth_steps} in the last tenth "
                f"of the run), fewer than the {MIN_VERDICT_STEPS} a verdict needs")
    return None


def _number(value: float) -> str:
    """680, 12, 1.2, 0.0033: a measurement this noisy has no more digits to give."""
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def sentence(summary: dict) -> str:
    """The run's batch against the measured noise scale, in words (McCandlish et al. 2018, eqs. 2.11-2.12).

    Their model: a batch B needs S = S_min (1 + B_noise / B) optimizer steps and E = E_min (1 + B / B_noise)
    items to reach a given loss; B_simple stands in for B_noise, and the critical batch is B_crit ~ B_noise.
    """
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
