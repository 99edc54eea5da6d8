"""docs/papers.md's hardware table is `reproduce papers --devices --markdown`'s output, so it lists every recipe and
cannot go stale; the command itself reads the recipes and the GPU catalog only (no torch)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from reproduce.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ROOT / "papers"
START, END = "<!-- generated: reproduce papers --devices --markdown -->\n", "<!-- end generated -->"
MEASURED = "<!-- generated: reproduce papers --devices --estimate --markdown (measured) -->\n"


def devices_markdown(capsys, *extra: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["papers", "--dir", str(PAPERS), "--devices", "--markdown", *extra])
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    return captured.out


def test_docs_table_is_the_commands_output(capsys):
    text = (ROOT / "docs" / "papers.md").read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(MEASURED) == 1
    pasted = text.split(START, 1)[1].split(END, 1)[0]
    assert pasted == devices_markdown(capsys), (
        "docs/papers.md: the hardware table is not `reproduce papers --devices --markdown`'s output; paste it again")


def test_readme_table_is_the_commands_output(capsys):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(START) == 1
    pasted = text.split(START, 1)[1].split(END, 1)[0]
    assert pasted == devices_markdown(capsys), (
        "README.md: the papers table is not `reproduce papers --devices --markdown`'s output; paste it again")


def test_the_table_has_a_row_for_every_recipe_and_says_what_the_estimate_does(capsys):
    rows = devices_markdown(capsys).splitlines()[2:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [p.stem for p in sorted(PAPERS.glob("*.yaml"))]
    row = {line.split(" | ")[0].removeprefix("| "): line for line in rows}
    assert row["goyal2017-resnet50"] == ("| goyal2017-resnet50 | 256 x P100-SXM2-16GB | 32 | - | 8,192 samples | - | "
                                         "p100-sxm2 (16 GiB) |")
    assert row["nanogpt-gpt2-124m"].startswith("| nanogpt-gpt2-124m | 8 x A100-40GB | 12 | 5 | 491,520 tokens |")
    assert row["taori2023-alpaca-7b"].endswith("| fsdp | a100-80gb (80 GiB) |")
    assert "a TPU: not modelled" in row["you2019-lamb-bert-large"] and "(of 2 phases)" in row["you2019-lamb-bert-large"]
    assert "no device stated" in row["he2016-resnet50"] and "runs here" in row["digits-mlp"]
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 8 for line in rows)  # seven cells each


def test_without_markdown_it_is_a_table_and_markdown_alone_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["papers", "--dir", str(PAPERS), "--devices"])
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None) and "│ goyal2017-resnet50" in out and "P100-SXM2-16GB" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["papers", "--dir", str(PAPERS), "--markdown"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip() == (
        "error: --markdown: only with --devices (reproduce papers --devices --markdown)")


def test_the_devices_table_imports_no_torch():
    code = ("import sys; from reproduce.cli import main\n"
            "try:\n    main(['papers', '--devices', '--markdown'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stderr.strip().splitlines()[-1] == "False" and "| goyal2017-resnet50 |" in done.stdout


def table_rows(markdown: str) -> list[list[str]]:
    return [re.split(r" (?<!\\)\| ", line.strip("| ")) for line in markdown.strip().splitlines()[2:]]


def test_the_measured_table_in_the_docs_has_the_same_rows(capsys):
    """The estimate's figures are measured (minutes), so the docs' copy is checked for its rows: the same recipes,
    the same hardware columns as the command prints now."""
    text = (ROOT / "docs" / "papers.md").read_text(encoding="utf-8")
    measured = table_rows(text.split(MEASURED, 1)[1].split(END, 1)[0])
    plain = table_rows(devices_markdown(capsys))
    assert [row[:7] for row in measured] == plain
    assert all(len(row) == 9 for row in measured)


def test_the_estimate_columns(monkeypatch, tmp_path):
    from reproduce.cli.papers import estimate_cells

    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path))
    assert estimate_cells(PAPERS / "nanogpt-shakespeare-char.yaml") == [">= 64", "1.00"]  # capped at its batch
    assert estimate_cells(PAPERS / "you2019-lamb-bert-large.yaml") == ["-", "-"]  # a TPU
    assert estimate_cells(PAPERS / "he2016-resnet50.yaml") == ["-", "-"]  # no device stated
