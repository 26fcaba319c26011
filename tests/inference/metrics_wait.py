"""Waiting on a server's /metrics, for the tests of this folder (imported as ``metrics_wait``): a test
that needs a request in a given state (running, queued, gone) polls for it instead of sleeping a fixed
time, which a fast machine outruns and a busy one undershoots."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from refractor.inference.client import summed_samples


def wait_for_metric(url: str, metric: str, done: Callable[[float], bool], seconds: float = 10) -> float:
    """Poll ``url``'s /metrics until ``done(value)`` holds for the summed ``metric``; the value. The
    test fails after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done(value := summed_samples(httpx.get(url + "/metrics").text)[metric]):
        assert time.monotonic() < deadline, f"{metric} stayed at {value}"
        time.sleep(0.01)
    return value
