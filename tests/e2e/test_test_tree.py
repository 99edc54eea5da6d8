"""The tests mirror the code: tests/core/ (the torch-free core, seconds: `make test-core`), tests/torch/<package>/
(one package of src/reproduce/ each; tests/torch/ itself for a root module such as session.py), tests/cli/ (the
commands) and tests/e2e/ (whole runs, several processes, docs, shipped recipes). Helpers stay in tests/ itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src" / "reproduce"
TEST_FILES = sorted(TESTS.rglob("test_*.py"))
COLLECT_CORE = ("import sys, pytest; code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
                "'tests/core']); print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")


def _layer_of(path: Path) -> str | None:
    """Where the file may live: None when its folder is none of the four."""
    parts = path.relative_to(TESTS).parts[:-1]
    if parts in (("core",), ("cli",), ("e2e",)):
        return parts[0]
    if parts == ("torch",):
        return "torch" if (SRC / (path.stem.removeprefix("test_") + ".py")).is_file() else None
    if len(parts) == 2 and parts[0] == "torch" and (SRC / parts[1]).is_dir():
        return f"torch/{parts[1]}"
    return None


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_every_test_module_is_in_a_folder_of_the_tree(path):
    assert _layer_of(path), f"{path.relative_to(TESTS)}: put it in core/, cli/, e2e/ or torch/<package>/"


def test_test_module_names_are_unique():
    """No __init__.py: pytest imports each test module by its file name, so two of one name would collide."""
    names = [path.name for path in TEST_FILES]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_the_four_folders_hold_tests():
    assert {_layer_of(path).split("/")[0] for path in TEST_FILES} == {"core", "cli", "e2e", "torch"}


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_module_imports_conftest(path):
    """pytest loads conftest.py itself; shared code is imported from helpers.py or core_helpers.py."""
    tree = ast.parse(path.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert "conftest" not in imported


@pytest.mark.subprocess
def test_the_core_is_collected_without_torch():
    result = subprocess.run([sys.executable, "-c", COLLECT_CORE], cwd=TESTS.parent, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.strip().endswith("no torch")


@pytest.mark.subprocess
def test_a_core_session_with_torch_imported_stops():
    """The guard of tests/core/conftest.py, seen failing: torch imported before the core is collected."""
    result = subprocess.run([sys.executable, "-c", "import torch; " + COLLECT_CORE], cwd=TESTS.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert "tests/core/ imported torch while its tests were collected" in result.stdout + result.stderr
