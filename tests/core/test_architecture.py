"""The seams of the code base, checked on its source: at most eight modules at the package root, the rest in
packages; no import cycle in src/ (not even under TYPE_CHECKING or inside a function); the core (`plan/`) free of
torch and of the CLI by package, importing nothing of reproduce outside itself but `errors`; no import of another
package's private (underscore) module; train/ independent of the exports, check/ using only public names of the
core, no CLI module importing another command's module (the decisions are in the session layer, which prints
nothing), and test modules that import shared helpers from tests/helpers.py, never from one another."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "reproduce"
TESTS = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in SRC.rglob("*.py")}


def _imports(name: str) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import statement in module `name`, anywhere in it."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            # `from . import x` imports the module x when there is one
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            found += [(sub, []) for sub in submodules] or [(target, names)]
    return found


@functools.cache  # read once: every module's imports, parsed (seconds on a loaded machine)
def _graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        targets = set()
        for target, _ in _imports(name):
            while target and target not in MODULES:  # reproduce.x.y.attr -> the module that defines it
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__ aside
                targets.add(target)
        graph[name] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_under_src():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


ROOT_MODULES_AT_MOST = 8  # so that a reader finds the room by its folder's name
CORE = "reproduce.plan"  # the torch-free core that plans and validates
CORE_MAY_IMPORT = ("reproduce.plan", "reproduce.errors")


def test_the_root_holds_at_most_eight_modules():
    root = sorted(path.name for path in SRC.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, f"{len(root)} modules at src/reproduce/: put new ones in a package"


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


CORE_MODULES = sorted(name for name in MODULES if _in_package(name, CORE))


def test_the_core_is_a_package():
    assert {"reproduce.plan.recipe", "reproduce.plan.planner", "reproduce.plan.planfile"} <= set(CORE_MODULES)


@pytest.mark.parametrize("name", CORE_MODULES)
def test_the_plan_core_imports_no_torch_and_no_cli(name):
    """Every module of plan/, present and future: no torch, typer or rich, and of reproduce only plan/ itself and
    errors.py (so nothing it imports brings torch or the CLI in either)."""
    imported = {target for target, _ in _imports(name)}
    assert not {t for t in imported if t.split(".")[0] in ("torch", "typer", "rich")}
    mine = {t for t in imported if _in_package(t, "reproduce")}
    outside = {t for t in mine if not any(_in_package(t, package) for package in CORE_MAY_IMPORT)}
    assert not outside, outside


@pytest.mark.subprocess
def test_importing_the_whole_core_imports_no_torch():
    import subprocess
    import sys

    code = f"import sys; import {', '.join(CORE_MODULES)}; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    code += "('torch', 'typer', 'rich')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _private_imports(imports: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, module) for every import of a private module (`_name.py`) from outside the package holding it."""
    found = []
    for name, targets in imports.items():
        for target in targets:
            package, _, last = target.rpartition(".")
            if last.startswith("_") and not last.startswith("__") and not _in_package(name, package):
                found.append((name, target))
    return sorted(found)


def test_no_import_of_another_packages_private_module():
    assert _private_imports(_graph()) == []


def test_the_private_import_finder_finds_one():
    imports = {"r.a.x": {"r.a._inner"}, "r.b.y": {"r.a._inner", "r.a.x"}, "r.a": {"r.a.__main__"}}
    assert _private_imports(imports) == [("r.b.y", "r.a._inner")]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("reproduce.train")))
def test_train_does_not_import_the_exports(name):
    assert not [t for t, _ in _imports(name) if t.startswith("reproduce.export")]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("reproduce.check")))
def test_check_uses_public_names_of_other_modules(name):
    private = [(target, n) for target, names in _imports(name) for n in names
               if n.startswith("_") and not target.startswith("reproduce.check") and target != "__future__"]
    assert not private, private


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: p.name)
def test_no_test_module_imports_another(path):
    tree = ast.parse(path.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.startswith("test_") or name.startswith("tests.test_")}


# cli/<name>.py, one typer command each
COMMANDS = {"check", "evaluate", "memory", "papers", "plan", "probe", "run", "verify", "report"}


@functools.cache
def _cli_modules_imported(name: str) -> set[str]:
    return {target for target in _graph()[name] if target.startswith("reproduce.cli.")}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("reproduce.cli.")))
