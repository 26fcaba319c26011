"""Built-in dedicated evals: one folder per eval, ``<name>/eval.py`` (found by ``refractor.evals.registry``)."""
