"""A synthetic run store: a ``run.db`` of any size, written through the real schema and row builders.

For the dashboard's tests (small sizes) and its benchmark (a day-long run). Rows go in with
``executemany`` in one transaction per step instead of through the asynchronous writer, so a run of
250,000 rollouts takes minutes, not hours. Everything is seeded: the same spec gives the same rows.

    python -m refractor.telemetry.synthetic runs/big --steps 2000 --rollouts-per-step 125
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from refractor.records import EvalRollout, Rollout, RolloutStatus, TimelineEvent
from refractor.records.rollout import ToolCall, Turn
from refractor.telemetry.code_snapshot import CodeFile, CodeInfo, CodeRoot, CodeSnapshot
from refractor.telemetry.metrics import RolloutSummary, rollout_step_metrics
from refractor.telemetry.store import SCHEMA_VERSION, code_snapshot_rows, connect_writer, rollout_rows

ENVS = ("countdown", "math", "code_tools")
STOP_REASONS = ("stop", "stop", "stop", "length")
GPU_METRICS = ("gpu_utilization_percent", "gpu_memory_used_gb", "gpu_power_w", "gpu_temperature_c")
TRAINER_SPANS = ("forward", "loss_computation", "backward")


@dataclass(frozen=True)
class SyntheticSpec:
    steps: int = 20
    rollouts_per_step: int = 32
    group_size: int = 8
    step_metrics: int = 80  # names per step in all: the derived rollout metrics, then fillers
    trainer_ranks: int = 2
    microbatches: int = 4  # per rank and step, each a forward, loss and backward span
    step_seconds: float = 5.0
    system_seconds: int = 0  # seconds of 1 s GPU and CPU metrics (0: as long as the run)
    gpus: int = 2
    servers: int = 2
    lanes_per_server: int = 8
    multi_turn_fraction: float = 0.3  # share of groups whose rollouts call tools over three turns
    # share of groups discarded for max async or cancelled off-policy (half each); groups whose
    # rewards are all equal are discarded for zero advantage besides
    discard_fraction: float = 0.1
    eval_every: int = 10
    status: str = "finished"
    seed: int = 0
    start_time: float = 1_750_000_000.0


def write_synthetic_run(run_dir: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """Create ``run_dir/run.db`` (replacing one there) filled as ``spec`` says; returns ``run_dir``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        (run_dir / f"run.db{suffix}").unlink(missing_ok=True)
    conn = connect_writer(run_dir / "run.db")
    try:
        _write(conn, run_dir.name, spec)
    finally:
        conn.close()
    return run_dir


def _write(conn: sqlite3.Connection, run_name: str, spec: SyntheticSpec) -> None:
    rng = random.Random(spec.seed)
    t0 = spec.start_time
    _insert(conn, "INSERT OR REPLACE INTO meta VALUES (?, ?)", _meta_rows(run_name, spec))
    next_id = 0
    for step in range(spec.steps):
        step_start = t0 + step * spec.step_seconds
        rollouts = []
        for g in range(math.ceil(spec.rollouts_per_step / spec.group_size)):
            group_id = step * 10_000 + g
            rollouts += _group(rng, spec, step, group_id, next_id, step_start)
            next_id += spec.group_size
        kept = [r for r in rollouts if r.status == RolloutStatus.KEPT]
        dropped = [r for r in rollouts if r.status != RolloutStatus.KEPT]
        conn.execute("BEGIN")
        for sql, rows in rollout_rows(kept, step, step) + rollout_rows(dropped, step, step):
            conn.executemany(sql, rows)
        conn.executemany(
            "INSERT OR REPLACE INTO step_metrics VALUES (?, ?, ?, ?)",
            [
                (step, k, v, step_start + spec.step_seconds)
                for k, v in _step_metrics(rng, spec, step, rollouts)
            ],
        )
        events = _events(rng, spec, step, step_start, {r.group_id for r in rollouts})
        conn.executemany(
            'INSERT INTO events (name, component, step, start, "end", attrs) VALUES (?,?,?,?,?,?)',
            [(e.name, e.component, e.attrs.get("step"), e.start, e.end, json.dumps(e.attrs)) for e in events],
        )
        if spec.eval_every and (step + 1) % spec.eval_every == 0:
            _write_eval(conn, rng, spec, step + 1, next_id, step_start)
            next_id += 8
        conn.execute("COMMIT")
    _write_system_metrics(conn, rng, spec)
    _write_code_snapshot(conn, spec)


