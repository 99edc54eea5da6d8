"""The core that plans and validates, pure Python: no torch, no CLI (tests/core/test_architecture.py).

The recipe (recipe/, validation.py, units.py), the plan (planner.py, split.py, segments.py, phases.py,
schedules.py), the plan file (planfile.py), and what the plan reads or records beside them."""
