"""Async HTTP client for one inference server, engine-agnostic (native engine or vLLM 0.32).

The orchestrator's rollout path is ``generate``: token ids in, sampled token ids + processed
log-probs + ``weight_versions`` spans out, through ``/inference/v1/generate``. The transport is one
``aiohttp.ClientSession`` per server, opened on first use inside the running event loop. aiohttp,
not httpx: the driver sends one request per sample from one event loop, so the client's CPU per
request caps the samples per second a run takes in, and aiohttp's request path costs about a tenth
of httpx's (``bench/bench_client_cpu.py``). Retried: connection failures (the request never reached
the server, so a retry cannot duplicate work), and once, a request whose pooled connection the
server closed under it (``refractor.inference.keepalive``). Any other transport failure raises
``InferenceServerError`` naming the server and the failure. Cancelling the awaiting task closes the
connection, which makes the server abort the request and free its KV cache. Each request carries
the credential its route needs (``refractor.inference.access``): the control token for control
routes, the API key for generation routes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from refractor.inference.access import RouteKind, bearer, route_kind
from refractor.inference.keepalive import KEEPALIVE_EXPIRY_S

log = logging.getLogger(__name__)

# how both engines name a /inference/v1/generate request internally (vLLM 0.32's token-in/token-out route)
GENERATE_REQUEST_ID_PREFIX = "generate-tokens-"
DEFAULT_MAX_CONNECTIONS = 1024
# the request never reached the server: no connection, or none within the connect timeout
NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# what aiohttp raises when the server closed the connection before answering (ClientOSError: a reset
# while sending or reading; ClientPayloadError: the answer's body cut short)
CLOSED_UNDER_US = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientPayloadError,
)
JSON_BODY = {"Content-Type": "application/json"}
HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


class InferenceServerError(RuntimeError):
    """The server answered with an error, or could not be reached (the message names the server)."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class Sampling:
    """The sampling settings sent as ``sampling_params`` (vLLM field names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # 0: the sampled token's log-prob only

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "n": self.n,
            "logprobs": self.logprobs,
            "ignore_eos": self.ignore_eos,
        }
        if self.top_k > 0:
            body["top_k"] = self.top_k
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        return body


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were sampled with weights ``version`` (an int when numeric)."""

    version: int | str
    start: int
    end: int


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    stop_reason: int | str | None = None
    index: int = 0
    # the server's account of the request's time, in seconds (queue_time, ttft, prefill_time,
    # decode_time, e2e_latency); empty when the server gives none (vLLM)
    latency: dict[str, float] = field(default_factory=dict)
    # the server's id of the request (both engines: ``generate-tokens-<request_id sent>``), which
    # vLLM's trace spans name (docs/metrics.md#latency)
    server_request_id: str | None = None


def _version(value: Any) -> int | str:
    return int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else value


