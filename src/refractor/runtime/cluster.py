"""Connecting to (or starting) the Ray cluster and reserving its resources.

Every failure names what to change: the address, or the `ray_*_cpus_per_worker` / worker-count
keys when the cluster is too small for the placement groups.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from refractor.errors import RefractorUserError


class ClusterError(RefractorUserError, RuntimeError):
    """The Ray cluster cannot host the run as configured."""


@dataclass(frozen=True)
class RaySettings:
    address: str
    auto_start_local: bool
    namespace: str
    log_to_driver: bool
    runtime_env: dict[str, Any] | None
    disable_runtime_env_hook: bool
    pin_py_executable: bool
    propagate_active_venv: bool
    propagate_run_dir: bool
    run_dir: str
    placement_timeout_s: int

    @classmethod
    def from_config(cls, cfg, run_dir: str) -> RaySettings:
        return cls(
            address=cfg.ray_address,
            auto_start_local=cfg.ray_auto_start_local,
            namespace=cfg.ray_namespace,
            log_to_driver=cfg.ray_log_to_driver and cfg.debug,
            runtime_env=cfg.ray_runtime_env,
            disable_runtime_env_hook=cfg.ray_disable_runtime_env_hook,
            pin_py_executable=cfg.ray_pin_py_executable,
            propagate_active_venv=cfg.ray_propagate_active_venv,
            propagate_run_dir=cfg.ray_propagate_run_dir,
            run_dir=run_dir,
            placement_timeout_s=cfg.ray_placement_timeout_s,
        )


def build_runtime_env(s: RaySettings) -> dict[str, Any]:
    env = dict(s.runtime_env or {})
    env_vars = {"TOKENIZERS_PARALLELISM": "false", **dict(env.get("env_vars", {}))}
    if s.propagate_active_venv:
        for key in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT"):
            if key in os.environ:
                env_vars.setdefault(key, os.environ[key])
    if s.propagate_run_dir:
        env_vars.setdefault("REFRACTOR_RUN_DIR", s.run_dir)
    for key in (
        "REFRACTOR_CACHE",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "REFRACTOR_ENV_PATH",
    ):
        if key in os.environ:
            env_vars.setdefault(key, os.environ[key])
    env["env_vars"] = env_vars
    if s.pin_py_executable:
        env.setdefault("py_executable", sys.executable)
    return env


def init_ray(s: RaySettings) -> bool:
    """Connect or start Ray. Returns True when this call started a local cluster (so we stop it)."""
    if ray.is_initialized():
        return False
    if s.disable_runtime_env_hook:
        os.environ.pop("RAY_RUNTIME_ENV_HOOK", None)
    common = dict(
        namespace=s.namespace,
        log_to_driver=s.log_to_driver,
        runtime_env=build_runtime_env(s),
        include_dashboard=False,
        configure_logging=False,
    )
    local = dict(address="local", _system_config={"enable_metrics_collection": False})
    if s.address == "":
        ray.init(**common, **local)
        return True
    try:
        ray.init(address=s.address, **common)
        return False
    except (ConnectionError, RuntimeError) as err:
        if not (s.address == "auto" and s.auto_start_local):
            raise ClusterError(
                f"cannot connect to the Ray cluster at `ray_address: {s.address}`: {err}"
            ) from None
    ray.init(**common, **local)
    return True


@dataclass(frozen=True)
class Reservation:
    """A ready placement group and what each bundle holds."""

    group: PlacementGroup
    cpus: float
    gpus: float
    count: int


def reserve(
    name: str,
    count: int,
    cpus: float,
    gpus: float,
    strategy: str,
    timeout_s: int,
    cpus_key: str,
    count_key: str,
) -> Reservation:
    """Create a placement group of `count` bundles and wait until it is ready (or explain why not)."""
    total = ray.cluster_resources()
    need_cpu = count * cpus
    need_gpu = count * gpus
    if need_cpu > total.get("CPU", 0) or need_gpu > total.get("GPU", 0):
        raise ClusterError(
            f"{name} needs {count} bundle(s) of {cpus:g} CPU + {gpus:g} GPU "
            f"({need_cpu:g} CPU, {need_gpu:g} GPU in all), "
            f"but the Ray cluster has {total.get('CPU', 0):g} CPU and {total.get('GPU', 0):g} GPU in total. "
            f"Lower `{cpus_key}` or `{count_key}`."
        )
    bundle: dict[str, float] = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy, name=f"refractor-{name}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(
            f"{name}: placement group of {count} x {bundle} with strategy {strategy} was not ready after "
            f"{timeout_s} s (`ray_placement_timeout_s`); other jobs may hold the resources."
        )
    return Reservation(group=pg, cpus=cpus, gpus=gpus, count=count)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
