"""The Megatron trainer's optimizer options (``refractor.megatron.adamw`` / ``offload`` / ``optimizer``).

* Precision-aware AdamW: with float32 moments it is torch's AdamW bit for bit; with bf16 / fp16
  moments one step from a fresh state updates the parameter as torch's float32 AdamW does and stores
  its moments rounded to nearest, and a 20-step trajectory stays within the bound that the rounding
  of the stored moments implies (computed from a float64 AdamW), and away from float32 AdamW.
* Gradients: ``megatron_main_grads_dtype: bfloat16`` accumulates the rows' gradients in bf16 (the sum of
  the bf16 gradients rounded to bf16 at each add); ``megatron_grad_reduce_in_fp32: false`` rounds the
  float32 gradients to the compute dtype for the data-parallel sum.
* CPU offload: Megatron-Core's choice of parameters; one-rank trainer runs offloading half or all of
  the parameters give the steps and weights of the run without offload bit for bit, through host
  copies that are separate tensors holding the AdamW state.
* A run with offload, bf16 compute and gradients, and bf16 / fp16 moments resumes exactly; a config
  with these keys loads (the refusals: ``test_layout``).
* Two data-parallel replicas with the AdamW state split between them: offloading half of each
  replica's parameters gives the steps without offload bit for bit and resumes exactly; in bf16, the
  data-parallel sum in bf16 (``megatron_grad_reduce_in_fp32: false``) and bf16 main grads stay within
  2e-2 relative of the float32 sums' steps and are not them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ._cpu_forward import MEGATRON_WARNINGS, free_port, quiet_megatron, spawn_ranks
from ._models import build
from ._trainer_runs import assert_resumes_exactly, batches, exported, run_three_steps, settings

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]

from refractor.megatron.adamw import MomentDtypes, PrecisionAdamW  # noqa: E402
from refractor.megatron.offload import offloaded  # noqa: E402
from refractor.trainer.checkpoint import CheckpointError  # noqa: E402

LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
COMPARED = ("loss", "grad_norm", "entropy", "kl_divergence_inference")


def _problem(steps: int, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Two parameters and their gradients for ``steps`` steps (magnitudes spread over 1e-4 .. 1e1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (65,)]
    params = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [
        [
            torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 2, shape, generator=g)
            for shape in shapes
        ]
        for _ in range(steps)
    ]
    return params, grads


def _run(optimizer_for, params, grads) -> list[torch.nn.Parameter]:
    stepped = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = optimizer_for(stepped)
    for step_grads in grads:
        for p, grad in zip(stepped, step_grads, strict=True):
            p.grad = grad.clone()
        optimizer.step()
    return stepped, optimizer


def _precision(dtypes: MomentDtypes):
    return lambda params: PrecisionAdamW(params, LR, WEIGHT_DECAY, dtypes, fused=True)


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def test_float32_moments_are_torch_adamw_bit_for_bit():
    params, grads = _problem(steps=5)
    got, optimizer = _run(_precision(MomentDtypes()), params, grads)
    want, reference = _run(_torch_adamw, params, grads)
    for p, q in zip(got, want, strict=True):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], reference.state[q][key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_step_updates_as_float32_adamw_and_stores_the_moments_rounded(dtype):
    params, grads = _problem(steps=1)
    got, optimizer = _run(_precision(MomentDtypes(dtype, dtype)), params, grads)
    want, reference = _run(_torch_adamw, params, grads)
    for p, q in zip(got, want, strict=True):
        assert torch.equal(p, q)  # the update read the float32 moments
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            exact = reference.state[q][key]
            assert state[key].dtype == dtype
            if dtype == torch.bfloat16:
                assert torch.equal(state[key], exact.to(torch.bfloat16)), key
            else:  # scaled so the absmax lands on half the float16 range, then rounded
                scale = state[f"{key}_scale"]
                assert scale.item() == pytest.approx(exact.abs().max().item() / 32752.0, rel=1e-6)
                assert torch.equal(state[key], (exact * scale.reciprocal()).to(torch.float16)), key


def _float64_adamw(params, grads, dtype):
    """AdamW's formula in float64, and per parameter the bound on how far an AdamW whose moments are
    stored in ``dtype`` (rounded each step, relative error <= u, plus float16's subnormal step after
    scaling) can drift from it: the stored moments' errors decay with beta, and move the update
    m_hat / (sqrt(v_hat) + eps) by at most what the worst of them can."""
    u = UNIT_ROUNDOFF[dtype]
    beta1, beta2 = BETAS
    out = []
    for index, p in enumerate(params):
        theta = p.double().clone()
        m = torch.zeros_like(theta)
        v = torch.zeros_like(theta)
        err_m = torch.zeros_like(theta)
        err_v = torch.zeros_like(theta)
        bound = torch.zeros_like(theta)
        for t, step_grads in enumerate(grads, start=1):
            if t > 1:  # the rounding of the moments stored after the previous step
                floor = {"m": 0.0, "v": 0.0}
                if dtype == torch.float16:  # half a subnormal step, in units of the per-tensor scale
                    floor = {
                        "m": 2.0**-25 * (m.abs().max() + err_m.max()).item() / 32752.0,
                        "v": 2.0**-25 * (v.max() + err_v.max()).item() / 32752.0,
                    }
                err_m = beta1 * ((1 + u) * err_m + u * m.abs() + floor["m"])
                err_v = beta2 * ((1 + u) * err_v + u * v + floor["v"])
            g = step_grads[index].double()
            theta.mul_(1 - LR * WEIGHT_DECAY)
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            c1 = 1 - beta1**t
            c2 = 1 - beta2**t
            root = (v / c2).sqrt()
            low = ((v - err_v).clamp(min=0) / c2).sqrt()
            high = ((v + err_v) / c2).sqrt()
            update = (m / c1) / (root + EPS)
            theta.sub_(LR * update)
            spread = torch.maximum(root - low, high - root)
            moved = (err_m / c1) / (low + EPS) + (m.abs() / c1) * spread / ((low + EPS) * (root + EPS))
            bound = (1 - LR * WEIGHT_DECAY) * bound + LR * moved
        out.append((theta, bound))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_moments_stay_within_their_rounding_bound_of_float64_adamw(dtype):
    """The bound (``_float64_adamw``) plus float32 arithmetic (1e-6 of a step per step)."""
    steps = 20
    params, grads = _problem(steps=steps, seed=1)
    got, _ = _run(_precision(MomentDtypes(dtype, dtype)), params, grads)
    full, _ = _run(_torch_adamw, params, grads)
    for p, q, (reference, bound) in zip(got, full, _float64_adamw(params, grads, dtype), strict=True):
        drift = (p.double() - reference).abs()
        assert (drift <= bound + steps * LR * 1e-5 + 1e-6).all(), (drift - bound).max()
        assert not torch.equal(p, q)  # the rounding did change the trajectory


def test_megatron_offloads_parameters_in_order_until_the_fraction_is_reached():
    sizes = [4, 3, 2, 1]  # 10 elements
    assert offloaded(sizes, 0.0) == [False] * 4
    assert offloaded(sizes, 0.3) == [True, False, False, False]  # 4 >= 3
    assert offloaded(sizes, 0.5) == [True, True, False, False]  # 4 < 5, then 7 >= 5
    assert offloaded(sizes, 0.95) == [True, True, True, True]  # 9 < 9.5
    assert offloaded(sizes, 1.0) == [True] * 4


# ------------------------------------------------------------------ the trainer


def _trainer(root, mixed: bool = False, **keys):
    from refractor.megatron.trainer import MegatronTrainer

    dtype = "bfloat16" if mixed else None
    return MegatronTrainer(
        settings(build("qwen2"), "megatron", root, mixed_precision_dtype=dtype, **keys), mixed_precision=mixed
    )


def _three_steps(root, mixed: bool = False, **keys) -> dict:
    from refractor.megatron import parallel

    trainer = _trainer(root, mixed, **keys)
    try:
        run = run_three_steps(trainer, 1)
        optimizer = trainer.optimizer
        run["trainer"] = trainer
        run["host"] = {name: optimizer.stepped[name] for name in optimizer.offloaded}
        run["state"] = optimizer.state()
        return run
    finally:
        parallel.stop()


@pytest.fixture(scope="module")
def offload_runs(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    return {
        fraction: _three_steps(
            root / str(fraction),
            megatron_optimizer_cpu_offload=fraction is not None,
            megatron_optimizer_offload_fraction=fraction or 0.0,
        )
        for fraction in (None, 0.5, 1.0)
    }


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_steps_equal_the_steps_without_offload_bit_for_bit(offload_runs, fraction):
    run, plain = offload_runs[fraction], offload_runs[None]
    for got, want in zip(run["metrics"], plain["metrics"], strict=True):
        for key in COMPARED:
            assert got[key] == want[key], key
    for name, tensor in plain["export"].items():
        assert torch.equal(run["export"][name], tensor), name


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_parameters_step_separate_host_copies_that_hold_their_adamw_state(offload_runs, fraction):
    run = offload_runs[fraction]
    trainer = run["trainer"]
    masters = trainer.params
    sizes = [p.numel() for p in masters.values()]
    expected = [name for name, out in zip(masters, offloaded(sizes, fraction), strict=True) if out]
    assert sorted(run["host"]) == sorted(expected)
    held = sum(masters[name].numel() for name in expected)
    assert held >= fraction * sum(sizes) and (fraction == 1.0 or len(expected) < len(masters))
    for name, host in run["host"].items():
        assert host is not masters[name] and host.data_ptr() != masters[name].data_ptr()
        assert host.device.type == "cpu" and host.dtype == torch.float32
        assert torch.equal(host, masters[name])  # the last update was copied back
        assert trainer.optimizer.adamw.state[host]["step"].item() == 4  # four updates over three steps
        assert masters[name] not in trainer.optimizer.adamw.state
    plain = offload_runs[None]["state"]
    for name, state in run["state"].items():  # the same AdamW state, wherever it was kept
        for key, value in state.items():
            assert torch.equal(value, plain[name][key]), (name, key)


def test_bf16_main_grads_accumulate_in_bf16(world):
    """Two rows' gradients: with bf16 main grads the parameter's bf16 gradient is the bf16 sum; with
    float32 main grads the master's gradient is the float32 sum of the two bf16 gradients."""
    from refractor.megatron.precision import MasterWeights

    g = torch.Generator().manual_seed(0)
    x = [torch.randn(3, 8, generator=g).bfloat16() for _ in range(2)]
    results = {}
    for low in (False, True):
        model = torch.nn.Linear(8, 4, bias=False).bfloat16()
        with torch.no_grad():
            model.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
        weights = MasterWeights(model, grads_in_compute_dtype=low)
        parts = []
        for row in x:
            parts.append(torch.autograd.grad(model(row).float().square().sum(), model.weight)[0])
            model(row).float().square().sum().backward()
        results[low] = (weights.grads["weight"].grad, parts)
    grad, parts = results[True]
    assert grad.dtype == torch.bfloat16
    assert torch.equal(grad, parts[0] + parts[1])  # bf16 + bf16, rounded to bf16
    grad, parts = results[False]
    assert grad.dtype == torch.float32
    assert torch.equal(grad, parts[0].float() + parts[1].float())
    assert not torch.equal(results[True][0].float(), grad)


