"""`train_backend: megatron` layouts are checked when the config loads: one line per broken rule naming
the keys; a valid layout loads. What the Megatron trainer does not run (the Transformer Engine spec and
mixture-of-experts models other than Qwen3-MoE / Mixtral or with TP but no sequence parallelism,
master weights other than float32) is refused, and so are the optimizer's dtype keys without the
precision-aware optimizer, one line naming the key."""

from __future__ import annotations

import json

import pytest

from refractor.config import ConfigError, config_from_dict, config_to_dict, load_config
from refractor.megatron.layout import ModelShape, ParallelSizes, layout_errors

from ._models import build

ENV = {"environments": [{"name": "countdown"}]}


def megatron_errors(**keys) -> list[str]:
    """The config errors of a Megatron run of the tiny Qwen3 (4 heads, 2 key/value heads, 4 layers)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, {**ENV, "model": str(build("qwen3")), "train_backend": "megatron", **keys})
    return str(err.value).splitlines()


TP, PP, CP, EP = (f"megatron_{kind}_parallel_size" for kind in ("tensor", "pipeline", "context", "expert"))
REJECT = [
    (
        {TP: 2, PP: 2, "trainer_num_workers": 6},
        "`trainer_num_workers` (6) must be a multiple of `megatron_tensor_parallel_size` x "
        "`megatron_pipeline_parallel_size` x `megatron_context_parallel_size` = 2 x 2 x 1 = 4",
    ),
    (
        {TP: 4, "trainer_num_workers": 4},
        "`megatron_tensor_parallel_size` (4) must divide the model's `num_key_value_heads` (2)",
    ),
    ({TP: 8, "trainer_num_workers": 8}, "must divide the model's `num_attention_heads` (4)"),
    (
        {PP: 3, "trainer_num_workers": 3},
        "`megatron_pipeline_parallel_size` (3) must divide the model's `num_hidden_layers` (4)",
    ),
    (
        {"megatron_sequence_parallel": True},
        "`megatron_sequence_parallel: true` needs `megatron_tensor_parallel_size` > 1",
    ),
    ({EP: 2}, "`megatron_expert_parallel_size` (2) needs a mixture-of-experts model; this model is dense"),
    (
        {CP: 2, TP: 2, "trainer_num_workers": 6},
        "`trainer_num_workers` (6) must be a multiple of `megatron_tensor_parallel_size` x "
        "`megatron_pipeline_parallel_size` x `megatron_context_parallel_size` = 2 x 1 x 2 = 4",
    ),
    ({"megatron_fp8": True}, "`megatron_fp8: true` needs `megatron_use_transformer_engine: true`"),
    (
        {"megatron_exp_avg_dtype": "bfloat16"},
        "`megatron_exp_avg_dtype: bfloat16` needs `megatron_use_precision_aware_optimizer: true` (without "
        "it master weights, gradients and AdamW moments are float32, as in Megatron-Core)",
    ),
    (
        {"megatron_use_precision_aware_optimizer": True, "megatron_exp_avg_sq_dtype": "float8"},
        "`megatron_exp_avg_sq_dtype: float8`: expected one of float32, bfloat16, float16",
    ),
    (
        {"megatron_use_precision_aware_optimizer": True, "megatron_main_params_dtype": "float16"},
        "`megatron_main_params_dtype: float16` is not supported by refractor's Megatron trainer (master "
        "weights are float32; Megatron-Core's float16 masters are TransformerEngine's per-tensor scaled "
        "copies, not built); set it to float32",
    ),
    (
        {
            "megatron_use_precision_aware_optimizer": True,
            "megatron_main_grads_dtype": "bfloat16",
            "mixed_precision_dtype": "float16",
        },
        "`megatron_main_grads_dtype: bfloat16` keeps the gradients in the bf16 compute dtype: it needs "
        "`mixed_precision_dtype: bfloat16` (not float16)",
    ),
    (
        {"model_dtype": "bfloat16"},
        "`model_dtype: bfloat16` is not supported by refractor's Megatron trainer (master weights are "
        "float32; mixed_precision_dtype sets the compute dtype); set it to float32",
    ),
    ({"fsdp_cpu_offload": True}, "`fsdp_cpu_offload: true` needs `train_backend: fsdp`"),
]


@pytest.mark.parametrize("keys, message", REJECT)
def test_a_broken_layout_rule_is_one_line_naming_the_keys(keys, message):
    errors = megatron_errors(**keys)
    assert [line for line in errors if message in line], errors


def test_every_broken_rule_is_reported_at_once():
    errors = megatron_errors(**{TP: 4, PP: 3, "trainer_num_workers": 12})
    assert (
        len(errors) == 2
        and "`num_key_value_heads` (2)" in errors[0]
        and "`num_hidden_layers` (4)" in errors[1]
    )


@pytest.mark.parametrize(
    "keys",
    [
        {TP: 2, PP: 2, "trainer_num_workers": 8},
        {TP: 2, "trainer_num_workers": 2},
        {PP: 4, "trainer_num_workers": 4, "megatron_use_distributed_optimizer": False},
        {TP: 2, "trainer_num_workers": 2, "megatron_sequence_parallel": True},
        {CP: 2, "trainer_num_workers": 2},
        {CP: 2, TP: 2, PP: 2, "trainer_num_workers": 16, "megatron_sequence_parallel": True},
    ],
)
def test_a_valid_layout_loads(keys):
    cfg = load_config(None, {**ENV, "model": str(build("qwen3")), "train_backend": "megatron", **keys})
    assert cfg.train_backend == "megatron"
    assert cfg.megatron_sequence_parallel is keys.get("megatron_sequence_parallel", False)


def test_a_model_that_is_not_on_this_machine_is_checked_for_the_layout_alone():
    keys = {**ENV, "model": "nobody/absent-model", "train_backend": "megatron"}
    assert load_config(None, {**keys, TP: 2, "trainer_num_workers": 2}).train_backend == "megatron"
    with pytest.raises(ConfigError, match=r"`trainer_num_workers` \(3\) must be a multiple"):
        load_config(None, {**keys, TP: 2, "trainer_num_workers": 3})


def test_a_qwen3_moe_or_mixtral_model_loads_with_expert_parallelism():
    for arch in ("qwen3-moe", "mixtral"):
        keys = {**ENV, "model": str(build(arch)), "train_backend": "megatron", "trainer_num_workers": 4}
        cfg = load_config(None, {**keys, EP: 2, PP: 2})
        assert (cfg.megatron_expert_parallel_size, cfg.megatron_pipeline_parallel_size) == (2, 2)
        cfg = load_config(None, {**keys, EP: 2, TP: 2, "megatron_sequence_parallel": True})
        assert (cfg.megatron_expert_parallel_size, cfg.megatron_tensor_parallel_size) == (2, 2)


def moe_errors(model, **keys) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(None, {**ENV, "model": str(model), "train_backend": "megatron", **keys})
    return str(err.value).splitlines()


def test_what_the_trainer_does_not_build_for_an_moe_model_is_refused_in_one_line(tmp_path):
    (error,) = moe_errors(build("qwen3-moe"), **{TP: 2, "trainer_num_workers": 2})
    assert error.endswith(
        "a mixture-of-experts model with `megatron_tensor_parallel_size` > 1 needs "
        "`megatron_sequence_parallel: true` (Megatron-Core's MoE layer takes each tensor-parallel rank's "
        "block of the sequence)"
    )
    (error,) = moe_errors(build("mixtral"), inference_engine="native")
    assert "`inference_engine: native`: refractor's engine has no mixture-of-experts layers" in error
    raw = json.loads((build("qwen3-moe") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "decoder_sparse_step": 2}))
    (error,) = moe_errors(tmp_path)
    assert "`decoder_sparse_step`: 2" in error and "every layer has experts" in error
    qwen2_moe = {"architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**qwen2_moe, "num_hidden_layers": 2, "num_experts": 8}))
    (error,) = moe_errors(tmp_path)
    assert (
        "`train_backend: megatron` maps the experts of Qwen3MoeForCausalLM, MixtralForCausalLM; this model "
        "is Qwen2MoeForCausalLM: use `train_backend: fsdp`" in error
    )


def test_expert_parallel_rules_for_a_real_moe_model_name_the_keys():
    """The tiny Qwen3-MoE has 4 experts: EP must divide them and the context x data parallel ranks."""
    (error,) = moe_errors(build("qwen3-moe"), **{EP: 3, "trainer_num_workers": 3})
    assert error.endswith("`megatron_expert_parallel_size` (3) must divide the model's expert count (4)")
    (error,) = moe_errors(build("qwen3-moe"), **{EP: 4, PP: 2, "trainer_num_workers": 4})
    assert "`megatron_expert_parallel_size` (4) must divide the context x data parallel ranks (2)" in error


def test_sequence_parallel_is_off_unless_set():
    """Telescope's default (true, meaning: when it can run) resolves to off: sequence parallelism is
    turned on by setting it."""
    assert load_config(None, ENV).megatron_sequence_parallel is False
    cfg = load_config(None, {**ENV, TP: 2})
    assert cfg.megatron_sequence_parallel is False
    assert config_from_dict(config_to_dict(cfg)).megatron_sequence_parallel is False
    assert load_config(None, {**ENV, TP: 2, "megatron_sequence_parallel": True}).megatron_sequence_parallel


def test_transformer_engine_rules_follow_the_installed_package():
    """Context parallelism is refractor's own (no Transformer Engine rule); FP8 needs the TE spec."""
    sizes = ParallelSizes(context=2)

    def errors(present: bool, **flags) -> list[str]:
        return layout_errors(sizes, 2, None, transformer_engine_present=present, **flags)

    assert errors(True, use_transformer_engine=True, fp8=True) == []
    (missing,) = errors(False, use_transformer_engine=True, fp8=True)
    assert "needs the transformer_engine package, which is not installed" in missing
    (fp8,) = errors(True, use_transformer_engine=False, fp8=True)
    assert "`megatron_fp8: true` needs `megatron_use_transformer_engine: true`" in fp8
    assert errors(False, use_transformer_engine=False, fp8=False) == []


def test_expert_parallelism_shares_the_experts_among_context_and_data_parallel_ranks():
    moe = ModelShape.from_hf({"num_attention_heads": 8, "num_hidden_layers": 4, "num_local_experts": 8})
    assert (moe.num_key_value_heads, moe.num_experts) == (8, 8)

    def errors(expert: int, ranks: int) -> list[str]:
        return layout_errors(
            ParallelSizes(tensor=2, expert=expert),
            ranks,
            moe,
            use_transformer_engine=False,
            fp8=False,
            transformer_engine_present=False,
        )

    assert errors(4, 8) == []
    assert errors(3, 6) == ["`megatron_expert_parallel_size` (3) must divide the model's expert count (8)"]
    (error,) = errors(4, 4)
    assert "`megatron_expert_parallel_size` (4) must divide the context x data parallel ranks (2)" in error
