"""`refractor train` end to end on CPU: Ray + inference server process + trainer rank + run store.

Every test starts a real local Ray cluster, a real server subprocess (native engine, or CPU vLLM)
and a real FSDP trainer rank, and reads its results back from the SQLite run store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refractor.config import load_config
from refractor.inference.process import ServerStartError
from refractor.telemetry.query import RunReader
from refractor.train import RunSetupError, run_training

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_ENVS = Path(__file__).parent / "envs"
QUICKSTART = ROOT / "configs" / "examples" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def _env_paths(monkeypatch):
    monkeypatch.setenv("REFRACTOR_ENV_PATH", os.pathsep.join([str(ROOT / "environments"), str(FIXTURE_ENVS)]))


def quick_cfg(tmp_path, **overrides):
    base = {"run_dir": str(tmp_path / "runs"), "run_name": "t", "number_of_steps": 3, "ray_address": ""}
    return load_config(QUICKSTART, {**base, **overrides})


def reward_means(run_dir) -> list[float]:
    with RunReader(run_dir) as reader:
        return [m["reward_sum_mean"] for m in reader.step_metrics(["reward_sum_mean"])]


@pytest.mark.slow
def test_three_async_steps_fill_the_run_store(quickstart_run, second_node_address):
    """The quick start on a two-node Ray cluster (tests/conftest.py): the server on the second node,
    the driver and the trainer rank on the head node; the store holds what each node did."""
    run_dir = quickstart_run
    second = second_node_address
    with RunReader(run_dir) as reader:
        steps = reader.step_metrics()
        assert [m["step"] for m in steps] == [0, 1, 2]
        for m in steps:
            for key in (
                "loss",
                "grad_norm",
                "entropy",
                "kl_divergence_inference",
                "reward_sum_mean",
                "timing_weight_sync_total",
                "timing_weight_sync_trainer_total",
                "timing_weight_sync_inference_total",
                "timing_waiting_for_data",
            ):
                assert key in m and m[key] == m[key], key  # present and not NaN
            assert m["policy_version"] >= 0
        kept = reader.rollouts(status="kept")
        discarded = reader.rollouts(status="discarded")
        assert len(kept) == 3 * 4 * 16  # steps x prompts_batch_size_for_trainer x group_size
        assert all(r["reason"] for r in discarded)  # zero-advantage or stale groups, when the run had any
        assert {r["server"] for r in kept} == {"server-0"}
        # the servers hold the trainer's weights (sent across nodes): later rollouts were generated
        # by later versions
        assert max(r["end_version"] for r in kept) >= 1
        assert reader.meta()["status"] == "finished"
        # what ran where (docs/run-store.md#topology)
        topology = reader.topology()
        head = topology["cluster"]["driver_node"]
        assert head != second and not topology["cluster"]["started_local"]
        assert {n["address"] for n in topology["cluster"]["nodes"] if n["alive"]} == {head, second}
        machines = {m["address"]: m for m in topology["machines"]}
        assert set(machines) == {head, second}
        assert all(
            m["gpus"] == [] and m["packages"]["torch"] and m["cpu_count"] >= 1 for m in machines.values()
        )
        (server,) = topology["inference"]["servers"]
        assert server["name"] == "server-0" and server["node"] == second
        # a server of a multi-node cluster listens on its node's address, which the driver uses
        assert server["url"].startswith(f"http://{second}:")
        assert server["url"] == json.loads(reader.meta()["servers"])[0]["url"]
        (rank,) = topology["trainer"]["ranks"]
        assert rank["rank"] == 0 and rank["device"] == "cpu" and rank["node"] == head
        assert [(pg["name"], [b["node"] for b in pg["bundles"]]) for pg in topology["placement_groups"]] == [
            ("inference servers", [second]),
            ("trainer ranks", [head]),
        ]
        model = topology["model"]
        assert model["architectures"] == ["Qwen2ForCausalLM"] and model["num_parameters"] > 0
        # every node's own metrics, and the server's /metrics scraped every
        # metrics_logger_interval_seconds, each with the node measured
        # (docs/metrics.md#system-metrics, docs/metrics.md#inference-server-metrics)
        memory = reader.system_metrics(name="system_memory_percent")
        assert {(r["source"], r["node"]) for r in memory} == {("system", head), ("system", second)}
        scraped = reader.system_metrics(source="inference:server-0")
        assert {r["node"] for r in scraped} == {second}
        assert {
            "requests_running",
            "generation_tokens_total",
            "engine_busy_fraction",
            "engine_step_ms",
        } <= {r["name"] for r in scraped}
        # the code the run started with: the repository its config file lives in
        # (docs/run-store.md#code-snapshot)
        assert reader.code_file("project", "configs/examples/quickstart.yaml") == QUICKSTART.read_text()
        # the timeline (docs/metrics.md#timeline-events): the start, every rollout's life, the
        # weight syncs with their phases; nothing left in flight
        events = reader.timeline()
        names = {e["name"] for e in events}
        assert {"orchestrator_start", "ray_init_done", "inference_servers_ready", "trainer_ready"} <= names
        assert {"weight_sync/pause", "weight_sync/send", "weight_sync/server", "weight_sync/resume"} <= names
        for r in kept[:8]:
            mine = [
                e
                for e in events
                if e["component"] == "rollout" and e["attrs"]["rollout_id"] == r["rollout_id"]
            ]
            assert [e["name"] for e in mine] == ["generation", "env_response", "reward"]
            assert mine[0]["attrs"]["server"] == "server-0" and mine[0]["attrs"]["lane"] == r["lane"]
            # measured by the engine on the second node, returned with the response
            assert 0 < mine[0]["attrs"]["ttft"] <= mine[0]["attrs"]["e2e_latency"]
        # each weight update's receive and load times, as the server on the second node reported them
        loads = [e["attrs"] for e in events if e["name"] == "weight_sync/server"]
        assert [a["version"] for a in loads] == [1, 2, 3]
        assert all(a["server"] == "server-0" and a["load_seconds"] > 0 for a in loads)
        assert reader.meta()["inflight"]["count"] == 0
        # every component's log lines, with the node they come from (docs/run-store.md#logs)
        lines = reader.logs(limit=100_000)
        origins = {(r["component"], r["rank"], r["source"]) for r in lines}
        assert {("driver", None, "log"), ("trainer", 0, "log"), ("server", 0, "file")} <= origins
        assert {(r["component"], r["node"]) for r in lines} == {
            ("driver", head),
            ("trainer", head),
            ("server", second),  # shipped from the second node over Ray
        }
        (server_line,) = reader.logs(component="server", text="refractor native server", limit=10)
    logs = Path(run_dir) / "logs"
    assert server_line["message"] in (logs / "server-0.log").read_text()  # the server's file, indexed
    assert "trainer rank 0/1 on cpu" in (logs / "trainer-0.log").read_text()
    assert f"run quick: joined the Ray cluster at {head}:" in (logs / "driver.log").read_text()
    saved = load_config(Path(run_dir) / "config.yaml")  # the resolved config, loadable as is
    assert saved.run_name == "quick" and saved.max_async_rollout == 1 and Path(saved.model).is_dir()


@pytest.mark.slow
def test_grpo_learns_and_a_zero_learning_rate_does_not(tmp_path):
    """The quick start's task and settings. Measured on 2 CPU cores (bench/RESULTS.md, 8 runs): reward ~0
    until the take-off at steps 8-13, >= 0.98 from step 15-20 on; 28 steps put the last three
    (25-27) past the latest of those. The control runs past the earliest take-off."""
    learned = reward_means(
        run_training(quick_cfg(tmp_path, run_name="learn", number_of_steps=28), quiet=True)
    )
    # the control run also records no telemetry: it trains and stores its steps all the same
    control_dir = run_training(
        quick_cfg(tmp_path, run_name="control", number_of_steps=9, learning_rate=0.0, record_telemetry=False),
        quiet=True,
    )
    control = reward_means(control_dir)
    with RunReader(control_dir) as reader:
        assert len(reader.rollouts(status="kept")) == 9 * 4 * 16
        assert reader.timeline() == [] and reader.system_metrics() == [] and reader.logs() == []
        assert reader.code_info() is None and reader.meta()["status"] == "finished"
    assert "trainer rank 0/1 on cpu" in (control_dir / "logs" / "trainer-0.log").read_text()  # files stay
    assert learned[0] < 0.2
    assert sum(learned[-3:]) / 3 >= 0.8, learned
    assert max(control) < 0.2, control


@pytest.mark.slow
def test_lora_with_the_embedding_trained_learns_the_quick_start(tmp_path):
    """The quick start's task and settings with LoRA (rank 16, alpha 32) and the tied embedding trained
    in full (lora_modules_to_save), pushed with the adapters (lora_sync: adapter). Adapters alone cannot
    learn it: the random model's frozen head caps the letter's probability at a few percent
    (tests/trainer/test_lora_modules_to_save.py). Measured on 2 CPU cores (bench/RESULTS.md, 12 runs):
    the reward takes off (>= 0.05) at steps 7-14, once at 21, and stays >= 0.95 from 4-8 steps later
    (steps 13-20, once 25); one CI run had not taken off by step 31. Seeded rollouts and 40 steps put the
    last three (37-39) twelve steps past the latest measured."""
    run_dir = run_training(
        quick_cfg(
            tmp_path,
            run_name="lora",
            number_of_steps=40,
            lora_rank=16,
            lora_alpha=32,
            lora_modules_to_save=["embed_tokens"],
            lora_sync="adapter",
            deterministic_rollouts=True,  # seeded sampling: the take-off does not hang on one lucky sample
        ),
        quiet=True,
    )
    learned = reward_means(run_dir)
    assert "embed_tokens in full" in (run_dir / "logs" / "trainer-0.log").read_text()
    assert learned[0] < 0.2
    assert sum(learned[-3:]) / 3 >= 0.8, learned


@pytest.mark.slow
@pytest.mark.parametrize(
    ("lora_sync", "steps", "saved"), [("merged", 4, ["embed_tokens"]), ("adapter", 2, [])]
)
def test_lora_runs_and_the_servers_sample_from_the_trained_adapters(tmp_path, lora_sync, steps, saved):
    """LoRA end to end, synchronous: each step's rollouts come from the weights the trainer just
    pushed, merged from its adapters (lora_sync: merged; here with the embedding trained in full) or
    its adapters alone, applied by the servers at run time (adapter), so the trainer's log-probs of
    those tokens equal the server's (kl_divergence_inference ~ 0). Servers sent the base weights
    instead of the merged ones gave 0.06 by the last step (measured with the merge removed from the
    export)."""
    run_dir = run_training(
        quick_cfg(
            tmp_path,
            number_of_steps=steps,
            max_async_rollout=0,
            deterministic_rollouts=True,  # a batch from one version: no group spans the weight update
            lora_rank=16,
            lora_alpha=32,
            lora_sync=lora_sync,
            lora_modules_to_save=saved,
            learning_rate=0.1,
            entropy_coef=0.1,  # a gradient at every step, whatever the rewards
        ),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        metrics = reader.step_metrics(["kl_divergence_inference", "grad_norm"])
    assert len(metrics) == steps and all(m["grad_norm"] > 0 for m in metrics)
    assert all(m["kl_divergence_inference"] < 1e-3 for m in metrics), metrics
    assert "LoRA rank 16" in (run_dir / "logs" / "trainer-0.log").read_text()
    server_log = (run_dir / "logs" / "server-0.log").read_text()
    assert ("runtime LoRA adapters of rank 16" in server_log) == (lora_sync == "adapter"), server_log[:2000]


@pytest.mark.slow
def test_a_megatron_run_trains_and_the_servers_sample_from_its_weights(tmp_path):
    """``train_backend: megatron`` end to end: each step's rollouts are generated by the weights the
    Megatron trainer exported after the step before (HF names, bucketed), so the trainer's log-probs of
    those tokens equal the server's (kl_divergence_inference ~ 0 after an lr 0.1 update);
    ``deterministic_rollouts`` keeps every batch to one version (a group dispatched past a batch's cut
    may otherwise span the update); a checkpoint of the run is written by the Megatron trainer."""
    run_dir = run_training(
        quick_cfg(
            tmp_path,
            number_of_steps=2,
            max_async_rollout=0,
            learning_rate=0.1,
            entropy_coef=0.1,  # a gradient at every step, whatever the rewards
            train_backend="megatron",
            deterministic_rollouts=True,
            checkpoint_every=2,
        ),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        metrics = reader.step_metrics(["kl_divergence_inference", "grad_norm"])
        ranks = reader.topology()["trainer"]["ranks"]
    assert len(metrics) == 2 and all(m["grad_norm"] > 0 for m in metrics)
    assert all(m["kl_divergence_inference"] < 1e-3 for m in metrics), metrics
    assert [r["impl"] for r in ranks] == ["megatron"] and ranks[0]["num_parameters"] > 0
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "megatron trainer rank 0/1 on cpu: TP 1 x PP 1 x CP 1 x DP 1, EP 1" in trainer_log
    assert "Apex" not in trainer_log  # megatron-core's expected fallbacks are not logged
    meta = json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["backend"] == "megatron"


@pytest.mark.slow
def test_a_megatron_run_over_two_tensor_parallel_ranks_pushes_whole_weights(tmp_path):
    """Two trainer ranks through ``refractor train``, Megatron with tensor parallelism 2: every weight
    push gathers the two shards of each weight, and the server's log-probs of each step's tokens equal
    the trainer's after an lr 0.1 update (a missing or misplaced shard would not)."""
    from refractor.testing import tiny_qwen2

    run_dir = run_training(
        quick_cfg(
            tmp_path,
            model=str(tiny_qwen2(num_key_value_heads=2)),  # whole key/value heads on each rank
            number_of_steps=2,
            max_async_rollout=0,
            learning_rate=0.1,
            entropy_coef=0.1,  # a gradient at every step, whatever the rewards
            deterministic_rollouts=True,
            train_backend="megatron",
            megatron_tensor_parallel_size=2,
            trainer_num_workers=2,
            ray_trainer_cpus_per_worker=0.5,  # a server and two ranks on a 2-CPU machine
            ray_inference_cpus_per_worker=0.5,
        ),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        metrics = reader.step_metrics(["kl_divergence_inference", "grad_norm"])
        ranks = reader.topology()["trainer"]["ranks"]
    assert [r["impl"] for r in ranks] == ["megatron", "megatron"]
    assert len(metrics) == 2 and all(m["grad_norm"] > 0 for m in metrics)
    assert all(m["kl_divergence_inference"] < 1e-3 for m in metrics), metrics
    assert "TP 2 x PP 1 x CP 1 x DP 1" in (run_dir / "logs" / "trainer-0.log").read_text()


@pytest.mark.slow
def test_a_raising_reward_discards_with_a_reason_and_the_run_goes_on(tmp_path):
    """Also the colocated synchronous layout end to end: server and trainer rank in one placement
    group, the server asleep while the trainer steps."""
    run_dir = run_training(
        quick_cfg(
            tmp_path,
            environments=[{"name": "flaky_reward"}],
            number_of_steps=2,
            group_size=4,
            max_tokens=12,
            colocate=True,
            max_async_rollout=0,
        ),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        assert len(reader.step_metrics()) == 2
        sleeps = [
            (e["step"], e["name"], e["attrs"].get("tags"))
            for e in reader.timeline()
            if e["name"] in ("inference_sleep", "inference_wake")
        ]
        per_step = [("inference_sleep", None), ("inference_wake", "weights"), ("inference_wake", "kv_cache")]
        assert sleeps == [(step, name, tags) for step in (0, 1) for name, tags in per_step]
        (group,) = reader.topology()["placement_groups"]
        assert group["name"] == "servers and trainer ranks (colocated)"
        assert [b["resources"] for b in group["bundles"]] == [{"CPU": 2.0}]
        failed = [
            r for r in reader.rollouts(status="discarded") if "judge is down" in f"{r['reason']} {r['error']}"
        ]
        assert failed, "the reward exception was not recorded"


@pytest.mark.slow
def test_a_server_that_dies_at_start_is_named_with_its_log(tmp_path, tiny_qwen2_path):
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_qwen2_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # the server exits while loading
    with pytest.raises(ServerStartError) as err:
        run_training(quick_cfg(tmp_path, model=str(broken)), quiet=True)
    message = str(err.value)
    assert "server-0" in message and "last log lines" in message


def test_an_existing_run_is_not_overwritten_silently(tmp_path):
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    (run_dir / "run.db").write_bytes(b"")
    with pytest.raises(RunSetupError, match="already holds a run"):
        run_training(quick_cfg(tmp_path), quiet=True)


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,pgid=,sid="], capture_output=True, text=True).stdout
    rows = [tuple(int(x) for x in line.split()) for line in out.splitlines() if line.strip()]
    children: dict[int, list[int]] = {}
    for p, pp, *_ in rows:
        children.setdefault(pp, []).append(p)
    found = set()
    stack = [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            os.kill(p, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{p}/stat")
        if state.exists() and state.read_text().split()[2] != "Z":
            alive.add(p)
    return alive


def _ignore_sigint() -> None:  # what a shell does to a background job (`refractor train ... &`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,after,background,busy,extra",
    [
        pytest.param(
            signal.SIGTERM, "Ray cluster", True, True, [], id="sigterm-while-starting-background-busy"
        ),
        pytest.param(
            signal.SIGINT,
            "step 2/",
            True,
            True,
            ["--checkpoint_every", "1"],
            id="sigint-while-training-and-checkpointing-background-busy",
        ),
    ],
)
def test_a_stop_signal_stops_everything_and_leaves_no_orphans(tmp_path, sig, after, background, busy, extra):
    """SIGINT and SIGTERM stop a run from any state within 30 s: exit 128 + signal, no process left,
    the store marked interrupted; also when the run was started in the background (SIGINT arrives
    ignored) and with both cores busy when the signal comes."""
    env = {**os.environ, "REFRACTOR_ENV_PATH": os.environ["REFRACTOR_ENV_PATH"]}
    argv = [sys.executable, "-m", "refractor.cli", "train", "--config", str(QUICKSTART)]
    argv += ["--run_dir", str(tmp_path / "runs"), "--run_name", "stop", "--number_of_steps", "50"]
    argv += ["--ray_address", "", *extra]
    hogs = []
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tmp_path,
            preexec_fn=_ignore_sigint if background else None,
        )
        seen: set[int] = set()
        deadline = time.monotonic() + 300
        lines = []
        for line in proc.stdout:  # wait for the state to reach, tracking every process it started
            lines.append(line)
            seen |= _descendants(proc.pid)
            if after in line or time.monotonic() > deadline:
                break
        assert any(after in line for line in lines), "".join(lines)
        seen |= _descendants(proc.pid)
        # both cores busy from here: the stop must not depend on the run getting CPU time
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if busy else 0)]
        time.sleep(1 if busy else 0)
        proc.send_signal(sig)
        sent_at = time.monotonic()
        rest, _ = proc.communicate(timeout=120)
        stopped_in = time.monotonic() - sent_at
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 128 + sig, output
    assert f"interrupted ({signal.Signals(sig).name})" in rest, output
    assert "Traceback" not in output, output
    assert stopped_in < 30, output
    time.sleep(2)
    assert not _alive(seen), f"orphans: {_alive(seen)}"
    with RunReader(tmp_path / "runs" / "stop") as reader:
        assert reader.meta()["status"] == "interrupted"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_megatron_moe_run_trains_and_the_vllm_servers_sample_from_its_weights(tmp_path):
    """A Qwen3-MoE model (4 experts, 2 per token) with ``train_backend: megatron``: refractor's engine has
    no experts, so vLLM serves it; each step's rollouts come from the weights the trainer exported
    (every expert under its checkpoint name), so the trainer's log-probs equal vLLM's."""
    from refractor.testing import tiny_qwen3_moe

    run_dir = run_training(
        quick_cfg(
            tmp_path,
            model=str(tiny_qwen3_moe()),
            number_of_steps=2,
            max_async_rollout=0,
            learning_rate=0.1,
            entropy_coef=0.1,  # a gradient at every step, whatever the rewards
            train_backend="megatron",
            inference_engine="vllm",
            deterministic_rollouts=True,
        ),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        metrics = reader.step_metrics(["kl_divergence_inference", "grad_norm"])
        assert reader.meta()["engine"] == "vllm"
    assert len(metrics) == 2 and all(m["grad_norm"] > 0 for m in metrics)
    assert all(m["kl_divergence_inference"] < 1e-3 for m in metrics), metrics


@pytest.mark.slow
@pytest.mark.vllm
def test_three_steps_with_the_vllm_cpu_engine(tmp_path):
    run_dir = run_training(
        quick_cfg(tmp_path, inference_engine="vllm", max_async_rollout=1, discard_group_zero_advantage=True),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        assert reader.meta()["engine"] == "vllm"
        assert [m["step"] for m in reader.step_metrics(["loss"])] == [0, 1, 2]
        kept = reader.rollouts(status="kept")
        assert len(kept) == 3 * 4 * 16 and max(r["end_version"] for r in kept) >= 1
        assert reader.rollouts(status="discarded")


@pytest.mark.slow
@pytest.mark.vllm
def test_lora_adapters_on_vllm_serve_what_the_trainer_trained(tmp_path):
    """lora_sync: adapter with the vLLM CPU engine, synchronous and seeded: the second step's rollouts
    come from the adapters pushed after the first, served by vLLM under the model's name, so the
    trainer's log-probs of those tokens equal the server's. Requests that named no model (the base)
    gave 0.066 at the second step. Seeded requests also cover the CPU engine's missing chunked prefill:
    with it, a step's 64 prompts (2,600 tokens, over the 2,048 budget) had one split, and the engine
    died rewinding that request's generator, failing every request of the run."""
    run_dir = run_training(
        quick_cfg(
            tmp_path,
            number_of_steps=2,
            max_async_rollout=0,
            deterministic_rollouts=True,  # a batch from one version: no group spans the weight update
            inference_engine="vllm",
            lora_rank=16,
            lora_alpha=32,
            lora_sync="adapter",
            learning_rate=0.1,
            entropy_coef=0.1,  # a gradient at every step, whatever the rewards
        ),
        quiet=True,
    )
    with RunReader(run_dir) as reader:
        metrics = reader.step_metrics(["kl_divergence_inference", "grad_norm"])
    assert len(metrics) == 2 and all(m["grad_norm"] > 0 for m in metrics)
    # ~1e-6 when every rollout of the second step came from the pushed adapters (the base alone: 0.066)
    assert all(m["kl_divergence_inference"] < 1e-3 for m in metrics), metrics
    assert "Loaded new LoRA adapter" in (run_dir / "logs" / "server-0.log").read_text()


def _start_quiet_run(tmp_path, name: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "REFRACTOR_ENV_PATH": os.environ["REFRACTOR_ENV_PATH"]}
    argv = [sys.executable, "-m", "refractor.cli", "train", "--config", str(QUICKSTART), "--quiet"]
    argv += ["--run_dir", str(tmp_path / "runs"), "--run_name", name, "--ray_address", "", *args]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
    )


def _read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            break
    return lines


def _kill_the_server(proc: subprocess.Popen, lines: list[str], sig: int = signal.SIGKILL) -> None:
    servers = [
        p
        for p in _alive(_descendants(proc.pid))
        if "serve" in Path(f"/proc/{p}/cmdline").read_text(errors="replace").split("\0")
    ]
    assert len(servers) == 1, "".join(lines)
    os.kill(servers[0], sig)


@pytest.mark.slow
def test_a_server_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path):
    """kill -9 of the only server: it is restarted on its resources and gets the current weights
    (canary checked); its groups run again; every step trains on exactly one batch."""
    steps = 5
    proc = _start_quiet_run(
        tmp_path, "restart", *("--number_of_steps", str(steps), "--heartbeat_interval_s", "1")
    )
    lines = _read_until(proc, "step 1/")
    _kill_the_server(proc, lines)
    rest, _ = proc.communicate(timeout=300)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "Restarting it (1 of at most 2)" in output, output
    with RunReader(tmp_path / "runs" / "restart") as reader:
        assert reader.meta()["status"] == "finished"
        assert [m["step"] for m in reader.step_metrics(["loss"])] == list(range(steps))
        (restart,) = [e for e in reader.timeline() if e["name"] == "server_restart"]
        assert restart["attrs"]["server"] == "server-0" and restart["attrs"]["restart"] == 1
        assert "process exited" in restart["attrs"]["reason"]
        version = restart["attrs"]["version"]
        pushes = [
            e for e in reader.timeline() if e["name"] == "weight_sync" and e["attrs"]["target"] == "restarted"
        ]
        assert [e["attrs"]["version"] for e in pushes] == [version] and 1 <= version <= steps
        for step in range(steps):  # one batch per step: 4 prompts x 16 samples, none twice
            kept = reader.rollouts(step=step, status="kept")
            assert len(kept) == 64, (step, len(kept))
        kept_groups = {r["group_id"]: r["prompt_ordinal"] for r in reader.rollouts(status="kept")}
        assert len(set(kept_groups.values())) == len(kept_groups)  # no prompt trained twice
        restarted = {
            r["prompt_ordinal"]
            for r in reader.rollouts(status="cancelled")
            if r["reason"] == "server_restart"
        }
        ran = {r["prompt_ordinal"] for r in reader.rollouts() if r["reason"] != "server_restart"}
        assert restarted <= ran  # what the dead server was generating ran again
        # the log of the first process and that of the restarted one (logs/server-0.restart1.log)
        starts = reader.logs(component="server", rank=0, text="refractor native server")
        assert len(starts) == 2 and starts[0]["message"] != starts[1]["message"]  # two pids


