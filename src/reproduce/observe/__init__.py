"""What a run measures and writes about itself as it runs: metrics.jsonl and the run folder's outputs
(outputs.py, the loss plot loss_plot.py), each step's rates and MFU (rates.py), the gradient noise
scale (noise.py), divergence and a reference run (reference.py) and the experiment trackers (trackers.py,
tracker_backends.py). The loop (train/) calls it; of the loop it reads only the checkpoints' file prefix."""