def _write_code_snapshot(conn: sqlite3.Connection, spec: SyntheticSpec) -> None:
    """Two small files; the learning rate in the config differs with the seed (code diffs)."""
    texts = {
        "train.yaml": f"model: synthetic/tiny-model\nlr: 1.0e-6\nseed: {spec.seed}\n",
        "environments/countdown/env.py": "def reward(text, answer):\n    return float(answer in text)\n",
    }
    files = [
        (
            CodeFile("project", path, len(text.encode()), hashlib.sha256(text.encode()).hexdigest()),
            text.encode(),
        )
        for path, text in sorted(texts.items())
    ]
    info = CodeInfo(
        roots=[CodeRoot("project", "/synthetic/project", None)],
        taken_at=spec.start_time,
        file_count=len(files),
        total_bytes=sum(f.size for f, _ in files),
    )
    conn.execute("BEGIN")
    for sql, rows in code_snapshot_rows(CodeSnapshot(info, files, [])):
        conn.executemany(sql, rows)
    conn.execute("COMMIT")


def _insert(conn: sqlite3.Connection, sql: str, rows: list[tuple]) -> None:
    conn.execute("BEGIN")
    conn.executemany(sql, rows)
    conn.execute("COMMIT")


def _meta_rows(run_name: str, spec: SyntheticSpec) -> list[tuple[str, str]]:
    config = {
        "model": "synthetic/tiny-model",
        "algorithm": "grpo",
        "loss_type": "grpo",
        "learning_rate": 1e-6,
        "group_size": spec.group_size,
        "number_of_steps": spec.steps,
        "inference_engine": "native",
        "seed": spec.seed,
        "environments": [{"name": e, "reward_min": 0, "reward_max": 1} for e in ENVS],
    }
    topology = {
        "schema_version": 1,
        "machines": [
            {
                "address": "10.0.0.1",
                "hostname": "synthetic-node",
                "cpu_count": 32,
                "memory_gb": 256.0,
                "packages": {"refractor": "0.1.0", "torch": "2.13.0"},
                "gpus": [{"index": i, "name": "Synthetic GPU", "memory_gb": 80.0} for i in range(spec.gpus)],
            }
        ],
        "inference": {
            "engine": "native",
            "servers": [
                {"name": f"server-{i}", "url": f"http://10.0.0.1:{8100 + i}", "node": "10.0.0.1"}
                for i in range(spec.servers)
            ],
        },
        "trainer": {
            "world_size": spec.trainer_ranks,
            "ranks": [
                {"rank": r, "device": f"cuda:{r}", "node": "10.0.0.1"} for r in range(spec.trainer_ranks)
            ],
        },
        "model": {
            "name": "synthetic/tiny-model",
            "architectures": ["Qwen2ForCausalLM"],
            "num_parameters": 1000,
        },
    }
    meta = {
        "schema_version": SCHEMA_VERSION,
        "run_name": run_name,
        "created_at": spec.start_time,
        "status": spec.status,
        "config": config,
        "engine": "native",
        "topology": topology,
    }
    if spec.status != "running":
        meta["finished_at"] = spec.start_time + spec.steps * spec.step_seconds
    return [(k, json.dumps(v)) for k, v in meta.items()]


def _text(rng: random.Random, tokens: int) -> str:
    words = ("the", "sum", "of", "numbers", "is", "we", "check", "each", "step", "so", "answer", "gives")
    return " ".join(rng.choice(words) for _ in range(max(1, tokens)))


