"""Megatron-Core's GPTModel driven on CPU (gloo), one rank or one process per rank.

``GPTModel.forward`` itself cannot run on CPU: megatron-core 0.16's ``RotaryEmbedding.get_emb`` moves
its frequencies to ``torch.cuda.current_device()``. ``stage_forward`` runs the model's own embedding,
decoder (every transformer layer of the stage, the final norm on the last) and output layer, giving
the decoder the rotary table built from Megatron's frequencies (``get_freqs_non_repeated``) laid out
as ``get_emb`` lays it out, and the attention of one causal sample (the trainer's ``PackedAttention``,
which the model's core attention takes as its ``attention_mask``). The full ``forward`` is for the GPU
tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings

import torch
import torch.distributed as dist

from refractor.models import PackedAttention

from ._models import build

SEQ = 64
MEGATRON_WARNINGS = ("Apex", "Transformer Engine", "full scope is deprecated")


# imported once by the fork server the rank processes start from, instead of once in every rank
PRELOAD = ["torch", "transformers", "megatron.core.models.gpt", "refractor.megatron.trainer"]


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` fresh processes, forked from a server that imported megatron-core
    once (each rank importing it costs seconds of CPU); the processes never inherit the test's threads."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_megatron() -> None:
    """Megatron-Core warns that it falls back to torch without TE / Apex (expected on CPU)."""
    for text in MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*", category=UserWarning)


def start_megatron(tensor_parallel: int, pipeline_parallel: int) -> None:
    """Megatron-Core's parallel state on this (already joined) gloo world, with the RNG tracker that
    forks nothing (the default one is CUDA-only; dropout is 0)."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as tp

    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    tp.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def stop_megatron() -> None:
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as tp

    parallel_state.destroy_model_parallel()
    tp.random.initialize_rng_tracker(force_reset=True)


def stage_forward(model, config, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of a causal forward over ``input_ids`` [s]: the hidden states [s, 1, h] the
    stage hands on, or on the last stage the logits of its vocabulary block [s, V / TP]."""
    seq = input_ids.numel()
    if hidden is None:
        hidden = model.embedding(input_ids=input_ids[None], position_ids=torch.arange(seq)[None])
    else:
        model.set_input_tensor(hidden)
    freqs = model.rotary_pos_emb.get_freqs_non_repeated(seq)
    rotary = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    one_sample = PackedAttention(document_ids=torch.zeros(seq, dtype=torch.long))
    hidden = model.decoder(hidden_states=hidden, attention_mask=one_sample, rotary_pos_emb=rotary)
    if not model.post_process:
        return hidden
    head = model.shared_embedding_or_output_weight() if config.tie_word_embeddings else None
    logits, _ = model.output_layer(hidden, weight=head)
    return logits[:, 0]


def tp2_pp2_worker(rank: int, port: int, arch: str, input_ids: torch.Tensor, out: str) -> None:
    """One of 4 ranks (TP=2 x PP=2, tensor-parallel ranks adjacent): loads its shard of the HF weights
    and runs its part of the forward; the first tensor-parallel rank of the last stage saves the
    gathered logits to ``out``."""
    from megatron.core import parallel_state

    from refractor.megatron.model import build_gpt_model
    from refractor.megatron.shards import MegatronLayout, hf_to_shards
    from refractor.models import ModelConfig, read_hf_config
    from refractor.models.loading import iter_safetensors

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    quiet_megatron()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    start_megatron(2, 2)
    path = build(arch)
    config = ModelConfig.from_hf(read_hf_config(path))
    layout = MegatronLayout(tensor_parallel=2, pipeline_parallel=2)
    stage, tp_rank = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    shard = hf_to_shards(dict(iter_safetensors(path)), config, layout)[stage][tp_rank]
    model = build_gpt_model(config, layout).eval()
    model.load_state_dict(shard, strict=True)
    with torch.no_grad():
        if stage == 0:
            dist.send(stage_forward(model, config, input_ids), dst=rank + 2)
        else:
            hidden = torch.empty(input_ids.numel(), 1, config.hidden_size)
            dist.recv(hidden, src=rank - 2)
            logits = stage_forward(model, config, input_ids, hidden)
            blocks = [torch.empty_like(logits) for _ in range(2)]
            dist.all_gather(blocks, logits, group=parallel_state.get_tensor_model_parallel_group())
            if tp_rank == 0:
                torch.save(torch.cat(blocks, dim=-1)[:, : config.vocab_size], out)
    stop_megatron()
    dist.destroy_process_group()


@contextlib.contextmanager
def gloo_world():
    """A one-rank gloo process group for the test, unless one is up already (then it is left alone)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()
