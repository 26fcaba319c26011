"""LoRA with ``lora_modules_to_save``: the embedding (the tied head) trains in full beside the adapters.

Why it exists: with the final norm and the head frozen, adapters cannot raise a token's probability
past a bound set by the head alone (``head_bound`` below), a few percent on the tiny random model whose
head rows are small; trained with the adapters, the embedding lifts the bound and the same steps put
nearly all the probability on the rewarded token. Then: what trains, what the servers get (merged and
adapter pushes), what checkpoints hold and resume, and the merged and PEFT exports.
"""

from __future__ import annotations

import math

import pytest
import torch

from refractor.models import CausalAttention, load_model
from refractor.records import TrainSample

from ._helpers import full_params, make_settings, pack
from .test_lora import LORA_KEYS, RANK, _lora_run, _merged, _trainer_settings

SAVED = ("embed_tokens",)
TOKEN = 67  # the rewarded token (any id works: the bound holds for every one)
PROMPT = list(range(3, 19))


def head_bound(norm_weight: torch.Tensor, head: torch.Tensor, token: int) -> float:
    """The most probability ``token`` can get at temperature 1 whatever the decoder layers compute,
    with the final RMSNorm and the head fixed (float64). The normed hidden state ``v = w * h / rms(h)``
    has ``|v| <= R = max|w| sqrt(hidden)``, so ``logit_j - logit_t = v . (E_j - E_t) >= -R |E_j - E_t|``
    for every ``j``, and ``p_t = 1 / sum_j exp(logit_j - logit_t)`` is at most the bound below."""
    head = head.double()
    radius = norm_weight.double().abs().max() * math.sqrt(head.shape[1])
    gaps = (head - head[token]).norm(dim=1)
    return float(1.0 / torch.exp(-radius * gaps).sum())


def rewarded_batch(step: int, generator: torch.Generator):
    """GRPO-like: 4 of 16 completions repeat TOKEN (advantage +1.5), the rest are random (-0.5)."""
    samples = []
    for i in range(16):
        good = i < 4
        completion = [TOKEN] * 8 if good else torch.randint(3, 500, (8,), generator=generator).tolist()
        ids = PROMPT + completion
        mask = [0] * len(PROMPT) + [1] * 8
        logprobs = [0.0] * len(PROMPT) + [math.log(1 / 512)] * 8
        samples.append(TrainSample(ids, mask, 1.5 if good else -0.5, logprobs, sample_id=i))
    return pack(samples, step=step)


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


@torch.no_grad()
def token_probability(trainer, plain) -> float:
    """Mean probability of TOKEN over the completion positions of a rewarded completion, from the
    weights the servers get (the merged export, loaded into ``plain``)."""
    from refractor.weight_sync.gather import iter_weight_buckets

    plain.load_state_dict(
        {
            n: t.clone()
            for bucket in iter_weight_buckets(trainer.model, 1 << 30, torch.float32)
            for n, t in bucket
        }
    )
    ids = torch.tensor(PROMPT + [TOKEN] * 8)
    hidden = plain(ids, torch.arange(len(ids)), CausalAttention())
    probs = plain.compute_logits(hidden).softmax(-1)[len(PROMPT) - 1 : -1, TOKEN]
    return float(probs.mean())


def test_adapters_alone_stay_under_the_frozen_heads_bound_and_the_trained_embedding_lifts_it(
    tiny_qwen2_path, tmp_path
):
    from refractor.trainer import Trainer

    plain = load_model(tiny_qwen2_path, dtype=torch.float32, device="cpu")
    reached = {}
    for saved in ((), SAVED):
        settings = make_settings(
            tiny_qwen2_path,
            checkpoint_dir=str(tmp_path / "_".join(saved)),
            lora_rank=16,
            lora_alpha=32.0,
            learning_rate=2e-2,
            temperature=1.0,
            lora_modules_to_save=saved,
        )
        trainer = Trainer(settings)
        lm = trainer.model.lm
        bound = head_bound(whole(lm.model.norm.weight), whole(lm.lm_head_weight()), TOKEN)
        start = token_probability(trainer, plain)
        generator = torch.Generator().manual_seed(0)
        for step in range(8):
            trainer.train_step(rewarded_batch(step, generator))
        reached[saved] = (start, token_probability(trainer, plain), bound)
        trainer.shutdown()
    (start, adapters_only, bound), (_, with_embedding, _) = reached[()], reached[SAVED]
    assert bound < 0.2 and start < 0.01, reached  # the tiny random model's head caps the letter
    assert 2 * start < adapters_only <= bound, reached  # the adapters learn up to the cap
    assert with_embedding > 0.9, reached


