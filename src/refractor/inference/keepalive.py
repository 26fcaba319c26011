"""How long idle HTTP connections live between refractor's clients and its inference servers.

A server that closes an idle kept-alive connection while a client sends a request on it fails that
request before reading it (the client sees the connection drop). So the client lets go of an idle
pooled connection well before any server closes it: after ``KEEPALIVE_EXPIRY_S``, below the 5 s of
a stock uvicorn or vLLM server, while refractor's own servers keep one open ``SERVER_KEEPALIVE_S``.
The margin matters: each side starts its idle clock when the answer leaves or arrives, and a busy
client reads an answer late, so its clock starts after the server's.
"""

KEEPALIVE_EXPIRY_S = 4.0
SERVER_KEEPALIVE_S = 65
