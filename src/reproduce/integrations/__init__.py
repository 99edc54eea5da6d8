"""Callbacks for the trainers people already use, on the plan and the exact window (docs/library.md):
`reproduce.integrations.lightning.ExactAccumulation` and `reproduce.integrations.transformers.PlanCallback`.
Each module imports its library (Lightning, transformers) when it is itself imported, and nothing else of
`reproduce` imports them."""
