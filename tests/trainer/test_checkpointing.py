"""Activation checkpointing modes of the trainer's decoder layers (``activation_checkpointing``):
what each one recomputes in the backward pass, counted at the aten level, and that all three give
the same gradients."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refractor.models import PackedAttention, build_model, read_hf_config
from refractor.trainer.policy_model import prepare_layers

MATMULS = ("mm", "addmm", "bmm")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(model_dir, mode, compile: bool = False) -> tuple[Counter, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(read_hf_config(model_dir), dtype=torch.float32)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    prepare_layers(model.model.layers, checkpoint_activations=mode, compile=compile)
    lengths = [7, 5]
    ids = torch.randint(3, 500, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    hidden = model(ids, positions, attention=PackedAttention(documents, cu, max(lengths)))
    loss = model.compute_logits(hidden).log_softmax(-1)[torch.arange(len(ids) - 1), ids[1:]].mean()
    with OpCounter() as counter:
        loss.backward()
    return counter.counts, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_checkpointing_recomputes_the_glue_but_no_matmul(tiny_qwen2_path):
    layers = read_hf_config(tiny_qwen2_path)["num_hidden_layers"]
    counts = {mode: backward_ops(tiny_qwen2_path, mode) for mode in (False, "selective", True)}
    matmuls = {mode: sum(c[name] for name in MATMULS) for mode, (c, _) in counts.items()}
    norms = {mode: c["rsqrt"] for mode, (c, _) in counts.items()}  # one per RMSNorm call
    # full checkpointing reruns each layer's forward: its 7 projections (q, k, v, o, gate, up, down) again
    assert matmuls[True] >= matmuls[False] + 7 * layers
    assert matmuls["selective"] == matmuls[False]  # the matmul outputs were kept
    assert norms[False] == 0  # nothing recomputed
    assert norms["selective"] == norms[True] == 2 * layers  # both layer norms of every layer recomputed
    grads = {mode: g for mode, (_, g) in counts.items()}
    for name, g in grads[False].items():
        for mode in ("selective", True):
            torch.testing.assert_close(grads[mode][name], g, rtol=0, atol=0, msg=f"{mode}: {name}")


def test_an_unknown_mode_is_named(tiny_qwen2_path):
    from refractor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config(None, {"model": str(tiny_qwen2_path), "activation_checkpointing": "partial"})


@pytest.mark.parametrize("mode", [True, "selective", False])
def test_every_mode_traces_under_torch_compile(tiny_qwen2_path, monkeypatch, mode):
    """The CUDA default compiles each checkpointed layer; Dynamo must trace the checkpoint of every
    mode (a ``context_fn`` passed for full checkpointing made Dynamo raise on the GPU). The
    ``aot_eager`` backend runs Dynamo and AOTAutograd as on the GPU without Inductor's C++ toolchain."""
    import functools

    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(
        torch, "compile", functools.partial(torch.compile, backend="aot_eager", fullgraph=True)
    )
    _, compiled = backward_ops(tiny_qwen2_path, mode, compile=True)
    _, eager = backward_ops(tiny_qwen2_path, False)
    for name, g in eager.items():
        torch.testing.assert_close(compiled[name], g, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
