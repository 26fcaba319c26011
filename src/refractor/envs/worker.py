"""A reward worker process: ``python -m refractor.envs.worker``.

Reads length-prefixed pickled ``(function, args)`` tasks on stdin and answers each with a pickled
``(ok, value_or_exception)`` on stdout. Functions run on this process's main thread, so
signal-based timeouts (math-verify) work. Started by ``runners.ProcessRunner`` as a plain
subprocess, so the parent's ``__main__`` is never re-imported (unlike multiprocessing).
"""

from __future__ import annotations

import pickle
import sys

HEADER_BYTES = 8


def encode(obj: object) -> bytes:
    data = pickle.dumps(obj)
    return len(data).to_bytes(HEADER_BYTES, "big") + data


def main() -> None:
    channel_in = sys.stdin.buffer
    channel_out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints of a task must not corrupt the channel
    while True:
        header = channel_in.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            return  # the parent closed the pipe
        fn, args = pickle.loads(channel_in.read(int.from_bytes(header, "big")))
        try:
            reply = (True, fn(*args))
        except BaseException as err:  # the parent re-raises it
            reply = (False, err)
        try:
            frame = encode(reply)
        except Exception:  # unpicklable result or exception
            frame = encode((False, RuntimeError(repr(reply[1])[:2000])))
        channel_out.write(frame)
        channel_out.flush()


if __name__ == "__main__":
    main()
