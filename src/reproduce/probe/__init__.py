"""The memory probe: the largest micro-batch whose training step fits a memory budget, measured (runner.py: the
search in search.py, no torch; the meters in meters.py; the "does not fit" report in advice.py)."""
