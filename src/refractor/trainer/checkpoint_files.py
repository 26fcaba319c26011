"""Checkpoint integrity: the size and SHA-256 of every file, recorded when it is saved and checked
before it is resumed.

The record goes into ``meta.json`` (written last), so a checkpoint whose shard was truncated,
overwritten or deleted afterwards (a full disk, a copy cut short, a manual edit) is recognised and
named instead of failing deep inside the loader. Recording reads every file back once, which also
flushes it to disk (``fsync``) before the checkpoint directory is renamed into place.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CHUNK = 8 * 2**20
# hashlib releases the GIL on large buffers, so shards hash in parallel.
_HASH_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class FileRecord:
    """What a checkpoint file held when it was saved."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileRecord:
        return cls(size=int(data["size"]), sha256=str(data["sha256"]))


def _digest(path: Path, sync: bool = False) -> FileRecord:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return FileRecord(size=size, sha256=h.hexdigest())


def _digest_and_sync(path: Path) -> FileRecord:
    return _digest(path, sync=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_files(directory: Path, skip: str) -> dict[str, FileRecord]:
    """Size and SHA-256 of every file under ``directory`` (relative POSIX paths) except ``skip``;
    every file and folder is flushed to disk on the way."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != skip)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        records = list(pool.map(_digest_and_sync, files))
    for folder in {p.parent for p in files} | {directory}:
        fsync_dir(folder)
    return {p.relative_to(directory).as_posix(): r for p, r in zip(files, records, strict=True)}


def find_damage(directory: Path, recorded: Mapping[str, FileRecord], checksums: bool) -> str | None:
    """The first recorded file that is missing, has another size or (with ``checksums``) other
    contents, described in one line; None when every file is as recorded."""
    for name, record in sorted(recorded.items()):
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != record.size:
            return f"{path} has {size} bytes where {record.size} were saved (truncated or overwritten)"
    if checksums:
        names = sorted(recorded)
        with ThreadPoolExecutor(_HASH_THREADS) as pool:
            digests = list(pool.map(_digest, [directory / n for n in names]))
        for name, digest in zip(names, digests, strict=True):
            if digest.sha256 != recorded[name].sha256:
                return f"{directory / name} does not match the SHA-256 saved with it (corrupted)"
    return None
