"""``refractor train``: the driver that wires a run together and tears it down.

Order: resolve the config and the model once -> run directory + run store (the code snapshot is
taken by a thread beside the rest of the start) -> environments -> Ray (connect or start; the
tokenizer loads meanwhile) -> inference servers and trainer ranks start side by side -> weight-sync
group -> resume (trainer state, orchestrator counters, prompt stream, weights pushed to the servers) -> the
orchestrator's event loop -> shutdown of every actor and server process, on success, on error
and on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from refractor.config import RefractorConfig
from refractor.errors import RunSetupError
from refractor.records import TimelineEvent

if TYPE_CHECKING:
    from refractor.inference.client import InferenceClient
    from refractor.runtime.health import ServerWatchdog
    from refractor.runtime.log_collector import LogCollector
    from refractor.runtime.run_lock import RunLock
    from refractor.telemetry.otlp import OtlpTraceReceiver
    from refractor.telemetry.store import RunStore

log = logging.getLogger("refractor.train")

CODE_SNAPSHOT_WAIT_S = 30.0  # how long the end of a run waits for a code snapshot still being taken


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def db(self) -> Path:
        return self.root / "run.db"


def prepare_run(cfg: RefractorConfig, overwrite: bool = False) -> tuple[RefractorConfig, RunPaths, RunLock]:
    """Fix the run name and model path once, so every process sees the same resolved config, and
    take the run directory's lock (released by the caller, or by the process ending).

    Every check that can refuse the run happens here, before anything starts or is written: a run
    that is refused leaves an existing run directory exactly as it was.
    """
    from refractor.hub import ModelNotFoundError, resolve_model_path
    from refractor.runtime.run_lock import RunLock, RunLockedError
    from refractor.telemetry.store import mark_crashed

    run_name = cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    paths = RunPaths(Path(cfg.run_dir) / run_name)
    resuming = cfg.resume_from_checkpoint is not False
    if resuming and not paths.root.exists():
        raise RunSetupError(
            f"`resume_from_checkpoint` is set but {paths.root} does not exist (check `run_name`/`run_dir`)"
        )
    if paths.db.exists() and not resuming and not overwrite:
        raise RunSetupError(
            f"{paths.root} already holds a run. Resume it with `--resume_from_checkpoint true`, "
            f"pick another `--run_name`, or pass `--overwrite` to replace it."
        )
    _check_writable(paths.root)
    try:
        lock = RunLock.acquire(paths.root)
    except RunLockedError as err:
        raise RunSetupError(str(err)) from None
    try:
        if paths.db.exists() and mark_crashed(paths.db):
            log.warning(
                "%s: the previous run there did not finish (its process died); marked crashed", paths.root
            )
        if resuming:
            resume_step = _check_resumable(cfg, paths)
        elif paths.db.exists():  # --overwrite, and nobody else writes it (we hold its lock)
            _clear_run_dir(paths.root)
        try:
            model_path = resolve_model_path(cfg.model)
        except ModelNotFoundError as err:
            raise RunSetupError(str(err)) from None
        paths.logs.mkdir(parents=True, exist_ok=True)
    except BaseException:
        lock.release()
        raise
    resolved = cfg.model_copy(update={"model": str(model_path), "run_name": run_name})
    if resuming:  # every trainer rank loads the checkpoint verified here
        resolved = resolved.model_copy(update={"resume_from_checkpoint": resume_step})
    return resolved, paths, lock


def _check_writable(root: Path) -> None:
    """The run directory exists (created if needed) and takes new files."""
    import tempfile

    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root, prefix=".write-check-"):
            pass
    except OSError as err:
        raise RunSetupError(
            f"cannot write to {root}: {err.strerror}; make it writable or pick another `--run_dir`"
        ) from None


def _check_resumable(cfg: RefractorConfig, paths: RunPaths) -> int:
    """The step to resume: the asked one, or the newest intact one, with every file's checksum checked."""
    from refractor.trainer.checkpoint import CheckpointError, resolve_checkpoint_step
    from refractor.trainer.settings import CheckpointSettings

    where = CheckpointSettings(
        run_dir=str(paths.root.parent), run_name=paths.root.name, checkpoint_dir=cfg.checkpoint_dir
    )
    try:
        return resolve_checkpoint_step(where.root, cfg.resume_from_checkpoint, checksums=True)
    except CheckpointError as err:
        raise RunSetupError(f"cannot resume {paths.root}: {err}; the run is left as it was") from None


