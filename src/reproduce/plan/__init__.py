"""The core that plans and validates, pure Python: no torch, no CLI (tests/core/test_architecture.py).

The recipe and its YAML reading (the recipe/ package, validation.py, units.py), the plan (planner.py, with split.py,
segments.py, phases.py, schedules.py), the plan file (planfile.py), sharding and memory options as recipe
fields (sharding.py, memory_options.py), the paper's reported values (reported.py), the torchrun command
line (launch.py), the built-in names and the user's builders (builtin_names.py, factory.py), and what
`run --resume` keeps (resume_rules.py).
"""
