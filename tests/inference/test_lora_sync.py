"""``lora_sync: adapter`` end to end on native CPU servers: the trainer pushes its adapters alone
through the weight-transfer protocol (same buckets, version and canary as a full push) and the server
applies them at run time. Greedy generation then equals HF transformers' with the adapters merged
(float64) and equals a server that got the merged push, token for token; the push moves a small
fraction of a full push's bytes (counted on the wire); adapters of another shape are refused naming
both shapes, and a damaged adapter bucket fails the canary.

The model is wider than the other tests' (hidden 256, vocab 4096) so that the bytes ratio has a
real model's proportions: rank 4 on hidden 256 is Qwen2.5-0.5B's rank 14 on hidden 896.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from native_thread_server import ENGINE_CONFIG, ThreadServer

from refractor.inference.engine import SamplingParams
from refractor.models import load_model
from refractor.models.lora import ADAPTER_SCALE_NAME, LoraSettings, add_lora, is_adapter_update_name
from refractor.testing import TEST_CONTROL_TOKEN, tiny_qwen2
from refractor.trainer import Trainer
from refractor.weight_sync.control_plane import WeightSyncError
from refractor.weight_sync.gather import iter_weight_buckets
from refractor.weight_sync.sender import CanaryError, WeightSender
from refractor.weight_sync.settings import WeightSyncSettings
from trainer._helpers import make_settings, quiet_env

quiet_env()
RANK = 4
ALPHA = 8.0
BUCKET_MB = 1
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [list(range(3, 30)), [5, 17, 99, 240, 7, 300], list(range(100, 140, 3))]
SETTINGS = WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30)


@pytest.fixture(scope="module")
def model_path():
    return tiny_qwen2(
        hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096
    )


@pytest.fixture(scope="module")
def trainer(model_path):
    """A LoRA trainer whose adapters moved away from their start (B non-zero)."""
    trainer = Trainer(make_settings(model_path, lora_rank=RANK, lora_alpha=ALPHA, lora_sync="adapter"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:  # one rank: the DTensor's local part is the whole tensor
                p.to_local().copy_(torch.randn(p.shape, generator=generator))
    return trainer


@pytest.fixture(scope="module")
def servers(model_path):
    adapter = ThreadServer("adapter-0", model_path, replace(ENGINE_CONFIG, lora_rank=RANK))
    merged = ThreadServer("merged-0", model_path)
    yield adapter, merged
    adapter.stop()
    merged.stop()


def greedy(server: ThreadServer) -> list[list[int]]:
    return [asyncio.run(server.engine.generate(p, GREEDY)).outputs[0].token_ids for p in PROMPTS]


@torch.no_grad()
def merged_hf_greedy(path, adapters: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy tokens of HF transformers' model with every adapter merged (W + scale B A in float64) and
    the weights trained in full copied in."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    scale = float(adapters[ADAPTER_SCALE_NAME])
    for name, a in adapters.items():
        if not is_adapter_update_name(name):
            hf.get_parameter(name).copy_(a)
        elif ".lora_A." in name:
            stem = name.removesuffix(".lora_A.weight")
            weight = hf.get_parameter(f"{stem}.weight")
            b = adapters[f"{stem}.lora_B.weight"]
            weight.copy_((weight.double() + scale * b.double() @ a.double()).float())
    out = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt) :])
    return out


def test_an_adapter_push_generates_what_the_merged_model_does_for_a_fraction_of_the_bytes(
    trainer, servers, model_path
):
    adapter_server, merged_server = servers
    before = greedy(adapter_server)
    adapters = {n: t.clone() for bucket in trainer.export_weight_buckets(BUCKET_MB) for n, t in bucket}
    assert float(adapters[ADAPTER_SCALE_NAME]) == ALPHA / RANK
    assert all(".lora_" in n for n in adapters if n != ADAPTER_SCALE_NAME)
    to_adapter = WeightSender([adapter_server.ref], SETTINGS)
    to_merged = WeightSender([merged_server.ref], SETTINGS)
    try:
        pushes = []
        for version in (1, 2):  # the second push of each: the group has the metadata already
            adapter = to_adapter.push(trainer.export_weight_buckets(BUCKET_MB), version)
            merged_buckets = iter_weight_buckets(trainer.model, BUCKET_MB << 20, trainer.inference_dtype())
            full = to_merged.push(merged_buckets, version)
            pushes.append((adapter.stats, full.stats))
        (worker,) = adapter.reports["adapter-0"]
        assert worker.params_loaded == worker.params_total == len(adapters)  # the canary's coverage
        assert adapter.stats.tensors == len(adapters) and adapter.stats.metadata_sent is False
    finally:
        to_adapter.close()
        to_merged.close()

    want = merged_hf_greedy(model_path, adapters)
    assert greedy(adapter_server) == want == greedy(merged_server)
    assert before != want  # the adapters change what is generated

    for adapter_stats, full_stats in pushes:
        ratio = adapter_stats.wire_bytes / full_stats.wire_bytes
        print(
            f"adapter push {adapter_stats.wire_bytes} B, merged push {full_stats.wire_bytes} B on the wire "
            f"(metadata sent: {adapter_stats.metadata_sent}): {100 * ratio:.2f}%"
        )
        assert ratio <= 0.02


def test_adapters_of_another_shape_are_refused_naming_both_and_the_canary_covers_adapters(
    trainer, servers, model_path
):
    adapter_server, _ = servers
    before = greedy(adapter_server)
    other = load_model(model_path, dtype=torch.float32, device="cpu")
    add_lora(other, LoraSettings(lora_rank=2, lora_target_modules=("q_proj", "v_proj")), torch.float32)
    sender = WeightSender([adapter_server.ref], SETTINGS)
    try:
        with pytest.raises(
            WeightSyncError,
            match=r"the update's LoRA adapters \(rank 2 on q_proj, v_proj\) do not fit this server's adapter "
            r"buffers \(rank 4 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj\)",
        ):
            sender.push(iter_weight_buckets(other, BUCKET_MB << 20, torch.float32, adapters=True), version=9)
        assert greedy(adapter_server) == before  # nothing was written
        # the canary covers the adapter bytes as they travel, as it covers full weights
        with pytest.raises(CanaryError, match=r"server 'adapter-0' \(rank 1\): received checksum"):
            sender.push(trainer.export_weight_buckets(BUCKET_MB), version=10, _corrupt_for_test=True)
    finally:
        sender.close()


def test_weights_trained_in_full_travel_with_the_adapters_and_count_in_the_coverage(
    trainer, servers, model_path
):
    """``lora_modules_to_save``: the embedding (the tied head too) travels whole in the adapter push,
    is written as in a full update and counts in the canary's coverage."""
    adapter_server, _ = servers
    adapters = {n: t.clone() for bucket in trainer.export_weight_buckets(BUCKET_MB) for n, t in bucket}
    name = "model.embed_tokens.weight"
    base = load_model(model_path, dtype=torch.float32, device="cpu").get_parameter(name).detach()
    trained = base + 0.05 * torch.randn(base.shape, generator=torch.Generator().manual_seed(7))
    sender = WeightSender([adapter_server.ref], SETTINGS)
    try:
        push = sender.push(iter([[(name, trained)], list(adapters.items())]), version=20)
        (worker,) = push.reports["adapter-0"]
        assert worker.params_loaded == worker.params_total == len(adapters) + 1
        want = merged_hf_greedy(model_path, {name: trained, **adapters})
        assert greedy(adapter_server) == want != merged_hf_greedy(model_path, adapters)
        sender.push(iter([[(name, base)], list(adapters.items())]), version=21)  # the base embedding back
        assert greedy(adapter_server) == merged_hf_greedy(model_path, adapters)
    finally:
        sender.close()
