"""The figures docs/recipes.md shows from `reproduce papers` (how many recipes run here, each model's parameter count,
each optimizer) are that command's output, pasted between `<!-- generated: ... -->` markers: this test runs the
commands and fails when the docs' copy differs (paste the new output). The model table's bert-base count is the
listing's too."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import cli

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DOC = ROOT / "docs" / "recipes.md"


def generated(text: str, command: str) -> str:
    """The fenced block under `<!-- generated: COMMAND ...`, without its fences and its `$ ` line."""
    start = text.index(f"<!-- generated: {command}")
    block = text[start:text.index("<!-- end generated -->", start)]
    body = block.split("```\n", 1)[1].rsplit("```\n", 1)[0]
    return body.split("\n", 1)[1]  # after the `$ reproduce ...` line


def test_the_papers_listing_in_the_docs_is_the_commands_output(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # `reproduce papers` lists ./papers
    code, out, err = cli(capsys, "papers")
    assert code == 0, err
    text = RECIPES_DOC.read_text(encoding="utf-8")
    assert generated(text, "reproduce papers (") == out, (
        "docs/recipes.md: the `reproduce papers` block is not the command's output; paste it again")
    runnable, plan_only = map(int, re.search(r"(\d+) runnable here, (\d+) plan-only", out).groups())
    assert runnable + plan_only == len(list((ROOT / "papers").glob("*.yaml")))
    bert = re.search(r"devlin2019-bert-base .*│ (adamw?) [\d.]+ +│ bert-base ([\d.]+M) ", out)
    assert bert is not None
    row = next(line for line in text.splitlines() if line.startswith("| `bert-base` |"))
    assert f"| {bert.group(2)} |" in row  # the model table's parameters built: the listing's count


def test_the_papers_show_summary_in_the_docs_is_the_commands_output(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = cli(capsys, "papers", "show", "tloen2023-alpaca-lora")
    assert code == 0, err
    summary = out[out.index("\ntloen2023-alpaca-lora: ") + 1:]
    shown = generated(RECIPES_DOC.read_text(encoding="utf-8"), "reproduce papers show tloen2023-alpaca-lora")
    assert shown.removeprefix("...\n") == summary
