"""The code a run starts with, recorded in its run store (docs/run-store.md#code-snapshot).

A snapshot holds labelled roots: ``project`` (the git repository the config file lives in, else the
config file's folder) and the folder of every environment or dedicated eval loaded from a user
folder (``env:<name>``, ``eval:<name>``) that the project does not already hold. A root inside a
git work tree lists git's files (tracked plus untracked-not-ignored) and records its commit,
branch, whether it is dirty and its diff against ``HEAD`` (untracked files as added ones); any other
root is walked. Files are left out and counted when an exclude pattern matches, when larger than
the file cap, when binary, when unreadable, or past the caps on the whole snapshot.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import stat
import subprocess
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from refractor.records import TimelineEvent

if TYPE_CHECKING:
    from refractor.config import RefractorConfig

log = logging.getLogger("refractor.code_snapshot")

PROJECT_ROOT = "project"
MAX_FILES = 5000
MAX_TOTAL_BYTES = 64 * 2**20
MAX_DIFF_BYTES = 2**20
MAX_WALKED_ENTRIES = 100_000  # a folder outside git is walked; this bounds a walk of a huge tree
BINARY_PROBE_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file, as git decides
GIT_TIMEOUT_S = 60.0
MAX_WARNING_EVENTS = 20  # a tree of unreadable files is summed up, not one event each
DIFF_PATHS_PER_CALL = 200  # changed paths passed to one `git diff` (command lines have a length cap)


@dataclass(frozen=True)
class CodeLimits:
    max_file_bytes: int
    exclude_patterns: tuple[str, ...] = ()
    max_files: int = MAX_FILES
    max_total_bytes: int = MAX_TOTAL_BYTES
    max_diff_bytes: int = MAX_DIFF_BYTES

    @classmethod
    def from_config(cls, cfg: RefractorConfig) -> CodeLimits:
        return cls(int(cfg.wandb_code_max_file_size_mb * 2**20), tuple(cfg.wandb_code_exclude_patterns))


@dataclass(frozen=True)
class GitState:
    commit: str  # '' before the first commit
    branch: str  # '' when HEAD is detached
    dirty: bool  # `git status` lists a change under the root (excluded files included)
    diff: str  # `git diff HEAD` of the snapshot's files plus its untracked files as added ones
    diff_truncated: bool  # the diff was cut at MAX_DIFF_BYTES


@dataclass(frozen=True)
class CodeRoot:
    label: str
    folder: str  # absolute path on the machine that started the run
    git: GitState | None  # None outside a git work tree


@dataclass(frozen=True)
class CodeFile:
    root: str
    path: str  # relative to the root's folder, '/'-separated
    size: int
    sha256: str


@dataclass
class CodeInfo:
    """A snapshot without its files: where each root was, its git state, and what was left out."""

    roots: list[CodeRoot] = field(default_factory=list)
    taken_at: float = 0.0
    seconds: float = 0.0
    file_count: int = 0
    total_bytes: int = 0
    skipped_too_large: int = 0
    skipped_binary: int = 0
    skipped_excluded: int = 0  # files or folders matched by an exclude pattern (a folder counts once)
    skipped_over_limit: int = 0  # files past MAX_FILES or MAX_TOTAL_BYTES
    skipped_unreadable: int = 0


@dataclass
class CodeSnapshot:
    info: CodeInfo
    files: list[tuple[CodeFile, bytes]]  # sorted by (root, path)
    warnings: list[str]  # what could not be read; the driver records each as an event


class GitError(RuntimeError):
    pass


def take_code_snapshot(
    project: Path, folders: Mapping[str, Path], limits: CodeLimits, skip: Sequence[Path] = ()
) -> CodeSnapshot:
    """Snapshot ``project`` (widened to its git repository) and each labelled folder of ``folders``
    that the project's files do not already cover; nothing under a ``skip`` folder is taken."""
    started = time.perf_counter()
    builder = _Builder(limits, [Path(p).resolve() for p in skip])
    project = Path(project).resolve()
    builder.add_root(PROJECT_ROOT, _git_toplevel(project) or project)
    for label, folder in folders.items():
        folder = Path(folder).resolve()
        if folder.is_dir() and not builder.covers(folder):
            builder.add_root(label, folder)
    builder.info.taken_at = time.time()
    builder.info.seconds = time.perf_counter() - started
    builder.files.sort(key=lambda item: (item[0].root, item[0].path))
    return CodeSnapshot(builder.info, builder.files, builder.warnings)


class SnapshotStore(Protocol):
    """What ``record_code_snapshot`` writes to (the run store; a Protocol so that the store can
    import this module's types without an import cycle)."""

    def log_code_snapshot(self, snapshot: CodeSnapshot) -> None: ...

    def log_event(self, event: TimelineEvent) -> None: ...


