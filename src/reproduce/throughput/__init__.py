"""How fast and how long: the exact split with the most samples per second (splits.py, `--policy
throughput` in policy.py), a run's time from its FLOPs (prediction.py), a plan's predicted wall
time (predicted_time.py) and what it costs on the probed device (plan_cost.py). No torch at import.
"""
