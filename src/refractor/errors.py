"""Errors a user can cause and fix: the CLI prints their one-line message, without a traceback.

Each one subclasses ``RefractorUserError`` where it is raised and keeps its builtin base too
(``class ClusterError(RefractorUserError, RuntimeError)``), so ``except RuntimeError`` still
catches it. The message says what failed and what to change: the config key, the file, the server.
This module imports nothing from refractor, so any layer can raise these.
"""

from __future__ import annotations


class RefractorUserError(Exception):
    """A mistake the user can fix; ``str(err)`` is the whole message shown to them."""


class RunSetupError(RefractorUserError, RuntimeError):
    """The run cannot start as configured; the message says what to change."""


def one_line(err: BaseException) -> str:
    """``"Type: first line of the message"``: an error as a response or log line can carry it (torch's
    errors append C++ frames after the first line)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
