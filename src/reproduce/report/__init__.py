"""`reproduce report RUN_DIR ... --out report.html`: runs' results in one self-contained HTML file (plots
embedded) and its Markdown twin: the plan against the paper, the curves overlaid, the paper's metric and the verdict.
"""

from .runs import RunFolder, Verdict, load_run, load_runs, verdicts
from .write import write_report

__all__ = ["RunFolder", "Verdict", "load_run", "load_runs", "verdicts", "write_report"]
