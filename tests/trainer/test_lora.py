"""LoRA: adapters on the shared model equal PEFT's LoRA on the HF model; only adapters train."""

from __future__ import annotations

import pytest
import torch

from refractor.models import CausalAttention, load_model
from refractor.models.lora import ALL_PROJECTIONS, LoraSettings, add_lora, lora_modules

RANK = 4


def _native(path, settings: LoraSettings):
    model = load_model(path, dtype=torch.float32, device="cpu")
    add_lora(model, settings, torch.float32, seed=1)
    return model


def _peft(path, settings: LoraSettings):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=0.0,
        target_modules=list(settings.lora_target_modules),
    )
    return get_peft_model(hf, config)


def _peft_adapters(peft_model) -> dict[str, torch.nn.Parameter]:
    """PEFT's adapter parameters under refractor's names (``...q_proj.lora_A.weight``)."""
    out = {}
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            name = name.removeprefix("base_model.model.").replace(".default", "")
            out[name] = p
    return out


def test_a_fresh_adapter_changes_nothing_and_only_adapters_train(tiny_qwen2_path):
    settings = LoraSettings(lora_rank=RANK)
    plain = load_model(tiny_qwen2_path, dtype=torch.float32, device="cpu")
    model = _native(tiny_qwen2_path, settings)
    ids = torch.randint(3, 500, (20,))
    pos = torch.arange(20)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, pos, CausalAttention()), plain(ids, pos, CausalAttention()), rtol=0, atol=0
        )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layers = model.config.num_hidden_layers
    assert len(trainable) == 2 * len(ALL_PROJECTIONS) * layers
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # HF names of the base weights are kept
    assert set(plain.state_dict()) <= set(model.state_dict())


@pytest.mark.parametrize("targets", [ALL_PROJECTIONS, ("q_proj", "v_proj")])
def test_forward_and_adapter_gradients_equal_peft(tiny_qwen2_path, targets):
    settings = LoraSettings(lora_rank=RANK, lora_alpha=8.0, lora_target_modules=targets)
    model = _native(tiny_qwen2_path, settings)
    reference = _peft(tiny_qwen2_path, settings)
    theirs = _peft_adapters(reference)
    ours = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(ours) == set(theirs)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B non-zero so that the update path is exercised
        for name, p in ours.items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            theirs[name].copy_(p)
    ids = torch.randint(3, 500, (1, 24), generator=g)
    targets_next = ids[0, 1:]

    hidden = model(ids[0], torch.arange(24), CausalAttention())
    ours_lp = model.compute_logits(hidden)[:-1].log_softmax(-1).gather(1, targets_next[:, None])
    theirs_lp = reference(ids).logits[0, :-1].log_softmax(-1).gather(1, targets_next[:, None])
    torch.testing.assert_close(ours_lp, theirs_lp, rtol=1e-5, atol=1e-5)
    ours_lp.sum().backward()
    theirs_lp.sum().backward()
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_lora_settings_name_the_key(tiny_qwen2_path):
    model = load_model(tiny_qwen2_path, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="lora_target_modules: qkv not in"):
        add_lora(model, LoraSettings(lora_rank=2, lora_target_modules=("qkv",)), torch.float32)
    with pytest.raises(ValueError, match="lora_rank 4096 exceeds self_attn.q_proj"):
        add_lora(model, LoraSettings(lora_rank=4096), torch.float32)
    with pytest.raises(ValueError, match="lora_init must be one of"):
        add_lora(model, LoraSettings(lora_rank=2, lora_init="pissa"), torch.float32)
    assert not list(lora_modules(load_model(tiny_qwen2_path, dtype=torch.float32, device="cpu")))


# ---------------------------------------------------------------- the trainer with adapters
LORA_KEYS = {"lora_rank": RANK, "lora_alpha": 8.0, "learning_rate": 1e-2}


def _trainer_settings(model_path, checkpoint_dir, **keys):
    from ._helpers import make_settings

    return make_settings(model_path, checkpoint_dir=str(checkpoint_dir), **{**LORA_KEYS, **keys})


