"""The run's optimizer, LR scheduler and plateau decay (optimizers.py), LARS and LAMB (large_batch.py)."""
