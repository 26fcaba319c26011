"""The model the trainer optimizes: a causal LM plus the chunked log-prob head, sharded with FSDP2.

``PolicyModel`` is the FSDP root. Its forward runs the decoder AND the LM-head log-prob/entropy
computation, because FSDP2 only materializes the root's parameters (embedding, final norm,
LM head) inside the root's forward; the loss itself runs outside on the returned per-token values.

Two decoders can sit inside (``PolicyModel.lm``):
* ``native``: refractor's shared model (``refractor.models``) for Llama / Qwen2 / Qwen3, with
  block-causal varlen attention over packed samples;
* ``hf``: ``transformers.AutoModelForCausalLM`` for other architectures. Packed samples are
  isolated by the position-id restarts, which transformers turns into a block-causal mask
  (flash-attn varlen when installed).
Parameter names are ``lm.`` + the HF names; ``hf_name`` strips the prefix.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from refractor.algorithms.logprobs import chunked_logprobs_entropy, token_logprobs_and_entropy
from refractor.records import MicroBatch
from refractor.trainer.context_parallel import ContextGroup

log = logging.getLogger(__name__)

ModelImpl = Literal["auto", "native", "hf"]
LM_PREFIX = "lm."
_WEIGHT_GLOBS = ("*.safetensors", "*.bin")


def hf_name(name: str) -> str:
    """``lm.model.layers.0...`` -> ``model.layers.0...`` (the checkpoint / export name)."""
    return name[len(LM_PREFIX) :] if name.startswith(LM_PREFIX) else name


class PolicyModel(nn.Module):
    def __init__(self, lm: nn.Module, impl: Literal["native", "hf"], context: ContextGroup | None = None):
        super().__init__()
        self.lm = lm
        self.impl = impl
        self.context = context or ContextGroup(1, 0)
        if self.context.enabled and impl != "native":
            raise ValueError(
                "fsdp_context_parallel_size > 1 needs the native model (Llama / Qwen2 / Qwen3); "
                "this checkpoint runs on HF transformers"
            )

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def hidden_states(self, mb: MicroBatch) -> torch.Tensor:
        """[T] packed row -> final-norm hidden states [T, H]."""
        if self.impl == "native":
            from refractor.models import PackedAttention

            # Built here, outside the checkpointed layers: on CUDA it makes the row's FlexAttention
            # block mask once (compiled kernel) for every layer and for the recompute.
            attention = PackedAttention(
                document_ids=mb.document_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen or None
            )
            return self.lm(mb.input_ids, mb.position_ids, attention=attention)
        out = self.lm.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        return out.last_hidden_state[0]

    def lm_head_weight(self) -> torch.Tensor:
        if self.impl == "native":
            return self.lm.lm_head_weight()
        return self.lm.get_output_embeddings().weight

    def forward(
        self, mb: MicroBatch, temperature: float, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (log-prob, entropy), each [T] fp32, aligned with ``mb.input_ids`` (records.py)."""
        if self.context.enabled:
            return self._context_parallel_forward(mb, temperature, chunk_size)
        hidden = self.hidden_states(mb)
        return token_logprobs_and_entropy(
            hidden, self.lm_head_weight(), mb.input_ids, temperature=temperature, chunk_size=chunk_size
        )

    def _context_parallel_forward(
        self, mb: MicroBatch, temperature: float, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on this rank's share of the row (``context_parallel.py``): the log-prob of the
        token after each held token, gathered into the whole row and shifted into place."""
        shard = self.context.shard(mb.document_ids)
        hidden = self.lm(shard.local(mb.input_ids), shard.local(mb.position_ids), attention=shard.attention())
        logprobs, entropy = chunked_logprobs_entropy(
            hidden,
            self.lm_head_weight(),
            shard.next_tokens(mb.input_ids),
            temperature=temperature,
            chunk_size=chunk_size,
        )
        return shard.token_values(logprobs), shard.token_values(entropy)


# ---------------------------------------------------------------- construction
def _has_weights(path: Path) -> bool:
    return any(next(path.glob(g), None) is not None for g in _WEIGHT_GLOBS)


def choose_impl(model_dir: Path, impl: ModelImpl) -> Literal["native", "hf"]:
    """``auto``: the shared model when it implements the architecture, else HF transformers."""
    if impl != "auto":
        return impl
    from refractor.models import UnsupportedModelError, read_hf_config
    from refractor.models.config import ModelConfig

    try:
        ModelConfig.from_hf(read_hf_config(model_dir))
        return "native"
    except (UnsupportedModelError, KeyError) as err:
        log.info(
            "trainer: %s is not covered by the native model (%s); using HF AutoModelForCausalLM",
            model_dir,
            err,
        )
        return "hf"


def load_lm(
    model_dir: Path,
    impl: Literal["native", "hf"],
    dtype: torch.dtype,
    device: torch.device,
    *,
    random_init: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Load the HF checkpoint at ``model_dir`` (or random weights from its config) on ``device``."""
    if not random_init and not _has_weights(model_dir):
        raise FileNotFoundError(
            f"{model_dir} has no weights (*.safetensors / *.bin); "
            "pass random_init=True to initialize from config.json only"
        )
    torch.manual_seed(seed)
    if impl == "native":
        from refractor.models import build_model, load_model, read_hf_config

        if not random_init:
            return load_model(model_dir, dtype=dtype, device=device).train()
        model = build_model(read_hf_config(model_dir), dtype=dtype, device=device)
        model.init_weights()
        return model.train()
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_init:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:  # (device_map would need accelerate; load on CPU, then move)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.config.use_cache = False
    return model.to(device).train()


# ``dynamic`` for the compiled decoder layers: static graphs, one per pass length. The trainer pads
# passes to a few lengths (``trainer_pass_pad_multiple``) because a dynamic-shape compile of a layer
# is impractically slow (bench/RESULTS.md); torch's automatic dynamic (None) would switch to it at the
# second distinct length. bench_trainer.py variant ``dyn`` sets True.
COMPILE_DYNAMIC: bool | None = False
# q/k/v and gate/up of the native model's plain projections as one GEMM each over weights stacked at
# every forward (``CausalLM.stack_projections``). Off: on an H200 at 0.5B the larger GEMMs gained no
# more than the compiled backward lost writing the parts' gradients into one buffer (bench/RESULTS.md);
# bench_trainer.py variant ``stacked`` turns it on.
STACK_PROJECTIONS = False


def prepare_layers(layers: nn.ModuleList, *, checkpoint_activations: bool | str, compile: bool) -> None:
    """Activation checkpointing and/or ``torch.compile`` of each decoder layer's forward, in place.

    ``checkpoint_activations``: True recomputes the whole layer in the backward; ``"selective"``
    keeps the outputs of its matmuls and attention and recomputes only the elementwise glue
    (RMSNorm, rotary, SiLU gate), which is cheap to recompute but a large share of the activations;
    False keeps everything.

    The layer's ``forward`` attribute is replaced (no wrapper module), so parameter names and
    state dicts are untouched and FSDP2's hooks stay eager on the layer's ``__call__`` (they
    unshard before the forward and before the backward).

    Order matters: the checkpoint goes INSIDE the compiled function. Dynamo then traces it as one
    checkpointed region and the recompute runs in the compiled backward graph, instead of Python
    saved-tensor hooks per tensor and an eager re-run of the layer (which cost more host time than
    the GPU work of a 0.5B layer; bench/RESULTS.md). The compiled code also fuses the RMSNorm,
    rotary and SiLU-gate glue into a few kernels.
    """
    if compile:  # one static graph per pass length and grad mode: room beyond Dynamo's default of 8
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
        setattr(config, name, max(getattr(config, name), 64))
    for layer in layers:
        if getattr(layer, "_refractor_prepared", False):
            continue
        forward = layer.forward
        if checkpoint_activations:
            forward = _checkpointed(forward, selective=checkpoint_activations == "selective")
        if compile:
            forward = torch.compile(forward, dynamic=COMPILE_DYNAMIC)
        layer.forward = forward
        layer._refractor_prepared = True


def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention kernels."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_mm",  # fp8's float8 GEMMs
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    # context parallelism's key/value all-gather: recomputing it would communicate again
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_gather_into_tensor", "wait_tensor"):
        if functional is not None and hasattr(functional, name):
            ops.add(getattr(functional, name).default)
    if hasattr(torch.ops.higher_order, "flex_attention"):
        ops.add(torch.ops.higher_order.flex_attention)
    return frozenset(ops)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED_OPS = _saved_ops()


def _checkpointed(forward, selective: bool = False):
    """Full checkpointing passes no ``context_fn``: Dynamo cannot trace an explicit
    ``noop_context_fn`` passed from a closure (it arrives as a lazy variable), so only the selective
    mode passes one (its contexts are required)."""
    if not selective:

        def checkpointed_forward(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return checkpointed_forward
    context_fn = partial(create_selective_checkpoint_contexts, _keep_matmuls)

    def selective_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return selective_forward


def shard_model(
    model: PolicyModel,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    keep_unsharded: bool = False,
    cpu_offload: bool = False,
) -> None:
    """FSDP2: one unit per decoder layer plus the root (embedding, final norm, LM head).

    Gradients are SUMMED over ranks (divide factor 1): the loss is already normalized by the
    global token count of the step, so averaging would shrink gradients by the world size.
    ``keep_unsharded`` (one rank: sharding saves nothing) keeps each layer's compute-dtype copy
    between forward and backward instead of gathering it again (less per-layer overhead).
    ``cpu_offload``: the sharded parameters, their gradients (and so the optimizer state) live in
    host memory; each unit's parameters are copied to the device for its forward and backward.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pinned host memory makes the per-layer copies asynchronous; it needs CUDA
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=not keep_unsharded, offload_policy=offload)
    fully_shard(model, mp_policy=policy, offload_policy=offload)
    for module in [*model.layers, model]:
        module.set_gradient_divide_factor(1.0)
        # A plain SUM reduce-scatter (gloo has no PREMUL_SUM); with factor 1 nothing is divided after.
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9; NCCL has PREMUL_SUM anyway
            module.set_force_sum_reduction_for_comms(True)
