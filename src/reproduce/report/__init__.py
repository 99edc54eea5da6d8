"""`reproduce report RUN_DIR ... --out report.html`: a run's (or several runs') result in one file.

One self-contained HTML file (plots embedded, no network) and its Markdown twin: the plan against the paper,
the curves of every run overlaid (loss, evaluation metrics, learning rate, gradient norm, throughput, noise
scale against the effective batch), and the paper's reported metric beside the run's final value with its
tolerance and verdict. Runs still going, stopped or resumed are reported as far as they got.
"""

from .runs import RunFolder, load_run, load_runs
from .verdict import Verdict, verdicts
from .write import write_report

__all__ = ["RunFolder", "Verdict", "load_run", "load_runs", "verdicts", "write_report"]
