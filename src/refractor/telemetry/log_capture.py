"""Log lines of one process (the driver, a trainer rank, a server actor), held until the driver
collects them (docs/run-store.md#logs).

A process keeps its lines in a :class:`LogBuffer`, which never blocks and never grows past its
bounds: a token bucket limits each process to ``lines_per_s`` (with a burst), the buffer holds at
most ``max_lines`` lines of at most ``max_line_chars`` characters, and what does not fit is counted
as dropped, so a model printing 100 MB costs a counter, not memory or time. Lines come from
Python logging (:class:`BufferHandler`, source ``log``) and, in the trainer ranks, from
``sys.stdout`` / ``sys.stderr`` (:class:`StreamTee`, sources ``stdout`` / ``stderr``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SURROGATE = re.compile("[\ud800-\udfff]")
# markers Ray's worker prints before a task so that its log monitor can name the task: not output
_RAY_MARKERS = (":actor_name:", ":task_name:")


@dataclass(frozen=True, slots=True)
class LogLine:
    time: float  # unix seconds: when the line was written (read, for lines of a log file)
    level: str  # one of LEVELS
    component: str  # driver, orchestrator, trainer, server
    rank: int | None  # the trainer rank or server index; None for the driver's components
    node: str  # address of the machine the line comes from
    source: str  # log (Python logging), stdout, stderr, file (a line of a server's log file)
    message: str
    # a ``file`` line's file, a path on ``node``: each line names its own, since a batch can hold the
    # last lines of a restarted server's old file and the first of its new one
    file: str | None = None


@dataclass(frozen=True)
class LogBatch:
    """What a collector hands over: its lines and how many it dropped since the last batch."""

    lines: list[LogLine] = field(default_factory=list)
    dropped: int = 0
    node: str = ""  # the address of the machine the collector runs on


@dataclass(frozen=True)
class LogLimits:
    lines_per_s: float = 500.0
    burst: int = 5_000  # lines let through at once before the rate applies
    max_lines: int = 10_000  # lines held between two collections
    max_line_chars: int = 4_000  # a longer line is cut and marked


def clean_text(text: str) -> str:
    """``text`` as storable UTF-8: lone surrogates (undecodable bytes smuggled into a str) become
    U+FFFD instead of failing the database write."""
    return _SURROGATE.sub("\ufffd", text)


def terminal_text(line: str) -> str:
    """What a terminal shows of ``line``: the text after its last carriage return (a progress bar
    redrawn with ``\r`` is its final state), a ``\r\n`` ending removed."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def cut_line(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]} [... {len(text) - max_chars} more characters cut]"


class LogBuffer:
    """Bounded, thread-safe store of one process's lines; ``add`` never blocks on I/O."""

    def __init__(self, limits: LogLimits = LogLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lines: deque[LogLine] = deque()
        self._dropped = 0
        self._tokens = float(limits.burst)
        self._refilled_at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(
            float(self.limits.burst), self._tokens + (now - self._refilled_at) * self.limits.lines_per_s
        )
        self._refilled_at = now

    def room(self) -> int:
        """How many lines would be kept now."""
        with self._lock:
            self._refill()
            return max(0, min(int(self._tokens), self.limits.max_lines - len(self._lines)))

    def count_dropped(self, lines: int) -> None:
        with self._lock:
            self._dropped += lines

    def add(self, line: LogLine) -> bool:
        """Keep ``line`` (cut to ``max_line_chars``); False when it was dropped (over the rate or
        the buffer full)."""
        with self._lock:
            self._refill()
            if self._tokens < 1.0 or len(self._lines) >= self.limits.max_lines:
                self._dropped += 1
                return False
            self._tokens -= 1.0
        message = clean_text(cut_line(line.message, self.limits.max_line_chars))
        if message is not line.message:
            line = dataclasses.replace(line, message=message)
        with self._lock:
            self._lines.append(line)
        return True

    def drain(self) -> LogBatch:
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
            dropped = self._dropped
            self._dropped = 0
        return LogBatch(lines, dropped)


def level_name(levelno: int) -> str:
    """The highest of LEVELS at or below ``levelno`` (a custom level 25 is INFO)."""
    for name in reversed(LEVELS):
        if levelno >= logging.getLevelName(name):
            return name
    return "DEBUG"


class BufferHandler(logging.Handler):
    """A logging handler that keeps records as lines of ``component``. It only appends to a
    :class:`LogBuffer`, so a record logged while the run store writes (or by the store itself)
    cannot recurse or wait."""

    def __init__(
        self,
        buffer: LogBuffer,
        component: str,
        rank: int | None,
        node: str,
        logger_components: Mapping[str, str] | None = None,
        level: int = logging.INFO,
    ) -> None:
        super().__init__(level)
        self.buffer = buffer
        self.component = component
        self.rank = rank
        self.node = node
        self.logger_components = dict(logger_components or {})

    def component_of(self, logger: str) -> str:
        """The component of a logger: that of its longest prefix in ``logger_components``."""
        for prefix in sorted(self.logger_components, key=len, reverse=True):
            if logger == prefix or logger.startswith(prefix + "."):
                return self.logger_components[prefix]
        return self.component

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = f"{record.name}: {record.getMessage()}"
            if record.exc_info and record.exc_info[0] is not None:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            line = LogLine(
                record.created,
                level_name(record.levelno),
                self.component_of(record.name),
                self.rank,
                self.node,
                "log",
                message,
            )
            self.buffer.add(line)
        except Exception:  # noqa: BLE001 - logging must never raise into the code that logs
            self.handleError(record)


class StreamTee(io.TextIOBase):
    """Stands in for ``sys.stdout`` / ``sys.stderr``: everything still goes to the original stream
    (so Ray's worker log files and its forwarding to the driver are unchanged) and each complete
    line also goes to the buffer. A line left without its newline is kept until the next write, up
    to ``max_line_chars``."""

    def __init__(
        self,
        original: TextIO,
        buffer: LogBuffer,
        source: str,
        level: str,
        component: str,
        rank: int | None,
        node: str,
    ) -> None:
        self.original = original
        self.lines = buffer
        self.source = source
        self.level = level
        self.component = component
        self.rank = rank
        self.node = node
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        written = self.original.write(text)
        with self._lock:
            pending = self._partial + text
            # a flood in one write (a huge repr) is split only as far as the buffer has room now;
            # the lines past that are counted, never split into a list
            *lines, self._partial = pending.split("\n", self.lines.room())
            if "\n" in self._partial:
                skipped, _, self._partial = self._partial.rpartition("\n")
                self.lines.count_dropped(skipped.count("\n") + 1)
            if len(self._partial) > self.lines.limits.max_line_chars:
                lines.append(self._partial)
                self._partial = ""
        now = time.time()
        for line in map(terminal_text, lines):
            if not line or line.startswith(_RAY_MARKERS):
                continue
            self.lines.add(LogLine(now, self.level, self.component, self.rank, self.node, self.source, line))
        return written if written is not None else len(text)

    def flush(self) -> None:
        self.original.flush()

    def fileno(self) -> int:
        return self.original.fileno()

    def isatty(self) -> bool:
        return self.original.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.original, "encoding", "utf-8")

    @property
    def buffer(self):  # the original's bytes stream: bytes written there are not captured
        return self.original.buffer


