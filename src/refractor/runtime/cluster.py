"""Connecting to (or starting) the Ray cluster and reserving its resources.

Every failure names what to change: the address, or the `ray_*_cpus_per_worker` / worker-count
keys when the cluster is too small for the placement groups.

Runs that share a machine or a cluster stay apart:

* a cluster a run started for itself is that run's alone: the run records itself as its owner,
  and ``ray_address: auto`` in another run does not join it while the owner lives (it starts a
  cluster of its own, or refuses when ``ray_auto_start_local`` is off); naming the address
  explicitly joins it anyway (it stops when its owner run ends);
* a run claims its Ray namespace on the cluster; a second live run with the same namespace is
  refused (pick another ``ray_namespace``);
* placement groups carry the run's own tag, so their names never collide.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from refractor.errors import RefractorUserError
from refractor.runtime import stop_signals

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_KV_NAMESPACE = "refractor"  # where runs record their claims in the cluster's key-value store
_OWNER_KEY = b"cluster-owner"


class ClusterError(RefractorUserError, RuntimeError):
    """The Ray cluster cannot host the run as configured."""


@dataclass(frozen=True)
class RunClaim:
    """A run's mark on a cluster: which run, which driver process, which Ray job."""

    run_dir: str
    host: str
    pid: int
    job_id: str

    @classmethod
    def mine(cls, run_dir: str) -> RunClaim:
        return cls(run_dir, socket.gethostname(), os.getpid(), ray.get_runtime_context().get_job_id())

    def describe(self) -> str:
        return f"the run {self.run_dir} (driver pid {self.pid} on {self.host})"

    def live(self) -> bool:
        """Whether the claiming run's Ray job still runs (a crashed run's claim is void)."""
        from ray._private import state

        return any(job["JobID"] == self.job_id and not job["IsDead"] for job in state.jobs())


def _read_claim(key: bytes) -> RunClaim | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)
    if raw is None:
        return None
    try:
        return RunClaim(**json.loads(raw))
    except (TypeError, ValueError):
        return None  # written by another version: ignore it rather than fail the run


def _write_claim(key: bytes, claim: RunClaim) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, json.dumps(asdict(claim)), overwrite=True, namespace=_KV_NAMESPACE)


@dataclass(frozen=True)
class RayConnection:
    """The cluster a run uses: whether the run started it (and so stops it), where, how big."""

    started_local: bool
    address: str
    namespace: str
    nodes: int
    cpus: float
    gpus: float

    def describe(self) -> str:
        how = "started a local Ray cluster" if self.started_local else "joined the Ray cluster"
        return f"{how} at {self.address}: {self.nodes} node(s), {self.cpus:g} CPU, {self.gpus:g} GPU"


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
    # ray_shutdown_on_exit: also leave a cluster the run joined (a cluster it started always stops)
    shutdown_on_exit: bool = False

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
            shutdown_on_exit=cfg.ray_shutdown_on_exit,
        )

    def shuts_down(self, connection: RayConnection | None) -> bool:
        """Whether the run's end calls ``ray.shutdown()``: always for a cluster the run started; for
        one it joined (where it only disconnects this process, the cluster goes on), with
        ``shutdown_on_exit``, so a caller that runs on afterwards (a notebook) is off the cluster."""
        return connection is not None and (connection.started_local or self.shutdown_on_exit)


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