def _clear_run_dir(root: Path) -> None:
    """Everything of the old run except the lock file this process holds."""
    import shutil

    from refractor.runtime.run_lock import LOCK_FILE

    for child in root.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def load_environments(cfg: RefractorConfig):
    from refractor.envs import get_environment

    envs = []
    for entry in cfg.environments:
        try:
            envs.append(get_environment(entry.name, **entry.kwargs))
        except Exception as err:  # noqa: BLE001 - user environments raise anything; report it with the entry
            raise RunSetupError(
                f"environment `{entry.name}` could not be created: {type(err).__name__}: {err}"
            ) from None
    return envs


def load_evals(cfg: RefractorConfig, envs):
    """Resolve and load every eval; ``separate_eval_samples`` removes its prompts from ``envs``."""
    from refractor.orchestrator.eval_runner import EvalSetupError
    from refractor.orchestrator.eval_runner import load_evals as load

    try:
        return load(cfg.evals, {entry.name: env for entry, env in zip(cfg.environments, envs, strict=True)})
    except EvalSetupError as err:
        raise RunSetupError(str(err)) from None


def load_tokenizer(cfg: RefractorConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model)
    if cfg.chat_template is not None:
        tok.chat_template = cfg.chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def run_training(
    cfg: RefractorConfig,
    *,
    quiet: bool = False,
    overwrite: bool = False,
    config_path: str | Path | None = None,
) -> Path:
    """Run a whole training job; returns the run directory. Raises RunSetupError for user mistakes.
    ``config_path``: the file the config was read from (it locates the code snapshot's project)."""
    cfg, paths, lock = prepare_run(cfg, overwrite=overwrite)
    try:
        return _train(cfg, paths, quiet, config_path)
    finally:
        lock.release()