def record_code_snapshot(
    store: SnapshotStore,
    project: Path,
    folders: Callable[[], Mapping[str, Path]],
    limits: CodeLimits,
    skip: Sequence[Path],
    keep: Callable[[CodeSnapshot], None] | None = None,
) -> None:
    """Take the snapshot, write it to ``store`` and hand it to ``keep``; every failure, finding the
    ``folders`` included, becomes a ``code_snapshot_warning`` event (never an exception: the run goes
    on without its code)."""
    try:
        snapshot = take_code_snapshot(project, folders(), limits, skip)
        store.log_code_snapshot(snapshot)
        if keep is not None:
            keep(snapshot)
        warnings = snapshot.warnings
    except Exception as err:  # noqa: BLE001 - a snapshot must never stop the run
        warnings = [f"code snapshot failed: {type(err).__name__}: {err}"]
    if len(warnings) > MAX_WARNING_EVENTS:
        more = len(warnings) - MAX_WARNING_EVENTS + 1
        warnings = [*warnings[: MAX_WARNING_EVENTS - 1], f"code snapshot: {more} more warnings not shown"]
    for message in warnings:
        log.warning(message)
        now = time.time()
        try:
            store.log_event(TimelineEvent("code_snapshot_warning", now, now, "driver", {"message": message}))
        except Exception as err:  # noqa: BLE001 - a closed or failed store: the log line stays
            log.warning("code snapshot warning not stored: %s", err)


