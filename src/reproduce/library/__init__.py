"""The library behind `import reproduce` for a user's own training code: the plan (`planning.py`) and the
largest micro-batch of the user's step (`probing.py`); the public names are in `reproduce/__init__.py`.
"""