def _lora_run(trainer, world_size: int) -> dict:
    """Two steps, a checkpoint, a third step; the merged export and the parameters after each."""
    from refractor.weight_sync.gather import iter_weight_buckets

    from ._helpers import full_params, make_samples, pack

    batches = [pack(make_samples(n=7, seed=60 + i), num_dp_ranks=world_size, step=i) for i in range(3)]
    initial = full_params(trainer)
    metrics = [trainer.train_step(batches[0]).metrics, trainer.train_step(batches[1]).metrics]
    trainer.save_checkpoint()
    params = full_params(trainer)
    export = {n: t.clone() for b in iter_weight_buckets(trainer.model, 2**16, torch.float32) for n, t in b}
    adapters = iter_weight_buckets(trainer.model, 2**12, torch.float32, adapters=True)  # lora_sync: adapter
    adapter_export = {n: t.clone() for b in adapters for n, t in b}
    metrics.append(trainer.train_step(batches[2]).metrics)
    return {
        "initial": initial,
        "metrics": metrics,
        "params": params,
        "export": export,
        "adapter_export": adapter_export,
        "final": full_params(trainer),
        "third_batch": batches[2],
    }


def _merged(params: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The weights a server should get: every adapter merged, adapter tensors dropped (float64 reference)."""
    out = {}
    for name, p in params.items():
        if ".lora_" in name:
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" in params:
            a, b = params[f"{stem}.lora_A.weight"].double(), params[f"{stem}.lora_B.weight"].double()
            p = (p.double() + scale * b @ a).float()
        out[name] = p
    return out


@pytest.fixture(scope="module")
def lora_single(tiny_qwen2_path, tmp_path_factory):
    from refractor.trainer import Trainer

    ckpt = tmp_path_factory.mktemp("lora1")
    trainer = Trainer(_trainer_settings(tiny_qwen2_path, ckpt))
    result = _lora_run(trainer, 1)
    result["trainer"] = trainer
    result["optimizer_tensors"] = len(trainer.optimizer.state)
    return result


def test_lora_trains_the_adapters_only_and_exports_merged_weights(lora_single):
    from refractor.models.lora import ADAPTER_SCALE_NAME, is_adapter_name

    initial, params = lora_single["initial"], lora_single["params"]
    adapters = [n for n in params if is_adapter_name(n)]
    assert adapters and lora_single["optimizer_tensors"] == len(adapters)  # no state for the base
    for name, p in params.items():
        if is_adapter_name(name):
            if ".lora_B." in name:  # B starts at zero and moves
                assert not torch.equal(p, initial[name]), name
        else:
            assert torch.equal(p, initial[name]), name  # the base is frozen
    assert all(m["loss"] == m["loss"] for m in lora_single["metrics"])  # finite
    want = _merged(params, LORA_KEYS["lora_alpha"] / RANK)
    assert list(lora_single["export"]) == list(want)
    for name, t in want.items():
        torch.testing.assert_close(lora_single["export"][name], t, rtol=1e-6, atol=1e-6, msg=name)
    # lora_sync: adapter exports the adapters themselves, then the scale
    exported = lora_single["adapter_export"]
    assert list(exported) == [*adapters, ADAPTER_SCALE_NAME]
    assert all(torch.equal(exported[n], params[n]) for n in adapters)
    assert exported[ADAPTER_SCALE_NAME].tolist() == [LORA_KEYS["lora_alpha"] / RANK]


def test_lora_on_a_model_running_on_hf_transformers_equals_the_native_model(tiny_qwen2_path, tmp_path):
    """A model outside the native architectures runs on HF transformers, with the same adapters on the
    same projection names: forced onto HF, the tiny Qwen2's adapter gradients equal the native model's
    (fp32), and three steps give the same losses, with the same tensors checkpointed and exported."""
    from refractor.models.lora import is_adapter_name
    from refractor.trainer import Trainer

    from ._helpers import first_minibatch_gradients, make_samples, pack

    batch = pack(make_samples(n=7, seed=60), num_dp_ranks=1, step=0)
    runs = {}
    for impl in ("native", "hf"):
        trainer = Trainer(_trainer_settings(tiny_qwen2_path, tmp_path / impl), model_impl=impl)
        assert trainer.impl == impl
        grads = first_minibatch_gradients(trainer, batch)
        runs[impl] = {"grads": grads, **_lora_run(trainer, 1)}
        trainer.shutdown()
    native, hf = runs["native"], runs["hf"]
    assert sorted(hf["grads"]) == sorted(native["grads"]) and all(map(is_adapter_name, hf["grads"]))
    assert any(g.abs().max() > 0 for g in native["grads"].values())
    for name, want in native["grads"].items():
        torch.testing.assert_close(hf["grads"][name], want, rtol=1e-5, atol=1e-7, msg=name)
    for got, want in zip(hf["metrics"], native["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert list(hf["params"]) == list(native["params"]) and list(hf["export"]) == list(native["export"])


def test_lora_checkpoints_hold_the_adapters_and_resume_exactly(lora_single, tiny_qwen2_path):
    from refractor.trainer import Trainer

    trainer = lora_single["trainer"]
    path = trainer.checkpoint_dir / "step_2"
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)

    resumed = Trainer(_trainer_settings(tiny_qwen2_path, trainer.checkpoint_dir))
    assert resumed.load_checkpoint("latest") == 2
    third = resumed.train_step(lora_single["third_batch"]).metrics
    assert third["loss"] == lora_single["metrics"][2]["loss"]
    from ._helpers import full_params

    for name, p in full_params(resumed).items():
        assert torch.equal(p, lora_single["final"][name]), name


def test_lora_checkpoints_refuse_another_base_or_shape(
    lora_single, tiny_qwen2_path, tiny_llama_path, tmp_path
):
    import shutil

    from refractor.trainer import Trainer
    from refractor.trainer.checkpoint import CheckpointError

    root = lora_single["trainer"].checkpoint_dir
    other_rank = Trainer(_trainer_settings(tiny_qwen2_path, root, lora_rank=2))
    with pytest.raises(CheckpointError, match="rank 4 on .*this run asks for rank 2"):
        other_rank.load_checkpoint("latest")
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    other_base = Trainer(_trainer_settings(tiny_llama_path, copy))
    with pytest.raises(CheckpointError, match="for base model '.*qwen2.*'; this run's model is '.*llama"):
        other_base.load_checkpoint("latest")
    full = Trainer(_trainer_settings(tiny_qwen2_path, copy, lora_rank=0))
    with pytest.raises(CheckpointError, match="holds LoRA adapters but this trainer trains the full model"):
        full.load_checkpoint("latest")


def _lora_worker(rank: int, world: int, port: int, model_path: str, ckpt: str, out: str) -> None:
    from refractor.trainer import Trainer

    from ._helpers import quiet_env

    quiet_env()
    trainer = Trainer(_trainer_settings(model_path, ckpt), rank, world, master_port=port)
    result = _lora_run(trainer, world)
    result.pop("third_batch")
    torch.save(result, f"{out}.rank{rank}")
    trainer.shutdown()


def test_two_lora_ranks_equal_one(lora_single, tiny_qwen2_path, tmp_path):
    import torch.multiprocessing as mp

    from ._helpers import free_port

    out = str(tmp_path / "result")
    mp.spawn(_lora_worker, args=(2, free_port(), str(tiny_qwen2_path), str(tmp_path / "c"), out), nprocs=2)
    rank0, rank1 = (torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2))
    for got, want in zip(rank0["metrics"], lora_single["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for name, p in lora_single["final"].items():
        # AdamW's normalized steps amplify float32 summation-order differences where gradients are
        # small (A's, while B is near zero): within 1% of the learning rate after three steps
        torch.testing.assert_close(
            rank0["final"][name], p, rtol=0, atol=1e-2 * LORA_KEYS["learning_rate"], msg=name
        )
    assert rank1["export"] == rank1["adapter_export"] == {}  # rank 0 receives the gathered weights
    for name, t in lora_single["export"].items():
        torch.testing.assert_close(rank0["export"][name], t, rtol=0, atol=1e-5, msg=name)
    assert list(rank0["adapter_export"]) == list(lora_single["adapter_export"])
    for name, t in lora_single["adapter_export"].items():  # gathered from the two ranks' shards
        torch.testing.assert_close(
            rank0["adapter_export"][name], t, rtol=0, atol=1e-2 * LORA_KEYS["learning_rate"]
        )


def test_convert_writes_the_merged_model_and_a_peft_adapter_with_the_same_logits(lora_single, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from refractor.models.loading import iter_safetensors
    from refractor.trainer.convert import export_adapter, export_hf

    step = lora_single["trainer"].checkpoint_dir / "step_2"
    merged_dir = export_hf(step, tmp_path / "merged", dtype="float32")
    want = _merged(lora_single["params"], LORA_KEYS["lora_alpha"] / RANK)
    got = dict(iter_safetensors(merged_dir))
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-6, msg=name)

    adapter_dir = export_adapter(step, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged_logits = base(ids).logits
        base_path = lora_single["trainer"].model_dir
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter_dir)
        adapter_logits = peft_model(ids).logits
    torch.testing.assert_close(adapter_logits, merged_logits, rtol=1e-5, atol=1e-5)
