"""The library behind `import reproduce` for a user's own training code: the plan from a recipe or from plain
arguments (`planning.py`) and the largest micro-batch of the user's own step (`probing.py`). The exact window
itself is `reproduce/accumulate.py` (below `train/`, which uses it); the trainers' callbacks are in
`reproduce/integrations/`. What is public is listed once, in `reproduce/__init__.py`."""
