"""Shared builders for the trainer tests: settings, deterministic samples, packing, HF reference."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from refractor.algorithms.packing import pack_train_batch
from refractor.records import TrainBatch, TrainSample
from refractor.trainer.settings import TrainerSettings

SEQ_LEN = 128
PAD_TO = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_settings(model: Any, **overrides: Any) -> TrainerSettings:
    """The trainer's settings for the tests: a few test values over the config defaults."""
    keys = dict(
        model=str(model),
        learning_rate=1e-3,
        pad_to_multiple_of=PAD_TO,
        entropy_chunk_size=48,
        temperature=0.8,
    )
    keys.update(overrides)
    try:
        from refractor.config import RefractorConfig
    except ImportError:  # GPU device images lack pydantic
        return TrainerSettings.from_keys(**keys)
    return TrainerSettings.from_config(
        RefractorConfig(environments=[{"name": "countdown"}], seq_len=SEQ_LEN, **keys)
    )


def make_samples(n: int = 9, seed: int = 0, vocab: int = 500) -> list[TrainSample]:
    """Samples of varied lengths with a prompt, +/- advantages and plausible rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(12, 70, (1,), generator=g))
        prompt = int(torch.randint(3, 10, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        lps = [0.0] * prompt + (-6.2 + 0.3 * torch.randn(length - prompt, generator=g)).tolist()
        adv = float(torch.randn((), generator=g))
        samples.append(TrainSample(ids, mask, adv, lps, sample_id=i))
    return samples


def pack(
    samples: list[TrainSample], num_dp_ranks: int = 1, number_of_minibatches: int = 1, step: int = 0
) -> TrainBatch:
    return pack_train_batch(
        samples,
        step=step,
        seq_len=SEQ_LEN,
        pad_to_multiple_of=PAD_TO,
        pad_token_id=0,
        num_dp_ranks=num_dp_ranks,
        number_of_minibatches=number_of_minibatches,
    )


def full_params(trainer) -> dict[str, torch.Tensor]:
    """HF name -> full fp32 parameter copy (a collective under FSDP: call on every rank)."""
    from refractor.trainer.policy_model import hf_name

    out = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        out[hf_name(name)] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone().cpu()
    return out


def quiet_env() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)


def first_minibatch_gradients(trainer, batch) -> dict[str, torch.Tensor]:
    """Full gradients (HF names) of the first minibatch's loss as the step computes it, no update."""
    from refractor.algorithms.loss import policy_loss
    from refractor.trainer.policy_model import hf_name
    from refractor.trainer.step import group_minibatches

    groups = group_minibatches(batch.micro_batches[trainer.dp_rank], trainer.step_settings, trainer.device)
    trainer.optimizer.zero_grad(set_to_none=True)
    for mb in groups[0]:
        logprobs, entropy = trainer.model(
            mb, trainer.step_settings.temperature, trainer.step_settings.chunk_size
        )
        out = policy_loss(
            logprobs,
            mb.rollout_logprobs,
            mb.advantages,
            mb.loss_mask,
            mb.document_ids,
            trainer.loss_settings,
            mb.loss_normalizer,
            entropy=entropy,
        )
        out.loss.backward()
    grads = {
        hf_name(n): p.grad.full_tensor().clone()
        for n, p in trainer.model.named_parameters()
        if p.grad is not None  # a frozen (LoRA base) parameter has none
    }
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads
