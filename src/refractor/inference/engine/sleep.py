"""Engine memory that is given back while the engine sleeps and taken again at the same address.

Sleep mode (vLLM's ``--enable-sleep-mode``, natively) lets a colocated trainer use the GPU memory
the engine holds. Two kinds of memory sleep, each in one ``ReleasableBuffer``:

* ``kv_cache``: always discarded by a sleep (running sequences are preempted first and re-prefill
  after the wake);
* ``weights``: the model's parameters, moved into one buffer when the engine is built. Level 1
  offloads them to pinned host memory and copies them back on wake; level 2 discards them (a weight
  update must refill them after ``wake_up(["weights"])``). An update while they are offloaded
  writes the host copy. (On CPU an offload saves nothing; it runs all the same, so the CPU tests
  cover what a GPU does.)

The addresses must not move: the decode CUDA graphs hold pointers into both buffers. On CUDA a
buffer is therefore a range of virtual addresses reserved once (the driver's virtual memory
management, through NVIDIA's ``cuda-bindings``) whose physical memory is unmapped on release and
mapped again on restore. On CPU a buffer is a private anonymous memory map whose pages a release
hands back to the system (``madvise(MADV_DONTNEED)``; they read as zeros when touched again). Either
way the storage keeps its size while released, so views of it can still be made (the HF-name views
of fused parameters; ``CausalLM.get_parameter_by_hf_name``).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable

import torch

TAGS = ("weights", "kv_cache")
_ALIGN = 256  # bytes: every view starts aligned for any dtype and vectorised kernels
GiB = 1 << 30


class ReleasableBuffer:
    """``nbytes`` of device memory as a uint8 tensor whose backing can be released and restored;
    views of ``tensor`` keep their addresses across a release (their contents do not survive it)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self.device = device
        self.resident = True
        self._cuda = None
        self._pages = None
        if device.type == "cuda":
            self._cuda = _CudaMapping(nbytes, device)
            self.tensor = torch.as_tensor(self._cuda, device=device)
        else:
            self._pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._pages, dtype=torch.uint8)
        self.tensor.zero_()  # touches every page: the memory is held from the start

    def view(self, offset: int, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        return _typed_view(self.tensor, offset, dtype, shape)

    def release(self) -> None:
        if not self.resident:
            return
        if self._cuda is None:
            self._pages.madvise(mmap.MADV_DONTNEED)
        else:
            torch.cuda.synchronize(self.device)  # no queued kernel may still touch it
            self._cuda.unmap()
        self.resident = False

    def restore(self, what: str) -> None:
        """Take the memory back (contents undefined); ``what`` names it in an out-of-memory error."""
        if self.resident:
            return
        if self._cuda is not None:  # CPU pages come back as they are touched
            self._cuda.map(what)
        self.resident = True


class ParameterArena:
    """The model's parameters moved into one ``ReleasableBuffer`` (shared parameters once)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], device: torch.device):
        unique = list({id(p): p for p in params}.values())
        offsets = []
        end = 0
        for param in unique:
            end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            end += param.numel() * param.element_size()
        self.memory = ReleasableBuffer(max(end, 1), device)
        self.params = unique
        for param, offset in zip(unique, offsets, strict=True):
            param.data = self.memory.view(offset, param.dtype, param.shape).copy_(param.data)
        self._host: torch.Tensor | None = None  # level 1's copy, allocated at the first offload

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where an update writes ``tensor`` (a parameter, or a contiguous view of one, such as a fused
        parameter's rows) while the arena is offloaded: the same bytes of the host copy."""
        assert self._host is not None, "the arena is not offloaded"
        assert tensor.is_contiguous(), "only a contiguous part of a parameter has one host range"
        offset = tensor.storage_offset() * tensor.element_size()
        return _typed_view(self._host, offset, tensor.dtype, tensor.shape)

    def offload(self) -> None:
        if self._host is None:
            pinned = self.memory.device.type == "cuda"
            self._host = torch.empty(self.memory.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._host.copy_(self.memory.tensor)
        self.memory.release()

    def restore(self, from_host: bool) -> None:
        self.memory.restore("the weights")
        if from_host:
            self.memory.tensor.copy_(self._host)


class EngineMemory:
    """What sleeps and how: ``asleep`` maps a tag to the level that put it to sleep."""

    def __init__(self, weights: ParameterArena, kv_cache: ReleasableBuffer):
        self.weights = weights
        self.kv_cache = kv_cache
        self.asleep: dict[str, int] = {}

    @property
    def weights_discarded(self) -> bool:
        return self.asleep.get("weights") == 2

    def sleep(self, level: int) -> None:
        self.kv_cache.release()
        self.asleep.setdefault("kv_cache", level)
        if "weights" in self.asleep:
            return
        if level == 1:
            self.weights.offload()
        else:
            self.weights.memory.release()
        self.asleep["weights"] = level

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        tags = list(TAGS if tags is None else tags)
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; known: {list(TAGS)}")
        if "weights" in tags and "weights" in self.asleep:
            self.weights.restore(from_host=self.asleep["weights"] == 1)
            del self.asleep["weights"]
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.kv_cache.restore("the KV cache")
            del self.asleep["kv_cache"]

    def write_target(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor an update of ``param`` (or of a view of one) writes: itself, or its host copy
        while offloaded."""
        if self.asleep.get("weights") == 1:
            return self.weights.host_view(param)
        return param


class _CudaMapping:
    """A reserved virtual address range with physical memory mapped into it or not; torch reads it
    through ``__cuda_array_interface__`` (it keeps this object alive as long as a view lives)."""

    def __init__(self, nbytes: int, device: torch.device):
        try:
            from cuda.bindings import driver
        except ImportError as err:
            raise RuntimeError(
                "sleep mode on a GPU needs NVIDIA's cuda-bindings package (pip install cuda-bindings)"
            ) from err
        self._driver = driver
        self.device = device
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        _check(driver.cuInit(0), "cuInit")
        # torch works in the device's primary context; the driver calls must too, on any thread
        self._context = _check(driver.cuDevicePrimaryCtxRetain(ordinal), "cuDevicePrimaryCtxRetain")
        self._use_context()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        granularity = _check(
            driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        self.nbytes = nbytes
        self.size = -(-nbytes // granularity) * granularity
        self.address = int(_check(driver.cuMemAddressReserve(self.size, 0, 0, 0), "cuMemAddressReserve"))
        self._handle = None
        self.map("a sleepable buffer")

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 3}

    def _use_context(self) -> None:
        _check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def map(self, what: str) -> None:
        driver = self._driver
        self._use_context()
        err, handle = driver.cuMemCreate(self.size, self._prop, 0)
        if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            free, total = torch.cuda.mem_get_info(self.device)
            raise torch.OutOfMemoryError(
                f"cannot take back {self.size / GiB:.2f} GiB of GPU memory for {what}: only "
                f"{free / GiB:.2f} of {total / GiB:.2f} GiB are free (another process on this GPU, "
                "a colocated trainer say, holds the rest); lower gpu_memory_utilization"
            )
        _check((err,), "cuMemCreate")
        try:
            _check(driver.cuMemMap(self.address, self.size, 0, handle, 0), "cuMemMap")
            _check(driver.cuMemSetAccess(self.address, self.size, [self._access], 1), "cuMemSetAccess")
        except BaseException:
            driver.cuMemUnmap(self.address, self.size)
            driver.cuMemRelease(handle)
            raise
        self._handle = handle

    def unmap(self) -> None:
        self._use_context()
        _check(self._driver.cuMemUnmap(self.address, self.size), "cuMemUnmap")
        _check(self._driver.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def __del__(self) -> None:
        driver = getattr(self, "_driver", None)
        if driver is None or not hasattr(self, "address"):
            return
        try:
            self._use_context()
            if self._handle is not None:
                self.unmap()
            driver.cuMemAddressFree(self.address, self.size)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass


def _typed_view(
    raw: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """``shape`` elements of ``dtype`` in the uint8 tensor ``raw``, from byte ``offset`` on."""
    return raw[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def _check(result: tuple, call: str):
    """The value of a cuda-bindings call (``(err, value)`` or ``(err,)``); raise on an error."""
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{call} failed: {name.decode() if name else err}")
    return values[0] if values else None
