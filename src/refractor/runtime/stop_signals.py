"""SIGINT and SIGTERM stop a run the same way, from any state, and say which one did.

Rules:
* Both signals end in ``KeyboardInterrupt`` in the driver's main thread, so one cleanup path runs
  (servers and trainer ranks stopped, the run store marked ``interrupted``). SIGTERM is what
  schedulers (Slurm, Kubernetes, ``kill``) send; it is re-raised as SIGINT so that inside
  ``asyncio.run`` the event loop's own SIGINT handling cancels the main task cleanly.
* SIGINT is handled even when the process started with it ignored: a shell starts background jobs
  (``refractor train ... &``) with SIGINT ignored, and ``kill -INT`` must still stop them.
* ``ray.init`` installs two SIGTERM handlers of its own: a Python one (exit without cleanup) and,
  in its C++ core, a crash reporter that prints a stack, passes the signal on, and arms
  ``alarm(3)`` to abort the process (exit 134) three seconds later, whatever the cleanup is doing.
  ``install`` is called again once Ray is up, and every stop signal cancels a pending alarm (a
  signal that arrives while Ray starts still passes through that reporter). refractor itself
  never uses SIGALRM.
* While the run cleans up, further signals are only noted (``deferred``): a scheduler repeating
  SIGTERM must not cut the cleanup short and leave orphan processes behind. Every cleanup step is
  bounded in time.
* The exit code is 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as shells report.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_received: list[int] = []  # the signals that asked this process to stop, in order


def _cancel_alarm() -> None:
    signal.alarm(0)  # see the module's rules: Ray's crash reporter would abort the cleanup


def _on_term(signum, frame) -> None:
    _received.append(signum)
    _cancel_alarm()
    signal.raise_signal(signal.SIGINT)  # handled by the event loop's or Python's SIGINT handler


def install() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (call it again after
    ``ray.init``). A no-op outside the main thread, where Python cannot handle signals."""
    if threading.current_thread() is not threading.main_thread():
        return
    # default_int_handler itself (not a wrapper) for SIGINT: asyncio.run replaces only that one with
    # its task-cancelling handler; SIGTERM notes itself, then raises SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_term)


def stopping_signal() -> int:
    """The first signal that stopped the run (SIGINT when none was noted: a Ctrl-C)."""
    return _received[0] if _received else signal.SIGINT


def exit_code() -> int:
    return 128 + stopping_signal()


def signal_name() -> str:
    return signal.Signals(stopping_signal()).name


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside: SIGINT and SIGTERM are noted, not raised (cleanup runs to its end); the handlers of
    ``install`` are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def note(signum, frame) -> None:
        _received.append(signum)
        _cancel_alarm()

    for sig in previous:
        signal.signal(sig, note)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
