"""`reproduce check --annotations github`: each failing check as a GitHub Actions `::error file=PATH,line=N,...`
command, on the line of the stated value that failed, else of the check itself; the path relative to
$GITHUB_WORKSPACE when the file lies under it. Values escaped as the runner's command parser expects."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from .load import LoadedFile
from .runner import Result

STATED = re.compile(r"^([A-Za-z_][\w.]*): expected ")  # plan_problems' "FIELD: expected X, the plan has Y"


def _key_line(node: yaml.Node, name: str) -> int | None:
    """1-based line of the first key `name` inside `node` (depth first), None when there is none."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == name:
                return key.start_mark.line + 1
            found = _key_line(value, name)
            if found is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _key_line(item, name)
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
