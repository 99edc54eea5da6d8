"""The probe in tokens: the largest token budget T per micro-batch that fits, for `data.packing: sorted` / `packed`.

The sample probe (runner.run_probe, search.search over micro-batches of m samples) measures m copies of the longest
example, L tokens each. With `packed` those are the way's own micro-batches (Workload.packed_rows: m rows of L, the
position ids restarting inside each row, so a trial attends through transformers' block mask over the whole row as
the run does, quadratic in the row under a dense kernel), and T = m x L is as fine as packed rows of L allow.

With `sorted` a micro-batch of T tokens is rows x its longest row. The sample probe brackets T: m rows of L fit,
m + 1 rows do not. Between them, the largest micro-batch of T tokens (m x L < T < (m + 1) x L) is k = m + 1 rows
of T // k tokens: any other sorted micro-batch within T computes no more tokens (its rows x longest row <= T), and
either at most m rows (at most m rows of L, measured to fit) or rows no longer than T // k (attention's pairs,
rows x row^2, at most this shape's). So `token_search` measures that shape at T = m x L + x x step, in steps of
L / TOKEN_STEPS tokens, with the same pure search over fits(x) (search.search) and the same meters; the answer
is a budget measured to fit, never one only predicted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .search import SearchResult, search
from .workload import Workload

TOKEN_STEPS = 8  # steps of the token search per longest example: L / 8 tokens (57 for Alpaca-mini's 456)


class SortedBudget(Workload):
    """The recipe's workload whose `batch(x)` is the largest sorted micro-batch of T(x) = m x L + x x step tokens:
    m + 1 rows of T(x) // (m + 1) tokens of the longest example."""

    def __init__(self, workload: Workload, rows: int, longest: int, step: int):
        super().__init__(workload.recipe, workload.data)
        self.fitting_rows, self.longest_length, self.step = rows, longest, step

    def budget(self, x: int) -> int:
        return self.fitting_rows * self.longest_length + x * self.step

    def batch(self, micro_batch: int) -> tuple[Any, Any]:
        return self.rows(self.fitting_rows + 1, self.budget(micro_batch) // (self.fitting_rows + 1))


def token_search(found: SearchResult, workload: Workload, make_meter: Callable[[Workload], Any]) -> dict:
    """`sorted`: the largest T between the sample probe's m x L (fits) and (m + 1) x L (does not) measured to fit,
    as ProbeResult's fields (`token_trials`: each trial with its budget T as micro_batch); none when the sample
    probe answered the whole per-rank batch (nothing larger is needed) or not even one row."""
    rows = found.micro_batch_max
    if rows is None or found.capped:
        return {}
    longest = len(workload.longest()[0])
    step = math.ceil(longest / TOKEN_STEPS)
    cap = (longest - 1) // step  # below (m + 1) x L, which the sample probe measured not to fit
    budgeted = SortedBudget(workload, rows, longest, step)
    fitting, trials = 0, []  # fitting: the largest x measured to fit (0: m x L, measured by the sample probe)
    if cap >= 1:
        meter = make_meter(budgeted)
        try:
            result = search(meter.measure, meter.limit_bytes, cap)
        finally:
            meter.close()
        fitting = result.micro_batch_max or 0
        trials = [dataclasses.replace(t, micro_batch=budgeted.budget(t.micro_batch)).to_json() for t in result.trials]
    return {"token_budget": budgeted.budget(fitting), "token_step": step, "longest": longest, "token_trials": trials}