def test_grad_reduce_in_the_compute_dtype_rounds_the_float32_gradients(world):
    import torch.distributed as dist

    from refractor.megatron.step import _sum_grads

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    for reduce_dtype in (None, torch.bfloat16):
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        _sum_grads(params, dist.group.WORLD, reduce_dtype)
        for p, grad in zip(params, grads, strict=True):
            want = grad if reduce_dtype is None else grad.bfloat16().float()
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, want)


def test_the_trainer_wires_the_gradient_dtypes(world, tmp_path):
    from refractor.megatron import parallel

    cases = [  # (mixed, keys) -> (gradient dtype, data-parallel sum dtype)
        (True, {}, torch.float32, None),
        (True, {"megatron_grad_reduce_in_fp32": False}, torch.float32, torch.bfloat16),
        (False, {"megatron_grad_reduce_in_fp32": False}, torch.float32, None),
        (
            True,
            {"megatron_use_precision_aware_optimizer": True, "megatron_main_grads_dtype": "bfloat16"},
            torch.bfloat16,
            None,
        ),
    ]
    for mixed, keys, grad_dtype, reduce_dtype in cases:
        trainer = _trainer(tmp_path, mixed, **keys)
        parallel.stop()
        assert {p.dtype for p in trainer.weights.grads.values()} == {grad_dtype}, keys
        assert trainer.stage.grad_reduce_dtype == reduce_dtype, keys


