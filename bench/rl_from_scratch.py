"""RL from scratch on one machine: SFT bases, then GRPO against a control and other algorithms.

Stage 1 trains candidate base models with ``bench/sft_base.py`` side by side, one per GPU: they
differ in the countdown problems' difficulty and in whether the worked solutions show a search
(rejected tries before the solution). The candidate whose held-out greedy accuracy is nearest 25%
becomes the base (RL needs room both ways). Stage 2 trains that base with
``configs/examples/countdown_from_scratch.yaml`` through ``run_training`` (the code behind
``refractor train``), the runs spread over the GPUs given (``--gpus 0,0,0`` puts three on one card),
each with the same wall-clock budget (``max_train_minutes``: a run ends itself, final eval
included): GRPO, the same with ``learning_rate: 0`` (the control: evals must not move), and other
algorithms. Stage 3 reads the run stores and writes a table and a PNG of training reward and
held-out pass@1 / pass@8 per step (temperature 1), with the held-out greedy accuracy of each run's
start and end: RL sharpens sampling, so a temperature-1 gain can exceed what greedy decoding gains.

    python bench/rl_from_scratch.py all --out /tmp/rfs --gpus 0,1,2,3 --sft-minutes 4 --rl-minutes 5
    python bench/rl_from_scratch.py sft --out /tmp/rfs --gpus 0,1,2,3
    python bench/rl_from_scratch.py rl --out /tmp/rfs --base /tmp/rfs/easy3 --gpus 0,1,2,3 --rl-minutes 5
    python bench/rl_from_scratch.py report --out /tmp/rfs

``score`` scores model folders (a base, handed-off policies) on more held-out problems, on any machine:
    python bench/rl_from_scratch.py score --out /tmp/score --eval 2000 --models .rfs-all/base .rfs-all/grpo
    python bench/rl_from_scratch.py score --out /tmp/score --eval 2000 --temperature 1 --samples 4 --models X

Runs longer than one device call (10 minutes) go in segments on the same warm machine: each run ends
its segment with a checkpoint, and ``rl --resume`` continues every run from it (the base is read back
from the SFT summary; each segment's final eval is a point of the held-out curve):

    python bench/rl_from_scratch.py all --out /tmp/rfs --gpus 0,0,0 --candidates std --rl-minutes 5.5 \
        --rl-steps 500 --overrides '{"ray_address": "", "kv_cache_memory_gb": 4}'
    python bench/rl_from_scratch.py rl --out /tmp/rfs --gpus 0,0,0 --rl-minutes 9 --rl-steps 500 --resume \
        --overrides '{"ray_address": "", "kv_cache_memory_gb": 4}'

A machine is not kept between calls for long (30 s idle), so a run can also go from one machine to the
next: ``--handoff DIR`` ends a call by writing each run's policy (bfloat16, the engine's precision) to
``DIR/<run>`` with its curve so far, and the base to ``DIR/base``; the next call, on any machine, carries
that folder in and continues with ``--continue-from DIR``: each run from its policy (a fresh optimizer,
the next training problems), a run without a policy there from the base; the report joins the segments:
    python bench/rl_from_scratch.py all --out /tmp/rfs --gpus 0 --runs grpo --candidates std \
        --rl-minutes 5 --rl-steps 2000 --handoff /tmp/handoff --overrides '{"ray_address": ""}'
    python bench/rl_from_scratch.py rl --out /tmp/rfs --gpus 0,0 --runs grpo,control --rl-minutes 9 \
        --rl-steps 2000 --continue-from .rfs --handoff /tmp/handoff --overrides '{"ray_address": ""}'
A CPU test runs the stages at toy scale (tests/runtime/test_rl_from_scratch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "examples" / "countdown_from_scratch.yaml"
CANDIDATES = {  # name -> sft_base.py arguments: problem difficulty, searched solutions, eval length
    "easy3": ["--numbers", "3,3", "--max-number", "20", "--max-target", "100", "--max-tokens", "96"],
    "easy3_search": [
        *("--numbers", "3,3", "--max-number", "20", "--max-target", "100"),
        *("--attempts", "3", "--max-tokens", "192"),
    ],
    "mid3_search": [
        *("--numbers", "3,3", "--max-number", "50", "--max-target", "500"),
        *("--attempts", "3", "--max-tokens", "192"),
    ],
    "std": ["--numbers", "3,4", "--max-tokens", "96"],
    "std_search": ["--numbers", "3,4", "--attempts", "4", "--max-tokens", "256"],
}
# easy3 / easy3_search / mid3_search bases scored 64.5% / 60.5% / 48.0% held-out after 1,200 steps on an H100
# (bench/RESULTS.md): above the range RL is meant to start from, so the harder problems come first.
DEFAULT_CANDIDATES = "mid3_search,std,std_search"
RUNS = {  # name -> config overrides on top of the example config
    "grpo": {"algorithm": "grpo"},
    "control": {"algorithm": "grpo", "learning_rate": 0.0},
    "dr_grpo": {"algorithm": "dr_grpo"},
    "cispo": {"algorithm": "cispo"},
    "grpo_lr1e-4": {"algorithm": "grpo", "learning_rate": 1e-4},
    # past the stable step size (it lowers held-out accuracy; bench/RESULTS.md): the upper bracket
    "grpo_lr2e-4": {"algorithm": "grpo", "learning_rate": 2e-4},
    # twice the prompts per step at twice the step size: a native server decodes all of a step's
    # samples at once and a model this small pays per decode step, so on a GPU a batch twice as
    # large should cost well under twice the time, and its gradient's lower noise is what a
    # larger step needs
    "grpo_b64": {
        "algorithm": "grpo",
        "prompts_batch_size_for_trainer": 64,
        "max_concurrent_prompts_per_server": 128,
        "learning_rate": 1e-4,
    },
}
DEFAULT_RUNS = "grpo,control,dr_grpo,grpo_lr1e-4"  # one per GPU of a 4-GPU machine
TARGET_ACCURACY = 0.25
EVAL_SEED = 1  # the held-out problems (the config's evals); training problems: seed 0, then SEGMENT_SEED * k
SEGMENT_SEED = 1000
HANDOFF = "handoff.json"
# the server's gauges the report averages over the training loop (the run store's system metrics)
SERVER_GAUGES = (
    "requests_running",
    "requests_waiting",
    "engine_step_ms",
    "engine_busy_fraction",
    "generation_tokens_per_s",
)
HANDOFF_MINUTES = 0.5  # the report (greedy evals included) and the export of every run's policy
CHECKPOINT_NEVER_ON_SCHEDULE = 1_000_000
RUN_OVERHEAD_MINUTES = 1.5  # an RL run's start-up and evals around its time-budgeted training loop


def run_in_parallel(
    commands: dict[str, list[str]], gpus: list[str], deadline: float, logs: Path, stagger_s: float = 0.0
) -> dict:
    """Each command on a GPU of its own (round robin), stopped at ``deadline`` (SIGTERM, then SIGKILL).
    ``stagger_s`` apart: runs that each start a local Ray cluster do not race for its ports."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for i, (name, cmd) in enumerate(commands.items()):
        if i:
            time.sleep(stagger_s)
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    codes = {}
    while procs and time.time() < deadline:
        for name, (proc, log) in list(procs.items()):
            if proc.poll() is not None:
                codes[name] = proc.returncode
                log.close()
                del procs[name]
        time.sleep(1)
    for name, (proc, log) in procs.items():  # out of time: stop, the run store keeps what it recorded
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        codes[name] = f"stopped at the deadline ({proc.returncode})"
        log.close()
    return codes