def _train(cfg: RefractorConfig, paths: RunPaths, quiet: bool, config_path: str | Path | None) -> Path:

    from refractor.inference.access import new_token
    from refractor.inference.process import raise_open_file_limit
    from refractor.orchestrator import Orchestrator, OrchestratorSettings
    from refractor.orchestrator.eval_schedule import build_eval_schedule, eval_server_names
    from refractor.runtime import stop_signals
    from refractor.runtime.cluster import RayHost, RaySettings
    from refractor.runtime.health import HeartbeatSettings, ServerWatchdog, actor_process_check
    from refractor.runtime.node_metrics import NodeMetricsLoop, run_nodes
    from refractor.runtime.placement import place
    from refractor.runtime.restarts import ServerRestarter
    from refractor.runtime.server_group import RayServerGroup, choose_engine
    from refractor.runtime.topology import model_info, placement_group_info, topology_snapshot
    from refractor.runtime.trainer_group import RayTrainerGroup, TrainerGroupSettings, TrainerMemoryLoop
    from refractor.telemetry.console import ConsoleSink
    from refractor.telemetry.server_metrics import ServerMetricsScraper
    from refractor.telemetry.store import RunStore

    raise_open_file_limit()  # the driver holds a connection per lane
    started = time.time()
    envs = load_environments(cfg)
    evals = load_evals(cfg, envs)
    envs_ready = time.time()
    store = RunStore(
        paths.root,
        config=cfg.model_dump(mode="json"),
        run_name=cfg.run_name,
        record_telemetry=cfg.record_telemetry,
    )
    store.set_meta({"environments": [env.describe() for env in envs]})  # ranges for the dashboard
    startup = StartupEvents(store)
    startup.mark("orchestrator_start", started)
    startup.mark("environments_prepare_start", started)
    startup.mark("environments_prepare_done", envs_ready)
    logs = start_log_collector(store, paths)
    sinks = []
    ray_host = RayHost()
    ray_settings = RaySettings.from_config(cfg, run_dir=str(paths.root))
    connection = None
    placement = None
    servers = None
    trainers = None
    node_metrics = None
    trace_receiver = None
    code_snapshot = None
    code_taken: list = []  # the snapshot once taken (W&B uploads it at the end)
    wandb_sink = None
    status = "failed"
    try:
        if cfg.record_telemetry:
            code_snapshot = start_code_snapshot(cfg, config_path, store, keep=code_taken.append)
        write_config_file(cfg, paths)
        sinks.append(ConsoleSink(cfg.number_of_steps, quiet=quiet))
        if cfg.use_wandb:
            from refractor.telemetry.wandb_sink import WandbSink

            wandb_sink = WandbSink.from_config(cfg, log_dir=paths.logs if cfg.wandb_upload_logs else None)
            sinks.append(wandb_sink)
        startup.mark("ray_init_start")
        loaded: list = []  # the tokenizer: importing transformers takes seconds, the cluster start too
        connection = ray_host.connect(
            ray_settings,
            meanwhile=lambda: loaded.append(load_tokenizer(cfg)),
        )
        (tokenizer,) = loaded
        startup.mark("ray_init_done")
        log.info("run %s: %s", cfg.run_name, connection.describe())
        if not quiet:
            print(f"refractor: {connection.describe()}", flush=True)
        # the secret of this run's server control routes: handed to the servers and to trainer
        # rank 0 in memory, never logged nor written to the run store or config files
        control_token = new_token()
        run_tag = f"{cfg.run_name}-{secrets.token_hex(3)}"  # names this run's placement groups
        engine, why = choose_engine(cfg.inference_engine, cfg.model)
        log.info("inference engine: %s (%s)", engine, why)
        if not quiet:
            print(f"refractor: inference engine {engine} ({why})", flush=True)
        placement = place(cfg, run_tag)
        if placement.colocated:
            log.info("servers and trainer ranks share GPUs (colocate: %s)", cfg.colocate)
        servers_sleep = cfg.sleeps_during_training(placement.colocated)
        if servers_sleep:
            log.info("servers sleep while the trainer steps (level %d)", cfg.inference_sleep_level)
            if not placement.colocated:
                log.warning(
                    "inference_sleep_during_training is on but no server shares a GPU with a trainer "
                    "rank: sleeping frees memory nobody else uses"
                )
        if cfg.record_telemetry:
            trace_receiver = start_trace_receiver(cfg, engine, single_node=connection.nodes == 1)
        servers = RayServerGroup(
            cfg,
            placement.servers,
            engine,
            str(paths.logs),
            control_token,
            gpu_memory_utilization=cfg.engine_memory_share(placement.colocated),
            otlp_traces_endpoint=None if trace_receiver is None else trace_receiver.endpoint,
            enable_sleep_mode=servers_sleep,
        )
        trainer_settings = TrainerGroupSettings.from_config(
            cfg,
            tokenizer.pad_token_id,
            control_token=control_token,
            single_node=connection.nodes == 1,
            colocated=placement.colocated,
            servers_sleep=servers_sleep,
        )
        trainers = RayTrainerGroup(trainer_settings, placement.trainers)
        for rank, actor in enumerate(trainers.actors):
            logs.add_actor_source("trainer", rank, actor.drain_logs.remote)
        for index in range(len(servers.actors)):  # the actor of the moment: a restart may replace it
            logs.add_actor_source("server", index, lambda i=index: servers.actors[i].drain_logs.remote())
        node_metrics = NodeMetricsLoop(
            run_nodes([r.group for _, r in placement.groups]),
            store.log_system_metrics,
            store.log_event,
            cfg.system_metrics_collection_interval_seconds,
        )
        if cfg.record_telemetry:
            node_metrics.launch()
        startup.mark("inference_processes_start")
        startup.mark("trainer_process_start")
        infos, trainer_ranks = _start_side_by_side(servers, trainers, startup.mark)
        store.set_meta({"engine": engine, "servers": json.dumps([i.__dict__ for i in infos])})
        eval_servers = eval_server_names(cfg, [i.name for i in infos])
        trainers.init_weight_sync([(i.name, i.url) for i in infos], eval_servers=eval_servers)

        clients = _http_servers(infos, cfg, control_token)
        if cfg.record_telemetry:
            node_metrics.start()
        server_places = servers.placements()
        store.set_meta(
            {
                "topology": topology_snapshot(
                    connection=connection,
                    engine=engine,
                    machines=node_metrics.describe_nodes(),
                    servers=server_places,
                    trainer_ranks=trainer_ranks,
                    placement_groups=[placement_group_info(name, r) for name, r in placement.groups],
                    model=model_info(cfg.model, trainer_ranks),
                )
            }
        )
        telemetry: list = [logs]
        if cfg.record_telemetry:
            telemetry += [
                node_metrics,
                ServerMetricsScraper(
                    clients,
                    store.log_system_metrics,
                    cfg.metrics_logger_interval_seconds,
                    nodes={place["name"]: place["node"] for place in server_places},
                ),
                TrainerMemoryLoop(
                    trainers,
                    store.log_system_metrics,
                    store.log_event,
                    cfg.ray_torch_memory_drain_interval_seconds,
                ),
            ]
        orchestrator = Orchestrator(
            OrchestratorSettings.from_config(cfg, colocated=placement.colocated),
            envs,
            servers=clients,
            trainer=trainers,
            store=store,
            tokenizer=tokenizer,
            sinks=sinks,
            evals=build_eval_schedule(cfg, evals, [i.name for i in infos], tokenizer, store, sinks),
            telemetry=telemetry,
            latency=trace_receiver,
        )
        if cfg.resume_from_checkpoint is not False:
            step = trainers.load_checkpoint(
                cfg.resume_from_checkpoint if cfg.resume_from_checkpoint is not True else "latest"
            )
            state = trainers.read_checkpoint_file(step, "orchestrator.json")
            if state is None:
                raise RunSetupError(
                    f"checkpoint step_{step} has no orchestrator.json; it cannot resume a run"
                )
            orchestrator.load_state_dict(json.loads(state))
            store.abandon_unfinished(
                orchestrator.counters.trainer_step, f"the run was resumed from checkpoint step_{step}"
            )
            asyncio.run(trainers.update_weights(orchestrator.counters.loaded_version))
        watchdog = ServerWatchdog(
            orchestrator.servers.values(),
            HeartbeatSettings.from_config(cfg),
            actor_process_check(servers.actor_of),
        )
        restarter = ServerRestarter(
            servers,
            trainers,
            {client.name: client for client in clients},
            orchestrator,
            watchdog,
            cfg.inference_restart_on_failure,
        )
        watchdog.on_failure = restarter.on_failure
        orchestrator.server_recovery = restarter.recover
        asyncio.run(closing_clients(run_watched(orchestrator.run(), watchdog), clients))
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        # runs to its end whatever signals arrive meanwhile; an interrupted run does not wait for
        # busy actors to finish what they were doing
        grace_s = 5.0 if status == "interrupted" else 30.0
        with stop_signals.deferred():
            try:  # the actors' last lines, before they are stopped
                logs.close(timeout_s=grace_s)
            except Exception as err:  # noqa: BLE001 - the rest of the shutdown must run
                log.warning("the last log lines were not collected: %s: %s", type(err).__name__, err)
            for group in (servers, trainers, node_metrics):
                if group is not None:
                    group.shutdown(timeout_s=grace_s)
            if placement is not None:  # after the actors that ran in them
                placement.release()
            if trace_receiver is not None:  # after the servers: their exporters flush as they stop
                trace_receiver.stop()
            if code_snapshot is not None:
                code_snapshot.join(CODE_SNAPSHOT_WAIT_S)
            if wandb_sink is not None and cfg.wandb_upload_code and code_taken:
                wandb_sink.upload_code(code_taken[0])
            for sink in sinks:
                sink.close()
            try:
                store.close(status)
            finally:
                ray_host.close(ray_settings.shuts_down(connection))
    return paths.root


