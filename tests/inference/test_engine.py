"""The native engine on CPU against transformers: greedy tokens, processed log-probs, batching,
abort, priority, in-place weight updates."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, PromptTooLongError, SamplingParams
from refractor.models import iter_safetensors

DEFAULTS = {"max_model_len": 256, "kv_cache_memory_gb": 0.02, "block_size": 16}


@pytest.fixture(autouse=True)
def _scheduling(async_scheduling, monkeypatch):
    """Every test here runs with the host waiting for each step and with the host a step ahead."""
    monkeypatch.setitem(DEFAULTS, "async_scheduling", async_scheduling)


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(**{**DEFAULTS, **overrides}))


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(count: int, seed: int = 0, low: int = 3, high: int = 40, vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference_logprobs(hf, prompt, completion, temperature=1.0, top_p=1.0):
    """float64 log-probs of ``completion`` under HF's logits / T with an independent nucleus mask."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].double() / (temperature or 1.0)
    if top_p < 1:
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # keep a token while the mass before it < top_p
        keep_sorted = mass_before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path", "tiny_qwen3_path"])
def test_greedy_matches_transformers_generate(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = _hf(path)
    engine = _engine(path)
    prompts = _prompts(4, seed=1)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


def test_sampled_logprobs_equal_a_fresh_forward(tiny_qwen2_path):
    hf = _hf(tiny_qwen2_path)
    engine = _engine(tiny_qwen2_path)
    prompts = _prompts(6, seed=2)
    for params in (
        SamplingParams(temperature=1.0, max_tokens=20, n=2, seed=3),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, n=2, seed=4),
    ):
        for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
            for choice in out.outputs:
                ref = _reference_logprobs(hf, prompt, choice.token_ids, params.temperature, params.top_p)
                assert torch.isfinite(ref).all()  # every sampled token was inside the nucleus
                assert (torch.tensor(choice.logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-4


def test_sixty_four_concurrent_requests_with_preemption(tiny_llama_path):
    """64 requests on a KV cache too small for all: new ones join, preempted ones resume, all exact."""
    hf = _hf(tiny_llama_path)
    engine = _engine(  # ~1400 tokens; newcomers join the decoding batch at once
        tiny_llama_path, kv_cache_memory_gb=1400 * 2 * 2 * 64 * 4 * 2 / 2**30, decode_steps_between_prefills=0
    )
    prompts = _prompts(64, seed=3, high=48)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts[:32]):
        engine.add_request(f"early-{i}", prompt, params)
    finished = {o.request_id: o for _ in range(5) for o in engine.step()}
    decoding = len(engine.scheduler.running)
    for i, prompt in enumerate(prompts[32:]):
        engine.add_request(f"late-{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
    assert decoding > 0 and engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    names = [f"early-{i}" for i in range(32)] + [f"late-{i}" for i in range(32)]
    for name, prompt in zip(names, prompts, strict=True):
        choice = finished[name].outputs[0]
        assert len(choice.token_ids) == 24
        ref = _reference_logprobs(hf, prompt, choice.token_ids)
        assert (torch.tensor(choice.logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-4
        with torch.no_grad():  # greedy: each token is the argmax of the full forward
            logits = hf(torch.tensor([prompt + choice.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == choice.token_ids


def test_abort_frees_kv_and_keeps_partial_tokens(tiny_qwen2_path):
    engine = _engine(tiny_qwen2_path)
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=0)
    for i, prompt in enumerate(_prompts(16, seed=4)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(6):
        engine.step()
    blocks_of = {s.request_id: len(s.block_table) for s in engine.scheduler.running}
    used_before = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    aborted = engine.abort([f"r{i}" for i in range(0, 16, 2)])
    freed = sum(blocks_of[f"r{i}"] for i in range(0, 16, 2))
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == used_before - freed
    assert {o.outputs[0].finish_reason for o in aborted} == {"abort"}
    assert all(len(o.outputs[0].token_ids) == 6 == len(o.outputs[0].logprobs) for o in aborted)
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert sorted(o.request_id for o in rest) == sorted(f"r{i}" for i in range(1, 16, 2))
    assert all(len(o.outputs[0].token_ids) == 64 for o in rest)
    assert engine.abort(["unknown"]) == []


def test_priority_lower_value_first(tiny_qwen2_path):
    engine = _engine(tiny_qwen2_path, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for name, priority in [("a", 5), ("b", 0), ("c", 10), ("d", -3), ("e", 0)]:
        engine.add_request(name, [5, 6, 7], params, priority=priority)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step()]
    assert order == ["d", "b", "e", "a", "c"]


def test_stop_conditions_seeds_and_limits(tiny_qwen2_path):
    engine = _engine(tiny_qwen2_path)
    prompt = [5, 6, 7, 8]
    free = engine.generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7, n=3)
    )[0]
    again = engine.generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7, n=3)
    )[0]
    assert [c.token_ids for c in free.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in free.outputs}) == 3  # the n samples differ
    stop_at = free.outputs[0].token_ids[10]
    first = free.outputs[0].token_ids.index(stop_at)
    stopped = engine.generate(
        [prompt],
        SamplingParams(temperature=1.0, max_tokens=40, seed=7, stop_token_ids=[stop_at], ignore_eos=True),
    )[0].outputs[0]
    assert stopped.token_ids == free.outputs[0].token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)
    eos_engine = LLMEngine(engine.model, engine.config, eos_token_ids=[stop_at])
    eos = eos_engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=40, seed=7))[0].outputs[0]
    assert (eos.token_ids[-1], eos.finish_reason, eos.stop_reason) == (stop_at, "stop", None)
    capped = engine.generate([list(range(3, 253))], SamplingParams(temperature=0, max_tokens=100))[0].outputs[
        0
    ]
    assert len(capped.token_ids) <= 6 and (capped.finish_reason == "length" or capped.finish_reason == "stop")
    with pytest.raises(PromptTooLongError, match="256 tokens but max_model_len is 256"):
        engine.add_request("long", list(range(256)), SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request("bad", [1, 10_000], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_top_logprobs_and_ranks(tiny_qwen2_path):
    hf = _hf(tiny_qwen2_path)
    engine = _engine(tiny_qwen2_path)
    prompt = [9, 8, 7]
    out = engine.generate([prompt], SamplingParams(temperature=0.8, max_tokens=5, logprobs=3, seed=1))[
        0
    ].outputs[0]
    with torch.no_grad():
        logp = (hf(torch.tensor([prompt + out.token_ids])).logits[0, 2:-1].double() / 0.8).log_softmax(-1)
    for t, token in enumerate(out.token_ids):
        assert out.ranks[t] == int((logp[t] > logp[t, token]).sum()) + 1
        ids, values = zip(*out.top_logprobs[t], strict=True)
        assert list(ids) == logp[t].topk(3).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(values, dtype=torch.float64), logp[t].topk(3).values, atol=1e-5, rtol=0
        )


def test_weight_update_switches_to_another_checkpoint(tiny_qwen2_path):
    from refractor.testing import TinyModelSpec, build_tiny_model

    other = build_tiny_model(TinyModelSpec(arch="qwen2", seed=1))
    hf_old = _hf(tiny_qwen2_path)
    hf_new = _hf(other)
    engine = _engine(tiny_qwen2_path)
    prompt = [5, 17, 33, 2, 90]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("inflight", prompt, params)
    for _ in range(10):
        engine.step()
    cache_ptr = engine.runner.kv_cache.data_ptr()
    copied = engine.update_weights(iter_safetensors(other), version=1)
    assert copied == len(list(engine.named_parameters()))
    assert engine.runner.kv_cache.data_ptr() == cache_ptr
    (inflight,) = [o for _ in range(40) for o in engine.step()]
    choice = inflight.outputs[0]
    assert [(s.version, s.start, s.end) for s in choice.weight_versions] == [(0, 0, 10), (1, 10, 30)]
    full = torch.tensor([prompt + choice.token_ids])
    with torch.no_grad():
        old_argmax = hf_old(full).logits[0, len(prompt) - 1 : -1].argmax(-1)
        new_argmax = hf_new(full).logits[0, len(prompt) - 1 : -1].argmax(-1)
    assert choice.token_ids[:10] == old_argmax[:10].tolist()
    assert choice.token_ids[10:] == new_argmax[10:].tolist()  # KV recomputed with the new weights
    fresh = engine.generate([prompt], params)[0].outputs[0]
    ref = hf_new.generate(
        torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert fresh.token_ids == ref
    assert (
        torch.tensor(fresh.logprobs, dtype=torch.float64) - _reference_logprobs(hf_new, prompt, ref)
    ).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="model.layers.9"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])