def stage_sft(args) -> Path:
    names = args.candidates.split(",")
    commands = {
        name: [
            sys.executable,
            str(ROOT / "bench" / "sft_base.py"),
            *("--out", str(args.out / name), "--size", args.size, "--steps", str(args.sft_steps)),
            *("--eval", str(args.eval), "--eval-at", str(args.sft_steps // 2)),
            *(["--device", "cpu"] if args.cpu else []),
            *args.sft_extra,
            *CANDIDATES[name],
        ]
        for name in names
    }
    codes = run_in_parallel(commands, args.gpus, time.time() + args.sft_minutes * 60, args.out / "logs")
    summaries = {}
    for name in names:
        path = args.out / name / "sft_summary.json"
        summaries[name] = json.loads(path.read_text()) if path.is_file() else {"exit": codes.get(name)}
    (args.out / "sft_candidates.json").write_text(json.dumps(summaries, indent=1))
    scored = {n: s for n, s in summaries.items() if "accuracy_at_step" in s}
    for name, s in summaries.items():
        print(f"SFT {name}: exit {codes.get(name)}, held-out accuracy by step {s.get('accuracy_at_step')}")
    if not scored:
        raise SystemExit("no SFT candidate finished")
    best = pick_base(scored)
    print(f"base: {best} (held-out greedy accuracy {final_accuracy(scored[best]):.3f})")
    return args.out / best


def final_accuracy(summary: dict) -> float:
    by_step = summary["accuracy_at_step"]
    return by_step[max(by_step, key=int)]


def sft_args(model: Path) -> dict:
    """The ``sft_base.py`` arguments a model folder was trained with (its problems' shape, eval length)."""
    return json.loads((model / "sft_summary.json").read_text())["args"]


def run_overrides(base: Path, run: str, run_dir: Path, steps: int, extra: dict, train_seed: int = 0) -> dict:
    """The example config's overrides for one run: the base, its problems' difficulty and length.
    ``train_seed``: the training problems' seed (a continued run's next segment gets problems it has
    not trained on); the held-out problems are always those of ``EVAL_SEED``."""
    if train_seed == EVAL_SEED:
        raise ValueError(f"training seed {train_seed} is the held-out problems' seed")
    sft = sft_args(base)
    shape = sft["shape"]
    return {
        "model": str(base),
        "run_dir": str(run_dir),
        "run_name": run,
        "number_of_steps": steps,
        # a checkpoint only where the run ends (its last step or its time budget): a later segment
        # resumes from it (--resume)
        "checkpoint_every": CHECKPOINT_NEVER_ON_SCHEDULE,
        "max_tokens": sft["max_tokens"],
        "environments": [
            {
                "name": "countdown",
                "reward_min": 0,
                "reward_max": 2,
                "kwargs": {"dataset_name": "procedural", "seed": train_seed, **shape},
            }
        ],
        "evals": [
            {
                "name": "countdown",
                "eval_every": extra.pop("eval_every", 10),
                "num_samples": extra.pop("eval_samples", 200),
                "pass_k": {"at_k": {"metrics": ["_equation_reward"], "k": [1, 8]}},
                "temperature": 1.0,
                "kwargs": {"dataset_name": "procedural", "seed": EVAL_SEED, **shape},
            }
        ],
        **extra,
        **RUNS[run],  # last: the control's learning rate 0 wins over a learning rate for every run
    }


def stage_train_one(args) -> None:
    from refractor.config import load_config
    from refractor.train import run_training

    extra = json.loads(args.overrides)
    if args.resume:  # the next segment of a run that ended on its time budget with a checkpoint
        extra["resume_from_checkpoint"] = True
    overrides = run_overrides(args.base, args.run, args.out / "runs", args.rl_steps, extra, args.train_seed)
    cfg = load_config(CONFIG, overrides)
    run_training(cfg, quiet=True, overwrite=not args.resume)


def pick_base(scored: dict[str, dict]) -> str:
    """The scored candidate whose held-out accuracy is nearest the target."""
    return min(scored, key=lambda n: abs(final_accuracy(scored[n]) - TARGET_ACCURACY))


def chosen_base(out: Path) -> Path:
    """The SFT stage's pick, read back from its summary (for the ``rl`` stage without ``--base``)."""
    summary = out / "sft_candidates.json"
    if not summary.is_file():  # e.g. a resume on a machine other than the one the SFT stage ran on
        raise SystemExit(
            f"no SFT summary at {summary}: run the sft (or all) stage in {out} first, or pass --base"
        )
    summaries = json.loads(summary.read_text())
    scored = {n: s for n, s in summaries.items() if "accuracy_at_step" in s}
    if not scored:
        raise SystemExit(f"no scored SFT candidate in {out / 'sft_candidates.json'}: pass --base")
    return out / pick_base(scored)


def earlier_segments(args, run: str) -> dict | None:
    """The hand-off ``run`` continues from (``--continue-from``), or None for a run that starts here."""
    if args.continue_from is None:
        return None
    path = args.continue_from / run / HANDOFF
    return json.loads(path.read_text()) if path.is_file() else None


def segment_seed(handoff: dict | None) -> int:
    """The training problems' seed of the segment after ``handoff`` (0: a run's first segment)."""
    return 0 if handoff is None else SEGMENT_SEED * len(handoff["series"]["segments"])


def steps_in(series: dict) -> int:
    """The steps a run has taken over all its segments."""
    return sum(segment["steps"] for segment in series["segments"])


def start_of(args, run: str, base: Path) -> tuple[Path, int]:
    """Where ``run``'s segment starts: the model folder and the training problems' seed."""
    handoff = earlier_segments(args, run)
    if handoff is not None:
        return args.continue_from / run, segment_seed(handoff)
    if not (base / "config.json").is_file():
        raise SystemExit(f"{run}: no hand-off in {args.continue_from} and no base model at {base}")
    return base, 0


def stage_rl(args, base: Path) -> list[str]:
    """Every run, side by side; the names of those that did not end on their own (their logs say why)."""
    names = args.runs.split(",")
    starts = {name: start_of(args, name, base) for name in names}
    stagger_s = 8.0

    def overrides(index: int) -> dict:
        # each run ends itself (final eval included) before the wall-clock deadline stops it from
        # outside: start-up, the baseline eval and the final eval take about a minute and a half,
        # and the run started `index` staggers after the first has that much less time
        budget = args.rl_minutes - RUN_OVERHEAD_MINUTES - index * stagger_s / 60
        return {"max_train_minutes": max(budget, 0.5), **json.loads(args.overrides)}

    commands = {
        name: [
            sys.executable,
            str(Path(__file__).resolve()),
            "train-one",
            *("--out", str(args.out), "--base", str(starts[name][0]), "--run", name),
            *("--train-seed", str(starts[name][1])),
            *("--rl-steps", str(args.rl_steps), "--overrides", json.dumps(overrides(i))),
            *(["--resume"] if args.resume else []),
        ]
        for i, name in enumerate(names)
    }
    deadline = time.time() + args.rl_minutes * 60
    codes = run_in_parallel(commands, args.gpus, deadline, args.out / "logs", stagger_s=stagger_s)
    for name in names:
        print(f"RL {name}: exit {codes.get(name)}")
    return [name for name in names if codes.get(name) != 0]


def series(run_dir: Path) -> dict:
    """Per step: the training reward (equation reward, mean) and the held-out pass@1 / pass@8."""
    from refractor.telemetry.query import RunReader

    with RunReader(run_dir) as reader:
        steps = reader.step_metrics()
        # where a weight push's time goes (pause, the servers' receive, finish, resume): generation
        # stops for the whole pause, so it is time the step's next batch is not sampled
        pushes = reader.rows(
            "SELECT name, AVG(end - start) AS seconds FROM events"
            " WHERE name = 'weight_sync' OR name LIKE 'weight_sync/%' GROUP BY name"
        )
        # the server between the first step and the final eval: lanes in use, engine step, tokens per second
        window = reader.rows(
            "SELECT (SELECT MIN(start) FROM events WHERE name = 'training_loop_start') AS a,"
            " (SELECT MIN(start) FROM events WHERE name = 'eval_final_start') AS b"
        )[0]
        server = reader.rows(
            "SELECT name, AVG(value) AS value FROM system_metrics WHERE source LIKE 'inference:%'"
            " AND name IN ("
            + ",".join("?" * len(SERVER_GAUGES))
            + ") AND time >= ? AND time <= ? GROUP BY name",
            (*SERVER_GAUGES, window["a"] or 0, window["b"] or float("inf")),
        )
    out = {"step": [], "train_reward": [], "eval_step": [], "pass@1": [], "pass@8": []}
    # the batch mean of the equation reward (its _max / _min / _std siblings say little per step)
    train_keys = sorted(
        {k for m in steps for k in m if k.endswith("_equation_reward_mean") and not k.startswith("eval/")}
    )
    train_key = min(train_keys, key=len) if train_keys else None
    for m in steps:
        if train_key in m:
            out["step"].append(m["step"])
            out["train_reward"].append(m[train_key])
        if "eval/countdown/pass@1/_equation_reward" in m:
            out["eval_step"].append(m["step"])
            out["pass@1"].append(m["eval/countdown/pass@1/_equation_reward"])
            out["pass@8"].append(m.get("eval/countdown/pass@8/_equation_reward"))
    out["train_key"] = train_key
    out["timing_step_total"] = [m["timing_step_total"] for m in steps if "timing_step_total" in m]
    # where a step's time goes (means over the steps): the time budget decides how many steps a run makes
    spans = sorted({k for m in steps for k in m if k.startswith("timing_") and isinstance(m[k], int | float)})
    out["timing_means"] = {k: round(statistics.fmean(m[k] for m in steps if k in m), 4) for k in spans}
    out["push_means"] = {row["name"]: round(row["seconds"], 4) for row in pushes}
    out["server_means"] = {row["name"]: round(row["value"], 3) for row in server}
    return out


def greedy_points(args, run_dir: Path, first_segment: bool) -> dict:
    """The run's held-out greedy accuracy on ``args.eval`` problems (the SFT stage's measure): of
    its last checkpoint (in bfloat16, as the engine samples) and, in a run's first segment, of the
    model it started from (step 0). The temperature-1 evals measure the policy's sampling, which RL
    also sharpens; greedy decoding measures what the policy knows, so the two gains can differ."""
    from refractor.telemetry.query import RunReader
    from refractor.trainer.checkpoint import checkpoint_path
    from refractor.trainer.convert import export_hf

    step = steps_done(run_dir)
    if not args.eval or not step:
        return {}
    with RunReader(run_dir) as reader:
        start = Path(reader.config()["model"])
    sft = sft_args(start)
    points = {"greedy_step": [], "greedy": []}
    with tempfile.TemporaryDirectory() as tmp:
        policy = export_hf(
            checkpoint_path(run_dir / "checkpoints", step), Path(tmp) / "policy", dtype="bfloat16"
        )
        for at, model in ([(0, start)] if first_segment else []) + [(step, policy)]:
            points["greedy_step"].append(at)
            points["greedy"].append(held_out_accuracy(model, args.eval, sft["max_tokens"], sft["shape"]))
    return points


def held_out_accuracy(
    model: Path, count: int, max_tokens: int, shape: dict, temperature: float = 0.0, samples: int = 1
) -> float:
    """``sft_base.py``'s held-out accuracy (greedy, or pass@1 at a temperature), on a GPU if there is one."""
    import torch
    from sft_base import held_out_accuracy as score  # bench/ is on the path: this script's folder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return score(model, count, device, max_tokens, shape, temperature, samples)


def steps_done(run_dir: Path) -> int:
    """The steps the run's policy has taken: its last checkpoint's step (0 without one)."""
    from refractor.trainer.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir / "checkpoints") or 0


def joined(before: dict, after: dict, offset: int) -> dict:
    """Two series as one run's, ``after``'s steps counted from ``offset``. A segment's first
    eval scores the policy it was handed (the last eval of the one before, up to bfloat16 rounding):
    both stay in the curve, so a hand-off that changed the policy would show."""
    out = {}
    for key in ("step", "eval_step", "greedy_step"):
        out[key] = before.get(key, []) + [offset + step for step in after.get(key, [])]
    for key in ("train_reward", "pass@1", "pass@8", "timing_step_total", "segments", "greedy"):
        out[key] = before.get(key, []) + after.get(key, [])
    out["train_key"] = after["train_key"] or before["train_key"]
    n_before, n_after = len(before["timing_step_total"]), len(after["timing_step_total"])

    def weighted(key: str) -> dict:
        """Means weighted by each side's steps, over the sides that have them."""
        a, b = before.get(key, {}), after.get(key, {})
        out = {}
        for k in sorted(a | b):
            parts = [(m[k], n) for m, n in ((a, n_before), (b, n_after)) if k in m]
            out[k] = round(sum(v * n for v, n in parts) / max(sum(n for _, n in parts), 1), 4)
        return out

    out["timing_means"] = weighted("timing_means")
    out["push_means"] = weighted("push_means")
    out["server_means"] = weighted("server_means")
    return out


def stage_report(args) -> dict:
    runs_dir = args.out / "runs"
    report = {}
    if not runs_dir.is_dir():  # every run failed before its store was made (their logs say why)
        print(f"no run stores in {runs_dir}: see {args.out / 'logs'}")
        return report
    for run_dir in sorted(p for p in runs_dir.iterdir() if (p / "run.db").is_file()):
        handoff = earlier_segments(args, run_dir.name)
        segment = {"steps": steps_done(run_dir), "train_seed": segment_seed(handoff)}
        here = {**series(run_dir), "segments": [segment], **greedy_points(args, run_dir, handoff is None)}
        if handoff is not None:
            here = joined(handoff["series"], here, steps_in(handoff["series"]))
        report[run_dir.name] = here
    (args.out / "rl_report.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| run | steps | s / step | train reward, first 5 -> last 5 steps "
        "| held-out pass@1 first -> last (step) | pass@8 first -> last | pass@1 gain (points) "
        "| held-out greedy first -> last (step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report.items():
        t = s["timing_step_total"]
        p1, p8, rw, gr = s["pass@1"], s["pass@8"], s["train_reward"], s.get("greedy", [])
        gain = 100 * (p1[-1] - p1[0]) if p1 else float("nan")
        greedy = f"{gr[0]:.3f} -> {gr[-1]:.3f} ({s['greedy_step'][-1]})" if gr else "-"
        lines.append(
            f"| {name} | {len(s['step'])} | {sum(t) / max(len(t), 1):.2f} | "
            f"{statistics.fmean(rw[:5]) if rw else float('nan'):.3f} -> "
            f"{statistics.fmean(rw[-5:]) if rw else float('nan'):.3f} | "
            f"{p1[0] if p1 else float('nan'):.3f} -> {p1[-1] if p1 else float('nan'):.3f} "
            f"({s['eval_step'][-1] if p1 else '-'}) | "
            f"{p8[0] if p8 and p8[0] is not None else float('nan'):.3f} -> "
            f"{p8[-1] if p8 and p8[-1] is not None else float('nan'):.3f} | {gain:+.1f} | {greedy} |"
        )
    for name, s in report.items():
        spans = ", ".join(f"{k.removeprefix('timing_')} {v:.2f}" for k, v in s["timing_means"].items())
        lines.append(f"\n{name}: mean seconds per step: {spans}")
        pushes = ", ".join(
            f"{k.removeprefix('weight_sync/')} {v:.3f}" for k, v in s.get("push_means", {}).items()
        )
        lines.append(f"\n{name}: mean seconds of a weight push's spans: {pushes}")
        server = ", ".join(f"{k} {v:g}" for k, v in s.get("server_means", {}).items())
        lines.append(f"\n{name}: the server while training (means): {server}")
    table = "\n".join(lines)
    (args.out / "rl_report.md").write_text(table + "\n")
    print(table)
    plot_report(report, args.out / "rl_from_scratch.png")
    return report


def plot_report(report: dict, path: Path) -> None:
    """The PNG of a report (``rl_report.json``): training reward per step, and held-out accuracy. A
    run's training reward is noisy step to step (32 prompts): a 25-step running mean goes over it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, s in report.items():
        line = left.plot(s["step"], s["train_reward"], alpha=0.3, linewidth=0.8)[0]
        window = min(25, len(s["train_reward"]))
        if window:
            mean = [
                statistics.fmean(s["train_reward"][i - window + 1 : i + 1])
                for i in range(window - 1, len(s["train_reward"]))
            ]
            left.plot(
                s["step"][window - 1 :], mean, color=line.get_color(), label=f"{name} ({window}-step mean)"
            )
        right.plot(s["eval_step"], s["pass@1"], marker="o", label=f"{name} pass@1")
        if s["pass@8"] and s["pass@8"][0] is not None:
            right.plot(s["eval_step"], s["pass@8"], linestyle="--", label=f"{name} pass@8")
        if s.get("greedy"):
            right.plot(s["greedy_step"], s["greedy"], marker="x", linestyle=":", label=f"{name} greedy")
    left.set(title="training reward (equation, mean)", xlabel="step")
    right.set(title="held-out accuracy (pass@k at temperature 1; greedy)", xlabel="step")
    left.legend()
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def stage_score(args) -> None:
    """Held-out accuracy of model folders (a base, a hand-off's policies) on ``--eval`` problems of the
    difficulty each was trained on (its ``sft_summary.json``): greedy, or pass@1 at ``--temperature``."""
    for model in args.models:
        sft = sft_args(model)
        accuracy = held_out_accuracy(
            model, args.eval, sft["max_tokens"], sft["shape"], args.temperature, args.samples
        )
        how = (
            f"pass@1 at temperature {args.temperature:g}, {args.samples} samples"
            if args.temperature
            else "greedy"
        )
        print(f"{model}: held-out {how}: {accuracy:.3f} ({args.eval} problems)")


def bfloat16_copy(model: Path, out: Path) -> None:
    """An HF model folder with its floating-point weights in bfloat16 (half the bytes to carry)."""
    from safetensors.torch import save_file

    from refractor.models.loading import iter_safetensors

    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.bfloat16() if v.is_floating_point() else v for k, v in iter_safetensors(model)}
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in model.iterdir():
        if file.is_file() and not file.name.startswith("model.safetensors") and file.suffix != ".safetensors":
            shutil.copy2(file, out / file.name)
    config = json.loads((out / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def stage_handoff(args, base: Path, report: dict) -> None:
    """Each run's policy (its last checkpoint, bfloat16) with its curve so far (``report``, whose
    segments say how far it got) in ``args.handoff/<run>``, and the base in ``args.handoff/base``:
    what a call on another machine continues from."""
    from refractor.trainer.checkpoint import checkpoint_path
    from refractor.trainer.convert import export_hf

    args.handoff.mkdir(parents=True, exist_ok=True)
    # a base that came from a hand-off is not handed back (the next call has it already)
    if (base / "config.json").is_file() and not (
        args.continue_from and base.is_relative_to(args.continue_from)
    ):
        bfloat16_copy(base, args.handoff / "base")
    for run in args.runs.split(","):
        run_dir = args.out / "runs" / run
        step = steps_done(run_dir)
        if not step or run not in report:
            print(f"{run}: no checkpoint to hand off")
            continue
        start, _ = start_of(args, run, base)
        out = args.handoff / run
        export_hf(checkpoint_path(run_dir / "checkpoints", step), out, dtype="bfloat16", overwrite=True)
        if start.resolve() != out.resolve():  # the problems' shape, for the next segment's config
            shutil.copy2(start / "sft_summary.json", out / "sft_summary.json")
        (out / HANDOFF).write_text(json.dumps({"run": run, "series": report[run]}, indent=1))
        print(f"{run}: handed off after {steps_in(report[run])} steps to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["all", "sft", "rl", "report", "train-one", "score"])
    ap.add_argument("--out", type=Path, required=True, help="working folder: bases, run stores, report")
    ap.add_argument("--gpus", default="", help="comma list of GPU indices, one job per GPU (round robin)")
    ap.add_argument("--candidates", default=DEFAULT_CANDIDATES, help=f"of {', '.join(CANDIDATES)}")
    ap.add_argument("--size", default="small", help="sft_base.py --size")
    ap.add_argument("--sft-steps", type=int, default=1200)  # ~150 s on an H100, then two held-out evals
    ap.add_argument("--sft-minutes", type=float, default=4.5)
    ap.add_argument("--sft-extra", default="", help="more sft_base.py arguments, space separated")
    ap.add_argument(
        "--eval",
        type=int,
        default=200,
        help="held-out problems scored greedily: after SFT, after each RL segment (0: none), by score",
    )
    ap.add_argument("--models", type=Path, nargs="*", default=[], help="score: model folders (sft_base.py's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="score: 0 greedy, else pass@1 at it")
    ap.add_argument("--samples", type=int, default=8, help="score: samples per problem at a temperature")
    ap.add_argument("--base", type=Path, help="the SFT base (rl, train-one): an sft_base.py output folder")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help=f"of {', '.join(RUNS)}")
    ap.add_argument("--run", help="train-one: the run's name")
    # an upper bound (and the LR schedule's horizon): the runs' training loops end on their time budget
    # (--rl-minutes less the start-up and evals)
    ap.add_argument("--rl-steps", type=int, default=100)
    ap.add_argument("--rl-minutes", type=float, default=5.0, help="wall-clock budget of every RL run")
    ap.add_argument("--overrides", default="{}", help="JSON of more config keys for every RL run")
    ap.add_argument("--cpu", action="store_true", help="SFT on the CPU (toy runs)")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="rl / train-one: continue each run from the checkpoint its last segment ended with "
        "(a longer run over several calls on one machine; the final eval of each segment is a point "
        "of the held-out curve)",
    )
    ap.add_argument(
        "--call-minutes",
        type=float,
        help="the whole invocation's budget (one device call): the RL stage gets at most what the SFT "
        "stage left of it, less the hand-off's time",
    )
    ap.add_argument("--train-seed", type=int, default=0, help="train-one: the training problems' seed")
    ap.add_argument(
        "--handoff",
        type=Path,
        help="all / rl: write each run's policy and curve, and the base, here for a later call to continue",
    )
    ap.add_argument(
        "--continue-from",
        type=Path,
        help="rl: a --handoff folder; each run continues from its policy there (a run without one "
        "starts from the base there)",
    )
    args = ap.parse_args()
    started = time.time()
    args.gpus = [g for g in args.gpus.split(",") if g]
    args.sft_extra = args.sft_extra.split()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "train-one":
        stage_train_one(args)
        return
    if args.stage == "score":
        stage_score(args)
        return
    if args.stage in ("all", "sft"):
        base = stage_sft(args)
    elif args.base:
        base = args.base
    else:
        base = args.continue_from / "base" if args.continue_from else chosen_base(args.out)
    if args.stage in ("all", "rl"):
        if args.call_minutes is not None:
            left = args.call_minutes - (time.time() - started) / 60 - HANDOFF_MINUTES
            args.rl_minutes = min(args.rl_minutes, left)
            print(f"RL budget: {args.rl_minutes:.2f} minutes")
        failed = stage_rl(args, base)
    else:
        failed = []
    if args.stage in ("all", "rl", "report"):
        report = stage_report(args)
        if args.handoff and args.stage != "report":
            stage_handoff(args, base, report)
    if failed:  # after the report and the hand-off: what the other runs did is kept
        raise SystemExit(f"RL runs that failed: {', '.join(failed)} (logs in {args.out / 'logs'})")


if __name__ == "__main__":
    main()
