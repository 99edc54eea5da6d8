"""What a run measures and writes about itself: its folder's outputs, metrics.jsonl and loss.svg (outputs.py),
rates and MFU (rates.py), the noise scale (noise.py), divergence and reference runs (reference.py), the experiment
trackers (trackers.py, tracker_backends.py). The loop (train/) calls it; of the loop it reads only a file prefix."""
