"""How fast and how long: the exact split with the most samples per second (splits.py, policy.py), a plan's
predicted time (predicted_time.py) and its cost on the probed device (cost.py). No torch at import."""
