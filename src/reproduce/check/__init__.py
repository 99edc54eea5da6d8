"""Reproduction checks for CI: check files (YAML) that name a recipe, a budget and what must hold (docs/checks.md).

Files are validated strictly, every problem one line, before anything runs; runs train in a work folder and are
shared between the checks that name them. Torch is imported only when a check trains or verifies.
"""

from .load import collect, load_all, load_check_file, merge
from .report import ICONS, check_outputs, tally, write_reports
from .runner import Runner, prepare_work, run_checks

__all__ = ["ICONS", "Runner", "check_outputs", "collect", "load_all", "load_check_file", "merge", "prepare_work",
           "run_checks", "tally", "write_reports"]