@pytest.mark.slow
def test_a_hung_server_is_restarted_and_a_failure_past_the_limit_stops_the_run(tmp_path):
    """A stopped (SIGSTOP) server is hung: restarted after heartbeat_timeout_s, also while a weight
    update waits on it; with inference_restart_on_failure 1, its next death (kill -9) stops the run
    instead of stalling it, naming the server and quoting its log. (Resume from a checkpoint is
    tested end to end in test_resume_determinism.py.)"""
    proc = _start_quiet_run(
        tmp_path,
        "hung",
        *("--number_of_steps", "50", "--heartbeat_interval_s", "1", "--heartbeat_timeout_s", "5"),
        *("--inference_restart_on_failure", "1"),
    )
    lines = _read_until(proc, "step 1/")
    _kill_the_server(proc, lines, signal.SIGSTOP)
    lines += _read_until(proc, "step 3/")  # restarted, and training again
    output = "".join(lines)
    assert "has not answered /health" in output and "Restarting it (1 of at most 1)" in output, output
    _kill_the_server(proc, lines)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output + rest
    assert "inference server server-0" in rest and "process exited" in rest, rest
    assert "refractor native server" in rest  # the first line of its log is quoted
    assert "restarted 1 time(s) already (inference_restart_on_failure = 1)" in rest, rest
    with RunReader(tmp_path / "runs" / "hung") as reader:
        assert reader.meta()["status"] == "failed"
        assert [e["attrs"]["restart"] for e in reader.timeline() if e["name"] == "server_restart"] == [1]


