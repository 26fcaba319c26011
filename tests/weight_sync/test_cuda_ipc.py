"""Buckets as CUDA IPC handles (a colocated run's server on the trainer's GPU): handles are JSON
that a worker checks before mapping anything; on a GPU, a trainer and a server process sharing it
exchange real weights this way, checked byte for byte and by the canary."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refractor.weight_sync import ServerRef, WeightSender, WeightSyncSettings
from refractor.weight_sync.cuda_ipc import MAX_HANDLE_BYTES, BadHandle, open_bucket

GOOD = {
    "device": 0,
    "handle": base64.b64encode(b"h" * 64).decode(),
    "storage_bytes": 1024,
    "storage_offset": 0,
    "counter_handle": base64.b64encode(b"/torch_123").decode(),
    "counter_offset": 0,
    "event_handle": None,
    "event_sync": False,
    "offset": 0,
    "nbytes": 512,
}


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\xff not json", "is JSON"),
        (b"[1, 2]", "a JSON object"),
        (b"x" * (MAX_HANDLE_BYTES + 1), f"at most {MAX_HANDLE_BYTES} bytes"),
        (json.dumps({**GOOD, "nbytes": -1}).encode(), "'nbytes' must be a non-negative integer"),
        (json.dumps({**GOOD, "device": "0"}).encode(), "'device' must be a non-negative integer"),
        (json.dumps({**GOOD, "handle": "!!not base64!!"}).encode(), "'handle' must be a base64 string"),
        (json.dumps({**GOOD, "event_handle": 5}).encode(), "'event_handle' must be a base64 string"),
        (json.dumps({**GOOD, "event_sync": "yes"}).encode(), "'event_sync' must be true or false"),
        (json.dumps({**GOOD, "nbytes": 600}).encode(), "the bucket is 512 bytes"),
        (json.dumps({**GOOD, "offset": 1000}).encode(), "of a 1024-byte allocation"),
    ],
)
def test_a_handle_is_checked_before_anything_is_mapped(blob, message):
    with pytest.raises(BadHandle, match=message):
        open_bucket(blob, 512, torch.device("cuda", 0))


def test_a_sender_on_a_gpu_with_cuda_ipc_uses_gloo_for_the_handles():
    servers = [ServerRef("a", "http://127.0.0.1:1")]
    sender = WeightSender(servers, WeightSyncSettings(cpu_staging=True, cuda_ipc=True), device="cuda:0")
    assert (sender.backend, sender.device, sender.ipc_device) == (
        "gloo",
        torch.device("cpu"),
        torch.device("cuda:0"),
    )
    on_cpu = WeightSender(servers, WeightSyncSettings(cuda_ipc=True))  # nothing to share on CPU
    assert (on_cpu.backend, on_cpu.ipc_device) == ("gloo", None)
    for s in (sender, on_cpu):
        s.close()


WORKER = """
import sys, torch
from refractor.weight_sync.data_plane import BucketReceiver
from refractor.weight_sync.process_group import TransferGroup
port, pushes = int(sys.argv[1]), int(sys.argv[2])
group = TransferGroup.create(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
    backend="gloo", group_name="ipc", init_timeout_s=60, timeout_s=60)
receiver = BucketReceiver(group, ipc_device=torch.device("cuda", 0))
for push in range(pushes):
    got = {n: t.clone() for b in receiver.receive() for n, t in b}
    torch.save({n: t.cpu() for n, t in got.items()}, sys.argv[3] + f".{push}")
    receiver.send_report(len(got), len(got), 0.0)
"""


@pytest.mark.gpu
def test_weights_travel_between_two_processes_on_one_gpu_as_ipc_handles(tmp_path):
    from refractor.weight_sync.buckets import iter_buckets
    from refractor.weight_sync.data_plane import BucketSender
    from refractor.weight_sync.process_group import TransferGroup, host_store

    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    named = [
        ("embed.weight", torch.randn(1000, 64, device=device, generator=g)),
        ("layers.0.q.weight", torch.randn(64, 64, device=device, generator=g).t()),  # not contiguous
        ("layers.0.norm.weight", torch.randn(13, device=device, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(1000, 64, device=device, generator=g).to(torch.bfloat16)),
    ]
    store = host_store("127.0.0.1", 2, init_timeout_s=60)
    out = tmp_path / "received"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(store.port), "3", str(out)], env=env)
    try:
        group = TransferGroup.create(
            master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2, backend="gloo",
            group_name="ipc", init_timeout_s=60, timeout_s=60, store=store,
        )  # fmt: skip
        sender = BucketSender(group, ipc_device=device)
        stats = [sender.send(iter_buckets(named, 100_000))]
        reports = [sender.gather_reports()]
        sent = [{n: t.cpu() for n, t in named}]
        named[0][1].add_(1.0)  # the next push sends new values from the same memory
        sent.append({n: t.cpu() for n, t in named})
        stats.append(sender.send(iter_buckets(named, 100_000)))
        reports.append(sender.gather_reports())
        stats.append(sender.send(iter_buckets(named, 100_000), corrupt=True))
        reports.append(sender.gather_reports())
        assert worker.wait(60) == 0
    finally:
        worker.kill()
    assert stats[0].buckets > 2  # several handles, each acknowledged before the memory is reused
    for push in range(2):
        (report,) = reports[push]
        assert (report.checksum, report.bytes) == (stats[push].checksum, stats[push].bytes)
        got = torch.load(f"{out}.{push}")
        expected = sent[push]
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    (corrupted,) = reports[2]
    assert corrupted.checksum != stats[2].checksum  # the canary sees a damaged bucket
