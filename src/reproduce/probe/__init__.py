"""The memory probe: the largest micro-batch whose training step fits a memory budget, measured.

- `search`: the pure search over a `fits(b) -> Measurement` callable (no torch);
- `catalog`: GPU names to datasheet memory (no torch);
- `cache`, `cost`, `runner`: the probe's cache, the cost of a plan, and the glue (no torch at import);
- `tracker`, `workload`, `meters`: the torch side: a live-storage tracker, one real-shape micro-batch,
  and the three meters (`cuda`, `cpu`, `estimate`) behind one interface.
"""