def write_code_archive(snapshot: CodeSnapshot, folder: Path) -> list[Path]:
    """``folder/source.zip`` (every file as ``<root>/<path>``) and ``folder/metadata.json`` (the
    roots, their git state and the counts): the snapshot as files, for W&B."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "source.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for f, content in snapshot.files:
            zf.writestr(f"{f.root}/{f.path}", content)
    metadata = folder / "metadata.json"
    metadata.write_text(json.dumps(dataclasses.asdict(snapshot.info), indent=1, default=str))
    return [archive, metadata]


def excluded_prefix(path: str, patterns: Sequence[str]) -> str | None:
    """The shortest leading part of ``path`` that a pattern matches, by a path component's name
    (``__pycache__``, ``*.pyc``) or by the whole leading part (``docs/*.png``); None if none does."""
    parts = path.split("/")
    for i, name in enumerate(parts, start=1):
        prefix = "/".join(parts[:i])
        if any(fnmatchcase(name, p) or fnmatchcase(prefix, p) for p in patterns):
            return prefix
    return None


class _Builder:
    def __init__(self, limits: CodeLimits, skip: list[Path]) -> None:
        self.limits = limits
        self.skip = skip
        self.info = CodeInfo()
        self.files: list[tuple[CodeFile, bytes]] = []
        self.warnings: list[str] = []

    def covers(self, folder: Path) -> bool:
        """Files under ``folder`` are in the snapshot already (it lies in a root that holds them)."""
        for root in self.info.roots:
            try:
                rel = folder.relative_to(root.folder).as_posix()
            except ValueError:
                continue
            inside = rel + "/"
            if rel == "." or any(f.root == root.label and f.path.startswith(inside) for f, _ in self.files):
                return True
        return False

    def add_root(self, label: str, folder: Path) -> None:
        in_git = _git_toplevel(folder) is not None
        tracked: set[str] = set()
        untracked: set[str] = set()
        excluded: set[str] = set()
        if in_git:
            try:
                tracked, untracked = _git_listing(folder)
            except (GitError, OSError) as err:
                self.warnings.append(f"{folder}: listing the files with git failed ({err}); walked instead")
                in_git = False
        names = sorted(tracked | untracked) if in_git else _walk(folder, self.limits, excluded, self.warnings)
        first = len(self.files)
        for name in names:
            if self._skipped(folder / name):
                continue
            prefix = excluded_prefix(name, self.limits.exclude_patterns)
            if prefix is not None:
                excluded.add(prefix)
                continue
            self._add_file(label, folder, name)
        self.info.skipped_excluded += len(excluded)
        state = None
        if in_git:
            try:
                state = _git_state(folder, self.files[first:], untracked, self.limits, self._skipped)
            except (GitError, OSError) as err:
                self.warnings.append(f"{folder}: reading the git state failed ({err})")
        self.info.roots.append(CodeRoot(label, _text(str(folder)), state))

    def _skipped(self, path: Path) -> bool:
        return any(path.is_relative_to(s) for s in self.skip)

    def _add_file(self, label: str, folder: Path, name: str) -> None:
        path = folder / name
        limits = self.limits
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):  # a submodule, a socket
                return
            if st.st_size > limits.max_file_bytes:
                self.info.skipped_too_large += 1
                return
            content = path.read_bytes()
        except FileNotFoundError:  # a tracked file deleted from the work tree (the diff shows it)
            return
        except OSError as err:
            self.info.skipped_unreadable += 1
            self.warnings.append(f"{path}: not readable ({err.strerror or err})")
            return
        if b"\0" in content[:BINARY_PROBE_BYTES]:
            self.info.skipped_binary += 1
            return
        if (
            self.info.file_count >= limits.max_files
            or self.info.total_bytes + len(content) > limits.max_total_bytes
        ):
            self.info.skipped_over_limit += 1
            return
        self.info.file_count += 1
        self.info.total_bytes += len(content)
        entry = CodeFile(label, _text(name), len(content), hashlib.sha256(content).hexdigest())
        self.files.append((entry, content))


def _text(name: str) -> str:
    """A file system name as valid UTF-8 text (an undecodable byte becomes U+FFFD)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _git(folder: Path, *args: str, check: bool = True) -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise GitError(f"`git {args[0]}` took more than {GIT_TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GitError(f"`git {' '.join(args[:2])}` failed: {message[-1] if message else proc.returncode}")
    return os.fsdecode(proc.stdout)


def _git_toplevel(folder: Path) -> Path | None:
    """The work tree ``folder`` lies in; None when it is in none, or git is not installed."""
    if not folder.is_dir():
        return None
    try:
        top = _git(folder, "rev-parse", "--show-toplevel").strip()
    except (GitError, OSError):
        return None
    return Path(top).resolve() if top else None


def _git_listing(folder: Path) -> tuple[set[str], set[str]]:
    """Tracked and untracked-not-ignored files under ``folder``, relative to it."""
    tracked = set(_git(folder, "ls-files", "--cached", "-z").split("\0")) - {""}
    untracked = set(_git(folder, "ls-files", "--others", "--exclude-standard", "-z").split("\0")) - {""}
    return tracked, untracked - tracked


def _walk(folder: Path, limits: CodeLimits, excluded: set[str], warnings: list[str]) -> Iterator[str]:
    """Files under ``folder`` (relative, sorted), never entering a folder an exclude pattern matches."""
    seen = 0
    for current, dirs, files in os.walk(folder):
        base = Path(current).relative_to(folder).as_posix()
        base = "" if base == "." else base + "/"
        seen += len(dirs) + len(files)
        if seen > MAX_WALKED_ENTRIES:
            warnings.append(f"{folder}: stopped listing after {MAX_WALKED_ENTRIES} entries")
            return
        kept = []
        for d in sorted(dirs):
            if excluded_prefix(base + d, limits.exclude_patterns) is None:
                kept.append(d)
            else:
                excluded.add(base + d)
        dirs[:] = kept
        yield from (base + f for f in sorted(files))


def _git_state(
    folder: Path,
    stored: list[tuple[CodeFile, bytes]],
    untracked: set[str],
    limits: CodeLimits,
    skipped: Callable[[Path], bool],
) -> GitState:
    """The git state of the work tree under ``folder``; ``stored``: the files the snapshot took from it
    (its untracked ones, or all before the first commit, are shown as added files)."""
    commit = _git(folder, "rev-parse", "-q", "--verify", "HEAD", check=False).strip()
    branch = _git(folder, "symbolic-ref", "-q", "--short", "HEAD", check=False).strip()
    dirty = bool(_git(folder, "status", "--porcelain", "-z", "--", "."))
    parts: list[str] = []
    if commit:
        changed = _git(folder, "diff", "HEAD", "--relative", "--name-only", "-z").split("\0")
        shown = [
            p
            for p in changed
            if p and excluded_prefix(p, limits.exclude_patterns) is None and not skipped(folder / p)
        ]
        for i in range(0, len(shown), DIFF_PATHS_PER_CALL):
            chunk = [f":(literal){p}" for p in shown[i : i + DIFF_PATHS_PER_CALL]]
            parts.append(_git(folder, "diff", "HEAD", "--relative", "--", *chunk))
            if sum(map(len, parts)) > limits.max_diff_bytes:
                break
    added = [(f.path, content) for f, content in stored if f.path in untracked or not commit]
    for path, content in added:
        parts.append(added_file_diff(path, content))
        if sum(map(len, parts)) > limits.max_diff_bytes:
            break
    diff = _text("".join(parts))
    data = diff.encode()
    truncated = len(data) > limits.max_diff_bytes
    if truncated:
        diff = data[: limits.max_diff_bytes].decode("utf-8", "ignore")
    return GitState(commit, _text(branch), dirty, diff, truncated)


def added_file_diff(path: str, content: bytes) -> str:
    """A new file as git shows it: every line added."""
    lines = content.decode("utf-8", "replace").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    body = "".join(difflib.unified_diff([], lines, "/dev/null", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\nnew file mode 100644\n{body}"
