"""Reproduction checks for CI: check files (YAML) that name a recipe, a budget, and what must hold.

A check file (`reproduce/*.yaml`):

    recipe: ../papers/digits-mlp.yaml      # relative to the check file (or to the working directory)
    budget: {micro_batch_max: 32, device: cpu, max_steps: 300, seeds: [0]}
    runs:                                   # optional variants of the recipe; `main` is the recipe itself
      plain: {budget: {micro_batch_max: 256}}
      no-scaling: {recipe: ../papers/other.yaml, overrides: {optimizer: {lr: 0.1}}}
    checks:
      - {kind: plan, expect: {micro_batch: 32, accumulation_steps: 8, exact: true}}
      - {kind: verify}                                   # gradient equivalence, via `reproduce verify`
      - {kind: metric, metric: eval_accuracy, min: 0.95}
      - {kind: metric, metric: eval_loss, baseline: data.unigram_loss, max_ratio: 0.8}
      - {kind: metric, metric: top1_accuracy, reported: top1_accuracy, scale: 100}
      - {kind: compare, a: main, b: plain, metric: loss, tolerance: 0.01}

Files are validated strictly (unknown keys, wrong types, unknown run names, recipes that do not load),
every problem one line, before anything runs. Runs train in a work folder (temporary unless given) and
are shared between the checks that name them. Torch is imported only when a check trains or verifies.
"""

from .invariants import plan_problems
from .load import LoadedFile, Run, collect, load_all, load_check_file, merge
from .report import ICONS, check_outputs, counts, junit_xml, markdown, write_reports
from .runner import Result, Runner, cleanup, prepare_work, run_checks
from .schema import KINDS, CheckFile

__all__ = ["ICONS", "KINDS", "CheckFile", "LoadedFile", "Result", "Run", "Runner", "check_outputs", "cleanup",
           "collect", "counts", "junit_xml", "load_all", "load_check_file", "markdown", "merge", "plan_problems",
           "prepare_work", "run_checks", "write_reports"]
