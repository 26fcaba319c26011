"""Single-rank training steps against an independent reference (HF transformers + float64 formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from refractor.algorithms.loss import LossSettings, policy_loss
from refractor.trainer import Trainer
from refractor.trainer.policy_model import hf_name

from ._helpers import full_params, make_samples, make_settings, pack, quiet_env

quiet_env()


def hf_reference(model_path, samples, temperature: float):
    """Loss, metrics and gradients of the GRPO step objective, one unpacked sample at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    masks = [torch.tensor(s.loss_mask[1:], dtype=torch.float64) for s in samples]  # token 0 never trains
    n = sum(float(m.sum()) for m in masks)
    loss = 0.0
    entropy = 0.0
    kl = 0.0
    for s, m in zip(samples, masks, strict=True):
        ids = torch.tensor(s.input_ids)
        logits = hf(ids[None]).logits[0].double() / temperature
        logp = torch.log_softmax(logits[:-1], -1)
        lp = logp.gather(1, ids[1:, None])[:, 0]
        loss = loss + (-lp * s.advantage * m).sum() / n
        entropy += float((-(logp.exp() * logp).sum(-1) * m).sum().detach()) / n
        d = (lp.detach() - torch.tensor(s.rollout_logprobs[1:], dtype=torch.float64)).clamp(-20, 20)
        kl += float(((d.exp() - 1 - d) * m).sum()) / n
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in hf.named_parameters()}
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    return {"loss": float(loss.detach()), "entropy": entropy, "kl": kl, "grad_norm": norm, "grads": grads}


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_first_step_matches_hf_reference(tiny_qwen2_path, impl):
    samples = make_samples()
    settings = make_settings(tiny_qwen2_path)
    trainer = Trainer(settings, model_impl=impl)
    before = full_params(trainer)
    result = trainer.train_step(pack(samples))
    ref = hf_reference(tiny_qwen2_path, samples, settings.forward.temperature)
    m = result.metrics
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
    assert m["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    assert m["kl_divergence_inference"] == pytest.approx(ref["kl"], rel=1e-4)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert m["learning_rate"] == settings.optimizer.learning_rate
    assert m["trainer/batch/trainable_tokens"] == sum(sum(s.loss_mask[1:]) for s in samples)
    assert m["timing_forward_total"] > 0 and m["timing_backward_total"] > 0
    assert {e.name for e in result.timeline} >= {"forward", "backward", "optimizer", "step"}
    # AdamW's first update is lr * g / (|g| + eps): -lr * sign(g) wherever the gradient is not tiny.
    after = full_params(trainer)
    for name, g in ref["grads"].items():
        big = g.abs() > 1e-5
        delta = (after[name] - before[name])[big]
        expected = -settings.optimizer.learning_rate * g.sign()[big]
        torch.testing.assert_close(delta, expected, rtol=2e-2, atol=2e-6, msg=name)


def test_a_few_grpo_steps_reduce_the_loss(tiny_llama_path):
    trainer = Trainer(make_settings(tiny_llama_path, learning_rate=2e-3))
    batch = pack(make_samples(seed=1))
    losses = [trainer.train_step(batch).metrics["loss"] for _ in range(3)]
    assert losses[0] > losses[1] > losses[2], losses
    assert trainer.step == 3


def packed_loss_and_grads(trainer: Trainer, rows, settings: LossSettings, normalizer: float):
    trainer.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in rows:
        forward = trainer.settings.forward
        logprobs, entropy = trainer.model(mb, forward.temperature, forward.entropy_chunk_size)
        out = policy_loss(
            logprobs,
            mb.rollout_logprobs,
            mb.advantages,
            mb.loss_mask,
            mb.document_ids,
            settings,
            normalizer,
            entropy=entropy,
        )
        out.loss.backward()
        total += float(out.loss.detach())
    grads = {hf_name(n): p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    return total, grads


@pytest.mark.parametrize(("impl", "checkpointing"), [("native", True), ("native", False), ("hf", True)])
def test_packed_rows_equal_samples_run_one_by_one(tiny_qwen3_path, impl, checkpointing):
    """Packing must not leak attention across samples: a packed row's loss and gradients equal the
    sum over the same samples run alone (each its own row), with the same global normalizer."""
    settings = make_settings(
        tiny_qwen3_path, activation_checkpointing=checkpointing, kl_penalty_tau=0.1, entropy_coef=0.01
    )
    trainer = Trainer(settings, model_impl=impl)
    samples = make_samples(n=5, seed=2)
    packed = pack(samples).micro_batches[0]
    assert any(len(mb.sample_ids) > 1 for mb in packed)
    singles = [pack([s]).micro_batches[0][0] for s in samples]
    normalizer = float(sum(sum(s.loss_mask[1:]) for s in samples))
    loss_packed, grads_packed = packed_loss_and_grads(trainer, packed, settings.loss, normalizer)
    loss_single, grads_single = packed_loss_and_grads(trainer, singles, settings.loss, normalizer)
    assert loss_packed == pytest.approx(loss_single, rel=1e-6, abs=1e-7)
    for name, g in grads_packed.items():
        torch.testing.assert_close(g, grads_single[name], rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_gives_the_same_step(tiny_qwen2_path):
    batch = pack(make_samples(seed=3))
    results = []
    for checkpointing in (False, True, "selective"):
        trainer = Trainer(make_settings(tiny_qwen2_path, activation_checkpointing=checkpointing))
        results.append((trainer.train_step(batch).metrics, full_params(trainer)))
    (m_off, p_off), *checkpointed = results
    for m_on, p_on in checkpointed:
        assert m_on["loss"] == m_off["loss"] and m_on["grad_norm"] == pytest.approx(
            m_off["grad_norm"], rel=1e-6
        )
        for name in p_on:
            torch.testing.assert_close(p_on[name], p_off[name], rtol=0, atol=1e-7)


def test_non_finite_gradient_skips_the_update_and_is_counted(tiny_qwen2_path):
    trainer = Trainer(make_settings(tiny_qwen2_path))
    samples = make_samples(n=4, seed=4)
    samples[1].advantage = float("nan")
    before = full_params(trainer)
    m = trainer.train_step(pack(samples)).metrics
    assert not math.isfinite(m["grad_norm"])
    assert m["trainer/optimizer/skipped_updates"] == 1 and m["trainer/optimizer/skipped_updates_total"] == 1
    for name, p in full_params(trainer).items():
        assert torch.equal(p, before[name]), name
    samples[1].advantage = 0.5  # training continues normally afterwards
    m = trainer.train_step(pack(samples)).metrics
    assert math.isfinite(m["grad_norm"]) and m["trainer/optimizer/skipped_updates"] == 0
    assert m["trainer/optimizer/skipped_updates_total"] == 1


def test_warmup_first_step_uses_lr_zero(tiny_qwen2_path):
    settings = make_settings(tiny_qwen2_path, lr_scheduler="linear", warmup_steps=2, number_of_steps=10)
    trainer = Trainer(settings)
    batch = pack(make_samples(n=4, seed=5))
    before = full_params(trainer)
    lrs = [trainer.train_step(batch).metrics["learning_rate"] for _ in range(3)]
    assert lrs == pytest.approx([0.0, 0.5e-3, 1e-3])
    trainer2 = Trainer(settings)
    trainer2.train_step(batch)
    for name, p in full_params(trainer2).items():
        assert torch.equal(p, before[name]), name


def test_batch_reference_logprobs_make_the_first_ppo_step_a_policy_gradient_step(tiny_qwen2_path):
    """With ppo_clip_ref_logprobs: batch the ratio starts at exactly 1, so PPO's gradient equals
    GRPO's; against the (stale) rollout log-probs the ratios are far from 1 and get clipped."""
    samples = make_samples(seed=6)
    for s in samples:  # a stale rollout policy: ratios near e^0.7 ~ 2, outside the clip range
        s.rollout_logprobs = [lp - 0.7 * m for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)]
    batch = pack(samples)
    norms = {}
    for name, over in {
        "grpo": {},
        "ppo_batch": dict(use_ppo_clip=True, ppo_clip_ref_logprobs="batch"),
        "ppo_rollout": dict(use_ppo_clip=True),
    }.items():
        trainer = Trainer(make_settings(tiny_qwen2_path, **over))
        result = trainer.train_step(batch)
        norms[name] = result.metrics["grad_norm"]
        if name == "ppo_batch":
            assert "timing_ref_logprobs_total" in result.metrics
    assert norms["ppo_batch"] == pytest.approx(norms["grpo"], rel=1e-5)
    assert abs(norms["ppo_rollout"] / norms["grpo"] - 1) > 0.1  # clipped / re-weighted tokens


def test_minibatches_take_one_optimizer_step_each(tiny_qwen2_path):
    trainer = Trainer(make_settings(tiny_qwen2_path))
    samples = make_samples(n=9, seed=7)
    result = trainer.train_step(pack(samples, number_of_minibatches=3))
    steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {3}
    assert trainer.scheduler.last_epoch == 1  # the LR schedule advances once per training step
    # The reported loss is the step objective: minibatch losses weighted by their share of tokens.
    assert math.isfinite(result.metrics["loss"]) and result.metrics["trainer/batch/micro_batches"] >= 3


def test_the_step_timeline_nests_per_microbatch_and_gives_microbatch_statistics(tiny_qwen2_path):
    trainer = Trainer(make_settings(tiny_qwen2_path))
    trainer.timeline_attrs = {"node": "10.0.0.7", "gpu": None}
    result = trainer.train_step(pack(make_samples(n=9, seed=3), number_of_minibatches=3, step=4))
    (step,) = [e for e in result.timeline if e.name == "step"]
    forwards = [e for e in result.timeline if e.name == "forward"]
    assert len(forwards) == result.metrics["timing_microbatch_count"] >= 3
    assert {e.attrs["minibatch"] for e in forwards} == {0, 1, 2}
    assert len([e for e in result.timeline if e.name == "optimizer"]) == 3  # one per minibatch
    for e in result.timeline:
        assert step.start <= e.start <= e.end <= step.end
        assert (e.attrs["step"], e.attrs["rank"], e.attrs["node"], e.attrs["gpu"]) == (4, 0, "10.0.0.7", None)
    for op in ("forward", "loss_computation", "backward"):
        seconds = [e.end - e.start for e in result.timeline if e.name == op]
        mean = math.fsum(seconds) / len(seconds)
        m = result.metrics
        assert m[f"timing_{op}_microbatch_mean"] == pytest.approx(mean, abs=1e-6)
        assert m[f"timing_{op}_microbatch_min"] == pytest.approx(min(seconds), abs=1e-6)
        assert m[f"timing_{op}_microbatch_max"] == pytest.approx(max(seconds), abs=1e-6)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in seconds) / len(seconds))
        assert m[f"timing_{op}_microbatch_std"] == pytest.approx(std, abs=1e-6)
        assert m[f"timing_{op}_total"] == pytest.approx(math.fsum(seconds), abs=1e-6)
    assert "timing_optimizer_microbatch_mean" not in result.metrics  # once per minibatch, not microbatch


def test_track_gpu_events_false_keeps_only_the_whole_step(tiny_qwen2_path):
    trainer = Trainer(make_settings(tiny_qwen2_path, track_gpu_events=False))
    result = trainer.train_step(pack(make_samples(n=4)))
    assert [e.name for e in result.timeline] == ["step"]
    timings = sorted(k for k in result.metrics if k.startswith("timing_"))
    assert timings == ["timing_microbatch_count", "timing_step_active", "timing_step_total"]
    assert math.isfinite(result.metrics["loss"])


def test_auto_picks_the_native_model_and_falls_back_to_hf_for_uncovered_architectures(tiny_qwen2_path):
    from refractor.testing import TinyModelSpec, build_tiny_model
    from refractor.trainer.policy_model import choose_impl

    sliding = build_tiny_model(
        TinyModelSpec(
            arch="qwen2", extra={"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}
        )
    )
    assert choose_impl(tiny_qwen2_path, "auto") == "native"
    assert choose_impl(sliding, "auto") == "hf"  # the native decoder has no sliding-window attention
    trainer = Trainer(make_settings(sliding))
    assert trainer.impl == "hf" and math.isfinite(trainer.train_step(pack(make_samples(n=3))).metrics["loss"])
