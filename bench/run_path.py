"""How long is the way from the command line to the first optimizer step? Counts the distinct functions defined in
src/reproduce that run before it, as a newcomer reading a profiler trace meets them.

    python bench/run_path.py                      # reproduce run papers/pysource-gpt.yaml --micro-batch-max 16 ...
    python bench/run_path.py --list               # and the functions themselves, by module
    python bench/run_path.py -- plan papers/digits-mlp.yaml --micro-batch-max 32   # another command, to its end

`sys.setprofile` sees every Python call; a function counts once, by its code object, if its file is under
src/reproduce. Left out: dunders (`__init__`, `__post_init__`, ...) and comprehensions (`<listcomp>`, `<genexpr>`,
`<lambda>` stays). The count stops at the first call of `step` in a file under torch/optim/ other than
lr_scheduler.py, whose schedulers call `step()` once when they are built. The run's output folder is a temporary
one; the recipe's data is built on the fly as `reproduce run` builds it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["run", "papers/pysource-gpt.yaml", "--micro-batch-max", "16", "--device", "cpu", "--max-steps", "1"]


class FirstStep(Exception):
    """Raised from the profiler at the first optimizer step: the count ends there."""


def count(argv: list[str]) -> tuple[dict[str, set[str]], bool]:
    """{module: {function}} of the project's functions called before the first optimizer step, and whether a step
    was reached."""
    import reproduce
    from reproduce.cli import main

    package = str(Path(reproduce.__file__).parent) + os.sep
    seen: dict[str, set[str]] = defaultdict(set)
    codes: dict[int, object] = {}  # held, so that a freed module body's id is not reused by a later function

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        name, file = code.co_name, code.co_filename
        if name == "step" and f"torch{os.sep}optim{os.sep}" in file and not file.endswith("lr_scheduler.py"):
            raise FirstStep
        if id(code) in codes or not file.startswith(package):
            return
        codes[id(code)] = code
        if (name.startswith("__") and name.endswith("__")) or name in ("<listcomp>", "<dictcomp>", "<setcomp>",
                                                                          "<genexpr>"):
            return
        module = file[len(package):-3].replace(os.sep, ".")
        seen[module].add(getattr(code, "co_qualname", name))

    reached = False
    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
    except FirstStep:
        reached = True
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    return seen, reached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the functions, by module")
    parser.add_argument("command", nargs="*", help="a reproduce command (default: the run of issue 52)")
    args = parser.parse_args()
    argv = args.command or DEFAULT
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as out:
        if argv[0] == "run" and "--out" not in argv:
            argv = [*argv, "--out", str(Path(out) / "run")]
        seen, reached = count(argv)
    functions = sum(len(names) for names in seen.values())
    if args.list:
        for module in sorted(seen):
            print(f"{module} ({len(seen[module])}): {', '.join(sorted(seen[module]))}")
    where = "before the first optimizer step" if reached else "in the whole command (no optimizer step)"
    print(f"reproduce {' '.join(argv)}")
    print(f"{functions} functions of src/reproduce in {len(seen)} modules ran {where}")


if __name__ == "__main__":
    main()
