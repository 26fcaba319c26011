"""refractor's backend for vLLM 0.32's built-in weight-transfer API (runs inside vLLM workers).

Server flag: ``--weight-transfer-config '{"backend": "refractor"}'``; the class is registered by
importing ``refractor.inference.vllm.worker_ext`` (the worker extension), because vLLM spawns its
workers and registrations made in the launching process are lost. The control plane is vLLM's
own (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``); the data plane is refractor's (``refractor.weight_sync.data_plane``)
over a stateless gloo (CPU) or NCCL (GPU) group, identical to what the native engine speaks.
An update is received whole and checked against the served checkpoint (``update_check``) before
any of it is loaded, so a bad update leaves the served weights and version as they were. With
``lora_sync: adapter`` an update carries LoRA adapters and their scale (and the weights the trainer
trains in full beside them, if any): the adapters are checked against the served adapter's folder and
written into it (``refractor.inference.vllm.adapter``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refractor.inference.vllm.adapter import AdapterFolder
from refractor.inference.vllm.cpu_kernels import refresh_cpu_kernels
from refractor.inference.vllm.update_check import ExpectedTensor, expected_update_tensors, update_problems
from refractor.models.lora import describe_adapters, is_adapter_update_name
from refractor.weight_sync.data_plane import BucketReceiver
from refractor.weight_sync.process_group import TransferGroup, check_worker_device, check_worker_join

logger = logging.getLogger(__name__)


@dataclass
class RefractorInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group: str = "full"
    backend: str = "gloo"
    payload: str = "group"  # or "cuda_ipc": buckets are handles of the trainer's GPU memory
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
        # the served LoRA adapter's folder (lora_sync: adapter), None: the server serves no adapter
        self.adapter = AdapterFolder.from_env() if vllm_config.lora_config is not None else None
        self._reloading = False  # a layerwise reload was started and awaits its finalization

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
        check_worker_device(init_info.backend, init_info.payload, self.device)
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
        self.receivers[init_info.group] = BucketReceiver(
            group, ipc_device=self.device if init_info.payload == "cuda_ipc" else None
        )

    def start_weight_update(self) -> None:
        """Nothing to prepare: the layerwise reload starts only once the whole update has arrived
        and passed its checks, so a rejected update never touches the served weights."""

    def finish_weight_update(self) -> None:
        """Finalize the layerwise reload of the weights, if the update carried any. vLLM then drops
        every loaded LoRA adapter: the next step loads the served adapter's folder again."""
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_kernels(self.model)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefractorUpdateInfo) -> None:
        """Receive the whole update, check it, and only then load it (all or nothing).

        Staging costs one copy of the incoming weights on the transfer device (host memory with
        gloo, GPU memory with NCCL) for the length of the update, on top of the served weights.
        """
        receiver = self.receivers.get(update_info.group)
        if receiver is None:
            raise RuntimeError(
                f"weight-transfer group {update_info.group!r} was never initialized on this "
                f"worker (known: {sorted(self.receivers)}); call /init_weight_transfer_engine"
            )
        # read before the reload swaps parameters for meta placeholders (which unties tied ones)
        param_names = {name for name, _ in self.model.named_parameters()}
        staged: list[list[tuple[str, torch.Tensor]]] = []
        for bucket in receiver.receive():
            # the receiver's tensors are valid only until the next bucket is asked for
            staged.append([(name, tensor.clone()) for name, tensor in bucket])
        # every bucket has arrived: from here on the trainer waits only for the report, which is
        # always sent (0 parameters written on failure)
        received = [pair for bucket in staged for pair in bucket]
        weights = [(name, t) for name, t in received if not is_adapter_update_name(name)]
        adapters = [(name, t) for name, t in received if is_adapter_update_name(name)]
        problems = update_problems(weights, self.expected_tensors) if weights or not adapters else []
        adapter_writes, adapter_problems = self._plan_adapters(adapters) if adapters else ({}, [])
        problems += adapter_problems
        loaded: set[str] = set()
        load_s = 0.0
        error: Exception | None = None
        if problems:
            error = ValueError(
                f"weight update rejected, nothing was written (the previous weights and version stay): "
                f"{'; '.join(problems)}"
            )
        else:
            start = time.perf_counter()
            try:
                if adapters and self.worker_rank() == 0:  # one writer; every worker loads the folder
                    self.adapter.write(adapter_writes)
                if weights:
                    loaded = self._load(
                        [[(n, t) for n, t in bucket if not is_adapter_update_name(n)] for bucket in staged]
                    )
            except Exception as err:  # noqa: BLE001 - re-raised after the report
                error = err
            load_s = time.perf_counter() - start
        written, total = self._coverage(param_names, loaded, bool(adapters))
        receiver.send_report(0 if error else written, total, load_s)
        if error is not None:
            raise error

    def _plan_adapters(
        self, adapters: list[tuple[str, torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        if self.adapter is None:
            sent = describe_adapters((name, tuple(t.shape)) for name, t in adapters)
            return {}, [
                f"the update carries LoRA adapters ({sent}) but this server serves none (a run with "
                "`lora_sync: adapter` starts its vLLM servers with them)"
            ]
        try:
            return self.adapter.plan(adapters)
        except ValueError as err:
            return {}, [str(err)]

    def _coverage(self, param_names: set[str], loaded: set[str], adapters: bool) -> tuple[int, int]:
        """(written, expected) for the canary's coverage check: every engine parameter for an update
        of weights; every adapter weight and the scale for an adapter update, plus the parameters the
        weights beside them wrote."""
        if adapters:
            expected = len(self.adapter.names) if self.adapter is not None else 0
            return expected + len(param_names & loaded), expected + len(param_names & loaded)
        missing = sorted(param_names - loaded)
        if missing:  # the trainer sees the counts; the names are in this log
            logger.warning("weight update left %d parameters untouched: %s", len(missing), missing[:20])
        return len(param_names & loaded), len(param_names)

    def _load(self, staged: list[list[tuple[str, torch.Tensor]]]) -> set[str]:
        """Load checked buckets under vLLM's layerwise reload: weights arrive in checkpoint format,
        and each layer's processing (fused qkv, repacked CPU kernels, ...) re-runs once all of its
        tensors are in, writing that layer's served weights. The reload is finalized at
        /finish_weight_update, or here on an error; an error past the checks is a loader fault, and
        the layers completed before it keep their new weights."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True
        loaded: set[str] = set()
        try:
            for bucket in staged:
                loaded |= set(self.model.load_weights(weights=bucket) or ())
        except BaseException:
            # leave no layer on the meta device: put the previous kernels back where nothing arrived
            self.finish_weight_update()
            raise
        return loaded

    @cached_property
    def expected_tensors(self) -> dict[str, ExpectedTensor] | None:
        """The served checkpoint's tensors (read once: its files do not change while it is served)."""
        text = self.model_config.hf_text_config
        tied = getattr(text, "tie_word_embeddings", False)
        return expected_update_tensors(
            self.model_config.model,
            self.model_config.revision,
            self.vllm_config.load_config.download_dir,
            (text.vocab_size, text.hidden_size) if tied else None,
        )

    def shutdown(self) -> None:
        for receiver in self.receivers.values():
            receiver.group.shutdown()
        self.receivers.clear()
