"""Request bodies of the native server (pydantic), shaped like vLLM 0.32's.

Unknown fields are ignored (as vLLM does), wrong types and out-of-range values are a 400 that
names the field. ``sampling_params`` maps each generation body onto the engine's ``SamplingParams``;
``InitInfo`` and ``UpdateWeightsBody`` are the weight-update routes' parameters.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from refractor.inference.engine import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _valid_unicode(self):
        # JSON can carry lone surrogates (``"\\ud800"``), which no tokenizer can encode: refuse them
        # here, naming the field, instead of failing inside tokenization.
        for name, value in self:
            bad = _first_invalid_text(value)
            if bad is not None:
                raise ValueError(f"{name}: text is not valid Unicode (a lone surrogate in {bad!r})")
        return self


def _first_invalid_text(value: Any) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return value[max(err.start - 8, 0) : err.end + 8]
        return None
    if isinstance(value, BaseModel):
        value = dict(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple) and value and not isinstance(value[0], int | float):
        # validated lists are homogeneous: token ids and numbers hold no text (and are the long ones)
        for item in value:
            bad = _first_invalid_text(item)
            if bad is not None:
                return bad
    return None


class _SamplingFields(_Body):
    n: int = Field(1, ge=1, le=256)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported by the native engine (use inference_engine: vllm)")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise ValueError(
                "repetition_penalty is not supported by the native engine (use inference_engine: vllm)"
            )
        return self

    def sampling_params(self, logprobs: int | None, default_max_tokens: int | None = 16) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            stop=stop,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
        )


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # accepted; the usage comes in the last chunk only


class CompletionRequest(_SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _flags(self):
        if self.stream and self.logprobs is not None:
            raise ValueError("logprobs are not streamed by the native engine: use stream=false for them")
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo with logprobs (the prompt's log-probs) is not supported by the native engine"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string, one id list, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None

    @model_validator(mode="after")
    def _flags(self):
        if self.stream and self.logprobs:
            raise ValueError("logprobs are not streamed by the native engine: use stream=false for them")
        return self


class GenerateSamplingParams(_SamplingFields):
    """``sampling_params`` of ``/inference/v1/generate`` (vLLM's ``SamplingParams`` fields we honour)."""

    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1)


class GenerateRequest(_Body):
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    priority: int = 0
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool = False

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    @model_validator(mode="after")
    def _flags(self):
        if self.stream:
            raise ValueError("stream=true is not supported by the native engine")
        return self


class AbortRequest(_Body):
    request_ids: list[str] | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


# A weight-transfer group is the trainer plus every inference worker; gloo sets up per-rank state,
# so a group size far past any deployment is refused rather than allowed to exhaust memory.
MAX_WORLD_SIZE = 1 << 16
MAX_TRANSFER_TIMEOUT_S = 24 * 3600.0


class InitInfo(_Body):
    """``init_info`` of ``/init_weight_transfer_engine``: the group this server joins as a worker.

    Which ranks, ports and backends a worker may take is ``check_worker_join``'s rule (shared with
    the vLLM workers); this model checks types and the bounds that rule does not cover.
    """

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int
    world_size: int = Field(le=MAX_WORLD_SIZE)
    rank_offset: int
    group: str = Field("full", min_length=1, max_length=255)
    backend: str = "gloo"
    # how bucket bytes travel: through the group, or as CUDA IPC handles of the sender's GPU memory
    # (a server on the trainer's GPU; the group is gloo then)
    payload: Literal["group", "cuda_ipc"] = "group"
    init_timeout_s: float = Field(300.0, gt=0, le=MAX_TRANSFER_TIMEOUT_S)
    timeout_s: float = Field(300.0, gt=0, le=MAX_TRANSFER_TIMEOUT_S)


class UpdateInfo(_Body):
    """``update_info`` of ``/update_weights``: which group streams the update, and its version tag."""

    group: str = "full"
    version: int | str | None = None


class UpdateWeightsBody(_Body):
    """The whole body of ``/update_weights`` (the route parses it itself, see there)."""

    update_info: UpdateInfo
