"""The native inference engine: requests in, sampled tokens + log-probs + weight versions out.

Synchronous core (``add_request`` / ``step`` / ``abort`` / ``update_weights``); the server drives
it from one background thread through ``AsyncLLMEngine``. A request with ``n`` samples becomes
``n`` sequences; it finishes when all of them have.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from refractor.errors import one_line
from refractor.inference.engine.block_manager import BlockManager
from refractor.inference.engine.config import EngineConfig
from refractor.inference.engine.lora import EngineAdapters, describe_update
from refractor.inference.engine.model_runner import ModelRunner
from refractor.inference.engine.sampler import (
    DeviceSample,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    fused_sampler_available,
    step_seeds,
)
from refractor.inference.engine.sampling_params import SamplingParams
from refractor.inference.engine.scheduler import Scheduler
from refractor.inference.engine.sequence import CompletionOutput, RequestOutput, Sequence
from refractor.inference.engine.sleep import EngineMemory, ParameterArena
from refractor.inference.engine.transfer import to_device
from refractor.models import CausalLM, load_model, read_hf_config
from refractor.models.lora import is_adapter_update_name

log = logging.getLogger(__name__)


def sequence_seed(seed: int, index: int) -> int:
    """The generator seed of the ``index``-th sequence of a seeded request, within torch's seed range
    (seeds whose product stays in range keep their plain value, so existing seeds sample as before)."""
    derived = seed * 1_000_003 + index
    return derived if -(2**63) <= derived < 2**64 else derived % 2**64


class PromptTooLongError(ValueError):
    """A prompt leaves no room to generate within ``max_model_len``."""


class SleepModeOffError(RuntimeError):
    """sleep / wake_up on an engine built without ``enable_sleep_mode``."""


class EngineStepError(RuntimeError):
    """A step failed for each of its requests, run alone as well: the engine itself is at fault."""


@dataclass
class _Request:
    seqs: list[Sequence]
    prompt_token_ids: list[int]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


@dataclass
class _Launched:
    """A decode step launched on the device whose tokens the host has not recorded yet."""

    seqs: list[Sequence]
    sample: DeviceSample
    version: int | str  # the weights it runs with (updates wait for it: ``_record_launched``)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    steps_total: int = 0
    # prompt tokens looked up in the prefix cache, and those found there (not recomputed)
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # wall time spent inside step() (busy / elapsed = how fed the engine is)
    busy_seconds_total: float = 0.0


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        self.config = config or EngineConfig()
        self.model = model.eval().requires_grad_(False)
        if self.config.fuse_projections:  # before the arena and the CUDA graphs take the parameters
            self.model.fuse_projections()
        # runtime LoRA: buffers allocated now, before the CUDA graphs capture their addresses
        self.adapters = (
            EngineAdapters.attach(self.model, self.config.lora_rank, self.config.lora_target_modules)
            if self.config.lora_rank
            else None
        )
        self.device = next(model.parameters()).device
        self.eos_token_ids = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.detokenize = detokenize  # only needed for stop strings
        # sleep mode: the parameters move to sleepable memory before the CUDA graphs capture them
        arena = (
            ParameterArena(self.model.parameters(), self.device) if self.config.enable_sleep_mode else None
        )
        self.runner = ModelRunner(self.model, self.config, self.device)
        self.memory = None if arena is None else EngineMemory(arena, self.runner.kv_memory)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.prefill_token_budget,
            self.config.decode_steps_between_prefills,
            self.config.max_prefill_delay_ms / 1000,
        )
        self.sampler = Sampler()
        # compiles and checks the fused sampler's kernels now, not in the first step
        fused_sampler_available(self.device, self.model.config.vocab_size)
        self._seeds = random.Random(self.config.seed)  # sample seeds of unseeded requests
        self.requests: dict[str, _Request] = {}
        self.weight_version: int | str = 0
        self.paused = False
        self._arrivals = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps_total = 0
        self.busy_seconds_total = 0.0
        self._launched: _Launched | None = None  # async scheduling: the step the device runs
        self._ready: list[RequestOutput] = []  # finished while recording outside step()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, **kwargs) -> LLMEngine:
        config = config or EngineConfig()
        device = config.resolve_device()
        hf_config = read_hf_config(path)
        dtype = config.resolve_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype"), device)
        return cls(load_model(path, dtype=dtype, device=device), config, **kwargs)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        prompt = list(prompt_token_ids)
        max_len = self.config.max_model_len
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= max_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens but max_model_len is {max_len}: "
                "it must leave room for at least one generated token "
                "(shorten the prompt or raise max_model_len)"
            )
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs ({params.logprobs}) exceeds the vocabulary of {vocab} tokens")
        if params.stop and self.detokenize is None:
            raise ValueError(
                "stop strings need a tokenizer; this engine was built without one (use stop_token_ids)"
            )
        # Like vLLM, max_tokens is silently capped by the room left in the context.
        room = max_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._arrivals += 1
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                seed = sequence_seed(params.seed, i)
                gen = torch.Generator(device=self.device).manual_seed(seed)
            else:
                seed = self._seeds.getrandbits(63)
            seqs.append(
                Sequence(
                    request_id, i, prompt, params, priority, self._arrivals, max_tokens, gen, seed % 2**63
                )
            )
        self.requests[request_id] = _Request(seqs, prompt)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[RequestOutput]:
        """Finish requests now (``finish_reason="abort"``, partial tokens kept); None = all.

        Frees their KV.
        """
        self._record_launched()
        ids = list(self.requests) if request_ids is None else [r for r in request_ids if r in self.requests]
        outputs = []
        for request_id in ids:
            for seq in self.requests[request_id].seqs:
                if not seq.is_finished:
                    seq.finish("abort")
                    self.scheduler.remove(seq)
            outputs.append(self._pop_output(request_id))
        return outputs

    def has_unfinished(self) -> bool:
        """Whether a request is in flight or its output has not been returned by ``step`` yet."""
        return bool(self.requests or self._ready)

    @property
    def has_work(self) -> bool:
        """Whether ``step`` has anything to do: outputs to return, a launched step, or sequences to run."""
        if self._ready or self._launched is not None:
            return True
        return not self.paused and not self.is_sleeping and self.scheduler.has_work

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode step; return the requests that finished in it.

        A request whose work raises inside the step fails alone: its output comes back with
        ``error`` set and its KV freed, and the step's other requests go on (see ``_sample_isolating``).
        Raises ``EngineStepError`` when the step fails for every one of two or more requests.

        With ``async_scheduling`` a decode step returns before its tokens are on the host: the
        next call launches the step after it (when no prefill is due and no sequence must be
        preempted), then records the earlier one, so the device never waits for the host's
        bookkeeping; when it cannot launch ahead, it records, then schedules as usual. Every
        control call (abort, pause, sleep, weight and cache updates) records a launched step first.
        """
        outputs, self._ready = self._ready, []
        started = time.perf_counter()
        launched, self._launched = self._launched, None
        if launched is not None:
            self._launched = self._launch_after(launched)
            outputs += self._record_step_of(launched)
            if self._launched is not None:
                self.busy_seconds_total += time.perf_counter() - started
                return outputs
            # else this call runs a step scheduled the usual way as well
        if self.paused or self.is_sleeping or not self.scheduler.has_work:
            return outputs
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        if is_prefill:
            self.prompt_tokens_total += sum(s.num_tokens for s in seqs)
        elif self.config.async_scheduling:
            try:
                self._launched = _Launched(seqs, self._launch(seqs), self.weight_version)
            except Exception as err:  # the synchronous step below finds the request at fault
                log.warning("launching a decode step failed (%s); running it synchronously", one_line(err))
            else:
                self.busy_seconds_total += time.perf_counter() - started
                return outputs
        try:
            sampled, failures = self._sample_isolating(seqs, is_prefill)
        except BaseException:
            self.block_manager.discard_pending()
            raise
        if not sampled and len(failures) > 1:
            self.block_manager.discard_pending()
            err = next(iter(failures.values()))
            raise EngineStepError(
                f"the step failed for each of its {len(failures)} requests, even run alone: {one_line(err)}"
            ) from err
        outputs += self._record_step(sampled, failures, self.weight_version)
        self.block_manager.finish_prefill_step()  # the failed requests' blocks were unnamed as freed
        self.busy_seconds_total += time.perf_counter() - started
        return outputs

    def _record_step(
        self,
        sampled: list[tuple[list[Sequence], SamplerOutput]],
        failures: dict[str, Exception],
        version: int | str,
    ) -> list[RequestOutput]:
        """Append each group's sampled tokens; the outputs of the requests that finished or failed.
        A sequence already finished (aborted, or done in the step before a launched-ahead one)
        takes nothing."""
        now = time.monotonic()
        finished_requests = []
        for group, out in sampled:
            for row, seq in enumerate(group):
                if seq.request_id in failures or seq.is_finished:
                    continue
                try:
                    if self._record(seq, out, row, now, version):
                        finished_requests.append(seq.request_id)
                except Exception as err:  # e.g. the tokenizer in a stop-string check: this request's alone
                    failures[seq.request_id] = err
                self.generation_tokens_total += 1
        outputs = [self._pop_output(r) for r in finished_requests if r not in failures]
        outputs += [self._fail(r, err) for r, err in failures.items()]
        self.steps_total += 1
        return outputs

    def _launch(self, seqs: list[Sequence], next_ids: torch.Tensor | None = None) -> DeviceSample:
        """Queue a decode step's model and sampler on the device and its tokens' copy to the host."""
        logits = self.runner.run(seqs, False, next_ids)
        batch = self._sampling_batch(seqs, logits, ahead=next_ids is not None)
        return self.sampler.launch(logits, batch).copy_to_host()

    def _launch_after(self, launched: _Launched) -> _Launched | None:
        """Launch the decode step after ``launched`` before its tokens reach the host, feeding them
        on the device; None when the scheduler wants the step recorded first."""
        rows = [i for i, seq in enumerate(launched.seqs) if not seq.is_finished]
        seqs = [launched.seqs[i] for i in rows]
        if not seqs or self.paused or self.is_sleeping or not self.scheduler.schedule_ahead(seqs):
            return None
        next_ids = launched.sample.token_ids
        if len(rows) < len(launched.seqs):
            next_ids = next_ids.index_select(0, to_device(rows, next_ids.device))
        try:
            return _Launched(seqs, self._launch(seqs, next_ids), self.weight_version)
        except Exception as err:  # recorded first, the sequences are scheduled the usual way
            log.warning(
                "launching a decode step ahead failed (%s); recording the last one first", one_line(err)
            )
            return None

    def _record_launched(self) -> None:
        """Record a launched step now (before a control call changes what it ran on); its finished
        requests come out of the next ``step``."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._ready += self._record_step_of(launched)

    def _record_step_of(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens and record them (``_record_step``)."""
        return self._record_step([(launched.seqs, launched.sample.result())], {}, launched.version)

    def _sampling_batch(
        self, seqs: list[Sequence], logits: torch.Tensor, ahead: bool = False
    ) -> SamplingBatch:
        """Each row's settings; ``ahead``: the step samples one token past what the host holds."""
        return SamplingBatch(
            temperatures=[s.params.temperature for s in seqs],
            top_ps=[s.params.top_p for s in seqs],
            top_ks=[s.params.top_k for s in seqs],
            generators=[s.generator for s in seqs],
            num_top_logprobs=[s.params.logprobs for s in seqs],
            seeds=step_seeds(
                np.fromiter((s.sample_seed for s in seqs), np.int64, len(seqs)),
                np.fromiter((s.num_output_tokens for s in seqs), np.int64, len(seqs)) + int(ahead),
            )
            if logits.is_cuda
            else None,
        )

    def _sample(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        logits = self.runner.run(seqs, is_prefill)
        return self.sampler(logits, self._sampling_batch(seqs, logits))

    def _sample_isolating(
        self, seqs: list[Sequence], is_prefill: bool
    ) -> tuple[list[tuple[list[Sequence], SamplerOutput]], dict[str, Exception]]:
        """Sample ``seqs`` as one batch; if that raises, bisect it to find the sequences that fail alone.

        Returns the groups that ran with their outputs, and the exception of each request with a
        sequence that failed on its own. Re-running is safe because nothing is recorded before a
        group has sampled: a sequence's KV slots are its own and are written again, and its tokens
        are appended only after. (Seeded rows would draw again only if the sampler raised after its
        draws, which takes a device fault, and that fails every group.) A group that fails only when
        batched (out of memory, say) runs as its halves. The cost is about two runs per halving
        level for each failing sequence.
        """
        try:
            return [(seqs, self._sample(seqs, is_prefill))], {}
        except Exception as err:
            if len(seqs) == 1:
                log.error("request %s failed in the engine step: %s", seqs[0].request_id, one_line(err))
                return [], {seqs[0].request_id: err}
            log.warning(
                "an engine step of %d sequences failed (%s); re-running it in halves",
                len(seqs),
                one_line(err),
            )
        half = len(seqs) // 2
        first, first_failures = self._sample_isolating(seqs[:half], is_prefill)
        rest = [s for s in seqs[half:] if s.request_id not in first_failures]  # a failed request is done
        if not rest:
            return first, first_failures
        second, second_failures = self._sample_isolating(rest, is_prefill)
        return first + second, first_failures | second_failures

    def _record(self, seq: Sequence, out: SamplerOutput, row: int, now: float, version: int | str) -> bool:
        """Append the sampled token to ``seq``; True when that finished its whole request."""
        seq.append(
            out.token_ids[row],
            out.logprobs[row],
            version,
            out.ranks[row] if out.ranks is not None and seq.params.logprobs is not None else None,
            out.top_logprobs[row] if out.top_logprobs is not None and seq.params.logprobs else None,
        )
        request = self.requests[seq.request_id]
        if request.first_token_time is None:
            request.first_token_time = now
        if not self._check_stop(seq):
            return False
        self.scheduler.remove(seq)
        return all(s.is_finished for s in request.seqs)

    def _fail(self, request_id: str, err: Exception) -> RequestOutput:
        """End a request whose work raised in a step: every sequence finishes with "error", KV freed."""
        for seq in self.requests[request_id].seqs:
            if not seq.is_finished:
                seq.finish("error")
            self.scheduler.remove(seq)
        return self._pop_output(request_id, one_line(err))

    def _check_stop(self, seq: Sequence) -> bool:
        token = seq.token_ids[-1]
        params = seq.params
        if token in params.stop_token_ids:
            seq.finish("stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            seq.finish("stop")
        elif params.stop and (hit := self._stop_string(seq)) is not None:
            seq.finish("stop", hit)
        elif seq.num_output_tokens >= seq.max_tokens:
            seq.finish("length")
        return seq.is_finished

    def _stop_string(self, seq: Sequence) -> str | None:
        # A stop string ends within the last few tokens; decoding only that tail keeps this O(1).
        window = max(len(s) for s in seq.params.stop) + 2
        tail = self.detokenize(seq.output_token_ids[-window:])
        return next((s for s in seq.params.stop if s in tail), None)

    def _pop_output(self, request_id: str, error: str | None = None) -> RequestOutput:
        return self._output(request_id, self.requests.pop(request_id), error)

    def partial_output(self, request_id: str) -> RequestOutput:
        """A request in flight, so far: the tokens recorded up to now (a streamed request's progress;
        with async scheduling, the launched step's tokens are not recorded yet)."""
        return self._output(request_id, self.requests[request_id], partial=True)

    def _output(
        self, request_id: str, request: _Request, error: str | None = None, partial: bool = False
    ) -> RequestOutput:
        return RequestOutput(
            request_id,
            request.prompt_token_ids,
            [CompletionOutput.from_sequence(s, partial) for s in request.seqs],
            request.arrival_time,
            request.first_token_time,
            error=error,
            scheduled_time=min(
                (q.scheduled_time for q in request.seqs if q.scheduled_time is not None), default=None
            ),
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Offline convenience: run the given prompts to completion; outputs in prompt order (a request
        that failed in a step comes back with ``error`` set)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{self._arrivals + i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            self.add_request(rid, prompt, params_list[i], priorities[i] if priorities else 0)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.step():
                done[output.request_id] = output
        return [done[r] for r in ids]

    # ---- control -----------------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> list[RequestOutput]:
        """keep: freeze in-flight requests until ``resume``; abort: finish them now (partial tokens)."""
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause mode must be 'keep' or 'abort' here, got {mode!r}")
        self._record_launched()
        self.paused = True
        return self.abort() if mode == "abort" else []

    def resume(self) -> None:
        self.paused = False

    # ---- sleep mode (vLLM's semantics; engine/sleep.py) ---------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.memory is not None and bool(self.memory.asleep)

    def sleep(self, level: int = 1) -> None:
        """Give back the KV cache (running sequences re-prefill after the wake) and the weights:
        offloaded to host memory at level 1, discarded at level 2. No step runs until every part is
        awake again; requests keep arriving and wait."""
        self.check_sleep(level)
        self._record_launched()
        self.scheduler.preempt_all()
        self.block_manager.reset_prefix_cache()  # the cached KV goes with the memory
        self.memory.sleep(level)

    def check_sleep(self, level: int = 1) -> None:
        """Raise unless ``sleep(level)`` can be done."""
        if self.memory is None:
            raise SleepModeOffError(
                "sleep mode is off: start the engine with enable_sleep_mode (--enable-sleep-mode)"
            )
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload the weights) or 2 (discard them), got {level}")

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``; None: both)."""
        self.check_sleep()
        self.memory.wake_up(tags)

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The live parameters by HF name (read-only use: checksums, debugging); a fused part is a view."""
        return self.model.named_hf_parameters()

    def update_names(self, adapters: bool) -> list[str]:
        """Every name a complete update writes: the parameters, or with ``adapters`` the LoRA adapter
        buffers and the scale (none on an engine without LoRA)."""
        if adapters:
            return [] if self.adapters is None else self.adapters.names
        return [name for name, _ in self.named_parameters()]

    @torch.inference_mode()
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | str | None = None,
        recompute_kv: bool = True,
    ) -> int:
        """Copy tensors into the parameters by HF name, in place (KV cache and CUDA graphs stay valid).

        Call between steps. ``version`` (when given) tags every token sampled from now on.
        ``recompute_kv``: running sequences drop their KV and are re-prefilled with the new weights
        (exact; vLLM's default); False keeps the stale KV (PipelineRL-style). An empty iterable only
        sets the version. Returns the number of tensors copied.

        An update carries weights, or LoRA adapters (``...lora_A.weight``, ``...lora_B.weight`` and
        ``ADAPTER_SCALE_NAME``: written into the engine's adapter buffers, engine/lora.py) with the
        weights the trainer trains in full beside them (``lora_modules_to_save``), if any.

        Atomic: every tensor is checked first (a known name, the parameter's shape, a floating dtype,
        only finite values), and one bad tensor fails the whole update with nothing written and the
        version unchanged.
        """
        updates = self._checked_update(list(named_tensors))
        self._record_launched()  # its tokens were sampled with the weights being replaced
        for target, tensor in updates:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        copied = len(updates)
        if version is not None:
            self.weight_version = version
        if copied:
            self.reset_prefix_cache(reset_running_requests=recompute_kv)
        return copied

    def _checked_update(
        self, named_tensors: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, value) pairs of an update (a parameter's host copy while it sleeps offloaded);
        ValueError naming every problem."""
        adapter = [name for name, _ in named_tensors if is_adapter_update_name(name)]
        if adapter and self.adapters is None:
            raise ValueError(
                f"update_weights: the update carries LoRA adapters ({describe_update(named_tensors)}) but "
                "this server has no adapter buffers (start it with --lora-rank and --lora-target-modules); "
                "nothing was written"
            )
        floating = [(name, t) for name, t in named_tensors if t.is_floating_point()]
        errors = [
            f"{name!r} has dtype {t.dtype}, expected a floating-point tensor"
            for name, t in named_tensors
            if not t.is_floating_point()
        ]
        writes, more = self._weight_destinations(
            [(n, t) for n, t in floating if not is_adapter_update_name(n)]
        )
        errors += more
        if adapter:
            adapter_writes, more = self.adapters.plan(
                [(n, t) for n, t in floating if is_adapter_update_name(n)]
            )
            writes += adapter_writes
            errors += more
        if writes:  # one device sync for the whole update, not one per tensor
            finite = torch.stack([torch.isfinite(t).all().to(self.device) for _, _, t in writes]).tolist()
            non_finite = [repr(n) for (n, _, _), ok in zip(writes, finite, strict=True) if not ok]
            if non_finite:
                errors.append(f"non-finite values (NaN or Inf) in {', '.join(non_finite)}")
        updates = [(target, value) for _, target, value in writes]
        if updates and self.memory is not None and self.memory.weights_discarded:
            errors.append(
                "the weights were discarded by sleep(level=2): wake_up(['weights']) before updating them"
            )
        if errors:
            raise ValueError("update_weights: " + "; ".join(errors) + "; nothing was written")
        return updates

    def _weight_destinations(
        self, named_tensors: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list[str]]:
        """(name, parameter, value) of each tensor of a weight update, and the names or shapes that do
        not fit."""
        tied = self.model.lm_head is None
        updates = []
        errors = []
        for name, tensor in named_tensors:
            if name == "lm_head.weight" and tied:
                continue  # the embedding is the head; vLLM ignores it as well
            try:
                param = self.model.get_parameter_by_hf_name(name)
            except AttributeError:
                errors.append(f"{name!r} is not a parameter of this {self.model.config.architecture}")
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                errors.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            else:
                target = param if self.memory is None else self.memory.write_target(param)
                updates.append((name, target, tensor))
        return updates, errors

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Forget the cached KV of finished prefixes (it was computed with other weights).

        ``reset_running_requests``: running sequences drop their KV too and are re-prefilled
        (prompt + tokens so far) on their next step; else they keep it.
        """
        self._record_launched()
        self.block_manager.reset_prefix_cache()
        if reset_running_requests:
            self.scheduler.preempt_all()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=self.block_manager.query_tokens_total,
            prefix_cache_hits_total=self.block_manager.hit_tokens_total,
            steps_total=self.steps_total,
            busy_seconds_total=self.busy_seconds_total,
        )
