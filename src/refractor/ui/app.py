"""``create_app``: the dashboard's FastAPI application.

Serves the JSON API (:mod:`refractor.ui.api`), the user's saved arrangement (:mod:`.state`) and the
built frontend from ``static/`` (nothing else on disk is reachable). Any bad input a user can cause
(an unknown run, a store that cannot be read, a garbage query string) answers 4xx with one line
``{"error": "..."}``, which the page shows."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from refractor import __version__
from refractor.ui.api import build_router
from refractor.ui.registry import RunRegistry, UnknownRunError
from refractor.ui.state import UiState

STATIC_DIR = Path(__file__).parent / "static"


class MetricSection(BaseModel):
    title: str = Field(max_length=200)
    metrics: list[str] = Field(max_length=200)


class Layout(BaseModel):
    sections: list[MetricSection] = Field(max_length=100)


class Note(BaseModel):
    run: str = Field(max_length=500)
    text: str = Field(max_length=20_000)


class Hidden(BaseModel):
    run: str = Field(max_length=500)
    hidden: bool


def create_app(runs_dirs: list[Path], state_dir: Path) -> FastAPI:
    registry = RunRegistry([Path(d) for d in runs_dirs])
    state = UiState(Path(state_dir))
    app = FastAPI(
        title="refractor dashboard", version=__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.include_router(build_router(registry, state))

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(UnknownRunError)
    async def unknown_run(request: Request, err: UnknownRunError) -> JSONResponse:
        return error(404, str(err))

    @app.exception_handler(sqlite3.DatabaseError)
    async def unreadable(request: Request, err: sqlite3.DatabaseError) -> JSONResponse:
        message = str(err)
        if "no such table" in message or "no such column" in message:
            return error(
                409, f"this run store lacks what the page needs ({message}): an older or unfinished run"
            )
        return error(422, f"the run store cannot be read ({message}): a damaged or half-written run.db")

    @app.exception_handler(FileNotFoundError)
    async def missing(request: Request, err: FileNotFoundError) -> JSONResponse:
        return error(404, str(err))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, err: ValueError) -> JSONResponse:
        return error(400, str(err))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body"))
        return error(400, f"bad parameter {where or '?'}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error(err.status_code, str(err.detail))

    # --- the user's arrangement (the dashboard's own files, never a run store) ---
    @app.get("/api/state/layout")
    def get_layout() -> dict[str, Any]:
        return {"layout": state.read("layout")}

    @app.put("/api/state/layout")
    def put_layout(layout: Layout) -> dict[str, Any]:
        state.write("layout", layout.model_dump())
        return {"layout": layout.model_dump()}

    @app.put("/api/state/notes")
    def put_note(note: Note) -> dict[str, Any]:
        key = str(registry.get(note.run).path.resolve())
        state.update("notes", key, note.text or None)
        return {"run": note.run, "note": note.text}

    @app.put("/api/state/hidden")
    def put_hidden(item: Hidden) -> dict[str, Any]:
        key = str(registry.get(item.run).path.resolve())
        state.update("hidden", key, True if item.hidden else None)
        return {"run": item.run, "hidden": item.hidden}

    @app.get("/api/version")
    def version() -> dict[str, str]:
        return {"version": __version__}

    # --- the frontend ---
    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            raise StarletteHTTPException(
                404, "the dashboard's frontend is not built (frontend/: npm run build)"
            )
        return FileResponse(page, headers={"Cache-Control": "no-cache"})

    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