@pytest.mark.parametrize("bad", ["unknown_name", "wrong_shape", "integer", "nan", "inf"])
def test_a_bad_weight_update_writes_nothing_and_keeps_the_version(tiny_qwen2_path, bad):
    """A valid tensor first, then a bad one: the update used to be half applied (the valid tensor
    written, the version label kept). Now the whole update is checked before anything is written."""
    engine = _engine(tiny_qwen2_path)
    engine.update_weights([], version=3)
    before = {n: t.clone() for n, t in engine.named_parameters()}
    good_name = "model.layers.0.mlp.up_proj.weight"
    target = "model.layers.1.self_attn.o_proj.weight"
    shape = before[target].shape
    bad_tensor = {
        "unknown_name": ("model.layers.99.mlp.up_proj.weight", torch.zeros(shape)),
        "wrong_shape": (target, torch.zeros(shape[0], shape[1] + 1)),
        "integer": (target, torch.zeros(shape, dtype=torch.int64)),
        "nan": (target, torch.zeros(shape).index_fill_(0, torch.tensor([1]), float("nan"))),
        "inf": (target, torch.zeros(shape).index_fill_(0, torch.tensor([0]), float("-inf"))),
    }[bad]
    update = [(good_name, torch.ones_like(before[good_name])), bad_tensor]
    needle = {
        "unknown_name": "is not a parameter",
        "wrong_shape": "has shape",
        "integer": "floating-point",
        "nan": "non-finite",
        "inf": "non-finite",
    }[bad]
    with pytest.raises(ValueError, match=f"{needle}.*nothing was written"):
        engine.update_weights(update, version=4)
    assert engine.weight_version == 3
    for name, tensor in engine.named_parameters():
        assert torch.equal(tensor, before[name]), name


def test_decode_graph_sizes_hold_every_batch_with_little_padding():
    from refractor.inference.engine.model_runner import decode_graph_sizes

    # up to 256 sequences: 1, 2, 4, 8 and every 16
    assert decode_graph_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert decode_graph_sizes(5) == [1, 2, 4, 5]
    for max_bs in (1, 100, 300, 512, 1000, 2048):
        sizes = decode_graph_sizes(max_bs)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_bs
        for batch in range(1, max_bs + 1):
            graph = next(s for s in sizes if s >= batch)
            assert graph - batch < max(16, batch / 8), (max_bs, batch, graph)
    assert len(decode_graph_sizes(2048)) == 52  # against 132 at one graph per 16 sequences
