"""The run's own tokenizer, loaded lazily from its local path for the dashboard's raw-token view.

Local files only, never remote code (``trust_remote_code`` stays False); the last few tokenizers
are kept (by path), and a path that cannot be loaded is tried again on the next request (a raised
error is not cached)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

MAX_TOKENIZERS = 4


class TokenizerUnavailable(LookupError):
    pass


@functools.lru_cache(maxsize=MAX_TOKENIZERS)
def load_tokenizer(path: str) -> Any:
    """The tokenizer at ``path`` (a local directory), cached; raises TokenizerUnavailable."""
    if not path or not Path(path).is_dir():
        raise TokenizerUnavailable(path)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # any failure to load reads the same to the page: not available here
        raise TokenizerUnavailable(path) from exc
