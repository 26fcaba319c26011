"""Built-in dedicated evals: one folder per eval, ``<name>/eval.py``.

Found by ``refractor.evals.registry``.
"""
