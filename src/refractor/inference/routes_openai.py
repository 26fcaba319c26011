"""Generation routes: OpenAI completions / chat completions and vLLM's token-in/token-out generate."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from refractor.errors import one_line
from refractor.inference.engine import RequestOutput, SamplingParams
from refractor.inference.engine.async_engine import stream_outputs
from refractor.inference.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    TokenizeRequest,
)
from refractor.inference.server_state import BadRequest, ServerState, run_until_disconnect

router = APIRouter()
log = logging.getLogger(__name__)


class OrjsonResponse(Response):
    """A JSON answer serialised by orjson, bypassing FastAPI's ``jsonable_encoder``: that walks every
    element in Python, which for long answers with per-token log-probs holds the GIL the engine
    thread needs. Non-finite floats become null (standard JSON has no -inf)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def fast_json(
    route: Callable[..., Awaitable[Any]],
) -> Callable[..., Awaitable[Response]]:
    """The route's dict answered as an ``OrjsonResponse``; a Response (a stream) goes out as it is."""

    @functools.wraps(route)
    async def answer(*args: Any, **kwargs: Any) -> Response:
        result = await route(*args, **kwargs)
        return result if isinstance(result, Response) else OrjsonResponse(result)

    return answer


def _state(request: Request) -> ServerState:
    return request.app.state.refractor


def _check_model(state: ServerState, model: str | None) -> None:
    if model and model != state.model_name:
        raise BadRequest(
            f"The model `{model}` does not exist (this server serves `{state.model_name}`).",
            HTTPStatus.NOT_FOUND,
        )


def _check_prompt(state: ServerState, ids: list[int], params: SamplingParams) -> None:
    vocab = state.engine.vocab_size
    if not ids:
        raise BadRequest("the prompt is empty")
    if len(ids) >= state.max_model_len:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens but max_model_len is {state.max_model_len}: it must "
            "leave room for at least one generated token"
        )
    # vLLM's rule: a max_tokens the context cannot hold is refused, not silently shortened
    room = state.max_model_len - len(ids)
    if params.max_tokens is not None and params.max_tokens > room:
        raise BadRequest(
            f"max_tokens ({params.max_tokens}) is too large: the prompt has {len(ids)} tokens and "
            f"max_model_len is {state.max_model_len}, which leaves room for {room}"
        )
    if min(ids) < 0 or max(ids) >= vocab:
        raise BadRequest(f"prompt token ids must be in [0, {vocab})")


def _sampling(body, logprobs: int | None, default_max_tokens: int | None) -> SamplingParams:
    try:
        return body.sampling_params(logprobs, default_max_tokens)
    except ValueError as err:
        raise BadRequest(str(err)) from None


Job = tuple[str, list[int], SamplingParams, int]  # request id, prompt ids, sampling, priority


def _check_jobs(state: ServerState, jobs: list[Job]) -> None:
    for rid, ids, params, _ in jobs:
        _check_prompt(state, ids, params)
        if rid in state.active_request_ids:
            raise BadRequest(f"request id {rid!r} is already in flight")


async def _run(request: Request, state: ServerState, jobs: list[Job]) -> list[RequestOutput] | None:
    """Generate every job concurrently; None if the client went away (everything aborted)."""
    _check_jobs(state, jobs)

    async def all_jobs() -> list[RequestOutput]:
        tasks = [
            asyncio.ensure_future(state.engine.generate(ids, params, rid, priority))
            for rid, ids, params, priority in jobs
        ]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failed or we were cancelled: the siblings must not run on
                task.cancel()
            raise

    ids = {rid for rid, *_ in jobs}
    state.active_request_ids |= ids
    try:
        outputs = await run_until_disconnect(request, all_jobs())
    except ValueError as err:
        raise BadRequest(str(err)) from None
    finally:
        state.active_request_ids -= ids
    for output in outputs or []:
        state.metrics.observe(output)
    return outputs


