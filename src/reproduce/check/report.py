"""The suite's reports: JUnit XML for CI test views and Markdown for a job summary."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from ..errors import UserError
from ..plan.planfile import check_writable, write_text_atomic
from ..report.document import markdown_cell as _cell
from .runner import Result


def counts(results: list[Result]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in ("pass", "fail", "error")}


def junit_xml(results: list[Result], seconds: float) -> str:
    """JUnit XML: one testsuite per check file, one testcase per check; failures and errors with details."""
    total = counts(results)
    suites = ET.Element("testsuites", name="reproduce check", tests=str(len(results)),
                        failures=str(total["fail"]), errors=str(total["error"]), time=f"{seconds:.2f}")
    for file in dict.fromkeys(r.file for r in results):
        mine = [r for r in results if r.file == file]
        c = counts(mine)
        suite = ET.SubElement(suites, "testsuite", name=file, tests=str(len(mine)), failures=str(c["fail"]),
                              errors=str(c["error"]), skipped="0", time=f"{sum(r.seconds for r in mine):.2f}")
        for r in mine:
            case = ET.SubElement(suite, "testcase", classname=f"reproduce.{Path(file).stem}", name=r.name,
                                 time=f"{r.seconds:.2f}")
            text = f"measured: {r.measured}\nexpected: {r.expected}\n" + "\n".join(r.details)
            if r.status == "fail":
                ET.SubElement(case, "failure", message=f"measured {r.measured}; expected {r.expected}",
                              type=r.kind).text = text
            elif r.status == "error":
                ET.SubElement(case, "error", message=(r.details or ["error"])[0], type=r.kind).text = text
            ET.SubElement(case, "system-out").text = text
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


ICONS = {"pass": "✅ pass", "fail": "❌ FAIL", "error": "💥 ERROR"}


def markdown(results: list[Result], seconds: float) -> str:
    """A Markdown report for a CI job summary: totals, one table row per check, then the failures' details."""
    c = counts(results)
    head = f"{c['pass']} passed, {c['fail']} failed" + (f", {c['error']} errors" if c["error"] else "")
    lines = [f"## reproduce check: {head} in {seconds:.0f} s", "",
             "| status | file | check | measured | expected | seconds |", "|---|---|---|---|---|---:|"]
    for r in results:
        cells = [ICONS[r.status], r.file, r.name, r.measured, r.expected, f"{r.seconds:.1f}"]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    bad = [r for r in results if not r.passed]
    if bad:
        lines += ["", "### Failures", ""]
        for r in bad:
            lines.append(f"- **{_cell(r.file)}: {_cell(r.name)}** ({r.status}): measured {_cell(r.measured)}; "
                         f"expected {_cell(r.expected)}")
            lines += [f"  - {_cell(d)}" for d in r.details]
    plots = [r for r in results if r.plot]
    if plots:
        lines += ["", "### Plots", ""] + [f"- {r.file}: {r.name}: `{r.plot}`" for r in plots]
    return "\n".join(lines) + "\n"


def write_reports(results: list[Result], seconds: float, junit: Path | None, summary: Path | None) -> None:
    if junit is not None:
        write_text_atomic(junit, junit_xml(results, seconds))
    given = os.environ.get("GITHUB_STEP_SUMMARY")  # GitHub's job summary: appended to, as the job's other steps do
    if summary is not None:
        if given and summary.exists() and Path(given).exists() and summary.resolve() == Path(given).resolve():
            with summary.open("a", encoding="utf-8") as out:
                out.write(markdown(results, seconds))
        else:
            write_text_atomic(summary, markdown(results, seconds))


def check_outputs(junit: Path | None, summary: Path | None, plots: Path | None, inputs: list[Path]) -> None:
    """Refuse output paths that are folders, lie under files, or are one of the check files."""
    from ..report.checks import html_beside

    for path, option in ((junit, "`junit`"), (summary, "`summary`"),
                         (html_beside(junit) if junit else None, "`junit` (its HTML report beside it)")):
        if path is not None:
            check_writable(path, option, protect=tuple(inputs))
    if plots is not None and plots.exists() and not plots.is_dir():
        raise UserError(f"{plots} exists and is not a folder", field="plots")
