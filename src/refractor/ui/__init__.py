"""The dashboard (``refractor ui``): a FastAPI app over the read-only query layer
(:mod:`refractor.telemetry.query` and friends) that serves the built frontend from ``static/``.
It never writes a run store; what the user arranges (layouts, notes, hidden runs) is kept in its
own state folder."""

from refractor.ui.app import create_app

__all__ = ["create_app"]
