"""The control plane over a server that closes kept-alive connections the way uvicorn does after a
request that raised: a repeatable call (resume, pause, the GETs) goes through on a new connection;
a call that must not be sent twice fails with the server's name; a resume that cannot be confirmed
fails the update instead of leaving the server paused."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from refractor.weight_sync import ServerRef, WeightSyncError
from refractor.weight_sync.control_plane import ServerControl
from refractor.weight_sync.sender import RESUME_ATTEMPTS, _resume_until_running


class DroppingServer:
    """HTTP/1.1 on a real socket. Each connection answers its first request (keep-alive) and closes
    without an answer when a second request arrives on it: what a client meets when it reuses a
    connection the server has just closed. ``paused_answers`` are the /is_paused values to give."""

    def __init__(self, paused_answers: list[bool] | None = None):
        self.requests: list[str] = []
        self.paused_answers = list(paused_answers or [])
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            for answered in (False, True):
                head = self._read_head(conn)
                if head is None:
                    return
                if answered:
                    return  # the second request on this connection: close it unanswered
                line = head.split("\r\n", 1)[0]
                self.requests.append(line)
                body = b"{}"
                if "/is_paused" in line:
                    paused = self.paused_answers.pop(0) if self.paused_answers else False
                    body = json.dumps({"is_paused": paused}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )

    @staticmethod
    def _read_head(conn: socket.socket) -> str | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            data += chunk
        return data.decode("latin-1")

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def server():
    s = DroppingServer()
    yield s
    s.close()


def test_a_repeatable_call_goes_through_on_a_new_connection(server):
    control = ServerControl(ServerRef("s0", server.url), timeout_s=5)
    control.pause()  # first connection: answered, kept alive
    control.resume()  # sent on the same connection, which the server closes: sent again on a new one
    assert not control.is_paused()
    assert [line.split()[1].split("?")[0] for line in server.requests] == ["/pause", "/resume", "/is_paused"]


def test_a_call_that_must_not_repeat_fails_naming_the_server(server):
    control = ServerControl(ServerRef("s0", server.url), timeout_s=5)
    control.pause()
    with pytest.raises(
        WeightSyncError, match=r"server s0 \(http://127\.0\.0\.1:\d+\): POST /start_weight_update"
    ):
        control.start_weight_update()
    assert [line.split()[1].split("?")[0] for line in server.requests] == ["/pause"]  # never sent twice


def test_resume_is_repeated_until_the_server_says_it_runs():
    server = DroppingServer(paused_answers=[True, True, False])
    control = ServerControl(ServerRef("s0", server.url), timeout_s=5)
    _resume_until_running(control)
    assert sum("/resume" in line for line in server.requests) == 3
    server.close()


def test_a_server_that_stays_paused_is_named():
    server = DroppingServer(paused_answers=[True] * RESUME_ATTEMPTS)
    control = ServerControl(ServerRef("s0", server.url), timeout_s=5)
    with pytest.raises(WeightSyncError, match=rf"server s0 .* stays paused after {RESUME_ATTEMPTS} resumes"):
        _resume_until_running(control)
    server.close()
