"""Callbacks for Lightning and the Hugging Face Trainer on the plan and the exact window (docs/library.md);
each module imports its library, and nothing else of `reproduce` does.
"""
