"""System metrics from every node of a run, through real Ray actors, into a real run store."""

from __future__ import annotations

import asyncio

import pytest
import ray

from refractor.runtime.node_metrics import NodeMetricsLoop, run_nodes
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import RunStore


@pytest.fixture(scope="module")
def local_ray():
    ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_each_node_is_sampled_and_a_dead_collector_is_a_warning_not_a_failure(local_ray, tmp_path):
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    store = RunStore(tmp_path)
    try:
        nodes = run_nodes([pg])
        assert nodes == [ray.get_runtime_context().get_node_id()]  # the driver's node, once
        loop = NodeMetricsLoop(nodes, store.log_system_metrics, store.log_event, interval_s=0.05)
        loop.start()
        address = ray.util.get_node_ip_address()
        assert list(loop.actors) == [address]

        async def twice_then_kill_then_once_more():
            for _ in range(2):
                await asyncio.sleep(0.2)  # CPU time to measure between two samples
                await loop.collect()
            ray.kill(loop.actors[address], no_restart=True)
            await asyncio.sleep(0.5)
            await loop.collect()  # finds the dead collector: recorded, left out
            await loop.collect()

        asyncio.run(twice_then_kill_then_once_more())
        store.flush()
        with RunReader(tmp_path) as reader:
            memory = reader.system_metrics(name="system_memory_percent", node=address)
            assert len(memory) == 2 and all(0 < r["value"] < 100 and r["source"] == "system" for r in memory)
            cpu = reader.system_metrics(name="cpu_utilization_percent")
            assert len(cpu) == 2 and {r["node"] for r in cpu} == {address}
            (failed,) = [e for e in reader.timeline() if e["name"] == "node_metrics_failed"]
            assert (
                failed["attrs"]["node"] == address and "system metrics of node" in failed["attrs"]["message"]
            )
        assert loop.actors == {}
    finally:
        store.close()
        ray.util.remove_placement_group(pg)
