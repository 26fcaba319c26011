"""fp8: the refusal off FP8 GPUs, the swap of the decoder projections, and what stays plain (CPU).
The config rules are in ``tests/config/test_loader.py``.

torch runs float8 GEMMs on CPU too (``torch._scaled_mm``), so the converted model's forward, backward,
AdamW step, scale precompute, export and checkpoints are exercised here on one gloo rank. The
Trainer itself refuses CPU; the Trainer with fp8 on an H100 (compiled layers, losses against bf16,
export) is ``test_fp8_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from refractor.trainer import Trainer
from refractor.trainer import checkpoint as ckpt
from refractor.trainer.distributed import init_distributed
from refractor.trainer.fp8 import (
    FP8UnsupportedError,
    after_optimizer_step,
    check_fp8,
    convert_to_float8,
    fp8_supported,
)
from refractor.trainer.policy_model import LM_PREFIX, PolicyModel, hf_name, load_lm, shard_model
from refractor.weight_sync.gather import iter_weight_buckets

from ._helpers import make_samples, make_settings, pack

pytest.importorskip("torchao.float8")
PROJECTIONS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def test_check_fp8_refuses_a_cpu_rank_naming_the_key():
    assert fp8_supported("cpu") == (False, "this rank runs on cpu")
    with pytest.raises(
        ValueError, match=r"fp8: true needs a CUDA GPU with FP8 tensor cores .*>= 8\.9.*on cpu"
    ):
        check_fp8(torch.device("cpu"))


def test_trainer_with_fp8_refuses_to_start_on_cpu(tiny_qwen2_path):
    with pytest.raises(FP8UnsupportedError, match="this rank runs on cpu"):
        Trainer(make_settings(tiny_qwen2_path, fp8=True), device="cpu")


class _AdaptedLinear(nn.Linear):  # as a LoRA projection: a forward of its own
    pass


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(64, 64)
        self.self_attn.k_proj = _AdaptedLinear(64, 64)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(64, 16, bias=False)  # a MoE router: not a projection
        self.mlp.down_proj = nn.Linear(40, 64)  # 40 is no multiple of 16


def test_convert_skips_routers_subclassed_and_unaligned_linears():
    from torchao.float8.float8_linear import Float8Linear

    model = nn.Module()
    model.layers = nn.ModuleList([_Layer()])
    model.lm_head = nn.Linear(64, 32)
    assert convert_to_float8(model) == 1
    layer = model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Float8Linear)
    assert type(layer.self_attn.k_proj) is _AdaptedLinear
    assert type(layer.mlp.gate) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear
    assert type(model.lm_head) is nn.Linear


def test_convert_fails_when_nothing_is_aligned():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.ModuleDict({"q_proj": nn.Linear(40, 40)})])
    with pytest.raises(FP8UnsupportedError, match="multiples of 16"):
        convert_to_float8(model)


def _policy(path, fp8: bool) -> PolicyModel:
    device = init_distributed(device="cpu").device
    model = PolicyModel(load_lm(path, "native", torch.float32, device), "native")
    if fp8:
        convert_to_float8(model)
    shard_model(model, param_dtype=None, reduce_dtype=torch.float32, keep_unsharded=True)
    return model


def test_convert_swaps_exactly_the_decoder_projections_keeping_names_and_shapes(tiny_qwen2_path):
    from torchao.float8.float8_linear import Float8Linear

    plain = PolicyModel(load_lm(tiny_qwen2_path, "native", torch.float32, torch.device("cpu")), "native")
    model = PolicyModel(load_lm(tiny_qwen2_path, "native", torch.float32, torch.device("cpu")), "native")
    assert convert_to_float8(model) == PROJECTIONS_PER_LAYER * len(model.layers)
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    linears = {name for name, m in plain.named_modules() if isinstance(m, nn.Linear)}
    assert swapped == linears  # tied embeddings: every linear is a decoder projection
    assert all(".layers." in name for name in swapped)
    assert type(model.lm.model.embed_tokens) is nn.Embedding
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    assert shapes == {n: (p.shape, p.dtype) for n, p in plain.named_parameters()}


def test_fp8_model_trains_exports_and_checkpoints_plain_tensors(tiny_qwen2_path, tmp_path):
    reference = _policy(tiny_qwen2_path, fp8=False)
    model = _policy(tiny_qwen2_path, fp8=True)
    mb = pack(make_samples()).micro_batches[0][0]
    logprobs, _ = model(mb, 1.0, 48)
    expected, _ = reference(mb, 1.0, 48)
    gap = (logprobs - expected).abs().max().item()
    assert 0 < gap < 0.2, gap  # float8 rounding, measured ~0.03 on log-probs of about -6

    logprobs.sum().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    after_optimizer_step(model)
    q_proj = model.layers[0].self_attn.q_proj.weight  # a DTensor around torchao's float8 weight wrapper
    master = q_proj._local_tensor._tensor
    amax = master.abs().max().double()
    expected_scale = torch.finfo(torch.float8_e4m3fn).max / amax
    assert q_proj._local_tensor._precomputed_scale.item() == pytest.approx(expected_scale.item(), rel=1e-6)

    names = [hf_name(n) for n, _ in reference.named_parameters()]
    exported = [(n, t) for bucket in iter_weight_buckets(model, 2**20, torch.bfloat16) for n, t in bucket]
    assert [n for n, _ in exported] == names
    assert all(type(t) is torch.Tensor and t.dtype == torch.bfloat16 for _, t in exported)
    assert torch.equal(dict(exported)["model.layers.0.self_attn.q_proj.weight"], master.to(torch.bfloat16))

    state = {"model": {hf_name(k): v for k, v in get_model_state_dict(model).items()}}
    path = ckpt.save_checkpoint(tmp_path, 1, state, meta={}, base_model_dir=None, save_rng=False)
    for shard in path.glob("*.distcp"):
        assert b"torchao" not in shard.read_bytes()  # plain tensors: loads without torchao
    for target in (reference, _policy(tiny_qwen2_path, fp8=True)):
        loaded = {"model": {hf_name(k): v for k, v in get_model_state_dict(target).items()}}
        ckpt.load_checkpoint_state(path, loaded, restore_rng=False)
        set_model_state_dict(target, {LM_PREFIX + k: v for k, v in loaded["model"].items()})
        weight = target.layers[0].self_attn.q_proj.weight.to_local()
        assert torch.equal(getattr(weight, "_tensor", weight), master)
