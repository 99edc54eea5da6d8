"""How fast and how long: the exact split with the most samples per second (splits.py, `--policy
throughput` in policy.py), a plan's predicted wall time from its steps or FLOPs
(predicted_time.py) and what it costs on the probed device (plan_cost.py). No torch at import.
"""