def test_no_cli_module_imports_a_command_module(name):
    """cli/ parses options, calls the core and renders: what several commands share lives in a neutral module
    (cli/options.py, cli/common.py), never in another command's module (only cli/__init__ registers them)."""
    commands = {f"reproduce.cli.{command}" for command in COMMANDS} - {name}
    assert not _cli_modules_imported(name) & commands


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not _in_package(n, "reproduce.cli")
                                        and n != "reproduce.__main__"))
def test_nothing_outside_the_cli_imports_it(name):
    """Data flows down: the session, the trainer and the trackers hand values to the CLI's renderer (the start
    lines, the records, the summary: train/reporter.Reporters) and never call into cli/; only `python -m reproduce`
    starts it."""
    assert not {target for target in _graph()[name] if _in_package(target, "reproduce.cli")}


def test_every_command_module_is_known():
    # app: the typer app the commands register on; options: a user error's fields as the flags typed (main's catch)
    registered = {target.rsplit(".", 1)[1] for target in _cli_modules_imported("reproduce.cli")} - {"app", "options"}
    assert registered == COMMANDS


SESSION_LAYER = ["reproduce.session", "reproduce.model_facts", "reproduce.plan.resume_rules",
                 *sorted(name for name in MODULES if _in_package(name, "reproduce.throughput")
                        and name != "reproduce.throughput.split_steps")]  # SplitSteps runs the steps: torch