class StartupEvents:
    """The start of a run as orchestrator instants in the run store (docs/metrics.md#timeline-events)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def mark(self, name: str, at: float | None = None) -> None:
        now = time.time() if at is None else at
        self.store.log_event(TimelineEvent(name, now, now, "orchestrator", {}), step=0)


def start_trace_receiver(cfg: RefractorConfig, engine: str, single_node: bool) -> OtlpTraceReceiver | None:
    """The receiver of vLLM's request spans (``enable_vllm_tracing``; docs/metrics.md#latency), in this
    process: on loopback when the cluster is one node, else on this node's address, which the
    servers' nodes reach. None for the native engine, which returns each request's latency itself."""
    if engine != "vllm" or not cfg.enable_vllm_tracing:
        return None
    from ray.util import get_node_ip_address

    from refractor.runtime.cluster import LOOPBACK
    from refractor.telemetry.otlp import OtlpTraceReceiver

    host = LOOPBACK if single_node else get_node_ip_address()
    receiver = OtlpTraceReceiver(host, cfg.otlp_receiver_port)
    log.info("vLLM's request spans go to the OTLP receiver at %s", receiver.endpoint)
    return receiver


def start_log_collector(store: RunStore, paths: RunPaths) -> LogCollector:
    """Record this process's logging (component ``driver``, ``orchestrator`` for the orchestrator's
    loggers) from now on; trainer ranks and servers are added as they are created
    (docs/run-store.md#logs)."""
    from ray.util import get_node_ip_address

    from refractor.runtime.log_collector import LogCollector
    from refractor.telemetry.log_capture import ProcessLogs
    from refractor.telemetry.log_files import LogFileCopies

    node = get_node_ip_address()
    driver = ProcessLogs(
        "driver",
        None,
        node,
        capture_streams=False,
        logger_components={"refractor.orchestrator": "orchestrator"},
    )
    return LogCollector(driver, store.log_lines, LogFileCopies(paths.logs, local_node=node), store.log_event)


def start_code_snapshot(
    cfg: RefractorConfig, config_path: str | Path | None, store: RunStore, keep=None
) -> threading.Thread:
    """Record the run's code in the run store from a thread, beside the start
    (docs/run-store.md#code-snapshot). The project is the config file's folder, or the working
    directory for a config given without a file or read from inside ``run_dir`` (a rerun of a
    run's saved config.yaml); run and checkpoint directories are never taken."""
    from refractor.telemetry.code_snapshot import CodeLimits, record_code_snapshot

    skip = [Path(cfg.run_dir).resolve()]
    if cfg.checkpoint_dir is not None:
        skip.append(Path(cfg.checkpoint_dir).resolve())
    project = Path.cwd()
    if config_path is not None:
        config_folder = Path(config_path).resolve().parent
        if not config_folder.is_relative_to(skip[0]):
            project = config_folder
    thread = threading.Thread(
        target=record_code_snapshot,
        args=(store, project, lambda: user_code_folders(cfg), CodeLimits.from_config(cfg), skip, keep),
        name="refractor-code-snapshot",
        daemon=True,
    )
    thread.start()
    return thread


def user_code_folders(cfg: RefractorConfig) -> dict[str, Path]:
    """The folder of every environment and dedicated eval the run loads from a user folder (installed
    packages and built-ins are not snapshotted), as ``env:<name>`` / ``eval:<name>``."""
    from refractor.envs.registry import discover
    from refractor.evals.registry import discover_evals

    envs = discover()
    evals = discover_evals()
    folders = {}
    for entry in cfg.evals:
        spec = evals.get(entry.name)
        if spec is not None and spec.source == "folder":
            folders[f"eval:{entry.name}"] = spec.folder
    # an eval that is no dedicated eval is the environment of that name
    for name in [e.name for e in cfg.environments] + [e.name for e in cfg.evals if e.name not in evals]:
        spec = envs.get(name)
        if spec is not None and spec.source == "folder":
            folders[f"env:{name}"] = Path(spec.location)
    return folders


def _start_side_by_side(servers, trainers, mark: Callable[[str], None]):
    """Boot the servers and the trainer ranks in parallel; returns the servers' infos and the
    ranks'; ``mark`` gets ``inference_servers_ready`` and ``trainer_ready`` as each is. Interrupted,
    it does not wait for the boots (the caller kills their actors, which ends them)."""

    def boot(start, event):
        out = start()
        mark(event)
        return out

    pool = ThreadPoolExecutor(2, thread_name_prefix="boot")
    try:
        server_future = pool.submit(boot, servers.start, "inference_servers_ready")
        trainer_future = pool.submit(boot, trainers.setup, "trainer_ready")
        infos = server_future.result()
        return infos, trainer_future.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


async def run_watched(main: Awaitable[None], watchdog: ServerWatchdog) -> None:
    """Run ``main`` beside the watchdog. A dead or hung server cancels ``main`` (its cleanup runs) and
    fails the run with the server's name; when ``main`` fails first, a dead server process is
    reported as the cause (a weight sync or a request to it is usually what failed)."""
    main_task = asyncio.ensure_future(main)
    dog_task = asyncio.ensure_future(watchdog.watch())
    try:
        await asyncio.wait({main_task, dog_task}, return_when=asyncio.FIRST_COMPLETED)
        if dog_task.done() and not main_task.done():
            main_task.cancel()
            await asyncio.gather(main_task, return_exceptions=True)
            dog_task.result()
        err = main_task.exception()
        if err is not None and not isinstance(err, KeyboardInterrupt):
            cause = await watchdog.diagnose()
            if cause is not None:
                raise type(cause)(f"{cause}\nWhat failed then: {err}") from err
        main_task.result()
    finally:
        dog_task.cancel()
        main_task.cancel()
        await asyncio.gather(main_task, dog_task, return_exceptions=True)


async def closing_clients(main: Awaitable[None], clients: list[InferenceClient]) -> None:
    """Run ``main``, then close the clients' connections in the same event loop, which owns them."""
    try:
        await main
    finally:
        for client in clients:
            await client.close()


def write_config_file(cfg: RefractorConfig, paths: RunPaths) -> None:
    """The resolved config as YAML in the run directory: rerun with
    `refractor train --config <run>/config.yaml`."""
    from refractor.config.loader import config_to_dict

    path = paths.root / ("config.yaml" if cfg.resume_from_checkpoint is False else "config.resumed.yaml")
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _http_servers(infos, cfg, control_token: str):
    from refractor.inference.client import InferenceClient, connections_for_lanes

    return [
        InferenceClient(
            info.url,
            name=info.name,
            # the served name: on vLLM with lora_sync: adapter, the name of the pushed adapter
            model=cfg.model,
            timeout_s=float(cfg.ray_placement_timeout_s),
            control_token=control_token,
            max_connections=connections_for_lanes(cfg.lanes_per_server),
        )
        for info in infos
    ]
