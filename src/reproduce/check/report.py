"""The suite's reports: JUnit XML for CI test views, Markdown for a job summary, and with `--annotations github`
each failing check as a GitHub Actions `::error file=PATH,line=N,...` command, on the line of the stated value that
failed, else of the check itself; the path relative to $GITHUB_WORKSPACE when the file lies under it. Values escaped
as the runner's command parser expects."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from ..errors import UserError
from ..plan.planfile import check_writable, write_text_atomic
from ..report.document import counts, tally
from ..report.document import markdown_cell as _cell
from .load import LoadedFile
from .runner import Result


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
    lines = [f"## reproduce check: {tally(results)} in {seconds:.0f} s", "",
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
    from ..report.write import html_beside

    for path, option in ((junit, "`junit`"), (summary, "`summary`"),
                         (html_beside(junit) if junit else None, "`junit` (its HTML report beside it)")):
        if path is not None:
            check_writable(path, option, protect=tuple(inputs))
    if plots is not None and plots.exists() and not plots.is_dir():
        raise UserError(f"{plots} exists and is not a folder", field="plots")


STATED = re.compile(r"^([A-Za-z_][\w.]*): expected ")  # plan_problems' "FIELD: expected X, the plan has Y"


def _key_line(node: yaml.Node, name: str) -> int | None:
    """1-based line of the first key `name` inside `node` (depth first), None when there is none."""
    children = node.value if isinstance(node, yaml.MappingNode) else (
        [(None, item) for item in node.value] if isinstance(node, yaml.SequenceNode) else [])
    for key, value in children:  # (key node, value node); a list's items have no key
        if key is not None and key.value == name:
            return key.start_mark.line + 1
        found = _key_line(value, name)
        if found is not None:
            return found
    return None


def failure_line(node: yaml.Node, result: Result) -> int:
    """The line to annotate: the stated value the first detail names, else the check's first line."""
    for detail in result.details:
        stated = STATED.match(detail)
        if stated:
            line = _key_line(node, stated.group(1).split(".")[-1])
            if line is not None:
                return line
    return node.start_mark.line + 1


def shown_path(path: Path) -> str:
    """The file as GitHub resolves it: relative to $GITHUB_WORKSPACE, else to the working directory."""
    resolved = path.resolve()
    for base in (os.environ.get("GITHUB_WORKSPACE"), os.getcwd()):
        if base:
            try:
                return resolved.relative_to(Path(base).resolve()).as_posix()
            except ValueError:
                continue
    return path.as_posix()


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(files: list[LoadedFile], results: list[Result]) -> list[str]:
    """One `::error ...` line per check that did not pass (`results`: run_checks', every check of every file)."""
    places = [(file, index) for file in files for index in range(len(file.spec.checks))]
    if len(places) != len(results):
        raise ValueError(f"{len(results)} results for {len(places)} checks")
    nodes: dict[Path, list[yaml.Node]] = {}  # each file's `checks` items as YAML nodes, in order
    for file in files:
        root = yaml.compose(file.path.read_text(encoding="utf-8"))
        found = [value for key, value in root.value if key.value == "checks" and isinstance(value, yaml.SequenceNode)
                 ] if isinstance(root, yaml.MappingNode) else []
        nodes[file.path] = list(found[0].value) if found else []
    lines = []
    for (file, index), result in zip(places, results, strict=True):
        if result.passed:
            continue
        found = nodes[file.path]
        line = failure_line(found[index], result) if index < len(found) else 1
        title = f"reproduce check: {result.file}: {result.name} ({result.status})"
        message = "\n".join([f"measured {result.measured}; expected {result.expected}", *result.details])
        lines.append(f"::error file={_property(shown_path(file.path))},line={line},title={_property(title)}::"
                     f"{_data(message)}")
    return lines
