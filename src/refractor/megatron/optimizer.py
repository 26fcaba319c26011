"""AdamW over a rank's Megatron-Core parameters, its state optionally split among data-parallel replicas.

Megatron-Core's own optimizers (``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params``) and
its gradient buffers live on CUDA devices (megatron-core 0.16 allocates them with
``torch.cuda.current_device()``); this is torch's AdamW (the FSDP trainer's, ``trainer/optim.py``)
on the rank's local tensors, which runs on any device and, AdamW being elementwise, updates a shard
exactly as the whole tensor's update would. It steps the float32 master weights (``precision.py``) and
then rounds them into the model's parameters when those are in a lower compute dtype.

``distributed`` (``megatron_use_distributed_optimizer``): every parameter of the rank has one owner
among the data-parallel replicas (balanced by size); a replica keeps AdamW state for the parameters
it owns only, steps them, and broadcasts them to the other replicas. Gradients are already summed
over the replicas, so every replica ends with the same weights as the undistributed update. With
expert parallelism the replicas hold different experts: each rank steps its own (``own_names``).

``moments`` (``megatron_use_precision_aware_optimizer``): the AdamW moments' storage dtypes
(``adamw.py``). ``offload`` (``megatron_optimizer_cpu_offload``): a share of the owned parameters is
stepped on the host (``offload.py``). A gradient kept in bf16 (``MasterWeights.grads``) is upcast to
float32 for the update, one parameter at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refractor.megatron.adamw import MOMENT_DTYPES, MomentDtypes, PrecisionAdamW
from refractor.megatron.offload import HostCopies, offloaded
from refractor.megatron.parallel import MegatronRanks
from refractor.megatron.precision import MASTER_DTYPE, MasterWeights
from refractor.trainer.settings import MegatronSettings

log = logging.getLogger(__name__)


def assign_owners(sizes: list[int], replicas: int) -> list[int]:
    """An owner replica for each parameter (by size, largest first, to the least loaded replica;
    ties to the lower replica), the same on every rank."""
    load = [0] * replicas
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(replicas), key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += sizes[index]
    return owners


def optimizer_precision(mg: MegatronSettings, compute_dtype: torch.dtype) -> tuple[MomentDtypes, bool]:
    """(AdamW's moment dtypes, whether gradients stay in the compute dtype) of the precision-aware
    optimizer's keys (validated with the config); without ``megatron_use_precision_aware_optimizer``
    everything is float32. A float16 compute dtype cannot hold bf16 gradients; a float32 one keeps float32
    gradients (logged)."""
    if not mg.megatron_use_precision_aware_optimizer:
        return MomentDtypes(), False
    if mg.megatron_main_params_dtype != "float32":
        raise ValueError(
            f"`megatron_main_params_dtype: {mg.megatron_main_params_dtype}` is not supported by "
            "refractor's Megatron trainer (master weights are float32); set it to float32"
        )
    low_grads = mg.megatron_main_grads_dtype == "bfloat16"
    if low_grads and compute_dtype == torch.float16:
        raise ValueError(
            "`megatron_main_grads_dtype: bfloat16` keeps gradients in the compute dtype, which is float16 "
            "here: set `mixed_precision_dtype: bfloat16` or `megatron_main_grads_dtype: float32`"
        )
    if low_grads and compute_dtype == MASTER_DTYPE:
        log.info(
            "megatron trainer computing in float32: gradients are float32 "
            "(megatron_main_grads_dtype=bfloat16 applies when computing in bf16)"
        )
    moments = MomentDtypes(
        MOMENT_DTYPES[mg.megatron_exp_avg_dtype], MOMENT_DTYPES[mg.megatron_exp_avg_sq_dtype]
    )
    return moments, low_grads and compute_dtype == torch.bfloat16


def grad_reduce_dtype(
    mg: MegatronSettings, grads: Mapping[str, torch.nn.Parameter], compute_dtype: torch.dtype
) -> torch.dtype | None:
    """The dtype float32 gradients are summed over the data-parallel replicas in, when not float32
    (``megatron_grad_reduce_in_fp32: false``: the compute dtype)."""
    if mg.megatron_grad_reduce_in_fp32 or compute_dtype == MASTER_DTYPE:
        return None
    if any(p.dtype != MASTER_DTYPE for p in grads.values()):  # bf16 gradients reduce in bf16 already
        return None
    return compute_dtype


@dataclass(frozen=True)
class Offload:
    """``megatron_optimizer_offload_fraction`` and ``megatron_overlap_cpu_optimizer_d2h_h2d``."""

    fraction: float = 1.0
    overlap: bool = True


class MegatronOptimizer:
    """AdamW (``learning_rate``, ``weight_decay``; torch's betas and eps) on the rank's master weights
    (``weights.master``: name -> parameter)."""

    def __init__(
        self,
        weights: MasterWeights,
        learning_rate: float,
        weight_decay: float,
        ranks: MegatronRanks,
        *,
        distributed: bool,
        moments: MomentDtypes = MomentDtypes(),
        offload: Offload | None = None,
        own_names: frozenset[str] = frozenset(),
    ):
        """``own_names``: parameters that differ among the replicas (each EP rank's experts), which every
        rank steps itself whether ``distributed`` or not."""
        self.weights = weights
        params = self.params = weights.master
        self.ranks = ranks
        replicas = ranks.data_size if distributed else 1
        shared = [name for name in params if name not in own_names]
        if replicas > max(len(shared), 1):
            raise ValueError(
                f"`megatron_use_distributed_optimizer: true` with {replicas} data-parallel replicas needs "
                f"as many parameters per rank; this rank holds {len(shared)}: set it to false"
            )
        owners = assign_owners([params[name].numel() for name in shared], replicas)
        self.owners = dict(zip(shared, owners, strict=True))
        mine = ranks.data_rank if replicas > 1 else 0
        self.owned = {name: p for name, p in params.items() if name in own_names or self.owners[name] == mine}
        self.replicas = replicas
        chosen = offloaded([p.numel() for p in self.owned.values()], offload.fraction if offload else 0.0)
        to_host = {name: p for (name, p), out in zip(self.owned.items(), chosen, strict=True) if out}
        self.host = HostCopies(to_host, offload.overlap) if to_host else None
        self.offloaded = frozenset(to_host)
        # what AdamW steps: the device masters, and the host copies of the offloaded ones
        self.stepped = {
            name: self.host.params[name] if name in to_host else p for name, p in self.owned.items()
        }
        self.adamw = PrecisionAdamW(list(self.stepped.values()), learning_rate, weight_decay, moments, True)

    @property
    def learning_rate(self) -> float:
        return float(self.adamw.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        for p in self.weights.grads.values():
            p.grad = None
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        grads = {name: self.weights.grads[name].grad for name in self.owned}
        if self.host:
            self.host.gradients_in(grads)
        # the device part first (a device master's gradient may be the model's bf16 one), launched while
        # the offloaded gradients travel; then the host copies with their host buffers
        self.adamw.step(grads={p: grads[n] for n, p in self.stepped.items() if n not in self.offloaded})
        if self.host:
            self.host.gradients_ready()
            self.adamw.step(grads={p: p.grad for p in self.host.params.values()})
            self.host.weights_out()
        if self.replicas > 1:
            self._share_updates()
        self.weights.refresh()

    def _share_updates(self) -> None:
        """Each replica's updated parameters, broadcast to the other replicas."""
        for owner in range(self.replicas):
            names = [name for name, o in self.owners.items() if o == owner]
            tensors = [self.params[name] for name in names]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(
                flat, src=dist.get_global_rank(self.ranks.data_group, owner), group=self.ranks.data_group
            )
            torch._foreach_copy_(
                tensors,
                [
                    part.view_as(t)
                    for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
                ],
            )

    # ------------------------------------------------------------------ checkpoint state
    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW state of the owned parameters by name, in its storage dtypes, on the device that steps
        them (a fresh state for a parameter not stepped yet: AdamW then behaves as on it)."""
        return {name: self.adamw.state.get(p) or self.adamw.zero_state(p) for name, p in self.stepped.items()}

    def load_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set the AdamW state (``state()``'s layout) after the masters were loaded."""
        for name, p in self.stepped.items():
            self.adamw.state[p] = dict(state[name])
        if self.host:
            self.host.weights_in()
