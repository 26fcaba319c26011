"""HF <-> Megatron-Core GPT weights, split over tensor-parallel ranks and pipeline stages: the round
trip is bit-exact, and each rank's tensors equal ones built head by head from the HF tensors.
(Megatron-Core itself is not needed here; test_gpt_model.py runs its GPTModel on the mapped weights.)"""

from __future__ import annotations

import pytest
import torch

from refractor.megatron.mapping import hf_to_megatron
from refractor.megatron.shards import MegatronLayout, hf_to_shards, shards_to_hf
from refractor.models import ModelConfig, UnsupportedModelError, read_hf_config
from refractor.models.loading import iter_safetensors

from ._models import build

TP2_PP2 = MegatronLayout(tensor_parallel=2, pipeline_parallel=2)


def _load(path):
    return ModelConfig.from_hf(read_hf_config(path)), dict(iter_safetensors(path))


@pytest.mark.parametrize("transformer_engine", [False, True], ids=["local-spec", "te-spec"])
def test_hf_to_tp2_pp2_shards_and_back_is_bit_exact(tiny_model, transformer_engine):
    _, path = tiny_model
    config, hf = _load(path)
    layout = MegatronLayout(tensor_parallel=2, pipeline_parallel=2, transformer_engine=transformer_engine)
    back = shards_to_hf(hf_to_shards(hf, config, layout), config, layout)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_every_rank_holds_its_heads_rows_columns_and_vocabulary_block():
    path = build("qwen2")
    config, hf = _load(path)
    shards = hf_to_shards(hf, config, TP2_PP2)
    head, groups_per_rank, queries_per_group = config.head_dim, 1, 2
    vocab = TP2_PP2.padded_vocab_size(config.vocab_size)
    assert (config.vocab_size, vocab) == (600, 768)
    for stage, ranks in enumerate(shards):
        for rank, shard in enumerate(ranks):
            for local in range(2):
                hf_layer = f"model.layers.{2 * stage + local}."
                mg_layer = f"decoder.layers.{local}."

                def rows(proj, first_head, count, kind="weight", _layer=hf_layer):
                    return hf[f"{_layer}self_attn.{proj}_proj.{kind}"][
                        first_head * head : (first_head + count) * head
                    ]

                for kind in ("weight", "bias"):
                    expected = []
                    for group in range(rank * groups_per_rank, (rank + 1) * groups_per_rank):
                        expected += [rows("q", group * queries_per_group, queries_per_group, kind)]
                        expected += [rows("k", group, 1, kind), rows("v", group, 1, kind)]
                    qkv = shard[f"{mg_layer}self_attention.linear_qkv.{kind}"]
                    assert torch.equal(qkv, torch.cat(expected))
                ffn = config.intermediate_size // 2
                gate = hf[f"{hf_layer}mlp.gate_proj.weight"][rank * ffn : (rank + 1) * ffn]
                up = hf[f"{hf_layer}mlp.up_proj.weight"][rank * ffn : (rank + 1) * ffn]
                assert torch.equal(shard[f"{mg_layer}mlp.linear_fc1.weight"], torch.cat([gate, up]))
                columns = config.num_attention_heads * head // 2
                o_proj = hf[f"{hf_layer}self_attn.o_proj.weight"][:, rank * columns : (rank + 1) * columns]
                assert torch.equal(shard[f"{mg_layer}self_attention.linear_proj.weight"], o_proj)
                down = hf[f"{hf_layer}mlp.down_proj.weight"][:, rank * ffn : (rank + 1) * ffn]
                assert torch.equal(shard[f"{mg_layer}mlp.linear_fc2.weight"], down)
                norm = hf[f"{hf_layer}input_layernorm.weight"]
                assert torch.equal(shard[f"{mg_layer}input_layernorm.weight"], norm)
            assert not any(name.startswith("decoder.layers.2.") for name in shard)
            # vocab-parallel: rows [rank * 384, (rank + 1) * 384) of the embedding padded with zeros to 768
            padded = torch.cat(
                [hf["model.embed_tokens.weight"], torch.zeros(vocab - 600, config.hidden_size)]
            )
            block = padded[rank * vocab // 2 : (rank + 1) * vocab // 2]
            if stage == 0:
                assert torch.equal(shard["embedding.word_embeddings.weight"], block)
                assert "output_layer.weight" not in shard and "decoder.final_layernorm.weight" not in shard
            else:
                assert "embedding.word_embeddings.weight" not in shard
                # tied: the last stage keeps its own copy of the embedding as the output layer
                assert torch.equal(shard["output_layer.weight"], block)
                assert torch.equal(shard["decoder.final_layernorm.weight"], hf["model.norm.weight"])


def test_an_untied_model_on_one_stage_has_its_own_output_layer_and_no_padding_rows():
    config, hf = _load(build("llama"))
    layout = MegatronLayout(make_vocab_size_divisible_by=64)
    ((shard,),) = hf_to_shards(hf, config, layout)
    assert torch.equal(shard["output_layer.weight"], hf["lm_head.weight"])
    assert torch.equal(shard["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert (
        len([n for n in shard if n.startswith("decoder.layers.")]) == 4 * 6
    )  # qkv, proj, fc1, fc2 and two norms


def test_an_hf_tensor_without_a_megatron_name_is_refused_naming_it():
    config, hf = _load(build("qwen3"))
    hf["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size)
    with pytest.raises(UnsupportedModelError, match=r"`model\.layers\.1\.self_attn\.o_proj\.bias`"):
        hf_to_megatron(hf, config)
    del hf["model.layers.1.self_attn.o_proj.bias"], hf["model.layers.3.mlp.down_proj.weight"]
    with pytest.raises(KeyError, match=r"decoder\.layers\.3\.mlp\.linear_fc2\.weight"):
        hf_to_megatron(hf, config)


def test_a_layout_that_cannot_split_the_model_is_refused_naming_the_sizes():
    config, hf = _load(build("qwen3"))
    with pytest.raises(
        ValueError, match=r"tensor parallel size 4 does not divide the model's key/value heads \(2\)"
    ):
        hf_to_shards(hf, config, MegatronLayout(tensor_parallel=4))
    with pytest.raises(
        ValueError, match=r"pipeline parallel size 3 does not divide the model's layers \(4\)"
    ):
        hf_to_shards(hf, config, MegatronLayout(pipeline_parallel=3))
