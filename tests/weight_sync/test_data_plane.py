"""The weight-transfer data plane without any engine: bucket planning, both broadcast modes, the
metadata cache, the canary checksum and bounded collectives. Ranks are threads of this process
joined through a real loopback gloo group."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refractor.weight_sync.buckets import TensorMeta, iter_buckets, plan_buckets
from refractor.weight_sync.data_plane import BucketReceiver, BucketSender, RunningChecksum
from refractor.weight_sync.process_group import CollectiveTimeout, TransferGroup, host_store
from refractor.weight_sync.sender import CanaryError, check_canary, rank_layout

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 300)), max_size=30),
    bucket_bytes=st.integers(1, 2000),
)
def test_bucket_plan_properties(sizes, bucket_bytes):
    named = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (dtype, n) in enumerate(sizes)]
    buckets = list(iter_buckets(named, bucket_bytes))
    sent = [name for bucket in buckets for name, _ in bucket]
    assert sorted(sent) == sorted(name for name, _ in named)  # every tensor exactly once
    for bucket in buckets:
        assert len({t.dtype for _, t in bucket}) == 1  # dtype-homogeneous
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1  # only an oversized tensor travels alone
    for dtype in DTYPES:  # order kept within a dtype
        assert [n for n in sent if dict(named)[n].dtype == dtype] == [n for n, t in named if t.dtype == dtype]
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in named], bucket_bytes)
    assert plan == [[TensorMeta.of(n, t) for n, t in bucket] for bucket in buckets]


def run_group(world_size: int, worker, *, timeout_s: float = 10.0):
    """Rank 0 in this thread, ranks 1.. in threads running ``worker(group)``; returns (group0, threads)."""
    store = host_store("127.0.0.1", world_size, init_timeout_s=10)
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            group = TransferGroup.create(
                master_address="127.0.0.1",
                master_port=store.port,
                rank=rank,
                world_size=world_size,
                backend="gloo",
                group_name="test",
                init_timeout_s=10,
                timeout_s=timeout_s,
            )
            worker(group)
        except BaseException as err:  # noqa: BLE001 - re-raised by the test
            errors.append(err)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(1, world_size)]
    for t in threads:
        t.start()
    group = TransferGroup.create(
        master_address="127.0.0.1",
        master_port=store.port,
        rank=0,
        world_size=world_size,
        backend="gloo",
        group_name="test",
        init_timeout_s=10,
        timeout_s=timeout_s,
        store=store,
    )
    return group, threads, errors


def model_like_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 30, generator=g)
    return [
        ("embed.weight", torch.randn(64, 16, generator=g)),
        ("layers.0.q.weight", base.t()),  # non-contiguous view
        ("layers.0.q.bias", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd byte count
        ("layers.0.norm.weight", torch.randn(13, generator=g).to(torch.bfloat16)),
        ("layers.0.steps", torch.arange(5)),
        ("lm_head.weight", torch.randn(64, 16, generator=g)),
    ]


@pytest.mark.parametrize("mode", ["flattened_bucket", "per_tensor"])
def test_both_modes_deliver_identical_tensors_and_cache_metadata(mode):
    named = model_like_tensors()
    received: dict[int, list[list[tuple[str, torch.Tensor]]]] = {1: [], 2: []}

    def worker(group):
        receiver = BucketReceiver(group)
        for _ in range(3):
            # clone: flattened tensors are views of a receive buffer
            received[group.rank].append([(n, t.clone()) for b in receiver.receive() for n, t in b])
            receiver.send_report(0, 0, 0.0)

    group, threads, errors = run_group(3, worker)
    sender = BucketSender(group, mode)
    first = sender.send(iter_buckets(named, 600))
    assert first.metadata_sent and first.tensors == len(named)
    reports = sender.gather_reports()
    assert [r.rank for r in reports] == [1, 2]
    assert all(
        (r.checksum, r.tensors, r.bytes, r.buckets)
        == (first.checksum, first.tensors, first.bytes, first.buckets)
        for r in reports
    )
    second = sender.send(iter_buckets(named, 600))
    sender.gather_reports()
    assert not second.metadata_sent and second.checksum == first.checksum
    changed = [(n, t[:-1] if n == "layers.0.steps" else t) for n, t in named]  # new shape: resend
    assert sender.send(iter_buckets(changed, 600)).metadata_sent
    sender.gather_reports()
    for t in threads:
        t.join(10)
    assert not errors
    for rank in (1, 2):
        for push, expected in zip(received[rank], (named, named, changed), strict=True):
            got = dict(push)
            assert sorted(got) == sorted(n for n, _ in expected)
            for name, tensor in expected:
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_modes_agree_with_each_other():
    named = model_like_tensors()
    per_mode = {}
    for mode in ("flattened_bucket", "per_tensor"):
        got = {}

        def worker(group, got=got):
            receiver = BucketReceiver(group)
            got.update({n: t.clone() for b in receiver.receive() for n, t in b})
            receiver.send_report(0, 0, 0.0)

        group, threads, errors = run_group(2, worker)
        sender = BucketSender(group, mode)
        sender.send(iter_buckets(named, 300))
        sender.gather_reports()
        threads[0].join(10)
        assert not errors
        per_mode[mode] = got
    flat = per_mode["flattened_bucket"]
    per_tensor = per_mode["per_tensor"]
    assert flat.keys() == per_tensor.keys()
    assert all(torch.equal(flat[k], per_tensor[k]) for k in flat)


def test_corrupted_bucket_fails_the_canary_naming_the_server():
    named = model_like_tensors()

    def worker(group):
        receiver = BucketReceiver(group)
        for _ in receiver.receive():
            pass
        receiver.send_report(3, 3, 0.0)

    group, threads, errors = run_group(2, worker)
    sender = BucketSender(group)
    stats = sender.send(iter_buckets(named, 10_000), corrupt=True)
    reports = sender.gather_reports()
    threads[0].join(10)
    assert not errors and reports[0].checksum != stats.checksum
    assert (reports[0].tensors, reports[0].bytes) == (stats.tensors, stats.bytes)
    with pytest.raises(CanaryError, match=r"server 'server-a' \(rank 1\): received checksum"):
        check_canary(stats, {"server-a": reports}, version=3)
    # coverage: bytes are right but the engine did not write all of its parameters
    good = [r.__class__(**{**r.__dict__, "checksum": stats.checksum, "params_loaded": 2}) for r in reports]
    with pytest.raises(CanaryError, match="only 2 of its 3 parameters"):
        check_canary(stats, {"server-a": good}, version=3)


def test_checksum_sees_order_and_single_bit():
    a = torch.arange(100, dtype=torch.int32)
    b = torch.arange(100, 200, dtype=torch.int32)
    flipped = b.clone()
    flipped.view(torch.uint8)[17] ^= 1
    sums = []
    for units in ((a, b), (b, a), (a, flipped)):
        c = RunningChecksum(torch.device("cpu"))
        for unit in units:
            c.add(unit)
        sums.append(c.item())
    assert len(set(sums)) == 3


def test_a_silent_peer_cannot_hang_the_sender():
    joined = threading.Event()

    def worker(group):  # joins the group, then never takes part in the transfer
        joined.set()
        time.sleep(8)

    group, threads, _ = run_group(2, worker, timeout_s=2.0)
    assert joined.wait(10)
    sender = BucketSender(group)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout):
        sender.send(iter_buckets(model_like_tensors(), 10_000))
        sender.gather_reports()
    assert time.monotonic() - start < 6
    assert group.broken


def test_rank_layout_gives_each_worker_of_each_server_its_own_rank():
    # servers with TP x PP x DP = 2, 1 and 4 workers: trainer 0, then 1-2, 3, 4-7
    assert rank_layout([2, 1, 4]) == ([1, 3, 4], 8)


def test_data_plane_backend_follows_device_and_cpu_staging():
    from refractor.weight_sync import ServerRef, WeightSender, WeightSyncSettings

    servers = [ServerRef("a", "http://127.0.0.1:1")]
    on_gpu = WeightSender(servers, device="cuda:0")
    staged = WeightSender(servers, WeightSyncSettings(cpu_staging=True), device="cuda:0")
    on_cpu = WeightSender(servers)
    assert (on_gpu.backend, on_gpu.device) == ("nccl", torch.device("cuda:0"))
    assert (staged.backend, staged.device) == (
        "gloo",
        torch.device("cpu"),
    )  # buckets assembled in host memory
    assert (on_cpu.backend, on_cpu.device) == ("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="eval servers"):
        WeightSender(servers, eval_servers={"b"})
    for sender in (on_gpu, staged, on_cpu):
        sender.close()
