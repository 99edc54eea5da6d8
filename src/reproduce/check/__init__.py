"""Reproduction checks for CI: check files (YAML) that name a recipe, a budget and what must hold (docs/checks.md).

Files are validated strictly, every problem one line, before anything runs; runs train in a work folder and are
shared between the checks that name them. Torch is imported only when a check trains or verifies.
"""

from .invariants import plan_problems
from .load import LoadedFile, Run, collect, load_all, load_check_file, merge
from .report import ICONS, check_outputs, counts, junit_xml, markdown, tally, write_reports
from .runner import Result, Runner, prepare_work, run_checks
from .schema import KINDS, CheckFile

__all__ = ["ICONS", "KINDS", "CheckFile", "LoadedFile", "Result", "Run", "Runner", "check_outputs", "collect",
           "counts", "junit_xml", "load_all", "load_check_file", "markdown", "merge", "plan_problems", "prepare_work",
           "run_checks", "tally", "write_reports"]
