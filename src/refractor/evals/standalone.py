"""``refractor eval``: the evals of a run, on saved models, without training
(docs/evals.md#standalone-evals).

Order: resolve what to evaluate (:mod:`refractor.evals.standalone_config`) -> run directory, its lock
and run store -> evals loaded -> once some prompt is left to run: Ray (connect or start), the
tokenizer, the prompts rendered once, one placement group for the servers -> for each model in
step order: convert a refractor checkpoint
to an HF directory under the run directory, start the servers on it (native or vLLM, as in
training), run the evals with the training eval runner, record the rows and ``eval/<name>/...``
metrics at the model's step, stop the servers, delete the converted copy -> a table of the results.

``resume``: the run store's eval rows are read first; a prompt whose completions are all stored for
a step is not run again, and that step's metrics are recomputed over stored and new completions.
Each prompt's rows are stored as soon as its completions are done (and again with its pass values
when the eval of that model ends), so an interrupted eval loses only the prompts in flight.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from refractor.config import RefractorConfig
from refractor.errors import RunSetupError
from refractor.evals.passk import SECTIONS, PassKSpec, aggregate
from refractor.evals.standalone_config import EvalTarget, StandaloneEvalKeys, resolve_targets
from refractor.orchestrator.eval_runner import (
    EvalIds,
    EvalResult,
    EvalRunner,
    EvalSetupError,
    EvalTask,
    LoadedEval,
    build_task,
    load_evals,
)
from refractor.records import EvalRollout

if TYPE_CHECKING:
    from refractor.runtime.cluster import RayConnection, RayHost, Reservation

log = logging.getLogger("refractor.evals")
COUNT_KEYS = ("num_prompts", "num_completions", "num_failed", "policy_version", "timing_total")


@dataclass(frozen=True)
class StoredCompletion:
    """An eval row already in the run store (what ``resume`` needs of it)."""

    step: int
    name: str
    prompt_index: int
    metrics: dict[str, float] | None  # None: a failed completion


@dataclass(frozen=True)
class EvalSummary:
    """One line of the printed table: an eval of one model."""

    step: int
    name: str
    metrics: dict[str, float]


# ------------------------------------------------------------------------------ resume (pure logic)
def without_pass_values(metrics: dict[str, float]) -> dict[str, float]:
    """A row's own metrics: the prompt's pass@k / pass^k values written into it are dropped."""
    return {k: v for k, v in metrics.items() if not k.startswith(tuple(SECTIONS.values()))}


def finished_prompts(
    stored: Sequence[StoredCompletion], needed: Mapping[str, int]
) -> set[tuple[int, str, int]]:
    """(step, eval, prompt index) of every prompt whose completions are all stored (``needed``:
    eval name -> completions per prompt)."""
    counts: dict[tuple[int, str, int], int] = defaultdict(int)
    for row in stored:
        counts[(row.step, row.name, row.prompt_index)] += 1
    return {key for key, n in counts.items() if key[1] in needed and n >= needed[key[1]]}


def combined_metrics(
    name: str,
    spec: PassKSpec,
    step: int,
    stored: Sequence[StoredCompletion],
    result: EvalResult | None,
    num_prompts: int,
) -> dict[str, float]:
    """Eval ``name``'s metrics at ``step`` over the stored completions of its finished prompts among
    the first ``num_prompts`` and the new ones of ``result``."""
    per_prompt: dict[int, list[dict[str, float] | None]] = defaultdict(list)
    done = finished_prompts(stored, {name: spec.num_completions})
    for row in stored:
        key = (step, name, row.prompt_index)
        if row.name == name and row.step == step and key in done and row.prompt_index < num_prompts:
            per_prompt[row.prompt_index].append(row.metrics)
    new = result.rollouts if result is not None else []
    for r in new:
        per_prompt[r.prompt_index].append(None if r.reason else without_pass_values(dict(r.sample_metrics)))
    agg = aggregate([per_prompt[i] for i in sorted(per_prompt)], spec)
    out = dict(result.metrics) if result is not None else {"policy_version": float(step)}
    for key in list(out):
        if key not in COUNT_KEYS:
            del out[key]
    return (
        out
        | agg.metrics
        | {
            "num_prompts": float(agg.num_prompts),
            "num_completions": float(agg.num_completions),
            "num_failed": float(agg.num_failed),
        }
    )


def read_stored(run_dir: Path) -> tuple[list[StoredCompletion], EvalIds]:
    """The eval rows of an existing run store, and id counters that continue after them."""
    from refractor.telemetry.query import RunReader

    ids = EvalIds()
    stored = []
    with RunReader(run_dir) as reader:
        for row in reader.rollouts(status="eval"):
            metrics = None if row["reason"] else without_pass_values(row["sample_metrics"])
            stored.append(StoredCompletion(row["step"], row["env"], row["prompt_index"], metrics))
            ids.next_rollout_id = max(ids.next_rollout_id, row["rollout_id"] + 1)
            ids.next_group_id = max(ids.next_group_id, row["group_id"] + 1)
    return stored, ids


# ------------------------------------------------------------------------------------------ driver
def run_standalone_evals(
    keys: StandaloneEvalKeys,
    cfg: RefractorConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
) -> tuple[Path, list[EvalSummary]]:
    """Evaluate every target; returns the run directory and one summary per (step, eval)."""
    from refractor.runtime.run_lock import RunLock, RunLockedError

    targets = resolve_targets(keys, cfg.model)
    run_name = cfg.run_name or time.strftime("eval-%Y%m%d-%H%M%S")
    root = Path(cfg.run_dir) / run_name
    db = root / "run.db"
    if resume and not db.exists():
        raise RunSetupError(f"--resume: {db} does not exist (check `run_name`/`run_dir`)")
    if db.exists() and not resume and not overwrite:
        raise RunSetupError(
            f"{root} already holds a run. Continue its evals with `--resume`, pick another `--run_name`, "
            "or pass `--overwrite` to replace it."
        )
    root.mkdir(parents=True, exist_ok=True)
    try:
        lock = RunLock.acquire(root)
    except RunLockedError as err:
        raise RunSetupError(str(err)) from None
    try:
        if db.exists() and not resume:
            for old in root.glob("run.db*"):
                old.unlink()
        try:
            loaded = load_evals(cfg.evals, {})
        except EvalSetupError as err:
            raise RunSetupError(str(err)) from None
        cfg = cfg.model_copy(update={"run_name": run_name})
        stored, ids = read_stored(root) if resume else ([], EvalIds())
        return root, _evaluate(keys, cfg, root, targets, loaded, stored, ids, quiet)
    finally:
        lock.release()


def _evaluate(
    keys: StandaloneEvalKeys,
    cfg: RefractorConfig,
    root: Path,
    targets: Sequence[EvalTarget],
    loaded: Sequence[LoadedEval],
    stored: Sequence[StoredCompletion],
    ids: EvalIds,
    quiet: bool,
) -> list[EvalSummary]:
    from refractor.orchestrator.eval_schedule import EvalResults
    from refractor.runtime.cluster import RayHost
    from refractor.telemetry.store import RunStore

    (root / "logs").mkdir(parents=True, exist_ok=True)
    store = RunStore(root, config=cfg.model_dump(mode="json"), run_name=cfg.run_name)
    store.set_meta({"kind": "eval", "eval_targets": [{"step": t.step, "path": str(t.path)} for t in targets]})
    needed = {e.entry.name: e.pass_k.num_completions for e in loaded}
    done = finished_prompts(stored, needed)
    todo = {  # step -> eval -> prompt indices still to run
        t.step: {
            e.entry.name: [i for i in range(e.num_prompts) if (t.step, e.entry.name, i) not in done]
            for e in loaded
        }
        for t in targets
    }
    ray_host = RayHost()
    servers: _Servers | None = None
    status = "failed"
    summaries: list[EvalSummary] = []
    results = EvalResults(store, [], time.time)
    try:
        for target in targets:
            if not quiet:
                print(f"refractor eval: step {target.step}: {target.path}", flush=True)
            got: dict[str, EvalResult] = {}
            if any(todo[target.step].values()):
                if servers is None:  # nothing to run (a finished eval resumed): no cluster at all
                    servers = _Servers.start(keys, cfg, root, targets[0], loaded, ray_host)
                tasks = [
                    replace(t, prompts=[p for p in t.prompts if p.index in set(todo[target.step][t.name])])
                    for t in servers.tasks
                ]
                results.event("eval_standalone_start", target.step, target.step, [])
                step = target.step
                ran = servers.run(  # each prompt's rows are stored once done: --resume skips it
                    cfg,
                    target,
                    [t for t in tasks if t.prompts],
                    ids,
                    root,
                    lambda rows, step=step: store.log_rollouts(rows, step, step),
                )
                results.event("eval_standalone_done", target.step, target.step, [])
                got = {r.name: r for r in ran}
            for e in loaded:
                name = e.entry.name
                result = got.get(name)
                previous = [s for s in stored if s.step == target.step and s.name == name]
                if result is None and not previous:
                    continue
                if previous:
                    metrics = combined_metrics(name, e.pass_k, target.step, stored, result, e.num_prompts)
                else:
                    metrics = result.metrics
                if result is not None:
                    store.log_rollouts(result.rollouts, target.step, target.step)
                store.log_step_metrics(target.step, {f"eval/{name}/{k}": v for k, v in metrics.items()})
                summaries.append(EvalSummary(target.step, name, metrics))
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        try:
            if servers is not None:
                servers.release()
            store.close(status)
        finally:
            ray_host.close(servers is not None and servers.shuts_down)
    return summaries


@dataclass
class _Servers:
    """The cluster side of an eval run: the Ray connection, the servers' placement group, the
    tokenizer-rendered eval tasks and the runner."""

    connection: RayConnection
    reservation: Reservation
    tasks: list[EvalTask]
    runner: EvalRunner
    control_token: str
    shuts_down: bool  # whether the end calls ray.shutdown() (ray_shutdown_on_exit, RaySettings.shuts_down)

    @classmethod
    def start(
        cls,
        keys: StandaloneEvalKeys,
        cfg: RefractorConfig,
        root: Path,
        first: EvalTarget,
        loaded: Sequence[LoadedEval],
        ray_host: RayHost,
    ) -> _Servers:
        from transformers import AutoTokenizer

        from refractor.inference.access import new_token
        from refractor.orchestrator.chat import run_chat_tokens
        from refractor.orchestrator.rollout import RolloutSettings
        from refractor.runtime.cluster import RaySettings

        tokenizers: list = []  # loads while the cluster starts
        ray_settings = RaySettings.from_config(cfg, run_dir=str(root))
        connection = ray_host.connect(
            ray_settings,
            meanwhile=lambda: tokenizers.append(AutoTokenizer.from_pretrained(first.tokenizer_dir)),
        )
        try:
            (tokenizer,) = tokenizers
            if cfg.chat_template is not None:
                tokenizer.chat_template = cfg.chat_template
            chat = run_chat_tokens(tokenizer, cfg.enable_thinking)
            base = RolloutSettings.from_config(cfg, tokenizer.eos_token or "")
            tasks = [build_task(e, chat, base) for e in loaded]
            lanes = keys.max_concurrent_samples_per_server or cfg.lanes_per_server
            return cls(
                connection,
                _reserve_servers(cfg),
                tasks,
                EvalRunner(chat, lanes),
                new_token(),
                ray_settings.shuts_down(connection),
            )
        except BaseException:  # the cluster this started stops with the failure
            ray_host.close(connection.started_local)
            raise

    def run(
        self,
        cfg: RefractorConfig,
        target: EvalTarget,
        tasks: list[EvalTask],
        ids: EvalIds,
        root: Path,
        on_prompt_done: Callable[[list[EvalRollout]], None],
    ) -> list[EvalResult]:
        return _run_target(
            cfg, target, tasks, self.runner, ids, self.reservation, root, self.control_token, on_prompt_done
        )

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.reservation.group)


def _reserve_servers(cfg: RefractorConfig) -> Reservation:
    import ray

    from refractor.runtime.cluster import reserve

    has_gpu = ray.cluster_resources().get("GPU", 0.0) > 0
    return reserve(
        "eval inference servers",
        cfg.num_inference_servers,
        cfg.ray_inference_cpus_per_worker,
        cfg.inference_tensor_parallel_size if has_gpu else 0,
        cfg.ray_inference_placement_strategy,
        cfg.ray_placement_timeout_s,
        "ray_inference_cpus_per_worker",
        "inference_num_workers",
        f"{cfg.run_name}-{secrets.token_hex(3)}",
        resources=dict(cfg.ray_inference_resources),
    )


def _run_target(
    cfg: RefractorConfig,
    target: EvalTarget,
    tasks: list[EvalTask],
    runner: EvalRunner,
    ids: EvalIds,
    reservation: Reservation,
    root: Path,
    control_token: str,
    on_prompt_done: Callable[[list[EvalRollout]], None],
) -> list[EvalResult]:
    """Serve one model on fresh servers, run ``tasks`` on them at the model's step, stop the servers."""
    from refractor.inference.client import InferenceClient, connections_for_lanes
    from refractor.runtime.server_group import RayServerGroup, choose_engine

    converted = None
    model_dir = target.path
    group = None
    try:
        if target.native:
            from refractor.trainer.convert import export_hf

            converted = root / "converted" / f"step_{target.step}"  # on the run's (shared) filesystem
            model_dir = export_hf(target.path, converted, overwrite=True)
        engine, why = choose_engine(cfg.inference_engine, str(model_dir))
        log.info("step %d: inference engine %s (%s)", target.step, engine, why)
        update: dict = {"model": str(model_dir)}
        if engine == "native" and cfg.max_num_seqs is None:  # every completion in flight on a server runs
            update["max_num_seqs"] = runner.lanes_per_server
        served = cfg.model_copy(update=update)
        group = RayServerGroup(
            served,
            reservation,
            engine,
            str(root / "logs"),
            control_token,
            gpu_memory_utilization=cfg.engine_memory_share(False),
        )
        infos = group.start()
        plan = runner.plan(tasks, target.step, ids)

        async def execute() -> list[EvalResult]:
            clients = [
                InferenceClient(
                    i.url,
                    name=i.name,
                    model=served.model,  # the served name (the adapter's with vLLM and lora_sync: adapter)
                    timeout_s=float(cfg.ray_placement_timeout_s),
                    control_token=control_token,
                    max_connections=connections_for_lanes(runner.lanes_per_server),
                )
                for i in infos
            ]
            try:
                return await runner.execute(plan, clients, target.step, on_prompt_done)
            finally:
                for client in clients:
                    await client.close()

        return asyncio.run(execute())
    finally:
        if group is not None:
            group.shutdown()
        if converted is not None:
            shutil.rmtree(converted, ignore_errors=True)


def print_summary(summaries: Sequence[EvalSummary], run_dir: Path) -> None:
    """One table per eval: a row per step, a column per metric (counts last)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    for name in dict.fromkeys(s.name for s in summaries):
        rows = [s for s in summaries if s.name == name]
        metrics = sorted({k for s in rows for k in s.metrics if k not in COUNT_KEYS})
        table = Table("step", *metrics, "prompts", "completions", "failed", title=f"eval {name}", box=None)
        for s in rows:
            table.add_row(
                str(s.step),
                *(f"{s.metrics[m]:.4g}" if m in s.metrics else "" for m in metrics),
                *(f"{s.metrics.get(k, 0):.0f}" for k in ("num_prompts", "num_completions", "num_failed")),
            )
        console.print(table)
    console.print(f"results stored in {run_dir / 'run.db'} (`refractor ui` shows them under evals)")