@pytest.mark.slow
def test_a_run_starved_of_advantage_says_so(tmp_path):
    """Every group scores the same and is discarded: no batch can fill, and the console says why."""
    env = {**os.environ, "REFRACTOR_ENV_PATH": os.environ["REFRACTOR_ENV_PATH"]}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "refractor.cli",
            "train",
            "--config",
            str(QUICKSTART),
            "--quiet",
            "--run_dir",
            str(tmp_path / "runs"),
            "--run_name",
            "starved",
            "--ray_address",
            "",
            "--environments",
            '[{"name": "constant_reward"}]',
            "--discard_group_zero_advantage",
            "true",
            "--group_size",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        lines.append(line)
        if "zero-advantage" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert "warning: the last 16 finished groups were all discarded as zero-advantage" in text, text + rest
    assert "discard_group_zero_advantage: false" in text
    with RunReader(tmp_path / "runs" / "starved") as reader:
        assert not reader.step_metrics()
        assert [e for e in reader.timeline() if e["name"] == "zero_advantage_stall"]


@pytest.mark.slow
def test_two_quick_starts_side_by_side_both_finish(tmp_path):
    """Two runs on one machine with the default `ray_address: auto`: the second does not join the
    first's private cluster (whose placement groups and shutdown would collide with its own)."""
    env = {**os.environ, "REFRACTOR_ENV_PATH": os.environ["REFRACTOR_ENV_PATH"]}

    def start(name: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "refractor.cli", "train", "--config", str(QUICKSTART)]
        argv += ["--run_dir", str(tmp_path / "runs"), "--run_name", name, "--number_of_steps", "2"]
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
        )

    first = start("first")
    for line in first.stdout:  # the first run's cluster is up before the second looks for one
        if line.startswith("refractor: ") and "Ray cluster" in line:  # not Ray's own notices
            break
    second = start("second")
    outputs = [proc.communicate(timeout=600)[0] for proc in (first, second)]
    for proc, output in zip((first, second), outputs, strict=True):
        assert proc.returncode == 0, output
    assert "started a local Ray cluster" in outputs[1], outputs[1]
    for name in ("first", "second"):
        with RunReader(tmp_path / "runs" / name) as reader:
            assert reader.meta()["status"] == "finished"
            assert [m["step"] for m in reader.step_metrics()] == [0, 1]