LOW = dict(
    megatron_optimizer_cpu_offload=True,
    megatron_optimizer_offload_fraction=0.5,
    megatron_use_precision_aware_optimizer=True,
    megatron_main_grads_dtype="bfloat16",
    megatron_exp_avg_dtype="bfloat16",
    megatron_exp_avg_sq_dtype="float16",
)


def test_offloaded_low_precision_state_resumes_exactly(world, tmp_path):
    from refractor.megatron import parallel

    run = _three_steps(tmp_path, mixed=True, **LOW)
    for state in run["state"].values():
        assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.float16
    resumed = _trainer(tmp_path, mixed=True, **LOW)
    assert_resumes_exactly(resumed, run, COMPARED)
    other = _trainer(tmp_path, mixed=True, **{**LOW, "megatron_exp_avg_sq_dtype": "bfloat16"})
    parallel.stop()
    with pytest.raises(CheckpointError, match=r"holds AdamW moments stored as .*'exp_avg_sq': 'float16'"):
        other.load_checkpoint("latest")


def test_a_config_with_the_optimizer_keys_loads():
    from refractor.config import load_config
    from refractor.trainer.settings import TrainerSettings

    keys = {**LOW, "megatron_grad_reduce_in_fp32": False, "megatron_overlap_cpu_optimizer_d2h_h2d": False}
    cfg = load_config(
        None,
        {"environments": [{"name": "countdown"}], "model": str(build("qwen3")), "train_backend": "megatron"}
        | keys,
    )
    megatron = TrainerSettings.from_config(cfg).megatron
    for key, value in keys.items():
        assert getattr(megatron, key) == value, key