async def _stream_jobs(state: ServerState, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(job index, output so far) of every job as the engine steps; each job's last item is its final
    output. Closing the iterator (the client went away) aborts what still runs."""
    progress: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, rid: str, ids: list[int], params: SamplingParams, priority: int) -> None:
        try:
            async for output in stream_outputs(state.engine, ids, params, rid, priority):
                progress.put_nowait((index, output, None))
        except Exception as err:  # noqa: BLE001 - reported in the stream, which has started
            progress.put_nowait((index, None, err))
        else:
            progress.put_nowait((index, None, None))

    ids = {rid for rid, *_ in jobs}
    state.active_request_ids |= ids
    tasks = [asyncio.ensure_future(pump(i, *job)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            index, output, error = await progress.get()
            if error is not None:
                raise error
            if output is None:
                running -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        state.active_request_ids -= ids


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events: one ``data:`` line per chunk, ``data: [DONE]`` last; an error after the
    stream started is sent as a chunk with ``error`` (the status line is gone by then)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except (BadRequest, ValueError) as err:
            yield (
                b"data: "
                + orjson.dumps({"error": {"message": str(err), "type": "BadRequestError", "code": 400}})
                + b"\n\n"
            )
        except Exception as err:  # noqa: BLE001 - the client gets the reason; the server goes on
            log.exception("a streamed request failed")
            message = {"message": one_line(err), "type": type(err).__name__, "code": 500}
            yield b"data: " + orjson.dumps({"error": message}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _chunk_maker(state: ServerState, answer_id: str, kind: str) -> Callable[..., dict[str, Any]]:
    """One streamed answer's chunks: ``chunk(choices, **extra)`` with the answer's id, object, model."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": answer_id,
            "object": kind,
            "created": state.created,
            "model": state.model_name,
            "choices": choices,
            **extra,
        }

    return chunk


class _Deltas:
    """The text of each streamed sequence sent so far; ``next`` gives what is new. Text that could be
    the start of a stop string, or an incomplete UTF-8 character, is held back until it is decided."""

    def __init__(self, text: _Text, stops: list[str]):
        self.text = text
        self.stops = stops
        self.sent: dict[tuple[int, int], str] = {}
        self.finished: set[tuple[int, int]] = set()

    def ends(self, key: tuple[int, int], choice) -> bool:
        """Whether this output is the first to carry the sequence's finish reason."""
        if choice.finish_reason is None or key in self.finished:
            return False
        self.finished.add(key)
        return True

    def next(self, key: tuple[int, int], choice) -> str:
        if choice.finish_reason is not None:
            visible = self.text.completion(choice.token_ids, choice.stop_reason)
        else:
            visible = self.text.tokenizer.decode(choice.token_ids, skip_special_tokens=self.text.skip)
            visible = visible.rstrip("\ufffd")
            hold = max(
                (k for stop in self.stops for k in range(1, len(stop)) if visible.endswith(stop[:k])),
                default=0,
            )
            visible = visible[: len(visible) - hold]
        sent = self.sent.get(key, "")
        if not visible.startswith(sent):  # the decoding of earlier tokens changed: send the difference on
            sent = sent[: len(visible)]
        self.sent[key] = visible
        return visible[len(sent) :]


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Text:
    """Token -> text helpers bound to one request's options."""

    def __init__(self, tokenizer, skip_special_tokens: bool, as_ids: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.as_ids = as_ids

    def completion(self, token_ids: list[int], stop_reason: Any) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip)
        if isinstance(stop_reason, str) and stop_reason in text:  # the stop string is not part of the output
            text = text[: text.index(stop_reason)]
        return text

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])


def _completion_logprobs(text: _Text, choice, k: int) -> dict[str, Any]:
    tokens = [text.token(t) for t in choice.token_ids]
    offsets = []
    position = 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    top = []
    for i, (token_id, logprob) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
        entry = {text.token(token_id): logprob}
        for alt_id, alt_logprob in (choice.top_logprobs[i] if k and choice.top_logprobs else [])[:k]:
            entry.setdefault(text.token(alt_id), alt_logprob)
        top.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": list(choice.logprobs),
        "tokens": tokens,
        "top_logprobs": top,
    }


