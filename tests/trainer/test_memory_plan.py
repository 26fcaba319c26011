"""``activation_checkpointing: auto``: the predicted peaks against the peaks measured on GPUs, the
choice under a budget, and the budget a trainer rank plans for where servers share its GPU."""

from __future__ import annotations

import logging
from dataclasses import asdict

import pytest

from refractor.config import RefractorConfig, load_config
from refractor.runtime.trainer_group import TrainerGroupSettings
from refractor.testing.tiny_models import QWEN25_05B_SHAPE, QWEN25_7B_SHAPE, QWEN25_15B_SHAPE
from refractor.trainer.memory_plan import GIB, LayerShape, choose_checkpointing, predicted_peak_bytes

# (HF config fields, parameter count) of the shapes the GPU benchmarks ran
SHAPES = {
    "0.5b": (asdict(QWEN25_05B_SHAPE), 494_032_768),
    "1.5b": (asdict(QWEN25_15B_SHAPE), 1_543_714_304),
    "7b": (asdict(QWEN25_7B_SHAPE), 7_615_616_512),
}

# torch's peak allocated GiB per rank, bench/bench_trainer.py (H100 and H200, 16k-token passes per rank)
MEASURED = [
    ("0.5b", 1, False, 23.2),
    ("0.5b", 1, "selective", 17.6),
    ("0.5b", 1, True, 9.0),
    ("1.5b", 1, False, 53.8),
    ("1.5b", 1, "selective", 42.2),
    ("1.5b", 1, True, 25.2),
    ("0.5b", 2, "selective", 14.2),
    ("0.5b", 2, True, 5.6),
    ("1.5b", 2, "selective", 31.2),
    ("1.5b", 2, True, 14.3),
    ("0.5b", 4, "selective", 12.8),
    ("0.5b", 4, True, 4.2),
    ("1.5b", 4, "selective", 26.9),
    ("1.5b", 4, True, 8.9),
    ("7b", 4, True, 36.5),
]


@pytest.mark.parametrize(("size", "world", "mode", "measured_gib"), MEASURED)
def test_the_prediction_covers_the_measured_peak_without_wasting_much(size, world, mode, measured_gib):
    config, params = SHAPES[size]
    predicted = predicted_peak_bytes(LayerShape.from_hf_config(config), params, 16384, mode, world) / GIB
    # never below what was measured (an out-of-memory step), at most 25% above (a slower mode for nothing)
    assert measured_gib <= predicted <= 1.25 * measured_gib, (predicted, measured_gib)


def test_the_fastest_mode_that_fits_is_chosen():
    config, params = SHAPES["1.5b"]
    shape = LayerShape.from_hf_config(config)
    peaks = {m: predicted_peak_bytes(shape, params, 16384, m) for m in (False, "selective", True)}
    assert peaks[False] > peaks["selective"] > peaks[True]
    assert choose_checkpointing(shape, params, 16384, peaks[False])[0] is False
    assert choose_checkpointing(shape, params, 16384, peaks[False] - 1)[0] == "selective"
    assert choose_checkpointing(shape, params, 16384, peaks["selective"] - 1)[0] is True
    mode, predicted = choose_checkpointing(shape, params, 16384, 1 * GIB)  # nothing fits: least memory
    assert mode is True and predicted["true"] > 1
    # an 80 GB card at 0.9: 1.5B keeps everything; sharing half the card with a server: full checkpointing
    assert choose_checkpointing(shape, params, 16384, int(0.9 * 80e9))[0] is False
    assert choose_checkpointing(shape, params, 16384, int(0.5 * 80e9))[0] is True
    # the same model over 4 ranks: the sharded state leaves room for the matmul outputs
    assert choose_checkpointing(shape, params, 16384, int(0.5 * 80e9), world_size=4)[0] == "selective"


def _group(colocated: bool, servers_sleep: bool, **keys) -> TrainerGroupSettings:
    cfg = RefractorConfig(environments=[{"name": "countdown"}], model="/models/policy", **keys)
    return TrainerGroupSettings.from_config(cfg, 0, colocated=colocated, servers_sleep=servers_sleep)


def test_the_budget_leaves_the_servers_their_share_of_a_shared_gpu():
    assert _group(False, False).trainer.trainer_memory_fraction == pytest.approx(0.9)
    # colocated servers that keep their memory (0.4 of the card unless gpu_memory_utilization says)
    assert _group(True, False).trainer.trainer_memory_fraction == pytest.approx(0.5)
    assert _group(True, False, gpu_memory_utilization=0.3).trainer.trainer_memory_fraction == pytest.approx(
        0.6
    )
    assert _group(True, True).trainer.trainer_memory_fraction == pytest.approx(0.9)  # they sleep meanwhile
    assert _group(True, False, trainer_memory_fraction=0.7).trainer.trainer_memory_fraction == 0.7


def test_auto_is_the_default_and_means_full_checkpointing_on_cpu(tiny_qwen2_path, caplog):
    from refractor.trainer import Trainer, TrainerSettings

    cfg = load_config(None, {"model": str(tiny_qwen2_path), "environments": [{"name": "countdown"}]})
    assert cfg.activation_checkpointing == "auto"
    with caplog.at_level(logging.INFO, logger="refractor.trainer.trainer"):
        trainer = Trainer(TrainerSettings.from_config(cfg))
    assert trainer.activation_checkpointing is True
    assert "activation_checkpointing auto: true (on CPU)" in caplog.text