# ------------------------------------------------------------------ two data-parallel replicas
TWO_RANK_RUNS = {  # name -> (bf16 compute, keys)
    "plain": (False, {}),
    "offload": (False, {"megatron_optimizer_cpu_offload": True, "megatron_optimizer_offload_fraction": 0.5}),
    "bf16": (True, {}),
    "bf16-reduce": (True, {"megatron_grad_reduce_in_fp32": False}),
    "bf16-grads": (
        True,
        {"megatron_use_precision_aware_optimizer": True, "megatron_main_grads_dtype": "bfloat16"},
    ),
}


def two_rank_worker(rank: int, port: int, root: str) -> None:
    import os

    import torch.distributed as dist

    from refractor.megatron import parallel
    from refractor.trainer.distributed import init_distributed

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    quiet_megatron()
    init_distributed(rank, 2, master_port=port)
    results = {}
    for name, (mixed, keys) in TWO_RANK_RUNS.items():
        trainer = _trainer(f"{root}/{name}", mixed, **keys)
        results[name] = run_three_steps(trainer, 2)
        results[name]["offloaded"] = sorted(trainer.optimizer.offloaded)
        results[name]["owned"] = sorted(trainer.optimizer.owned)
        parallel.stop()
    resumed = _trainer(f"{root}/offload", False, **TWO_RANK_RUNS["offload"][1])
    assert resumed.load_checkpoint("latest") == 2
    results["resumed"] = {"metrics": resumed.train_step(batches(2)[2]).metrics, "export": exported(resumed)}
    parallel.stop()
    everyone = [None] * 2
    dist.all_gather_object(everyone, {name: r.get("offloaded") for name, r in results.items()})
    if rank == 0:
        results["offloaded_per_rank"] = [o["offload"] for o in everyone]
        torch.save(results, f"{root}/results.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-ranks")
    build("qwen2")
    spawn_ranks(two_rank_worker, (free_port(), str(root)), nprocs=2)
    return torch.load(root / "results.pt", weights_only=False)


def test_two_replicas_offloading_half_their_share_step_as_without_offload_and_resume(two_ranks):
    offload, plain = two_ranks["offload"], two_ranks["plain"]
    first, second = two_ranks["offloaded_per_rank"]
    assert first and second and not set(first) & set(second)  # each replica offloads what it owns
    assert len(offload["offloaded"]) < len(offload["owned"])
    for run in (offload, two_ranks["resumed"]):
        steps = run["metrics"] if run is offload else [*offload["metrics"][:2], run["metrics"]]
        for got, want in zip(steps, plain["metrics"], strict=True):
            for key in COMPARED:
                assert got[key] == want[key], key
        for name, tensor in plain["export"].items():
            assert torch.equal(run["export"][name], tensor), name


@pytest.mark.parametrize("name", ["bf16-reduce", "bf16-grads"])
def test_bf16_gradient_sums_stay_near_the_float32_sums(two_ranks, name):
    """bf16 rounding of the summed gradients moves the steps by far less than the bf16 compute does
    (``test_mixed_precision``: 2e-2 relative against float32)."""
    run, reference = two_ranks[name], two_ranks["bf16"]
    for got, want in zip(run["metrics"], reference["metrics"], strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=2e-2), key
    assert any(
        not torch.equal(run["export"][n], t) for n, t in reference["export"].items()
    )  # the sums were rounded