def unhandled_elsewhere(record: logging.LogRecord) -> bool:
    """Whether no logger between ``record``'s and the root has a handler: the records Python's
    last-resort handler would print (a library that prints its own records is not printed twice)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if logger.handlers:
            return False
        logger = logger.parent if logger.propagate else None
    return True


class ProcessLogs:
    """This process's lines: a :class:`BufferHandler` on the root logger and, with
    ``capture_streams``, ``sys.stdout`` / ``sys.stderr`` replaced by :class:`StreamTee`\\ s.

    Streams are captured in Python, not at the file descriptor: an fd-level pipe needs a reader
    thread that every ``print`` would wait on once the pipe fills (a stall of the rank when that
    thread is slow), and it would take the output away from Ray's own worker log files. Output of C
    code (NCCL, CUDA) therefore stays in Ray's worker logs on its node only.

    Adding a handler to the root logger turns off Python's last-resort handler, which is what
    prints warnings when nothing configured logging; a stderr handler at WARNING, for the records
    that handler would have printed, takes its place then, so what reaches the console does not
    change.
    """

    def __init__(
        self,
        component: str,
        rank: int | None,
        node: str,
        *,
        capture_streams: bool,
        logger_components: Mapping[str, str] | None = None,
        limits: LogLimits = LogLimits(),
    ) -> None:
        self.buffer = LogBuffer(limits)
        self.handler = BufferHandler(self.buffer, component, rank, node, logger_components)
        self.console: logging.Handler | None = None
        self._streams: tuple[TextIO, TextIO] | None = None
        root = logging.getLogger()
        if not root.handlers:
            self.console = logging.StreamHandler(sys.stderr)
            self.console.setLevel(logging.WARNING)
            self.console.addFilter(unhandled_elsewhere)
            root.addHandler(self.console)
        root.addHandler(self.handler)
        self._refractor_level = logging.getLogger("refractor").level
        if self._refractor_level == logging.NOTSET:  # refractor's INFO lines are recorded (not printed)
            logging.getLogger("refractor").setLevel(logging.INFO)
        if capture_streams:
            self._streams = (sys.stdout, sys.stderr)
            sys.stdout = StreamTee(sys.stdout, self.buffer, "stdout", "INFO", component, rank, node)
            sys.stderr = StreamTee(sys.stderr, self.buffer, "stderr", "WARNING", component, rank, node)

    def drain(self) -> LogBatch:
        batch = self.buffer.drain()
        return LogBatch(batch.lines, batch.dropped, self.handler.node)

    def close(self) -> None:
        """Give back the streams, the handlers and the level (the buffer keeps what it holds)."""
        root = logging.getLogger()
        root.removeHandler(self.handler)
        if self.console is not None:
            root.removeHandler(self.console)
        logging.getLogger("refractor").setLevel(self._refractor_level)
        if self._streams is not None:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            sys.stdout, sys.stderr = self._streams
            self._streams = None