def test_the_config_names_the_same_modules_and_projections_as_the_model_code():
    """config/schema.py does not import torch: it keeps its own copies of the names."""
    from refractor.config import schema
    from refractor.models.lora import ALL_PROJECTIONS, MODULES_TO_SAVE

    assert schema.LORA_MODULES_TO_SAVE == MODULES_TO_SAVE
    assert schema.LORA_PROJECTIONS == ALL_PROJECTIONS


@pytest.fixture(scope="module")
def lora_saved(tiny_qwen2_path, tmp_path_factory):
    from refractor.trainer import Trainer

    ckpt = tmp_path_factory.mktemp("lora_saved")
    trainer = Trainer(_trainer_settings(tiny_qwen2_path, ckpt, lora_modules_to_save=SAVED))
    result = _lora_run(trainer, 1)
    result["trainer"] = trainer
    result["optimizer_tensors"] = len(trainer.optimizer.state)
    return result


def test_the_embedding_trains_beside_the_adapters_and_every_push_carries_it(lora_saved):
    from refractor.models.lora import ADAPTER_SCALE_NAME, is_adapter_name

    initial, params = lora_saved["initial"], lora_saved["params"]
    adapters = [n for n in params if is_adapter_name(n)]
    embedding = "model.embed_tokens.weight"
    assert lora_saved["optimizer_tensors"] == len(adapters) + 1
    assert not torch.equal(params[embedding], initial[embedding])
    for name, p in params.items():
        if not is_adapter_name(name) and name != embedding:
            assert torch.equal(p, initial[name]), name  # the rest of the base is frozen
    want = _merged(params, LORA_KEYS["lora_alpha"] / RANK)  # the trained embedding, the merged adapters
    assert list(lora_saved["export"]) == list(want)
    for name, t in want.items():
        torch.testing.assert_close(lora_saved["export"][name], t, rtol=1e-6, atol=1e-6, msg=name)
    # lora_sync: adapter: the trained embedding, then the adapters, then the scale
    exported = lora_saved["adapter_export"]
    assert list(exported) == [embedding, *adapters, ADAPTER_SCALE_NAME]
    assert all(torch.equal(exported[n], params[n]) for n in [embedding, *adapters])


def test_checkpoints_hold_the_embedding_resume_exactly_and_refuse_another_choice(lora_saved, tiny_qwen2_path):
    import torch.distributed.checkpoint as dcp

    from refractor.trainer import Trainer
    from refractor.trainer.checkpoint import CheckpointError

    root = lora_saved["trainer"].checkpoint_dir
    saved = dcp.FileSystemReader(str(root / "step_2")).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    assert "model.model.embed_tokens.weight" in model_keys
    assert all(".lora_" in k for k in model_keys - {"model.model.embed_tokens.weight"})

    # on the tied tiny model lm_head names the same tensor: the checkpoint fits
    resumed = Trainer(_trainer_settings(tiny_qwen2_path, root, lora_modules_to_save=("lm_head",)))
    assert resumed.load_checkpoint("latest") == 2
    assert resumed.train_step(lora_saved["third_batch"]).metrics["loss"] == lora_saved["metrics"][2]["loss"]
    for name, p in full_params(resumed).items():
        assert torch.equal(p, lora_saved["final"][name]), name
    adapters_only = Trainer(_trainer_settings(tiny_qwen2_path, root))
    with pytest.raises(
        CheckpointError, match=r"down_proj, embed_tokens in full; this run asks for rank 4 on [a-z_,]+$"
    ):
        adapters_only.load_checkpoint(2)


def test_the_merged_model_and_the_peft_folder_carry_the_trained_embedding(lora_saved, tmp_path):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from refractor.models.loading import iter_safetensors
    from refractor.trainer.convert import export_adapter, export_hf

    step = lora_saved["trainer"].checkpoint_dir / "step_2"
    merged_dir = export_hf(step, tmp_path / "merged", dtype="float32")
    want = _merged(lora_saved["params"], LORA_KEYS["lora_alpha"] / RANK)
    got = dict(iter_safetensors(merged_dir))
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-6, msg=name)

    adapter_dir = export_adapter(step, tmp_path / "adapter")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens"] and config["ensure_weight_tying"] is True
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    base_path = lora_saved["trainer"].model_dir
    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)(ids).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter_dir)
        adapter_logits = peft_model(ids).logits
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the trained embedding moved the logits
    torch.testing.assert_close(adapter_logits, merged_logits, rtol=1e-5, atol=1e-5)
