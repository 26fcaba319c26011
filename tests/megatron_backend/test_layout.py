"""`train_backend: megatron` layouts are checked when the config loads: one line per broken rule naming
the keys; a valid layout gets the one error saying the Megatron trainer is not built yet."""

from __future__ import annotations

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
    ({CP: 2}, "`megatron_context_parallel_size` > 1 needs `megatron_use_transformer_engine: true`"),
    ({"megatron_fp8": True}, "`megatron_fp8: true` needs `megatron_use_transformer_engine: true`"),
]


@pytest.mark.parametrize("keys, message", REJECT)
def test_a_broken_layout_rule_is_one_line_naming_the_keys(keys, message):
    errors = megatron_errors(**keys)
    assert [line for line in errors if message in line], errors
    assert not any("not built yet" in line for line in errors)  # a layout error comes alone


def test_every_broken_rule_is_reported_at_once():
    errors = megatron_errors(**{TP: 4, PP: 3, "trainer_num_workers": 12})
    assert (
        len(errors) == 2
        and "`num_key_value_heads` (2)" in errors[0]
        and "`num_hidden_layers` (4)" in errors[1]
    )


@pytest.mark.parametrize(
    "keys, layout",
    [
        ({TP: 2, PP: 2, "trainer_num_workers": 8}, "TP 2 x PP 2 x CP 1 x DP 2 = 8 trainer ranks"),
        (
            {TP: 2, "trainer_num_workers": 2},
            "TP 2 x PP 1 x CP 1 x DP 1 = 2 trainer ranks",
        ),  # sequence parallel
        ({PP: 4, "trainer_num_workers": 4}, "TP 1 x PP 4 x CP 1 x DP 1 = 4 trainer ranks"),
    ],
)
def test_a_valid_layout_gets_the_one_error_that_the_trainer_is_not_built(keys, layout):
    (error,) = megatron_errors(**keys)
    assert f"the layout is valid ({layout})" in error
    assert "Megatron trainer is not built yet; use `train_backend: fsdp`" in error


def test_a_model_that_is_not_on_this_machine_leaves_its_shape_unchecked():
    with pytest.raises(ConfigError) as err:
        load_config(None, {**ENV, "model": "nobody/absent-model", "train_backend": "megatron"})
    (error,) = str(err.value).splitlines()
    assert (
        "the model's heads and layers were not checked: nobody/absent-model is not on this machine" in error
    )


def test_sequence_parallel_defaults_to_on_only_with_tensor_parallelism():
    assert load_config(None, ENV).megatron_sequence_parallel is False
    cfg = load_config(None, {**ENV, TP: 2})
    assert cfg.megatron_sequence_parallel is True
    assert config_from_dict(config_to_dict(cfg)).megatron_sequence_parallel is True
    assert (
        load_config(None, {**ENV, TP: 2, "megatron_sequence_parallel": False}).megatron_sequence_parallel
        is False
    )


def test_transformer_engine_rules_follow_the_installed_package():
    sizes = ParallelSizes(context=2)

    def errors(present: bool, **flags) -> list[str]:
        return layout_errors(sizes, 2, None, transformer_engine_present=present, **flags)

    assert errors(True, use_transformer_engine=True, fp8=True) == []
    (missing,) = errors(False, use_transformer_engine=True, fp8=True)
    assert "needs the transformer_engine package, which is not installed" in missing
    assert len(errors(True, use_transformer_engine=False, fp8=True)) == 2  # CP and FP8 both need TE


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
