"""``activation_checkpointing: auto``: the fastest checkpointing mode whose predicted peak fits.

The three modes trade memory for recompute (``policy_model.prepare_layers``): ``false`` keeps every
activation (fastest), ``selective`` keeps the outputs of the matmuls and attention and recomputes
the elementwise glue (about as fast, 60-65% of the memory), ``true`` keeps only each layer's input
and recomputes the layer in the backward (least memory, one extra forward). ``auto`` predicts the
peak GPU memory of one rank for each, from the model's shape and the tokens of one forward pass,
and takes the first of ``false``, ``selective``, ``true`` whose prediction fits the budget.

The prediction, per rank (bytes):

- resident state: every parameter's master copy, gradient and two AdamW moments (4 bytes each in
  float32), divided over the FSDP ranks;
- activations of one pass of ``T`` tokens through ``L`` layers, with ``M`` the elements the matmuls
  and attention of one layer write per token (q, k, v, attention output, o, gate, up, down):
  ``selective`` keeps ``2 * M`` bytes per token per layer (bf16); ``false`` keeps
  ``NO_CHECKPOINT_FACTOR`` times that (the elementwise outputs too); ``true`` keeps each layer's
  input (``2 * hidden`` bytes) plus one layer's full activations while that layer is recomputed;
- a margin for the logits chunk of the loss, gathered parameters and allocator slack.

The factors come from measured peaks (``bench/bench_trainer.py``, 0.5B/1.5B/7B Qwen2.5 shapes,
16k-token passes, 1 and 4 GPUs, ``bench/RESULTS.md``); the tests hold the prediction to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30
# the share of its GPU a trainer rank plans for when it has the GPU to itself (or its servers sleep)
DEFAULT_MEMORY_FRACTION = 0.9
STATE_BYTES_PER_PARAM = 16  # float32 master weight + gradient + AdamW exp_avg + exp_avg_sq
ACTIVATION_BYTES = 2  # bf16 compute
NO_CHECKPOINT_FACTOR = 1.6  # the elementwise outputs too: at or above the measured ratio on Qwen2.5 shapes
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 1 * GIB
# the order auto tries them in: fastest first
MODES: tuple[bool | str, ...] = (False, "selective", True)


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    intermediate: int
    q_width: int  # heads * head_dim
    kv_width: int  # kv heads * head_dim
    layers: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LayerShape:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            q_width=heads * head_dim,
            kv_width=config.get("num_key_value_heads", heads) * head_dim,
            layers=config["num_hidden_layers"],
        )

    @property
    def matmul_elements(self) -> int:
        """Elements written per token by one layer's matmuls and attention."""
        q, kv, h, i = self.q_width, self.kv_width, self.hidden, self.intermediate
        return q + 2 * kv + q + h + 2 * i + h


def predicted_peak_bytes(
    shape: LayerShape,
    num_params: int,
    tokens_per_pass: int,
    mode: bool | str,
    world_size: int = 1,
    state_on_gpu: bool = True,
    frozen_bytes: int = 0,
) -> int:
    """One rank's predicted peak for ``mode`` (False, "selective" or True). ``num_params`` train
    (master weights, gradients, AdamW state); ``frozen_bytes`` are weights that do not (a LoRA base).
    ``state_on_gpu=False`` (``fsdp_cpu_offload``): the state lives in host memory."""
    state = (num_params * STATE_BYTES_PER_PARAM + frozen_bytes) / world_size if state_on_gpu else 0
    selective = ACTIVATION_BYTES * shape.matmul_elements * tokens_per_pass
    full_layer = NO_CHECKPOINT_FACTOR * selective
    if mode is False:
        activations = full_layer * shape.layers
    elif mode == "selective":
        activations = selective * shape.layers
    else:
        activations = ACTIVATION_BYTES * shape.hidden * tokens_per_pass * shape.layers + full_layer
    return int((state + activations) * (1 + MARGIN_FRACTION) + MARGIN_BYTES)


def choose_checkpointing(
    shape: LayerShape,
    num_params: int,
    tokens_per_pass: int,
    budget_bytes: int,
    world_size: int = 1,
    state_on_gpu: bool = True,
    frozen_bytes: int = 0,
) -> tuple[bool | str, dict[str, float]]:
    """(mode, predicted peak in GiB per mode): the first mode of ``MODES`` that fits, else True."""
    peaks = {
        mode: predicted_peak_bytes(
            shape, num_params, tokens_per_pass, mode, world_size, state_on_gpu, frozen_bytes
        )
        for mode in MODES
    }
    chosen = next((mode for mode in MODES if peaks[mode] <= budget_bytes), True)
    return chosen, {str(mode).lower(): peak / GIB for mode, peak in peaks.items()}
