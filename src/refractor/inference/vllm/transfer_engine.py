"""refractor's backend for vLLM 0.32's built-in weight-transfer API (runs inside vLLM workers).

Server flag: ``--weight-transfer-config '{"backend": "refractor"}'``; the class is registered by
importing ``refractor.inference.vllm.worker_ext`` (the worker extension), because vLLM spawns its
workers and registrations made in the launching process are lost. The control plane is vLLM's
own (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``); the data plane is refractor's (``refractor.weight_sync.data_plane``)
over a stateless gloo (CPU) or NCCL (GPU) group, identical to what the native engine speaks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refractor.inference.vllm.cpu_kernels import refresh_cpu_kernels
from refractor.weight_sync.data_plane import BucketReceiver
from refractor.weight_sync.process_group import TransferGroup, check_worker_join

logger = logging.getLogger(__name__)


@dataclass
class RefractorInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group: str = "full"
    backend: str = "gloo"
    init_timeout_s: float = 300.0
    timeout_s: float = 300.0


@dataclass
class RefractorUpdateInfo(WeightTransferUpdateInfo):
    group: str = "full"
    version: str | None = None  # vLLM applies the version at /finish_weight_update


class RefractorWeightTransferEngine(WeightTransferEngine[RefractorInitInfo, RefractorUpdateInfo]):
    init_info_cls = RefractorInitInfo
    update_info_cls = RefractorUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.receivers: dict[str, BucketReceiver] = {}  # one per group this worker belongs to
        self._param_names: set[str] = set()

    def worker_rank(self) -> int:
        """This worker's index among all workers of its server (DP replicas x TP x PP)."""
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: RefractorInitInfo) -> None:
        check_worker_join(
            init_info.rank_offset + self.worker_rank(),
            init_info.world_size,
            init_info.master_port,
            init_info.backend,
        )
        device = self.device if init_info.backend == "nccl" else torch.device("cpu")
        group = TransferGroup.create(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank=init_info.rank_offset + self.worker_rank(),
            world_size=init_info.world_size,
            backend=init_info.backend,
            group_name=init_info.group,
            device=device,
            init_timeout_s=init_info.init_timeout_s,
            timeout_s=init_info.timeout_s,
        )
        previous = self.receivers.pop(init_info.group, None)
        if previous is not None:
            previous.group.shutdown()
        self.receivers[init_info.group] = BucketReceiver(group)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # read before the reload swaps parameters for meta placeholders (which unties tied ones)
        self._param_names = {name for name, _ in self.model.named_parameters()}
        # weights arrive in checkpoint format; layerwise reload re-runs each layer's processing
        # (fused qkv, repacked CPU kernels, ...) once all of its tensors have been loaded
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_kernels(self.model)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefractorUpdateInfo) -> None:
        receiver = self.receivers.get(update_info.group)
        if receiver is None:
            raise RuntimeError(
                f"weight-transfer group {update_info.group!r} was never initialized on this "
                f"worker (known: {sorted(self.receivers)}); call /init_weight_transfer_engine"
            )
        loaded: set[str] = set()
        load_s = 0.0
        load_error: Exception | None = None
        try:
            for bucket in receiver.receive():
                if load_error is not None:
                    continue  # keep receiving: the trainer is still broadcasting to every worker
                start = time.perf_counter()
                try:
                    loaded |= set(self.model.load_weights(weights=bucket) or ())
                except Exception as err:  # noqa: BLE001 - re-raised after the report
                    load_error = err
                load_s += time.perf_counter() - start
            total = self._param_names
            missing = sorted(total - loaded)
            if missing:  # vLLM's load_weights skips unknown names silently; the trainer sees the counts
                logger.warning("weight update left %d parameters untouched: %s", len(missing), missing[:20])
            # always report (a failed load reports nothing written, so the canary names this server)
            receiver.send_report(0 if load_error else len(total & loaded), len(total), load_s)
            if load_error is not None:
                raise load_error
        except BaseException:
            # leave no layer on the meta device: put the previous kernels back where nothing arrived
            self.finish_weight_update()
            raise

    def shutdown(self) -> None:
        for receiver in self.receivers.values():
            receiver.group.shutdown()
        self.receivers.clear()
