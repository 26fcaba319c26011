"""System and GPU metrics from every node the run uses, into the driver's run store.

One :class:`NodeMetricsActor` per Ray node that holds a refractor process (the driver's node, and
every node of the servers' and trainer ranks' placement groups), pinned there, taking no CPU from
the run's reservations. Every ``system_metrics_collection_interval_seconds`` the driver's
:class:`NodeMetricsLoop` asks each actor for a sample (Ray calls: nothing assumes a shared file
system or one machine) and stores the rows with the node's address. A node whose collector dies or
fails is recorded once as a ``node_metrics_failed`` warning event and left out from then on; the
run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from refractor.records import TimelineEvent
from refractor.runtime.health import await_ref
from refractor.telemetry.system import NodeSampler, describe_machine

log = logging.getLogger(__name__)


# No GPU asked for: Ray then leaves CUDA_VISIBLE_DEVICES as the node was started with, so the sampler
# records the GPUs Ray may hand out on this node (none if Ray is told to blank it for zero-GPU actors,
# RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1).
@ray.remote(num_cpus=0, max_restarts=0)
class NodeMetricsActor:
    def __init__(self) -> None:
        self.address = ray.util.get_node_ip_address()
        self.sampler = NodeSampler.open()  # the first CPU reading: the first sample covers since then

    def node(self) -> str:
        return self.address

    def describe(self) -> dict:
        return {"address": self.address, **describe_machine()}

    def sample(self) -> tuple[float, list[tuple[str, str, float]]]:
        return time.time(), self.sampler.sample()


def run_nodes(placement_groups: Iterable[Any]) -> list[str]:
    """Ray node ids of the driver and of every bundle of ``placement_groups``, each once, in order."""
    nodes = [ray.get_runtime_context().get_node_id()]
    for pg in placement_groups:
        table = ray.util.placement_group_table(pg)
        for node in table.get("bundles_to_node_id", {}).values():
            if node not in nodes:
                nodes.append(node)
    return nodes


class NodeMetricsLoop:
    """Samples every node's collector each ``interval_s`` into ``log_metrics(source, metrics,
    timestamp, node)``; ``warn(event)`` records a collector that stopped."""

    def __init__(
        self,
        node_ids: list[str],
        log_metrics: Callable[..., None],
        warn: Callable[[TimelineEvent], None],
        interval_s: float,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.node_ids = node_ids
        self.log_metrics = log_metrics
        self.warn = warn
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.actors: dict[str, Any] = {}  # node address -> its collector
        self._booting: list[tuple[str, Any]] = []  # (node id, collector) launched, not yet answered

    def launch(self) -> None:
        """Place one collector on each node without waiting for it: a collector's process boots
        beside the run's servers and trainer ranks instead of after them. ``start`` waits."""
        if self._booting or self.actors:
            return
        self._booting = [
            (
                node_id,
                NodeMetricsActor.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(),
            )
            for node_id in self.node_ids
        ]

    def start(self) -> None:
        """Launch the collectors if ``launch`` did not, and wait until each has answered (blocking:
        call before the event loop)."""
        self.launch()
        booting, self._booting = self._booting, []
        for node_id, actor in booting:
            try:
                self.actors[ray.get(actor.node.remote(), timeout=self.call_timeout_s)] = actor
            except Exception as err:  # noqa: BLE001 - a node without metrics is no reason to stop
                self._stopped(node_id, err)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.collect()

    async def collect(self) -> None:
        nodes = list(self.actors)
        results = await asyncio.gather(
            *(
                asyncio.wait_for(await_ref(self.actors[n].sample.remote()), self.call_timeout_s)
                for n in nodes
            ),
            return_exceptions=True,
        )
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, BaseException):
                del self.actors[node]
                self._stopped(node, result)
                continue
            timestamp, rows = result
            by_source: dict[str, dict[str, float]] = {}
            for source, name, value in rows:
                by_source.setdefault(source, {})[name] = value
            for source, metrics in by_source.items():
                self.log_metrics(source, metrics, timestamp, node=node)

    def _stopped(self, node: str, err: BaseException) -> None:
        message = f"system metrics of node {node} stopped: {type(err).__name__}: {err}"[:2000]
        log.warning(message)
        now = time.time()
        self.warn(
            TimelineEvent("node_metrics_failed", now, now, "driver", {"node": node, "message": message})
        )

    def describe_nodes(self) -> list[dict]:
        """Every sampled node's hardware and software (blocking; a node that cannot answer is
        listed with its error)."""
        out = []
        for address, actor in self.actors.items():
            try:
                out.append(ray.get(actor.describe.remote(), timeout=self.call_timeout_s))
            except Exception as err:  # noqa: BLE001 - the snapshot names what it could not read
                out.append({"address": address, "error": f"{type(err).__name__}: {err}"})
        return out

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Kill every collector, launched or started (nothing to wait for: they hold no state)."""
        for actor in [*self.actors.values(), *(actor for _, actor in self._booting)]:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self._booting = []
