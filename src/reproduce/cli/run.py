"""`reproduce run`: filled in by the training-run issue."""
