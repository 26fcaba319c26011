"""Run a command as a child subreaper: ``python reaper.py CMD ARGS...``.

Without a PID namespace, a program can leave processes behind by detaching them from its process
group (``setsid``, double fork). As a subreaper this wrapper inherits every such orphan, so when the
command exits it kills all that remain, and while the command runs the host finds them all below
this process. Exits with the command's status (128 + N when a signal N ended it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import time

import psutil

_PR_SET_CHILD_SUBREAPER = 36


def _reap_zombies() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def end_descendants() -> None:
    me = psutil.Process()
    while descendants := me.children(recursive=True):
        for proc in descendants:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _reap_zombies()
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        command = subprocess.Popen(argv)
    except OSError as err:
        print(f"cannot run {argv[0]!r}: {err.strerror}", file=sys.stderr)
        return 127
    code = command.wait()
    end_descendants()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