def init_ray(s: RaySettings) -> RayConnection:
    """Connect to or start Ray, keeping clear of other runs' clusters and namespaces (see the module
    docstring). ``started_local``: this call started the cluster, so the run stops it at the end."""
    if ray.is_initialized():
        return _connection(False, s.namespace)
    if s.disable_runtime_env_hook:
        os.environ.pop("RAY_RUNTIME_ENV_HOOK", None)
    common = dict(
        namespace=s.namespace,
        log_to_driver=s.log_to_driver,
        runtime_env=build_runtime_env(s),
        include_dashboard=False,
        configure_logging=False,
    )
    started_local = _connect(s, common)
    me = RunClaim.mine(s.run_dir)
    if started_local:
        _write_claim(_OWNER_KEY, me)
    namespace_key = f"namespace/{s.namespace}".encode()
    holder = _read_claim(namespace_key)
    if holder is not None and holder.job_id != me.job_id and holder.live():
        if started_local:
            ray.shutdown()
        raise ClusterError(
            f"the Ray namespace {s.namespace!r} on {ray_address_text(s)} is in use by {holder.describe()}; "
            f"set `ray_namespace` to another name, or stop that run"
        )
    _write_claim(namespace_key, me)
    return _connection(started_local, s.namespace)


def stale_auto_address(timeout_s: float = 2.0) -> str | None:
    """The address ``ray_address: auto`` would join (``RAY_ADDRESS``, else the address file a
    local cluster leaves in Ray's temp folder) when nothing listens there, as a cluster killed
    without its shutdown leaves it; None when there is none or it answers."""
    address = os.environ.get("RAY_ADDRESS", "")
    if not address:
        path = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray" / "ray_current_cluster"
        try:
            address = path.read_text().strip()
        except OSError:
            return None
    return address if unreachable(address, timeout_s) else None