@router.post("/v1/completions")
@fast_json
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    _check_model(state, body.model)
    params = _sampling(body, body.logprobs, 16)
    base = body.request_id or uuid.uuid4().hex
    prompts = [
        (await state.off_loop(state.tokenizer, p)).input_ids if isinstance(p, str) else p
        for p in body.prompts()
    ]
    jobs = [(f"cmpl-{base}-{i}", ids, params, body.priority) for i, ids in enumerate(prompts)]
    text = _Text(state.tokenizer, body.skip_special_tokens, body.return_tokens_as_token_ids)
    echoed = [_echo(state, body, p, ids) for p, ids in zip(body.prompts(), prompts, strict=True)]
    if body.stream:
        _check_jobs(state, jobs)
        return _sse(_completion_chunks(state, body, jobs, params, text, echoed, f"cmpl-{base}"))
    outputs = await _run(request, state, jobs)
    if outputs is None:
        return {}
    choices = []
    for p, output in enumerate(outputs):
        for choice in output.outputs:
            choices.append(
                {
                    "index": p * params.n + choice.index,
                    "text": echoed[p] + text.completion(choice.token_ids, choice.stop_reason),
                    "logprobs": _completion_logprobs(text, choice, body.logprobs)
                    if body.logprobs is not None
                    else None,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None,
                    "token_ids": choice.token_ids if body.return_token_ids else None,
                }
            )
    return {
        "id": f"cmpl-{base}",
        "object": "text_completion",
        "created": state.created,
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(outputs),
    }


def _echo(state: ServerState, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> str:
    """With ``echo``, the prompt's text (a token-id prompt decoded) starts each completion's text."""
    if not body.echo:
        return ""
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(ids, skip_special_tokens=False)


async def _completion_chunks(
    state: ServerState,
    body: CompletionRequest,
    jobs: list[Job],
    params: SamplingParams,
    text: _Text,
    echoed: list[str],
    completion_id: str,
) -> AsyncIterator[dict[str, Any]]:
    chunk = _chunk_maker(state, completion_id, "text_completion")
    deltas = _Deltas(text, params.stop)
    finals: dict[int, RequestOutput] = {}
    for p, echo in enumerate(echoed):
        if echo:
            yield chunk(
                [
                    {"index": p * params.n + c, "text": echo, "logprobs": None, "finish_reason": None}
                    for c in range(params.n)
                ]
            )
    async for p, output in _stream_jobs(state, jobs):
        choices = []
        for choice in output.outputs:
            delta = deltas.next((p, choice.index), choice)
            ends = deltas.ends((p, choice.index), choice)
            if delta or ends:
                choices.append(
                    {
                        "index": p * params.n + choice.index,
                        "text": delta,
                        "logprobs": None,
                        "finish_reason": choice.finish_reason if ends else None,
                        "stop_reason": choice.stop_reason,
                    }
                )
        if all(c.finish_reason is not None for c in output.outputs):
            finals[p] = output
            state.metrics.observe(output)
        if choices:
            yield chunk(choices)
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=_usage([finals[p] for p in sorted(finals)]))


async def _chat_prompt(
    state: ServerState, body: ChatCompletionRequest | TokenizeRequest, kwargs: dict | None
) -> list[int]:
    return await state.off_loop(_render_chat_prompt, state, body, kwargs)


def _render_chat_prompt(
    state: ServerState, body: ChatCompletionRequest | TokenizeRequest, kwargs: dict | None
) -> list[int]:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        rendered = state.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            chat_template=state.chat_template,
            **(kwargs or {}),
        )
    except Exception as err:  # a template error is the caller's messages or the configured template
        raise BadRequest(f"could not apply the chat template: {err}") from None
    return state.tokenizer(rendered, add_special_tokens=False).input_ids


