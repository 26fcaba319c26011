"""The run's own tokenizer, loaded lazily from its local path for the dashboard's raw-token view.

Local files only, never remote code (``trust_remote_code`` stays False); a few tokenizers are kept
(an LRU keyed by path), and a path that cannot be loaded is tried again on the next request."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

MAX_TOKENIZERS = 4

_lock = threading.Lock()
_cache: OrderedDict[str, Any] = OrderedDict()


class TokenizerUnavailable(LookupError):
    pass


def load_tokenizer(path: str) -> Any:
    """The tokenizer at ``path`` (a local directory), cached; raises TokenizerUnavailable."""
    with _lock:
        if path in _cache:
            _cache.move_to_end(path)
            return _cache[path]
    if not path or not Path(path).is_dir():
        raise TokenizerUnavailable(path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # any failure to load reads the same to the page: not available here
        raise TokenizerUnavailable(path) from exc
    with _lock:
        _cache[path] = tok
        _cache.move_to_end(path)
        while len(_cache) > MAX_TOKENIZERS:
            _cache.popitem(last=False)
    return tok
