"""Megatron-Core's own GPTModel (local layer spec, fp32, gloo on CPU) loads the mapped weights and
computes HF's logits: on one rank, and on 4 processes as TP=2 x PP=2 (each rank its own shard).
How the model is driven on CPU: ``_cpu_forward``."""

from __future__ import annotations

import warnings

import pytest
import torch

from refractor.megatron.mapping import megatron_names
from refractor.megatron.shards import MegatronLayout, hf_to_shards
from refractor.models import ModelConfig, read_hf_config
from refractor.models.loading import iter_safetensors

from ._cpu_forward import (
    MEGATRON_WARNINGS,
    SEQ,
    free_port,
    quiet_megatron,
    spawn_ranks,
    stage_forward,
    tp2_pp2_worker,
)
from ._models import build

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]


def _hf_logits(path, input_ids: torch.Tensor):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf, hf(input_ids[None]).logits[0]


def _input_ids(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(0))


def test_gpt_model_on_mapped_weights_computes_hf_logits(tiny_model, one_rank_world):
    from refractor.megatron.model import build_gpt_model

    _, path = tiny_model
    config = ModelConfig.from_hf(read_hf_config(path))
    layout = MegatronLayout()
    ((shard,),) = hf_to_shards(dict(iter_safetensors(path)), config, layout)
    model = build_gpt_model(config, layout).eval()
    model.load_state_dict(shard, strict=True)
    own = {name for name in model.state_dict() if not name.endswith("._extra_state")}
    assert own == set(megatron_names(config))

    input_ids = _input_ids(config)
    hf, expected = _hf_logits(path, input_ids)
    # the rotary frequencies, Llama 3.1's scaling included (too small to show in 64 tokens' logits)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    with torch.no_grad():
        got = stage_forward(model, config, input_ids)[:, : config.vocab_size]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _dot_product_attention_reference(model, mb) -> torch.Tensor:
    """The decoder's output for the row with Megatron-Core's own ``DotProductAttention`` in every layer (the
    local spec's core attention: unfused scores) and a dense block-causal mask, True where a query must
    not see a key (a later token, or another sample; padding tokens see earlier padding)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from refractor.megatron.forward import rotary_table

    length = mb.num_tokens
    heads = model.config.num_attention_heads
    # its scores' scratch buffer, made here on the CPU (megatron-core makes one on the current CUDA device)
    parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(heads * length**2)
    own = [layer.self_attention.core_attention for layer in model.decoder.layers]
    later = torch.ones(length, length, dtype=torch.bool).triu(1)
    mask = (later | (mb.document_ids[:, None] != mb.document_ids[None, :]))[None, None]
    try:
        for layer in model.decoder.layers:
            layer.self_attention.core_attention = DotProductAttention(
                model.config, layer.layer_number, AttnMaskType.causal, "self"
            )
        hidden = model.embedding(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None])
        return model.decoder(
            hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary_table(model, mb)
        )
    finally:
        for layer, core in zip(model.decoder.layers, own, strict=True):
            layer.self_attention.core_attention = core


def test_packed_core_attention_equals_megatrons_attention_with_a_block_causal_mask(one_rank_world):
    """Qwen3 (4 query heads on 2 key/value groups, q/k norms) on a packed row of four samples and
    padding, float32: the trainer's core attention (refractor's ``PackedAttention``) gives the hidden
    states Megatron-Core's ``DotProductAttention`` gives under the dense block-causal mask."""
    from refractor.megatron.attention import PackedCoreAttention
    from refractor.megatron.forward import stage_forward as trainer_stage_forward
    from refractor.megatron.model import build_gpt_model
    from trainer._helpers import make_samples, pack

    path = build("qwen3")
    config = ModelConfig.from_hf(read_hf_config(path))
    ((shard,),) = hf_to_shards(dict(iter_safetensors(path)), config, MegatronLayout())
    model = build_gpt_model(config, MegatronLayout()).eval()
    model.load_state_dict(shard, strict=True)
    assert all(
        isinstance(la.self_attention.core_attention, PackedCoreAttention) for la in model.decoder.layers
    )
    (mb,) = pack(make_samples(n=4, seed=3, vocab=500)).micro_batches[0]
    assert mb.document_ids.unique().tolist() == [-1, 0, 1, 2, 3]
    with torch.no_grad():
        got = trainer_stage_forward(model, mb, None)
        expected = _dot_product_attention_reference(model, mb)
    real = mb.document_ids >= 0  # padding: only its own earlier tokens, a row no loss reads
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


def test_tp2_pp2_ranks_on_their_shards_compute_hf_logits(tmp_path):
    """Qwen2 (q/k/v biases, a vocabulary padded from 600 to 768), untied: GPTModel's tied head on
    several stages is set up on a CUDA device (``LanguageModule.setup_embeddings_and_output_layer``)."""
    arch = "qwen2-untied"
    path = build(arch)
    input_ids = _input_ids(ModelConfig.from_hf(read_hf_config(path)))
    out = str(tmp_path / "logits.pt")
    spawn_ranks(tp2_pp2_worker, (free_port(), arch, input_ids, out), nprocs=4)
    _, expected = _hf_logits(path, input_ids)
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-4, atol=1e-4)


def test_transformer_engine_names_are_the_ones_megatron_core_renames_to_the_local_spec():
    """Megatron-Core's own pre-hook that loads a Transformer Engine checkpoint into the local spec turns
    the TE-named shards into the local-spec ones."""
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import (
        mcore_gpt_load_te_state_dict_pre_hook,
    )

    path = build("qwen3")
    config = ModelConfig.from_hf(read_hf_config(path))
    hf = dict(iter_safetensors(path))
    te = hf_to_shards(hf, config, MegatronLayout(transformer_engine=True))[0][0]
    local = hf_to_shards(hf, config, MegatronLayout())[0][0]
    assert te.keys() != local.keys()
    mcore_gpt_load_te_state_dict_pre_hook(te, "", {}, True, [], [], [])
    assert te.keys() == local.keys()


def test_rope_scaling_megatron_core_computes_otherwise_is_refused(tiny_llama_path, one_rank_world):
    """megatron-core's llama3 scaling fixes original_max_position_embeddings at 8192; the default tiny
    Llama says 256, so Megatron's frequencies would differ from HF's."""
    from refractor.megatron.model import build_gpt_model
    from refractor.models import UnsupportedModelError

    config = ModelConfig.from_hf(read_hf_config(tiny_llama_path))
    with pytest.raises(UnsupportedModelError, match="'original_max_position_embeddings': 256"):
        build_gpt_model(config, MegatronLayout())
    yarn_rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    yarn = ModelConfig.from_hf({**read_hf_config(tiny_llama_path), "rope_parameters": yarn_rope})
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        build_gpt_model(yarn, MegatronLayout())
