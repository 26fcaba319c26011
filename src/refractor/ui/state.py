"""What the user arranges in the dashboard, kept in its own state folder as small JSON files
(never in a run store): the custom metrics layout, a note per run, the runs hidden from view.
Each file is replaced atomically (written beside it, then renamed), so a crash never leaves half
a file."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "refractor" / "ui"


class UiState:
    FILES = ("layout", "notes", "hidden")

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self._lock = threading.RLock()

    def read(self, name: str) -> Any:
        """The stored value, or None when nothing was stored (or the file is unreadable)."""
        try:
            return json.loads((self.dir / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    def write(self, name: str, value: Any) -> None:
        if name not in self.FILES:
            raise ValueError(f"unknown state {name!r}")
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(value, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.dir / f"{name}.json")
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def update(self, name: str, key: str, value: Any) -> dict[str, Any]:
        """Set (or with None remove) one key of a dict-valued state file."""
        with self._lock:
            current = self.read(name)
            current = current if isinstance(current, dict) else {}
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
            self.write(name, current)
            return current