@pytest.mark.parametrize("name", SESSION_LAYER)
def test_the_session_layer_imports_no_cli_and_no_torch_at_import(name):
    """The core session layer returns values and prints nothing: no typer, rich or cli/, and torch only inside the
    functions that measure (so `reproduce plan --micro-batch-max` imports none)."""
    imported = {target for target, _ in _imports(name)}
    assert not {t for t in imported if t.split(".")[0] in ("typer", "rich") or t.startswith("reproduce.cli")}
    top = ast.parse(MODULES[name].read_text()).body
    at_import = {alias.name for node in top if isinstance(node, ast.Import) for alias in node.names}
    assert "torch" not in at_import
    calls = [node.func.id for node in ast.walk(ast.parse(MODULES[name].read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    assert "print" not in calls


def test_the_reading_order_names_every_package_and_root_module():
    """docs/architecture.md matches the tree: its reading order (one line a package) names every folder of
    src/reproduce/ and every module at the root but the entry points."""
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    order = doc.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    folders = {f"src/reproduce/{path.name}/" for path in SRC.iterdir() if path.is_dir() and path.name != "__pycache__"}
    modules = {f"src/reproduce/{path.name}" for path in SRC.glob("*.py")} - {
        "src/reproduce/__init__.py", "src/reproduce/__main__.py", "src/reproduce/errors.py"}
    assert not {name for name in folders | modules if f"`{name}`" not in order}


# Package direction. Reading down, a package imports only what lies below it:
#   cli -> session -> throughput -> probe -> train -> observe -> {models, data} -> storage -> core
# where the core is plan/, hardware/ and errors.py (no torch, nothing of reproduce outside the core).
# - probe/ does not import throughput/; throughput/ imports of probe/ only what a plan's speed is computed from:
#   the probe's result and budget (runner), the recipe's trial data (workload), the FLOPs count and its cache
#   (flops, cache), never a meter, the search or the advice.
# - no cycle between packages once the known exceptions below are set aside; each has its reason, and fails the
#   test once it is gone (so the list only shrinks).
CORE_PACKAGES = ("reproduce.plan", "reproduce.hardware", "reproduce.errors")
THROUGHPUT_MAY_IMPORT_FROM_PROBE = {"reproduce.probe.runner", "reproduce.probe.workload", "reproduce.probe.flops",
                                    "reproduce.probe.cache"}
KNOWN_BACK_EDGES = {
    # (importer, imported): why it is there
    ("reproduce.probe.memory_plan", "reproduce.throughput.cost"):
        "the memory plan weighs its two ways (with and without checkpointing) by the step-time cost model",
    ("reproduce.observe.rates", "reproduce.probe.flops"):
        "the run counts its model FLOPs once, at its first step, with the estimate's counter on fake tensors",
    ("reproduce.models.architectures", "reproduce.train.pretraining_loss"):
        "BERT's pre-training loss is a built-in architecture's own loss (models.LOSSES)",
    ("reproduce.data", "reproduce.models"):
        "`build_data` checks the text's sequence length against the model's context (`models.check_context`)",
}


def _package(name: str) -> str:
    return ".".join(name.split(".")[:2])


@functools.cache
def _package_edges() -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(package, package) -> the (module, module) imports behind it, between two top-level packages."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for name, targets in _graph().items():
        for target in targets:
            if _package(name) != _package(target):
                edges.setdefault((_package(name), _package(target)), set()).add((name, target))
    return edges


def test_the_core_packages_import_nothing_outside_the_core_and_no_torch():
    core = [name for name in MODULES if any(_in_package(name, package) for package in CORE_PACKAGES)]
    assert "reproduce.hardware.catalog" in core and "reproduce.hardware.peaks" in core
    bad = {(name, target) for name in core for target, _ in _imports(name)
           if target.split(".")[0] in ("torch", "typer", "rich")
           or (_in_package(target, "reproduce") and not any(_in_package(target, p) for p in CORE_PACKAGES))}
    assert not bad, bad


def test_probe_does_not_import_throughput_but_where_listed():
    found = {edge for edge in _package_edges().get(("reproduce.probe", "reproduce.throughput"), set())}
    assert found <= set(KNOWN_BACK_EDGES), found - set(KNOWN_BACK_EDGES)


def test_throughput_imports_of_the_probe_only_its_result_workload_and_flops():
    found = {target for _, target in _package_edges().get(("reproduce.throughput", "reproduce.probe"), set())}
    assert found <= THROUGHPUT_MAY_IMPORT_FROM_PROBE, found - THROUGHPUT_MAY_IMPORT_FROM_PROBE


def test_no_cycle_between_packages_but_the_known_back_edges():
    packages: dict[str, set[str]] = {_package(name): set() for name in MODULES}
    for (a, b), behind in _package_edges().items():
        if behind - set(KNOWN_BACK_EDGES):
            packages[a].add(b)
    assert _cycle(packages) is None, " -> ".join(_cycle(packages) or [])


@pytest.mark.parametrize("edge", sorted(KNOWN_BACK_EDGES), ids=lambda e: f"{e[0]}->{e[1]}")
def test_each_known_back_edge_is_still_there(edge):
    """A back edge that was fixed leaves this list, so that it cannot come back unseen."""
    assert edge[1] in _graph()[edge[0]], f"{edge} is gone: remove it from KNOWN_BACK_EDGES"


# The library (docs/library.md): the exact window `accumulate.py` sits below train/ (which runs every step through
# it) and imports nothing of reproduce but errors; `library/` and `integrations/` sit on top, imported by nothing
# else; only integrations/ imports Lightning or transformers' Trainer; `import reproduce` stays light.
LIBRARY_ON_TOP = ("reproduce.library", "reproduce.integrations")


def test_the_exact_window_imports_nothing_of_reproduce_but_errors():
    mine = {target for target, _ in _imports("reproduce.accumulate") if _in_package(target, "reproduce")}
    assert mine == {"reproduce.errors"}
    assert "reproduce.accumulate" in _graph()["reproduce.train.step"]  # the run's step is its user


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not any(_in_package(n, p) for p in LIBRARY_ON_TOP)
                                        and n != "reproduce"))
def test_nothing_below_imports_the_library_or_the_integrations(name):
    assert not {t for t in _graph()[name] if any(_in_package(t, p) for p in LIBRARY_ON_TOP)}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not _in_package(n, "reproduce.integrations")))
def test_only_the_integrations_import_lightning(name):
    assert not {t for t, _ in _imports(name) if t.split(".")[0] in ("lightning", "pytorch_lightning")}


def test_the_package_root_imports_its_public_names_lazily():
    """`reproduce/__init__.py` imports nothing at import time (its names come from `__getattr__`): `__all__` is
    the one list of the public names, each mapped to the module that defines it."""
    top = ast.parse(MODULES["reproduce"].read_text()).body
    imported = [node for node in top if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert {alias.name for node in imported for alias in node.names} <= {"annotations", "importlib", "Any"}
    import reproduce

    for name, module in reproduce._PUBLIC.items():  # each name found where it is mapped
        body = ast.parse(MODULES[module].read_text()).body
        defined = {getattr(node, "name", None) for node in body} | {
            target.id for node in body if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Name)} | {
            alias.asname or alias.name for node in body if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert name in defined, f"{name}: not defined (or imported) at the top of {module}"


@pytest.mark.subprocess
def test_import_reproduce_imports_no_torch_until_a_name_is_used():
    import subprocess
    import sys

    code = ("import sys, reproduce; print('torch' in sys.modules); reproduce.Accumulator; "
            "print('torch' in sys.modules, 'lightning' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "False", "False"]
