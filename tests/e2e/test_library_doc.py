"""docs/library.md: every `python` block runs as written, in a namespace of its own, and each `print(...)  # X: ...`
prints X (the page shows what the code prints)."""

from __future__ import annotations

import contextlib
import io
import re
import warnings

import pytest

from docs_commands import ROOT

PAGE = ROOT / "docs" / "library.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
SAID = re.compile(r"^\s*print\(.*\)\s+# ([^:]+)(:|$)")


def test_the_page_has_its_examples():
    assert len(BLOCKS) == 6


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_example_runs_and_prints_what_the_page_says(index, one_thread, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = BLOCKS[index].replace("/tmp/library-doc-trainer", str(tmp_path / "trainer"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block, f"docs/library.md block {index + 1}", "exec"), {"__name__": "library_doc"})
    lines = [line.strip() for line in printed.getvalue().splitlines()]
    expected = [match.group(1).strip() for match in map(SAID.match, block.splitlines()) if match]
    assert expected, "each example says what it prints"
    for said in expected:
        assert said in lines, f"block {index + 1}: the page says {said!r}; it printed {lines}"
