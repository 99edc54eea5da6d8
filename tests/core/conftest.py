"""tests/core/: the torch-free core's tests (planner, recipe validation, overrides, the probe's search, the code's
layering), seconds in all (`make test-core`). Torch stays out of them, checked on every run of this folder: a test
module that imports torch when only tests/core/ is collected stops the session, and a test that imports it while it
runs fails. A test that needs torch belongs in tests/torch/<package>/, tests/cli/ or tests/e2e/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_finish(session):
    core_only = session.items and all(HERE in Path(item.path).parents for item in session.items)
    if core_only and "torch" in sys.modules:
        raise pytest.UsageError("tests/core/ imported torch while its tests were collected: a module there imports "
                                "it (directly or through helpers.py); the torch-free helpers are core_helpers.py")


@pytest.fixture(autouse=True)
def imports_no_torch(request):
    before = "torch" in sys.modules
    yield
    if not before and "torch" in sys.modules:
        pytest.fail(f"{request.node.nodeid} imported torch: it belongs in tests/torch/, tests/cli/ or tests/e2e/",
                    pytrace=False)
