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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refractor.megatron.parallel import MegatronRanks
from refractor.megatron.precision import MasterWeights
from refractor.trainer.optim import build_optimizer


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
        self.adamw = build_optimizer(list(self.owned.values()), learning_rate, weight_decay, fused=True)

    @property
    def learning_rate(self) -> float:
        return float(self.adamw.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.adamw.step()
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
        """AdamW state of the owned parameters by name (zeros for a parameter not stepped yet: AdamW
        then behaves as on a fresh state)."""
        out = {}
        for name, p in self.owned.items():
            state = self.adamw.state.get(p) or {}
            out[name] = {
                "step": state.get("step", torch.zeros((), dtype=torch.float32, device=p.device)),
                "exp_avg": state.get("exp_avg", torch.zeros_like(p)),
                "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(p)),
            }
        return out

    def load_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, p in self.owned.items():
            self.adamw.state[p] = dict(state[name])
