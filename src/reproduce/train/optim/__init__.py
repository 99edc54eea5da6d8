"""The run's optimizer and LR scheduler (optimizers.py), LARS and LAMB (large_batch.py), plateau decay
(plateau.py)."""