def _group(
    rng: random.Random, spec: SyntheticSpec, step: int, group_id: int, first_id: int, step_start: float
) -> list[Rollout]:
    env = ENVS[group_id % len(ENVS)]
    tools = env == "code_tools" or rng.random() < spec.multi_turn_fraction / 2
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    prompt = f"Compute ${a} \\times {b}$ and show your work.\n\n**Format:** end with `Answer: <n>`."
    p_success = min(0.95, 0.1 + step / max(1, spec.steps))  # the reward climbs over the run
    fate = rng.random()
    out = []
    for k in range(spec.group_size):
        server = rng.randrange(spec.servers)
        lane = rng.randrange(spec.lanes_per_server)
        dispatch = step_start - spec.step_seconds * rng.uniform(0.2, 0.9)
        turns = _turns(rng, a * b, tools, dispatch, step)
        correct = rng.random() < p_success
        reward = 1.0 if correct else 0.0
        r = Rollout(
            rollout_id=first_id + k,
            group_id=group_id,
            sample_idx=k,
            env_name=env,
            prompt_index=group_id % 997,
            prompt_ordinal=group_id,
            prompt_text=prompt,
            system_prompt="You are a careful assistant. Think inside <think></think> first.",
            turns=turns,
            prompt_ids=[1] * rng.randint(30, 90),
            first_start_version=max(0, step - rng.randint(0, 1)),
            off_policy_steps=rng.randint(0, 2),
            stop_reason=rng.choice(STOP_REASONS),
            reward=reward,
            sample_metrics={"correct": reward, "format": float(rng.random() < 0.9)},
            golden_answers={"answer": str(a * b)},
            server=f"server-{server}",
            lane=lane,
            dispatch_time=dispatch,
            generation_end_time=turns[-1].end_time,
            reward_time=rng.uniform(0.001, 0.05),
            finish_time=turns[-1].end_time + 0.05,
        )
        out.append(r)
    rewards = [r.reward for r in out]
    mean = sum(rewards) / len(rewards)
    for r in out:
        r.advantage = r.reward - mean
    if len(set(rewards)) == 1 or fate < spec.discard_fraction / 2:
        reason = "zero_advantage" if len(set(rewards)) == 1 else "max_async"
        for r in out:
            r.mark(RolloutStatus.DISCARDED, reason)
    elif fate < spec.discard_fraction:
        for r in out:
            r.mark(RolloutStatus.CANCELLED, "off_policy")
    else:
        for r in out:
            r.mark(RolloutStatus.KEPT)
    return out


def _turns(rng: random.Random, answer: int, tools: bool, start: float, step: int) -> list[Turn]:
    count = 3 if tools else 1
    turns = []
    t = start
    for i in range(count):
        n = rng.randint(20, 300)
        last = i == count - 1
        if last:
            text = f"<think>{_text(rng, n // 2)}</think>\nThe product is $$x = {answer}$$\n\nAnswer: {answer}"
        else:
            text = f"<think>{_text(rng, n // 3)}</think>\nLet me run it.\n<tool_call>python</tool_call>"
        end = t + n * 0.01
        calls = (
            []
            if last
            else [
                ToolCall(
                    "python",
                    json.dumps({"code": f"print({answer} + {i})"}),
                    str(answer + i),
                    success=rng.random() < 0.9,
                    raw={"exit_code": 0, "truncated": False},
                )
            ]
        )
        env = [] if last else [{"role": "tool", "content": str(answer + i)}]
        turns.append(
            Turn(
                index=i,
                prompt_ids=[1] * 4,
                completion_ids=[2] * n,
                finish_reason="stop",
                completion_text=text,
                start_version=step,
                end_version=step,
                max_tokens=512,
                start_time=t,
                end_time=end,
                env_messages=env,
                env_time=0.0 if last else 0.05,
                tool_calls=calls,
            )
        )
        t = end + (0.0 if last else 0.05)
    return turns