@router.post("/v1/chat/completions")
@fast_json
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = _state(request)
    _check_model(state, body.model)
    top = body.top_logprobs or 0
    params = _sampling(body, top if body.logprobs else None, None)
    if body.max_completion_tokens is not None:
        params.max_tokens = body.max_completion_tokens
    rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
    prompt = await _chat_prompt(state, body, body.chat_template_kwargs)
    text = _Text(state.tokenizer, body.skip_special_tokens, body.return_tokens_as_token_ids)
    if body.stream:
        jobs = [(rid, prompt, params, body.priority)]
        _check_jobs(state, jobs)
        return _sse(_chat_chunks(state, body, jobs, params, text))
    outputs = await _run(request, state, [(rid, prompt, params, body.priority)])
    if outputs is None:
        return {}
    (output,) = outputs

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = text.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": [] if text.as_ids else list(token.encode())}

    choices = []
    for choice in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = {
                "content": [
                    {
                        **entry(t, lp),
                        "top_logprobs": [
                            entry(a, alp)
                            for a, alp in (choice.top_logprobs[i] if choice.top_logprobs else [])[:top]
                        ],
                    }
                    for i, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True))
                ]
            }
        choices.append(
            {
                "index": choice.index,
                "message": {
                    "role": "assistant",
                    "content": text.completion(choice.token_ids, choice.stop_reason),
                },
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids if body.return_token_ids else None,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": state.created,
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(outputs),
        "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None,
        # refractor's addition: the engine's account of the request's time (docs/metrics.md#latency)
        "latency": output.latency(),
    }


async def _chat_chunks(
    state: ServerState, body: ChatCompletionRequest, jobs: list[Job], params: SamplingParams, text: _Text
) -> AsyncIterator[dict[str, Any]]:
    rid = jobs[0][0]

    chunk = _chunk_maker(state, rid, "chat.completion.chunk")
    yield chunk(
        [
            {
                "index": c,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in range(params.n)
        ]
    )
    deltas = _Deltas(text, params.stop)
    final = None
    async for _, output in _stream_jobs(state, jobs):
        choices = []
        for choice in output.outputs:
            delta = deltas.next((0, choice.index), choice)
            if delta:
                choices.append(
                    {
                        "index": choice.index,
                        "delta": {"content": delta},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            if deltas.ends((0, choice.index), choice):
                choices.append(
                    {
                        "index": choice.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                )
        if all(c.finish_reason is not None for c in output.outputs):
            final = output
            state.metrics.observe(output)
        if choices:
            yield chunk(choices)
    if final is not None and body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=_usage([final]))


@router.post("/inference/v1/generate")
@fast_json
async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
    """vLLM 0.32's tokens-only endpoint: ids in, ids + processed logprobs + weight_versions out."""
    state = _state(request)
    _check_model(state, body.model)
    sp = body.sampling_params
    params = _sampling(sp, sp.logprobs, sp.max_tokens)
    request_id = body.request_id or uuid.uuid4().hex
    outputs = await _run(
        request, state, [(f"generate-tokens-{request_id}", body.token_ids, params, body.priority)]
    )
    if outputs is None:
        return {}
    (output,) = outputs
    choices = []
    for choice in output.outputs:
        logprobs = None
        if sp.logprobs is not None:
            content = []
            for i, (token_id, logprob) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
                rank = choice.ranks[i] if choice.ranks else None
                sampled = {"token_id": token_id, "logprob": logprob, "rank": rank}
                alternatives = [
                    {"token_id": a, "logprob": alp, "rank": r + 1}
                    for r, (a, alp) in enumerate(
                        (choice.top_logprobs[i] if choice.top_logprobs else [])[: sp.logprobs]
                    )
                ]
                content.append({**sampled, "top_logprobs": [sampled, *alternatives]})
            logprobs = {"content": content}
        choices.append(
            {
                "index": choice.index,
                "token_ids": choice.token_ids,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": [
                    {"version": str(s.version), "start": s.start, "end": s.end}
                    for s in choice.weight_versions
                ],
            }
        )
    return {
        "request_id": request_id,
        "model": state.model_name,
        "created": state.created,
        "output_mode": "tokens",
        "choices": choices,
        "usage": _usage(outputs),
        "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None,
        # refractor's addition: the engine's account of the request's time (docs/metrics.md#latency)
        "latency": output.latency(),
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "refractor",
                "root": state.model_name,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
        ],
    }


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    if body.messages is not None:
        tokens = await _chat_prompt(state, body, None)
    else:
        encoded = await state.off_loop(
            state.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens
        )
        tokens = encoded.input_ids
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": None}
