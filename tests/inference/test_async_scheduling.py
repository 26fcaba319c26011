"""``async_scheduling``: the host launches decode step N+1 (feeding step N's tokens on the device)
before it records step N. The engine must sample exactly what it samples when the host waits for
each step, whatever ends a sequence mid-chain, and must hand back every KV block."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams


def _engine(path, **overrides) -> LLMEngine:
    config = {"max_model_len": 256, "kv_cache_memory_gb": 0.02, "block_size": 4, "dtype": "float32"}
    return LLMEngine.from_pretrained(path, EngineConfig(**{**config, **overrides}))


def _workload() -> list[tuple[list[int], SamplingParams]]:
    """Seeded and greedy requests that end at many different steps: lengths, stop tokens, n > 1."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(24):
        prompt = torch.randint(3, 500, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen)
        params = SamplingParams(
            temperature=0.0 if i % 4 == 0 else 1.0,
            max_tokens=5 + 3 * i,
            ignore_eos=True,
            seed=100 + i,
            n=2 if i % 5 == 0 else 1,
            logprobs=0 if i % 3 == 0 else None,
            stop_token_ids=list(range(3, 60)) if i % 6 == 1 else [],
            top_p=0.9 if i % 7 == 2 else 1.0,  # on a GPU: a row the fused sampler leaves to torch ops
        )
        out.append((prompt.tolist(), params))
    return out


def _run(engine: LLMEngine, workload, arrive_late: bool = False) -> dict:
    """Half the requests join while the first half decodes (when ``arrive_late``)."""
    first = workload if not arrive_late else workload[: len(workload) // 2]
    for i, (prompt, params) in enumerate(first):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    steps = 0
    while engine.has_unfinished() or (arrive_late and steps < 8):
        steps += 1
        if arrive_late and steps == 8:
            for i, (prompt, params) in enumerate(workload[len(first) :], start=len(first)):
                engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            done[out.request_id] = out
    return done


def _spy_ahead(engine: LLMEngine) -> list[int]:
    """Counts (in a list) the decode steps the runner ran one token past the host."""
    calls = []
    run = engine.runner.run

    def counting(seqs, is_prefill, next_ids=None):
        if next_ids is not None:
            calls.append(len(seqs))
        return run(seqs, is_prefill, next_ids)

    engine.runner.run = counting
    return calls


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert (x.token_ids, x.finish_reason, x.stop_reason) == (
                y.token_ids,
                y.finish_reason,
                y.stop_reason,
            )
            assert x.ranks == y.ranks
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def test_launching_ahead_samples_what_waiting_samples(tiny_qwen2_path):
    workload = _workload()
    reference = _run(_engine(tiny_qwen2_path), workload, arrive_late=True)
    engine = _engine(tiny_qwen2_path, async_scheduling=True)
    ahead = _spy_ahead(engine)
    got = _run(engine, workload, arrive_late=True)
    _same(got, reference)
    assert len(ahead) > 50  # most decode steps ran ahead of the host
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.has_work
    stats = engine.stats()
    assert stats.generation_tokens_total == sum(o.num_generated_tokens for o in got.values())


def test_launching_ahead_with_a_cache_too_small_for_all_preempts_and_stays_exact(tiny_qwen2_path):
    """The KV runs out mid-chain: the step is recorded first and the scheduler preempts as usual."""
    workload = [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p, _ in _workload()]
    small = {
        "kv_cache_memory_gb": 700 * 2 * 2 * 64 * 4 / 2**30
    }  # 700 tokens (k+v, 2 layers, fp32) for 24 x ~55
    reference = _run(_engine(tiny_qwen2_path, **small), workload)
    engine = _engine(tiny_qwen2_path, async_scheduling=True, **small)
    ahead = _spy_ahead(engine)
    got = _run(engine, workload)
    _same(got, reference)
    assert engine.scheduler.num_preemptions > 0 and ahead
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_launching_ahead_samples_what_waiting_samples(tiny_qwen2_path):
    """CUDA graphs and the fused sampler: a step launched ahead reads its input tokens on the device
    and keys its samples by the position it computes."""
    workload = _workload()
    gpu = {"device": "cuda", "max_num_seqs": 64}
    reference = _run(_engine(tiny_qwen2_path, **gpu), workload, arrive_late=True)
    engine = _engine(tiny_qwen2_path, async_scheduling=True, **gpu)
    assert engine.runner.graphs
    ahead = _spy_ahead(engine)
    _same(_run(engine, workload, arrive_late=True), reference)
    assert len(ahead) > 50
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
