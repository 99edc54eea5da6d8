"""The `reproduce` commands shown in README.md and docs/*.md, so that none goes stale.

`tests/e2e/test_docs.py` checks each one against the CLI without running it (the command and every option exist,
files it reads are in the repository); `make docs-check` runs them all for real from the repository root and
compares each exit code with the one the docs show (`exit code N` in a comment, an `error:` line for 2, a
"does not fit" report for 3, else 0):

    python tests/docs_commands.py            # every command, minutes (full-size paper estimates among them)
    python tests/docs_commands.py plan.md    # the commands of the files whose names contain plan.md
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class DocCommand:
    file: Path
    line: int
    argv: list[str]  # after `reproduce` (or after `python -m` for a helper module such as reproduce.data.samples)
    expected_exit: int
    module: str = "reproduce"

    def __str__(self) -> str:
        shown = "reproduce" if self.module == "reproduce" else f"python -m {self.module}"
        return f"{self.file.relative_to(ROOT)}:{self.line}: {shown} {shlex.join(self.argv)}"


def _expected_exit(comment: str, output: list[str]) -> int:
    stated = re.search(r"exit(?: code)? (\d+)", comment)
    if stated:
        return int(stated.group(1))
    if any(line.startswith("error: ") for line in output):
        return 2
    if any("does not fit" in line and "exit" in line for line in output):
        return 3
    return 0


def doc_commands(files: list[Path] = DOCS) -> list[DocCommand]:
    """Every `$ reproduce ...` (or `$ python -m reproduce[.module] ...`) line inside a fenced block, with its
    continuation lines, and the output lines shown under it up to the next command or the block's end."""
    found = []
    for path in files:
        lines = path.read_text().splitlines()
        fenced, index = False, 0
        while index < len(lines):
            line = lines[index]
            if line.startswith("```"):
                fenced = not fenced
            indent = "" if fenced else "    "  # a fenced block, or a Markdown code block indented by four spaces
            match = re.match(rf"^{indent}\$ (?:python -m )?(reproduce(?:\.[\w.]+)?) (.*)$", line) if (
                fenced or line.startswith("    $ ")) else None
            if not match:
                index += 1
                continue
            start, module, text = index + 1, match.group(1), match.group(2)
            while text.endswith("\\") and index + 1 < len(lines):
                index += 1
                text = text[:-1] + " " + lines[index].strip()
            command, _, comment = text.partition(" #")
            command = command.split(" | ")[0]  # a pipe into head / tail only trims what is shown
            output = []
            index += 1
            while index < len(lines) and not lines[index].startswith(("```", "$ ", "    $ ")) and (
                    fenced or lines[index].startswith("    ")):
                output.append(lines[index].strip())
                index += 1
            found.append(DocCommand(path, start, shlex.split(command), _expected_exit(comment, output), module))
    return found


def run_all(commands: list[DocCommand]) -> int:
    """Runs each command, in order, in a fresh folder that links the repository's papers/, reproduce/, examples/
    and tests/ (so `--out runs/...` starts empty and nothing in the checkout is touched); prints one line each;
    skips a command on a file the page has the reader write first; returns the number whose exit code differs
    from the docs'."""
    failures = 0
    work = Path(tempfile.mkdtemp(prefix="docs-check-"))
    for folder in ("papers", "reproduce", "examples", "tests"):
        (work / folder).symlink_to(ROOT / folder)
    skipped, not_made = 0, set()
    for command in commands:
        # a command on a file the page has the reader write first (its YAML shown beside it) cannot run here
        missing = [arg for arg in command.argv if (arg.endswith(".yaml") and not (work / arg).exists())
                   or arg in not_made]
        if missing:
            skipped += 1
            argv = command.argv
            not_made.update(argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--out")  # nor what it writes
            print(f"skip {' '.join(missing)}: made by the reader first, or by a command skipped  {command}", flush=True)
            continue
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", command.module, *command.argv], cwd=work, capture_output=True,
                                text=True, timeout=1200)
        ok = result.returncode == command.expected_exit
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} exit {result.returncode} (docs: {command.expected_exit}) "
              f"{time.perf_counter() - started:6.1f} s  {command}", flush=True)
        if not ok:
            print("     " + "\n     ".join((result.stdout + result.stderr).strip().splitlines()[-8:]))
    print(f"{skipped} skipped (files the reader writes first, or that a skipped command would write)")
    return failures


if __name__ == "__main__":
    chosen = [c for c in doc_commands() if not sys.argv[1:] or any(a in str(c.file) for a in sys.argv[1:])]
    failed = run_all(chosen)
    print(f"{len(chosen) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
