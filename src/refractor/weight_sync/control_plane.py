"""The control plane: the HTTP calls trainer rank 0 makes to each inference server in an update.

Contract: every server exposes vLLM 0.32's weight-update routes (a vLLM server in dev mode; the
native server through ``refractor.inference.weight_routes``): ``/get_world_size``,
``/init_weight_transfer_engine``, ``/pause``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/reset_prefix_cache``, ``/resume``, ``/weight_info``,
``/shutdown_weight_transfer_engine``, ``/health``. Every call is bounded by a timeout, and every
failure raises ``WeightSyncError`` naming the server it came from. Every call but ``/health``
presents the run's control token (``Authorization: Bearer``), which those routes require.

A call that may be repeated without effect (pause in ``keep`` mode, resume, the cache reset, the
GETs) is sent again once when the server closed the kept-alive connection under it: uvicorn closes
a connection whose request raised after its error answer went out (a rejected ``/update_weights``
does), and the next call on that pooled connection then fails with "connection reset" although
the server is fine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from refractor.errors import RefractorUserError

# what httpx raises when the server closed the connection before answering
CLOSED_UNDER_US = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class WeightSyncError(RefractorUserError, RuntimeError):
    """A weight update could not be completed; the message names the server(s) involved."""

    def __init__(self, message: str, unresponsive: frozenset[str] = frozenset()):
        super().__init__(message)
        self.unresponsive = unresponsive  # names of servers that did not answer /health


@dataclass(frozen=True)
class ServerRef:
    """An inference server the trainer updates: a display name and its base URL."""

    name: str
    url: str

    def __str__(self) -> str:
        return f"{self.name} ({self.url})"


class ServerControl:
    def __init__(self, server: ServerRef, timeout_s: float, control_token: str | None = None):
        self.server = server
        self._http = httpx.Client(
            base_url=server.url.rstrip("/"),
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {control_token}"} if control_token else None,
        )

    def call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        timeout_s: float | None = None,
        repeatable: bool = False,
    ) -> Any:
        kwargs: dict[str, Any] = {"params": params}
        if json is not None:
            kwargs["json"] = json
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        try:
            try:
                response = self._http.request(method, path, **kwargs)
            except CLOSED_UNDER_US:
                if not repeatable:
                    raise
                response = self._http.request(method, path, **kwargs)  # the pool opens a new connection
        except httpx.TimeoutException as err:
            raise WeightSyncError(f"server {self.server}: {method} {path} timed out ({err!r})") from err
        except httpx.HTTPError as err:
            raise WeightSyncError(f"server {self.server}: {method} {path} failed: {err!r}") from err
        if response.status_code >= 400:
            raise WeightSyncError(
                f"server {self.server}: {method} {path} answered HTTP {response.status_code}: "
                f"{response.text[:2000]}"
            )
        return response.json() if response.content else None

    # --- the routes, named after vLLM's ----------------------------------------------------
    def world_size(self) -> int:
        return int(self.call("GET", "/get_world_size", repeatable=True)["world_size"])

    def init_weight_transfer_engine(self, init_info: dict, timeout_s: float) -> None:
        self.call("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, timeout_s=timeout_s)

    def pause(self) -> None:
        # keep: in-flight requests are frozen, not aborted. clear_cache=false: the prefix cache is
        # reset explicitly after the update (vLLM applies clear_cache even in keep mode)
        self.call("POST", "/pause", params={"mode": "keep", "clear_cache": "false"}, repeatable=True)

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, group: str, version: str, timeout_s: float) -> None:
        # version: engines that apply weights in one call (native) tag them now; vLLM at finish
        self.call(
            "POST",
            "/update_weights",
            json={"update_info": {"group": group, "version": version}},
            timeout_s=timeout_s,
        )

    def finish_weight_update(self, version: str) -> None:
        self.call("POST", "/finish_weight_update", json={"weight_version": version})

    def reset_prefix_cache(self, reset_running_requests: bool = True) -> None:
        # reset_running_requests: in-flight requests recompute their KV with the new weights on resume;
        # without it they keep their old-weight KV (only the cache of finished prefixes is dropped)
        self.call(
            "POST",
            "/reset_prefix_cache",
            params={"reset_running_requests": "true" if reset_running_requests else "false"},
            repeatable=True,
        )

    def resume(self) -> None:
        self.call("POST", "/resume", repeatable=True)

    def is_paused(self) -> bool:
        return bool(self.call("GET", "/is_paused", repeatable=True)["is_paused"])

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("POST", "/shutdown_weight_transfer_engine", timeout_s=5.0)

    def weight_version(self) -> str | None:
        return self.call("GET", "/weight_info", repeatable=True)["weight_version"]

    def probe(self, timeout_s: float = 5.0) -> str | None:
        """None when the server answers /health, else why it does not."""
        try:
            response = self._http.get("/health", timeout=timeout_s)
        except httpx.TimeoutException:
            return f"no answer to /health within {timeout_s:.0f} s (hung or overloaded)"
        except httpx.HTTPError as err:
            return f"unreachable ({type(err).__name__}: {err}) - the server process probably died"
        return None if response.status_code == 200 else f"/health answered HTTP {response.status_code}"

    def close(self) -> None:
        self._http.close()