def _latency(value: Any) -> dict[str, float]:
    """The response's ``latency`` object, numbers only (a server's garbage is dropped, not raised)."""
    if not isinstance(value, dict):
        return {}
    return {
        str(k): float(v) for k, v in value.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def parse_generate_choice(choice: dict[str, Any]) -> GenerateResult:
    content = (choice.get("logprobs") or {}).get("content") or []
    return GenerateResult(
        token_ids=list(choice.get("token_ids") or []),
        logprobs=[float(c["logprob"]) for c in content],
        finish_reason=choice.get("finish_reason") or "stop",
        weight_versions=[
            WeightVersionSpan(_version(s["version"]), s["start"], s["end"])
            for s in choice.get("weight_versions") or []
        ],
        stop_reason=choice.get("stop_reason"),
        index=choice.get("index", 0),
    )


def connections_for_lanes(lanes: int) -> int:
    """A client's connection limit for a server that gets at most ``lanes`` requests at once: a
    connection for every lane and as many more for control requests (weight pushes, pauses,
    status), so that neither waits for a connection the other holds."""
    return max(DEFAULT_MAX_CONNECTIONS, 2 * lanes)


class InferenceClient:
    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        model: str | None = None,
        timeout_s: float | None = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        control_token: str | None = None,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._credentials = {
            RouteKind.CONTROL: bearer(control_token),
            RouteKind.GENERATION: bearer(api_key),
            RouteKind.OPEN: {},
        }
        # how the orchestrator, lanes and the run store refer to this server
        self.name = name or self.base_url
        self.model = model
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_connections = max_connections
        # connect: waiting for a free pooled connection and opening one; sock_connect: the TCP
        # connect alone; sock_read: the longest silence while waiting for the answer
        self._timeout = aiohttp.ClientTimeout(
            connect=timeout_s, sock_connect=connect_timeout_s, sock_read=timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self.closed_connection_retries = 0  # requests sent again after the server closed their connection

    def _http(self) -> aiohttp.ClientSession:
        """The session, opened on first use: aiohttp binds it to the event loop running then."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_EXPIRY_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
            # aiohttp resends an idempotent request once by itself when its kept-alive connection
            # drops; _request does that for every method, once, and counts it
            self._session._retry_connection = False
        return self._session

    def rebase(self, base_url: str) -> None:
        """The server now answers at ``base_url`` (a restart may move it to another port)."""
        self.base_url = base_url.rstrip("/")

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, params: dict | None = None
    ) -> bytes:
        """The answer's body; raises ``InferenceServerError`` on a transport failure or HTTP >= 400."""
        headers = self._credentials[route_kind(path)]
        data = None
        if body is not None:
            headers = {**headers, **JSON_BODY}
            data = orjson.dumps(body)
        attempt = 0
        closed_under_us = False
        while True:
            try:
                async with self._http().request(
                    method, self.base_url + path, headers=headers, data=data, params=params
                ) as response:
                    status = response.status
                    content = await response.read()
                break
            except NOT_CONNECTED as err:
                if attempt == self.max_retries:
                    raise InferenceServerError(
                        f"inference server {self.base_url} unreachable after {attempt + 1} attempts: {err!r}"
                    ) from err
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
                attempt += 1
            except CLOSED_UNDER_US as err:
                # once: a kept-alive connection the server had just closed (the retry takes another);
                # twice is the server dropping requests
                if closed_under_us:
                    raise InferenceServerError(
                        f"inference server {self.base_url}{path}: {transport_error_text(err)} (twice)"
                    ) from err
                closed_under_us = True
                self.closed_connection_retries += 1
                log.info("%s%s: %s; sending it again", self.base_url, path, transport_error_text(err))
            except (TimeoutError, aiohttp.ClientError) as err:  # timeouts, protocol errors
                raise InferenceServerError(
                    f"inference server {self.base_url}{path}: {transport_error_text(err)}"
                ) from err
        if status >= 400:
            raise InferenceServerError(
                f"inference server {self.base_url}{path} returned {status}: {_error_text(content)}", status
            )
        return content

    async def _post_json(self, path: str, body: dict[str, Any] | None = None, **params) -> dict[str, Any]:
        content = await self._request("POST", path, body, params or None)
        # orjson: a long answer's per-token log-probs are tens of kB of JSON, parsed on the event loop
        return orjson.loads(content) if content else {}

    async def _get_json(self, path: str) -> Any:
        return orjson.loads(await self._request("GET", path))

    # ---- generation ----------------------------------------------------------------------------
    async def generate_choices(
        self, token_ids: list[int], sampling: Sampling, *, request_id: str | None = None, priority: int = 0
    ) -> list[GenerateResult]:
        """``request_id``: names the request on the server (as ``generate-tokens-<request_id>``); a new
        one when None."""
        request_id = request_id or uuid.uuid4().hex
        body: dict[str, Any] = {
            "token_ids": list(token_ids),
            "sampling_params": sampling.to_json(),
            "priority": priority,
            "request_id": request_id,
        }
        if self.model is not None:
            body["model"] = self.model
        data = await self._post_json("/inference/v1/generate", body)
        latency = _latency(data.get("latency"))
        server_id = f"{GENERATE_REQUEST_ID_PREFIX}{request_id}"
        return sorted(
            (
                replace(parse_generate_choice(c), latency=latency, server_request_id=server_id)
                for c in data["choices"]
            ),
            key=lambda r: r.index,
        )

    async def generate(
        self, token_ids: list[int], sampling: Sampling, *, request_id: str | None = None, priority: int = 0
    ) -> GenerateResult:
        """One sample (``sampling.n`` must be 1; use ``generate_choices`` for n > 1)."""
        if sampling.n != 1:
            raise ValueError("generate() returns one sample; use generate_choices() for n > 1")
        (result,) = await self.generate_choices(token_ids, sampling, request_id=request_id, priority=priority)
        return result

    # ---- control -------------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            async with self._http().get(self.base_url + "/health", timeout=HEALTH_TIMEOUT) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._post_json("/pause", None, mode=mode, clear_cache=str(clear_cache).lower())

    async def resume(self) -> None:
        await self._post_json("/resume")

    async def is_paused(self) -> bool:
        return bool((await self._get_json("/is_paused"))["is_paused"])

    async def sleep(self, level: int = 1, mode: str = "keep") -> None:
        """Give the server's GPU memory back (vLLM's sleep mode); requests wait until ``wake_up``."""
        await self._post_json("/sleep", None, level=level, mode=mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``; None: all of it)."""
        await self._post_json("/wake_up", None, **({"tags": tags} if tags else {}))

    async def is_sleeping(self) -> bool:
        return bool((await self._get_json("/is_sleeping"))["is_sleeping"])

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Abort requests by the ids given at generate time (None: everything in flight)."""
        data = await self._post_json("/abort_requests", {"request_ids": request_ids or []})
        return int(data.get("aborted", 0))

    async def weight_version(self) -> int | str | None:
        """The server's current weight version (``/weight_info``); None if the route is absent."""
        try:
            data = await self._get_json("/weight_info")
        except InferenceServerError as err:
            if err.status_code == 404:
                return None
            raise
        version = data.get("weight_version")
        return None if version is None else _version(version)

    async def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels, e.g. ``vllm:num_requests_running``."""
        return summed_samples((await self._request("GET", "/metrics")).decode())


def summed_samples(text: str) -> dict[str, float]:
    """A ``/metrics`` page's samples by name, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def transport_error_text(err: BaseException) -> str:
    """The failure's type and message (a timeout's message is often empty)."""
    if isinstance(err, CLOSED_UNDER_US) and not str(err):
        return f"{type(err).__name__}: the server closed the connection without answering"
    return f"{type(err).__name__}: {err or 'no detail'}"


def _error_text(content: bytes) -> str:
    try:
        data = orjson.loads(content)
    except ValueError:
        return content.decode(errors="replace")[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