def _step_metrics(
    rng: random.Random, spec: SyntheticSpec, step: int, rollouts: list[Rollout]
) -> list[tuple[str, float]]:
    summaries = [RolloutSummary.of(r) for r in rollouts]
    out = rollout_step_metrics(summaries)
    progress = step / max(1, spec.steps)
    train = spec.step_seconds * 0.8  # the trainer spans of _events fill 80% of the step
    out |= {
        "loss": 0.5 * math.exp(-3 * progress) + rng.gauss(0, 0.02),
        "grad_norm": 1.0 + rng.random(),
        "entropy": 1.5 - progress + rng.gauss(0, 0.02),
        "kl_divergence_inference": abs(rng.gauss(0.001, 0.0005)),
        "learning_rate": 1e-6,
        "timing_step_total": spec.step_seconds,
        "timing_waiting_for_data": rng.uniform(0, 1),
        "timing_weight_sync_total": spec.step_seconds * 0.15,
        "timing_data_to_device_total": train / (3 * spec.microbatches + 2),
        "timing_forward_total": train * spec.microbatches / (3 * spec.microbatches + 2),
        "timing_loss_computation_total": train * spec.microbatches / (3 * spec.microbatches + 2),
        "timing_backward_total": train * spec.microbatches / (3 * spec.microbatches + 2),
        "timing_optimizer_total": train / (3 * spec.microbatches + 2),
        "policy_version": float(step + 1),
    }
    filler = 0
    while len(out) < spec.step_metrics:
        out[f"trainer/extra/metric_{filler:03d}"] = math.sin(step / 10 + filler) + rng.gauss(0, 0.1)
        filler += 1
    return list(out.items())


def _events(
    rng: random.Random, spec: SyntheticSpec, step: int, step_start: float, groups: set[int]
) -> list[TimelineEvent]:
    out = []
    orch = "orchestrator"
    for g in sorted(groups):
        t = step_start - spec.step_seconds * rng.uniform(0.5, 1.0)
        out.append(TimelineEvent("inference_call", t, t, orch, {"group_id": g, "step": step}))
        t2 = t + spec.step_seconds * 0.4
        out.append(TimelineEvent("rollouts_group_done", t2, t2, orch, {"group_id": g, "step": step}))
    out.append(TimelineEvent("save_batch", step_start, step_start, orch, {"step": step}))
    train_end = step_start + spec.step_seconds * 0.8
    for rank in range(spec.trainer_ranks):
        t = step_start
        out.append(TimelineEvent("step", t, train_end, "trainer", {"step": step, "rank": rank}))
        span = (train_end - t) / (spec.microbatches * len(TRAINER_SPANS) + 2)
        out.append(TimelineEvent("data_to_device", t, t + span, "trainer", {"step": step, "rank": rank}))
        t += span
        for mb in range(spec.microbatches):
            for name in TRAINER_SPANS:
                attrs = {"step": step, "rank": rank, "microbatch": mb}
                out.append(TimelineEvent(name, t, t + span, "trainer", attrs))
                t += span
        out.append(TimelineEvent("optimizer", t, train_end, "trainer", {"step": step, "rank": rank}))
    sync_end = step_start + spec.step_seconds * 0.95
    out.append(
        TimelineEvent("weight_sync", train_end, sync_end, "trainer", {"step": step, "version": step + 1})
    )
    out.append(TimelineEvent("weight_update", sync_end, sync_end, orch, {"step": step, "version": step + 1}))
    return out


