"""torch-memory sampling: the recorder's buffer, the driver's drain loop, the CUDA reading."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch

from refractor.runtime.trainer_group import TrainerMemoryLoop
from refractor.telemetry.torch_memory import TorchMemoryRecorder, torch_memory_gb


def test_nothing_is_read_on_cpu():
    assert torch_memory_gb(torch.device("cpu")) == {}


def test_the_recorder_keeps_samples_in_order_until_drained_and_counts_what_a_full_buffer_drops():
    counter = itertools.count()
    ticks = itertools.count(100)
    recorder = TorchMemoryRecorder(
        lambda: {"torch_allocated_gb": float(next(counter))},
        1.0,
        capacity=3,
        clock=lambda: float(next(ticks)),
    )
    for _ in range(5):
        recorder.sample()
    assert recorder.drain() == [(102.0, {"torch_allocated_gb": 2.0}), (103.0, {"torch_allocated_gb": 3.0}),
                                (104.0, {"torch_allocated_gb": 4.0})]  # fmt: skip
    assert recorder.dropped == 2 and recorder.drain() == []


def test_a_failing_reading_stops_the_thread_and_says_why():
    def read():
        raise RuntimeError("CUDA driver gone")

    recorder = TorchMemoryRecorder(read, 0.001)
    recorder.start()
    deadline = time.monotonic() + 30
    while recorder.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    recorder.stop()
    assert recorder.error == "RuntimeError: CUDA driver gone" and recorder.drain() == []


class Rank:
    """A trainer actor's drain method as Ray exposes it (``.remote()`` gives an awaitable)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.drain_torch_memory = self

    def remote(self):
        answer = self.answers.pop(0)

        async def call():
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return call()


class Group:
    def __init__(self, ranks, on_gpu=True):
        self.actors = ranks
        self.on_gpu = on_gpu


def test_the_loop_stores_every_ranks_samples_and_drops_a_failing_rank_with_one_warning():
    rows = []
    warnings = []
    ok = {"node": "10.0.0.2", "dropped": 0, "error": None}
    group = Group(
        [
            Rank(
                [
                    {
                        **ok,
                        "samples": [(5.0, {"torch_allocated_gb": 1.5}), (5.1, {"torch_allocated_gb": 1.75})],
                    },
                    {**ok, "samples": [], "error": "RuntimeError: CUDA driver gone"},
                ]
            ),
            Rank([RuntimeError("actor died")]),
        ]
    )
    loop = TrainerMemoryLoop(
        group, lambda *a, **kw: rows.append((a, kw)), warnings.append, interval_s=0.01, call_timeout_s=5
    )
    asyncio.run(loop.collect())
    assert rows == [
        (("torch:trainer-0", {"torch_allocated_gb": 1.5}, 5.0), {"node": "10.0.0.2"}),
        (("torch:trainer-0", {"torch_allocated_gb": 1.75}, 5.1), {"node": "10.0.0.2"}),
    ]
    assert [(w.name, w.attrs["rank"]) for w in warnings] == [("torch_memory_failed", 1)]
    assert "actor died" in warnings[0].attrs["message"]
    asyncio.run(loop.run())  # rank 0 reports that its sampling stopped: no rank is left, the loop ends
    assert [w.attrs["rank"] for w in warnings] == [1, 0] and "CUDA driver gone" in warnings[1].attrs[
        "message"
    ]


def test_with_no_rank_on_a_gpu_the_loop_ends_at_once():
    loop = TrainerMemoryLoop(Group([Rank([])], on_gpu=False), None, None, interval_s=3600)
    asyncio.run(asyncio.wait_for(loop.run(), 5))


@pytest.mark.gpu
def test_the_cuda_reading_follows_allocations():
    device = torch.device("cuda")
    before = torch_memory_gb(device)
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 0.25 GiB
    after = torch_memory_gb(device)
    assert after["torch_allocated_gb"] - before["torch_allocated_gb"] == pytest.approx(0.25, abs=1e-3)
    assert after["torch_reserved_gb"] >= after["torch_allocated_gb"]
    assert after["torch_max_allocated_gb"] >= after["torch_allocated_gb"]
    del block
