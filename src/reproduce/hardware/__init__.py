"""What the devices are: the GPU catalog behind `--gpu` (catalog.py) and the datasheets' peak
FLOP/s and bandwidth by precision (peaks.py). Pure Python, no torch: the core's, beside plan/."""
