"""Log files: reading the lines a server process appends to its own file (on the server's node),
and writing the driver's plain-text copy of each component's lines into ``runs/<run>/logs/``."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from refractor.telemetry.log_capture import LogBuffer, LogLine, terminal_text

# the first level word near the start of a line: "INFO 11-25 19:08:01 [x.py:1] ..." (vLLM),
# "2026-11-25 19:08:01,123 WARNING refractor.x: ..." (refractor serve)
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b")


def line_level(text: str) -> str:
    """The level a server log line names in its first 48 characters; INFO when it names none."""
    match = _LEVEL.search(text, 0, 48)
    if match is None:
        return "INFO"
    return "WARNING" if match.group(1) == "WARN" else match.group(1)


class FileFollower:
    """Reads what is appended to one log file (the server's, which may be replaced by the log of a
    restarted server) into a :class:`LogBuffer` as ``file`` lines. Each ``poll`` reads at most
    ``max_read_bytes``; a file that grows faster is read behind, never into memory at once.
    Thread-safe: the server starts in one thread while the collector polls in another."""

    def __init__(
        self, buffer: LogBuffer, component: str, rank: int | None, node: str, max_read_bytes: int = 4 << 20
    ) -> None:
        self.buffer = buffer
        self.component = component
        self.rank = rank
        self.node = node
        self.max_read_bytes = max_read_bytes
        self.path: Path | None = None
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()

    def follow(self, path: str | Path) -> None:
        """Read what is appended to ``path`` from now on (a resumed run's server appends to the file
        of the earlier attempt, whose lines are stored already); the rest of the previous file is
        read first."""
        with self._lock:
            self._read(final=True)
            self.path = Path(path)
            self._offset = self.path.stat().st_size if self.path.exists() else 0
            self._partial = b""

    def poll(self) -> None:
        """Read what was appended since the last poll (a last line without its newline waits)."""
        with self._lock:
            self._read(final=False)

    def _read(self, final: bool) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(self.max_read_bytes)
        except FileNotFoundError:
            return  # not created yet
        self._offset += len(data)
        pending = self._partial + data
        *lines, self._partial = pending.split(b"\n")
        if final or len(self._partial) > self.buffer.limits.max_line_chars:
            lines.append(self._partial)
            self._partial = b""
        now = time.time()
        path = str(self.path)
        for raw in lines:
            text = terminal_text(raw.decode("utf-8", "replace"))
            if not text:
                continue
            self.buffer.add(
                LogLine(now, line_level(text), self.component, self.rank, self.node, "file", text, path)
            )


def component_file_name(component: str, rank: int | None) -> str:
    return f"{component}.log" if rank is None else f"{component}-{rank}.log"


class LogFileCopies:
    """The driver's plain-text copy of every component's lines: ``<dir>/<component>[-<rank>].log``
    (``trainer-0.log``, ``driver.log``). A server's lines go to its own file name, and only when the
    server's file is not there already (its server runs on another node without a shared file
    system); lines of a file are copied as they are, others get time, level and source. A server on
    ``local_node`` (the driver's machine) writes its file here: its lines are never copied."""

    def __init__(self, folder: str | Path, local_node: str | None = None) -> None:
        self.folder = Path(folder)
        self.local_node = local_node
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, TextIO] = {}
        self._server_file_here: dict[str, bool] = {}

    def write(self, lines: Iterable[LogLine]) -> None:
        for line in lines:
            if line.source == "file":
                if line.file is None or self._file_is_here(line.file, line.node):
                    continue
                self._file(Path(line.file).name).write(line.message + "\n")
                continue
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(line.time))
            millis = int(line.time % 1 * 1000)
            text = f"{stamp}.{millis:03d} {line.level:<7} [{line.source}] {line.message}\n"
            self._file(component_file_name(line.component, line.rank)).write(text)
        for f in self._files.values():
            f.flush()

    def _file_is_here(self, path: str, node: str) -> bool:
        # A server of this machine writes its file here, also before it has created it (a copy made
        # then would land in the file the server appends to, and its follower would read it back).
        if self.local_node is not None and node == self.local_node:
            return True
        # another node: decided once per file, as once copied the copy itself would look like the file
        if path not in self._server_file_here:
            self._server_file_here[path] = os.path.exists(path)
        return self._server_file_here[path]

    def _file(self, name: str) -> TextIO:
        if name not in self._files:
            self._files[name] = open(self.folder / name, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        return self._files[name]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
