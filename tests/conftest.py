"""Shared fixtures: tiny offline models, marker handling, and a quiet, deterministic torch."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    skip_vllm = pytest.mark.skip(reason="vLLM is not installed")
    has_cuda = _has_cuda()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)


@pytest.fixture(scope="session")
def tiny_qwen2_path():
    from refractor.testing import tiny_qwen2

    return tiny_qwen2()


@pytest.fixture(scope="session")
def tiny_llama_path():
    from refractor.testing import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_qwen3_path():
    from refractor.testing import tiny_qwen3

    return tiny_qwen3()


# The second node's address: another loopback address, so the two nodes of the simulated cluster
# have different addresses (the head takes this machine's own) as on two machines.
SECOND_NODE_ADDRESS = "127.0.0.2"


def _ray_start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``ray start --block`` with ``args``, once it says the node runs (its own session, so stopping
    it stops only this node's processes, not every Ray on the machine as ``ray stop`` would)."""
    out = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats", *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _ray_stop(proc)
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def _ray_stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # `ray start --block` stops its node's processes on SIGTERM
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(frozen=True)
class TwoNodeCluster:
    address: str  # the head's GCS address, for `ray_address`
    env: dict[str, str]  # the environment a driver of this cluster runs with


@contextmanager
def two_node_ray(root: Path) -> Iterator[TwoNodeCluster]:
    """A real two-node Ray cluster on this machine while the block runs: a head node (where the
    driver runs; custom resource ``node_a``) and a second node at ``SECOND_NODE_ADDRESS``
    (``node_b``), each started by ``ray start`` with its own temp dir and 2 CPUs. Token
    authentication is off for this throwaway cluster (its driver runs in a subprocess with the same
    environment). Keep the block short: while the cluster runs, ``ray_address: auto`` anywhere on
    the machine finds it (Ray looks for running GCS processes)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = _ray_start(
        [
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--resources",
            '{"node_a": 1}',
            "--include-dashboard",
            "false",
            "--temp-dir",
            str(root / "a"),
        ],
        root / "head.log",
        env,
    )
    try:
        second = _ray_start(
            [
                "--address",
                f"127.0.0.1:{port}",
                "--node-ip-address",
                SECOND_NODE_ADDRESS,
                "--num-cpus",
                "2",
                "--resources",
                '{"node_b": 1}',
                "--temp-dir",
                str(root / "b"),
            ],
            root / "second.log",
            env,
        )
    except BaseException:
        _ray_stop(head)
        raise
    try:
        yield TwoNodeCluster(address=f"127.0.0.1:{port}", env=env)
    finally:
        _ray_stop(second)
        _ray_stop(head)


@pytest.fixture(scope="session")
def second_node_address() -> str:
    return SECOND_NODE_ADDRESS


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """The README's quick start, 3 steps on CPU (asynchronous, zero-advantage groups discarded,
    metrics scraped every 0.5 s), run once by ``refractor train`` for every test that only reads what
    a run leaves behind, on the two-node cluster: the inference server on the second node, the
    trainer rank on the head node with the driver. Returns its run directory (``runs/quick``); tests
    must not write to it."""
    root = Path(__file__).resolve().parents[1]
    quickstart = root / "configs" / "examples" / "quickstart.yaml"
    runs = tmp_path_factory.mktemp("quickstart") / "runs"
    overrides = {
        "run_dir": str(runs),
        "run_name": "quick",
        "number_of_steps": 3,
        "ray_inference_resources": "{node_b: 1}",
        "ray_trainer_resources": "{node_a: 1}",
        "max_async_rollout": 1,
        "discard_group_zero_advantage": True,
        "metrics_logger_interval_seconds": 0.5,
    }
    # the cluster lives only for the run: other tests' `ray_address: auto` must not find it
    with two_node_ray(tmp_path_factory.mktemp("ray-nodes")) as cluster:
        overrides["ray_address"] = cluster.address
        flags = [part for key, value in overrides.items() for part in (f"--{key}", str(value))]
        env = {
            **cluster.env,
            "REFRACTOR_ENV_PATH": str(root / "environments"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")])),
        }
        done = subprocess.run(
            [sys.executable, "-m", "refractor.cli", "train", "--config", str(quickstart), "--quiet", *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return runs / "quick"