def unreachable(address: str, timeout_s: float = 2.0) -> bool:
    """Nothing accepts a connection at ``address`` (``host:port``, or ``ray://host:port``) within
    ``timeout_s``. ``ray.init`` would instead retry a dead address for minutes. Addresses of
    another form (``auto``, ``local``) are not probed."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except OSError:
        return True


def _connect(s: RaySettings, common: dict[str, Any]) -> bool:
    """ray.init as configured; True when a local cluster was started for this run."""
    local = dict(address="local", _system_config={"enable_metrics_collection": False})
    if s.address == "":
        ray.init(**common, **local)
        return True
    if s.address == "auto" and s.auto_start_local:
        stale = stale_auto_address()
        if stale is not None:  # ray.init would retry the dead address for minutes
            log.info("no Ray cluster answers at %s (left by a cluster that is gone); starting one", stale)
            ray.init(**common, **local)
            return True
    elif s.address != "auto" and unreachable(s.address):
        raise ClusterError(
            f"cannot reach the Ray cluster at `ray_address: {s.address}`: nothing answers there; "
            f'start it, fix the address, or set `ray_address: ""` to start a cluster for this run'
        )
    try:
        ray.init(address=s.address, **common)
    except (ConnectionError, RuntimeError) as err:
        if not (s.address == "auto" and s.auto_start_local):
            raise ClusterError(
                f"cannot connect to the Ray cluster at `ray_address: {s.address}`: {err}"
            ) from None
        ray.init(**common, **local)
        return True
    owner = _read_claim(_OWNER_KEY)
    if owner is None or not owner.live():
        return False
    if s.address != "auto":  # named explicitly: the user chose to share it
        log.warning(
            "the Ray cluster at %s was started by %s and stops when that run ends",
            s.address,
            owner.describe(),
        )
        return False
    ray.shutdown()
    if not s.auto_start_local:
        raise ClusterError(
            f"`ray_address: auto` found only the private Ray cluster of {owner.describe()}; name its "
            f"address in `ray_address` to share it anyway (it stops when that run ends), or set "
            f'`ray_address: ""` for a cluster of this run\'s own'
        )
    log.info("the Ray cluster on this machine belongs to %s; starting one for this run", owner.describe())
    ray.init(**common, **local)
    return True


def ray_address_text(s: RaySettings) -> str:
    return "the local cluster" if s.address in ("", "auto") else s.address


def _connection(started_local: bool, namespace: str) -> RayConnection:
    total = ray.cluster_resources()
    return RayConnection(
        started_local=started_local,
        address=ray.get_runtime_context().gcs_address,
        namespace=namespace,
        nodes=sum(1 for node in ray.nodes() if node["Alive"]),
        cpus=total.get("CPU", 0.0),
        gpus=total.get("GPU", 0.0),
    )


class RayHost:
    """Starts Ray from a thread of its own that lives until the run ends.

    Not from the main thread: there ``ray.init`` replaces the SIGTERM handler with one that exits
    without cleanup (and that, raised while Ray forks its processes, is even swallowed). Not from a
    short-lived thread either: Ray ties the processes of a cluster it starts (GCS, raylet) to the
    starting *thread* (the kernel's parent-death signal), so they die when that thread ends. This
    thread ends after ``ray.shutdown`` or with the process: a killed driver still takes its cluster
    down.
    """

    def __init__(self) -> None:
        self._release = threading.Event()
        self._started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread: threading.Thread | None = None

    def connect(self, settings: RaySettings, meanwhile: Callable[[], object] | None = None) -> RayConnection:
        """Start or join the cluster on the hosting thread and wait for it. ``meanwhile`` runs on
        this thread while the cluster starts (the start is mostly other processes booting, so work
        such as loading the tokenizer overlaps it); if it fails or is interrupted, the cluster is
        still stopped once its start ends, so nothing is left running."""
        self._thread = threading.Thread(target=self._host, args=(settings,), name="ray-host", daemon=True)
        self._thread.start()
        try:
            if meanwhile is not None:
                meanwhile()
            connection = self._started.result()
            stop_signals.install()  # ours again, over the handlers ray.init installed
            return connection
        except KeyboardInterrupt:
            if settings.address not in ("", "auto"):
                raise  # joining a named cluster starts nothing here: no need to wait for it
            with stop_signals.deferred():  # let the start finish, then stop what it started
                self._stop_once_started()
            raise
        except Exception:
            with stop_signals.deferred():
                self._stop_once_started()
            raise

    def _stop_once_started(self) -> None:
        try:
            connection = self._started.result(timeout=120)
        except Exception:  # noqa: BLE001 - the start failed too: nothing to stop
            connection = None
        self.close(connection is not None and connection.started_local)

    def _host(self, settings: RaySettings) -> None:
        logging.getLogger("ray._private.worker").addFilter(_NoSigtermNotice())
        try:
            self._started.set_result(init_ray(settings))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting main thread
            self._started.set_exception(err)
            return
        self._release.wait()

    def close(self, shutdown: bool) -> None:
        """Stop the cluster (when this run started it) and end the hosting thread."""
        if shutdown:
            ray.shutdown()
        self._release.set()
        if self._thread is not None:
            self._thread.join(10)


class _NoSigtermNotice(logging.Filter):
    """Drops Ray's notice that it set no SIGTERM handler: refractor keeps its own on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


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
    run_tag: str = "",
    resources: Mapping[str, float] | None = None,
) -> Reservation:
    """Create a placement group of `count` bundles and wait until it is ready (or explain why not).

    ``run_tag`` makes the group's name unique to the run (two runs on one cluster never collide);
    ``resources``: custom Ray resources every bundle also holds (which nodes it may go to)."""
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
    bundle |= dict(resources or {})
    group = reserve_bundles(name, [dict(bundle) for _ in range(count)], strategy, timeout_s, run_tag)
    return Reservation(group=group, cpus=cpus, gpus=gpus, count=count)


def reserve_bundles(
    name: str, bundles: list[dict[str, float]], strategy: str, timeout_s: int, run_tag: str = ""
) -> PlacementGroup:
    """A placement group of ``bundles``, once it is ready (removed again if it is not in time)."""
    pg = placement_group(
        bundles, strategy=strategy, name=f"refractor-{run_tag}-{name}" if run_tag else f"refractor-{name}"
    )
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(
            f"{name}: placement group of {bundles} with strategy {strategy} was not ready after "
            f"{timeout_s} s (`ray_placement_timeout_s`); other jobs may hold the resources."
        )
    return pg
