"""Prefix caching in the native engine: shared prompt blocks are computed once and reused, with the
same tokens and log-probs as recomputing them; weight updates and failures never leave stale KV
behind. And the scheduler's batching of prefills while a full batch decodes."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.block_manager import BlockManager
from refractor.inference.engine.scheduler import Scheduler
from refractor.inference.engine.sequence import Sequence
from refractor.models import iter_safetensors

BLOCK = 16


DEFAULTS = {"max_model_len": 1280, "kv_cache_memory_gb": 0.05, "block_size": BLOCK, "dtype": "float32"}


@pytest.fixture(autouse=True)
def _scheduling(async_scheduling, monkeypatch):
    """Every test here runs with the host waiting for each step and with the host a step ahead."""
    monkeypatch.setitem(DEFAULTS, "async_scheduling", async_scheduling)


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(**{**DEFAULTS, **overrides}))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logprobs(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _computed_tokens(engine: LLMEngine) -> int:
    stats = engine.stats()
    return stats.prompt_tokens_total - stats.prefix_cache_hits_total


def test_n8_on_a_long_prompt_prefills_it_once_and_samples_as_without_the_cache(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    prompt = _prompt(1000)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    cached = _engine(tiny_qwen2_path)
    peak_blocks = 0
    cached.add_request("r", prompt, params)
    outputs = []
    while cached.has_unfinished():
        outputs += cached.step()
        peak_blocks = max(peak_blocks, cached.block_manager.num_blocks - cached.block_manager.num_free_blocks)
    plain = _engine(tiny_qwen2_path, enable_prefix_caching=False)
    [reference] = plain.generate([prompt], params)

    shared = (len(prompt) - 1) // BLOCK * BLOCK  # the tokens before the last one, in full blocks
    assert cached.stats().prefix_cache_hits_total == 7 * shared
    assert _computed_tokens(cached) == len(prompt) + 7 * (len(prompt) - shared)  # one prefill + 7 tails
    assert _computed_tokens(plain) == 8 * len(prompt)
    # one copy of the prompt's blocks, plus each sample's own tail and completion blocks
    own = -(-(len(prompt) + 12) // BLOCK) - shared // BLOCK
    assert peak_blocks == shared // BLOCK + 8 * own
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).eval()
    for got, want in zip(outputs[0].outputs, reference.outputs, strict=True):
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        ref = _hf_logprobs(hf, prompt, got.token_ids)
        assert (torch.tensor(got.logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-4
    assert len({tuple(o.token_ids) for o in outputs[0].outputs}) > 1  # the samples differ


def test_separate_requests_of_a_group_and_the_next_turn_reuse_the_cache(tiny_llama_path):
    """A GRPO group sent as separate requests (the orchestrator's lanes), then a second turn that
    extends one conversation: greedy tokens equal the uncached engine's, and only tails are computed."""
    prompt = _prompt(300, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engines = {on: _engine(tiny_llama_path, enable_prefix_caching=on) for on in (True, False)}
    first = {on: e.generate([prompt] * 4, greedy) for on, e in engines.items()}
    assert [o.outputs[0].token_ids for o in first[True]] == [o.outputs[0].token_ids for o in first[False]]
    computed = _computed_tokens(engines[True])
    assert computed == len(prompt) + 3 * (len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK)

    turn = prompt + first[True][0].outputs[0].token_ids + _prompt(40, seed=2)
    second = {on: e.generate([turn], greedy)[0].outputs[0] for on, e in engines.items()}
    assert second[True].token_ids == second[False].token_ids
    assert torch.allclose(
        torch.tensor(second[True].logprobs), torch.tensor(second[False].logprobs), atol=1e-5
    )
    # the first conversation's KV (prompt + all but its last sampled token) was found again
    reused = (len(prompt) + 20 - 1) // BLOCK * BLOCK
    assert _computed_tokens(engines[True]) - computed == len(turn) - reused


def test_new_weights_drop_the_cache_and_stale_kv_is_never_named(tiny_qwen2_path, tiny_qwen2_seed1_path):
    prompt = _prompt(200, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = _engine(tiny_qwen2_path)
    engine.generate([prompt], greedy)
    assert engine.block_manager.num_cached_blocks > 0
    new_weights = list(iter_safetensors(tiny_qwen2_seed1_path))
    # a request keeps decoding over the update with the KV it holds (recompute_kv=False)
    engine.add_request("stale", prompt, greedy)
    engine.step()
    engine.update_weights(new_weights, version=1, recompute_kv=False)
    assert engine.block_manager.num_cached_blocks == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_cached_blocks == 0  # its KV came from the old weights
    hits = engine.stats().prefix_cache_hits_total
    [after] = engine.generate([prompt], greedy)
    assert engine.stats().prefix_cache_hits_total == hits  # nothing found: recomputed
    [fresh] = _engine(tiny_qwen2_seed1_path).generate([prompt], greedy)
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids
    # the route's reset: a prompt seen before is recomputed
    engine.reset_prefix_cache()
    [again] = engine.generate([prompt], greedy)
    assert engine.stats().prefix_cache_hits_total == hits
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_a_prefill_that_fails_leaves_no_named_blocks(tiny_qwen2_path):
    engine = _engine(tiny_qwen2_path)
    run = engine.runner.run

    def faulty(seqs, is_prefill):
        if is_prefill and any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("injected fault")
        return run(seqs, is_prefill)

    engine.runner.run = faulty
    prompt = _prompt(100, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("bad", prompt, greedy)
    [failed] = engine.step()
    assert failed.error and "injected fault" in failed.error
    assert engine.block_manager.num_cached_blocks == 0 and not engine.block_manager.pending
    engine.runner.run = run
    [out] = engine.generate([prompt], greedy)
    assert engine.stats().prefix_cache_hits_total == 0
    [plain] = _engine(tiny_qwen2_path, enable_prefix_caching=False).generate([prompt], greedy)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_small_cache_evicts_old_prefixes_and_serves_every_request(tiny_llama_path):
    # 40 blocks of 16 tokens; 30 distinct 100-token prompts need 7 blocks each
    block_bytes = _engine(tiny_llama_path, max_model_len=256).runner.block_bytes
    engine = _engine(tiny_llama_path, max_model_len=256, kv_cache_memory_gb=40.5 * block_bytes / 2**30)
    assert engine.block_manager.num_blocks == 40
    prompts = [_prompt(100, seed=10 + i) for i in range(30)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = engine.generate(prompts, greedy)
    plain = _engine(tiny_llama_path, max_model_len=256, enable_prefix_caching=False).generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and 0 < bm.num_cached_blocks <= bm.num_blocks
    assert sorted([*bm.free_blocks, *bm.evictable]) == list(range(bm.num_blocks))  # each block once


# ---- the block manager and the scheduler alone ---------------------------------------------------
def _seq(tokens: list[int], index: int = 0) -> Sequence:
    params = SamplingParams(max_tokens=4)
    return Sequence(f"r{index}", 0, tokens, params, 0, index, 4, None)


def test_blocks_are_shared_by_prefix_and_refcounted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert bm.admit(a, bm.match(a))
    assert bm.match(_seq(list(range(10)))) is None  # its blocks are being computed: wait a step
    bm.finish_prefill_step()
    b = _seq([*range(8), 99, 98, 97])
    hits = bm.match(b)
    assert hits == a.block_table[:2]
    assert bm.admit(b, hits) and b.num_computed_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2 and bm.num_free_blocks == 10 - 3 - 1
    c = _seq([1, *range(1, 10)])  # differs in the first token: nothing shared
    assert bm.match(c) == []
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 2
    # the cached blocks are reclaimed last, oldest first
    kept = set(a.block_hashes[:2])
    d = _seq(list(range(100, 132)))
    assert bm.admit(d, bm.match(d)) and len(d.block_table) == 8
    assert kept <= set(bm.block_of)
    e = _seq(list(range(200, 208)))
    assert bm.admit(e, bm.match(e))
    assert not kept & set(bm.block_of) and bm.num_free_blocks == 0
    assert not bm.admit(_seq([5]), [])  # full


def test_a_prompt_ending_on_a_block_boundary_still_computes_its_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq(list(range(8)))
    bm.admit(a, bm.match(a))
    bm.finish_prefill_step()
    b = _seq(list(range(8)))
    assert len(bm.match(b)) == 1  # the block holding the last token is recomputed


def _decoding(scheduler: Scheduler, count: int, start: int) -> list[Sequence]:
    seqs = [_seq([start + i, 1, 2], start + i) for i in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and len(batch) == count
    scheduler.block_manager.finish_prefill_step()
    for seq in batch:
        seq.append(5, 0.0, 0)
    return seqs


@pytest.mark.parametrize("steps", [0, 3])
def test_a_full_batch_takes_newcomers_every_few_decode_steps(steps):
    scheduler = Scheduler(
        BlockManager(200, 4), max_num_seqs=8, prefill_token_budget=64, decode_steps_between_prefills=steps
    )
    _decoding(scheduler, 6, start=0)
    scheduler.add(_seq([50, 1, 2], 50))
    kinds = [scheduler.schedule()[1] for _ in range(steps + 1)]
    assert kinds == [False] * steps + [True]


def test_newcomers_wait_no_longer_than_the_prefill_delay_however_slow_the_steps():
    now = [0.0]
    scheduler = Scheduler(
        BlockManager(200, 4),
        max_num_seqs=8,
        prefill_token_budget=64,
        decode_steps_between_prefills=32,
        max_prefill_delay_s=0.1,
        clock=lambda: now[0],
    )
    _decoding(scheduler, 6, start=0)
    scheduler.add(_seq([50, 1, 2], 50))
    kinds = []
    for _ in range(5):  # steps of 30 ms: the fourth is past 100 ms since the last prefill
        now[0] += 0.03
        kinds.append(scheduler.schedule()[1])
    assert kinds == [False, False, False, True, False]


def test_newcomers_that_fill_the_prefill_budget_are_taken_at_once():
    scheduler = Scheduler(
        BlockManager(200, 4), max_num_seqs=16, prefill_token_budget=12, decode_steps_between_prefills=5
    )
    _decoding(scheduler, 2, start=0)
    scheduler.schedule()  # a decode step
    scheduler.add(_seq([50, 1, 2], 50))
    assert scheduler.schedule()[1] is False
    for i in range(3):  # 4 x 3 tokens: the budget of 12
        scheduler.add(_seq([60 + i, 1, 2], 60 + i))
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and len(batch) == 4 and scheduler.waiting_tokens == 0
