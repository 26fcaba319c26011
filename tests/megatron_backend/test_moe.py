"""Mixture-of-experts models (Qwen3-MoE, Mixtral) in the Megatron trainer: the HF <-> Megatron mapping of
the router and experts (TP shards of each expert, experts split among EP ranks) is bit-exact both ways,
and Megatron-Core's MoE layer on the mapped weights computes HF's logits (float32, one rank)."""

from __future__ import annotations

import warnings

import pytest
import torch

from refractor.megatron.experts import model_config
from refractor.megatron.mapping import megatron_names
from refractor.megatron.shards import MegatronLayout, expert_shards_to_hf, hf_to_shards
from refractor.models import UnsupportedModelError, read_hf_config
from refractor.models.loading import iter_safetensors

from ._cpu_forward import MEGATRON_WARNINGS, SEQ, quiet_megatron, stage_forward
from ._models import MOE_ARCHS, build

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]
TP2_PP2_EP2 = MegatronLayout(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2)


def _load(arch: str):
    path = build(arch)
    return path, model_config(read_hf_config(path)), dict(iter_safetensors(path))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_hf_to_tp2_pp2_ep2_shards_and_back_is_bit_exact(arch):
    _, config, hf = _load(arch)
    shards = [hf_to_shards(hf, config, TP2_PP2_EP2, rank) for rank in range(2)]
    back = expert_shards_to_hf(shards, config, TP2_PP2_EP2)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_each_ep_rank_holds_its_experts_numbered_from_zero_split_over_tp():
    """Mixtral's w1 (gate), w3 (up), w2 (down): EP rank 1 of 2 holds experts 2 and 3 as local 0 and 1;
    TP rank r holds rows [r F/2, (r+1) F/2) of gate and up, and those columns of down."""
    _, config, hf = _load("mixtral")
    half = config.moe.intermediate_size // 2
    for ep in range(2):
        stages = hf_to_shards(hf, config, TP2_PP2_EP2, ep)
        for stage, ranks in enumerate(stages):
            for tp, shard in enumerate(ranks):
                for local in range(2):
                    hf_layer = f"model.layers.{2 * stage + local}.block_sparse_moe."
                    mg_layer = f"decoder.layers.{local}.mlp."
                    assert torch.equal(shard[mg_layer + "router.weight"], hf[hf_layer + "gate.weight"])
                    for expert in range(2):
                        hf_expert = f"{hf_layer}experts.{2 * ep + expert}."
                        rows = slice(tp * half, (tp + 1) * half)
                        gate, up = hf[hf_expert + "w1.weight"][rows], hf[hf_expert + "w3.weight"][rows]
                        mg_expert = f"{mg_layer}experts.local_experts.{expert}."
                        assert torch.equal(shard[mg_expert + "linear_fc1.weight"], torch.cat([gate, up]))
                        down = hf[hf_expert + "w2.weight"][:, rows]
                        assert torch.equal(shard[mg_expert + "linear_fc2.weight"], down)
                    assert mg_layer + "experts.local_experts.2.linear_fc1.weight" not in shard


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_gpt_model_on_mapped_weights_computes_hf_logits_and_logprobs(arch, one_rank_world):
    """Qwen3-MoE without top-k renormalization (softmax, then top-2) and Mixtral with it."""
    from transformers import AutoModelForCausalLM

    from refractor.megatron.model import build_gpt_model

    path, config, hf_state = _load(arch)
    ((shard,),) = hf_to_shards(hf_state, config, MegatronLayout())
    model = build_gpt_model(config, MegatronLayout()).eval()
    model.load_state_dict(shard, strict=True)
    assert {n for n in model.state_dict() if not n.endswith("._extra_state")} == set(megatron_names(config))
    input_ids = torch.randint(0, config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids[None]).logits[0]
        got = stage_forward(model, config, input_ids)[:, : config.vocab_size]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.log_softmax(-1), expected.log_softmax(-1), rtol=1e-5, atol=1e-5)


def test_moe_layouts_the_trainer_does_not_build_are_refused_naming_the_key():
    raw = read_hf_config(build("qwen3-moe"))
    with pytest.raises(UnsupportedModelError, match="`decoder_sparse_step`: 2"):
        model_config({**raw, "decoder_sparse_step": 2})
    with pytest.raises(UnsupportedModelError, match=r"`mlp_only_layers`: \[1\]"):
        model_config({**raw, "mlp_only_layers": [1]})
    mixtral = read_hf_config(build("mixtral"))
    with pytest.raises(UnsupportedModelError, match="`router_jitter_noise`"):
        model_config({**mixtral, "router_jitter_noise": 0.1})
    with pytest.raises(UnsupportedModelError, match="`sliding_window`"):
        model_config({**mixtral, "sliding_window": 4096})


def _hf_checkpoint_grads(hf, config) -> dict[str, torch.Tensor]:
    """The HF model's gradients under its checkpoint's names: transformers keeps each layer's experts
    fused (``experts.gate_up_proj`` [E, 2F, H], ``experts.down_proj`` [E, H, F]) in a module named
    ``mlp``, where ``save_pretrained`` writes them one by one under ``hf_block``."""
    moe = config.moe
    gate, up, down = moe.hf_projections
    out = {}
    for name, p in hf.named_parameters():
        grad = p.grad
        layer, _, rest = name.partition(".mlp.")
        if rest == "gate.weight":
            out[f"{layer}.{moe.hf_block}.gate.weight"] = grad
        elif rest == "experts.gate_up_proj":
            for e in range(moe.num_experts):
                first, second = grad[e].chunk(2)
                out[f"{layer}.{moe.hf_block}.experts.{e}.{gate}.weight"] = first
                out[f"{layer}.{moe.hf_block}.experts.{e}.{up}.weight"] = second
        elif rest == "experts.down_proj":
            for e in range(moe.num_experts):
                out[f"{layer}.{moe.hf_block}.experts.{e}.{down}.weight"] = grad[e]
        else:
            out[name] = grad
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_gpt_model_gradients_equal_hf_through_router_and_experts(arch, one_rank_world):
    """The gradient of the tokens' summed log-probs for every weight (the router's through the top-k
    probabilities, each expert's through the tokens routed to it), mapped back to HF names (float32)."""
    from transformers import AutoModelForCausalLM

    from refractor.megatron.mapping import megatron_to_hf
    from refractor.megatron.model import build_gpt_model

    path, config, hf_state = _load(arch)
    ((shard,),) = hf_to_shards(hf_state, config, MegatronLayout())
    model = build_gpt_model(config, MegatronLayout()).train()
    model.load_state_dict(shard, strict=True)
    input_ids = torch.randint(0, config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(1))
    targets = input_ids[1:, None]
    logits = stage_forward(model, config, input_ids)[:-1, : config.vocab_size]
    logits.log_softmax(-1).gather(1, targets).sum().backward()
    # the padded vocabulary's rows are cut off the embedding's and the head's gradients
    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    grads = {
        name: p.grad[: config.vocab_size] if name in vocab else p.grad for name, p in model.named_parameters()
    }
    got = megatron_to_hf(grads, config)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    hf(input_ids[None]).logits[0, :-1].log_softmax(-1).gather(1, targets).sum().backward()
    expected = _hf_checkpoint_grads(hf, config)
    assert got.keys() == expected.keys()
    router = f"model.layers.0.{config.moe.hf_block}.gate.weight"
    assert expected[router].abs().max() > 1e-3  # the router learns through the top-k probabilities
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)
