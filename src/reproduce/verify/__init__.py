"""`reproduce verify`: the plan's accumulated gradient against one large-batch pass, in float64, and, with
activation checkpointing, the recomputation's gradient."""
