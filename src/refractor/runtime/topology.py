"""The run's topology, recorded once at start (``meta.topology`` in the run store).

What ran where and on what: the Ray cluster (address, namespace, every node and its resources),
each machine the run uses (hardware, GPUs, driver and CUDA versions, package versions, as
its own collector read them), every inference server (node, GPUs, URL) and trainer rank (node,
device, GPUs), the placement groups (strategy, bundles, the node of each bundle) and the model
(architecture from its ``config.json``, parameter count from the trainer). Machines are keyed by
address, the same ``node`` as in ``system_metrics``, so metrics join on it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import ray

TOPOLOGY_VERSION = 1

_MODEL_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
)


def cluster_nodes() -> list[dict[str, Any]]:
    return [
        {
            "node_id": node["NodeID"],
            "address": node["NodeManagerAddress"],
            "hostname": node.get("NodeManagerHostname", ""),
            "alive": bool(node["Alive"]),
            "resources": {k: v for k, v in node.get("Resources", {}).items() if not k.startswith("node:")},
        }
        for node in ray.nodes()
    ]


def placement_group_info(name: str, reservation: Any) -> dict[str, Any]:
    table = ray.util.placement_group_table(reservation.group)
    node_addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    bundle_nodes = table.get("bundles_to_node_id", {})
    return {
        "name": name,
        "id": reservation.group.id.hex(),
        "strategy": table.get("strategy"),
        "bundles": [
            {
                "index": int(index),
                "resources": bundle,
                "node": node_addresses.get(bundle_nodes.get(index, ""), ""),
            }
            for index, bundle in sorted(table.get("bundles", {}).items())
        ],
    }


def model_info(model: str, trainer_ranks: list[dict[str, Any]]) -> dict[str, Any]:
    info: dict[str, Any] = {"name": model}
    config = Path(model) / "config.json"
    if config.is_file():
        hf = json.loads(config.read_text())
        info.update({key: hf[key] for key in _MODEL_KEYS if key in hf})
    if trainer_ranks:
        info["num_parameters"] = trainer_ranks[0].get("num_parameters")
        info["trainer_impl"] = trainer_ranks[0].get("impl")
    return info


def topology_snapshot(
    *,
    connection: Any,
    engine: str,
    machines: list[dict[str, Any]],
    servers: list[dict[str, Any]],
    trainer_ranks: list[dict[str, Any]],
    placement_groups: list[dict[str, Any]],
    model: dict[str, Any],
) -> dict[str, Any]:
    return {
        "schema_version": TOPOLOGY_VERSION,
        "collected_at": time.time(),
        "cluster": {
            "address": connection.address,
            "namespace": connection.namespace,
            "started_local": connection.started_local,
            "driver_node": ray.util.get_node_ip_address(),
            "nodes": cluster_nodes(),
        },
        "machines": machines,
        "inference": {"engine": engine, "servers": servers},
        "trainer": {"world_size": len(trainer_ranks), "ranks": trainer_ranks},
        "placement_groups": placement_groups,
        "model": model,
    }