def _write_eval(
    conn: sqlite3.Connection, rng: random.Random, spec: SyntheticSpec, eval_step: int, first_id: int, t: float
) -> None:
    rows = []
    correct = []
    for k in range(8):
        ok = float(rng.random() < min(0.9, 0.2 + eval_step / max(1, spec.steps)))
        correct.append(ok)
        turns = _turns(rng, 42, False, t, eval_step)
        rows.append(
            EvalRollout(
                rollout_id=first_id + k,
                group_id=-eval_step * 100 - k // 4,
                sample_idx=k % 4,
                env_name="gsm8k_eval",
                prompt_text="What is 6 times 7?",
                turns=turns,
                prompt_ids=[1] * 10,
                stop_reason="stop",
                reward=ok,
                sample_metrics={"correct": ok},
                golden_answers={"answer": "42"},
                status=RolloutStatus.EVAL,
                step=eval_step,
            )
        )
    for sql, data in rollout_rows(rows, eval_step, eval_step):
        conn.executemany(sql, data)
    mean = sum(correct) / len(correct)
    metrics = {"correct": mean, "pass@4/correct": min(1.0, mean * 1.5), "num_prompts": 2.0}
    conn.executemany(
        "INSERT OR REPLACE INTO step_metrics VALUES (?, ?, ?, ?)",
        [(eval_step, f"eval/gsm8k_eval/{k}", v, t) for k, v in metrics.items()],
    )


def _write_system_metrics(conn: sqlite3.Connection, rng: random.Random, spec: SyntheticSpec) -> None:
    seconds = spec.system_seconds or int(spec.steps * spec.step_seconds)
    t0 = spec.start_time
    chunk = 3600
    for begin in range(0, seconds, chunk):
        rows = []
        for s in range(begin, min(seconds, begin + chunk)):
            t = t0 + s
            busy = 50 + 45 * math.sin(s / 30)
            for gpu in range(spec.gpus):
                values = (busy, 40 + gpu + busy / 10, 200 + 3 * busy, 50 + busy / 5)
                rows += [(t, f"gpu{gpu}", n, v, "10.0.0.1") for n, v in zip(GPU_METRICS, values, strict=True)]
            rows.append((t, "system", "cpu_utilization_percent", busy * 0.6, "10.0.0.1"))
            rows.append((t, "system", "system_memory_percent", 35 + rng.random(), "10.0.0.1"))
            if s % 5 == 0:
                for server in range(spec.servers):
                    src = f"inference:server-{server}"
                    rows.append((t, src, "requests_running", float(rng.randint(0, 32)), ""))
                    rows.append((t, src, "cache_usage", rng.random(), ""))
        _insert(conn, "INSERT INTO system_metrics (time, source, name, value, node) VALUES (?,?,?,?,?)", rows)


def main(
    run_dir: Path = typer.Argument(..., help="The run directory to create (its run.db is replaced)."),
    steps: int = typer.Option(SyntheticSpec.steps, help="Training steps."),
    rollouts_per_step: int = typer.Option(SyntheticSpec.rollouts_per_step, help="Rollouts per step."),
    group_size: int = typer.Option(SyntheticSpec.group_size, help="Rollouts per group."),
    step_metrics: int = typer.Option(SyntheticSpec.step_metrics, help="Metric names per step."),
    trainer_ranks: int = typer.Option(SyntheticSpec.trainer_ranks, help="Trainer ranks on the timeline."),
    microbatches: int = typer.Option(SyntheticSpec.microbatches, help="Micro-batches per rank and step."),
    step_seconds: float = typer.Option(SyntheticSpec.step_seconds, help="Wall seconds per step."),
    system_seconds: int = typer.Option(0, help="Seconds of 1 s system metrics (0: the run's length)."),
    gpus: int = typer.Option(SyntheticSpec.gpus, help="GPUs with metrics."),
    status: str = typer.Option("finished", help="The run's status (running, finished, failed)."),
) -> None:
    """Write a synthetic run store (for the dashboard's tests and benchmark)."""
    spec = SyntheticSpec(
        steps=steps,
        rollouts_per_step=rollouts_per_step,
        group_size=group_size,
        step_metrics=step_metrics,
        trainer_ranks=trainer_ranks,
        microbatches=microbatches,
        step_seconds=step_seconds,
        system_seconds=system_seconds,
        gpus=gpus,
        status=status,
    )
    began = time.perf_counter()
    write_synthetic_run(run_dir, spec)
    typer.echo(f"wrote {run_dir}/run.db in {time.perf_counter() - began:.1f}s")


if __name__ == "__main__":
    typer.run(main)
