"""runtime/cluster.py: settings from the config, the runtime env handed to every worker, and
placement-group reservations on a local Ray cluster (errors name the keys to change)."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from refractor.config import RefractorConfig
from refractor.runtime.cluster import ClusterError, RayHost, RaySettings, build_runtime_env, init_ray, reserve


def settings(**overrides) -> RaySettings:
    cfg = RefractorConfig(model="some/model", environments=[{"name": "countdown"}])
    return replace(RaySettings.from_config(cfg, run_dir="/runs/x"), **overrides)


def test_settings_read_the_ray_keys():
    cfg = RefractorConfig(
        model="some/model",
        environments=[{"name": "countdown"}],
        ray_address="auto",
        ray_namespace="ns",
        ray_log_to_driver=True,
        ray_placement_timeout_s=7,
    )
    s = RaySettings.from_config(cfg, run_dir="/runs/x")
    assert (s.address, s.namespace, s.placement_timeout_s, s.run_dir) == ("auto", "ns", 7, "/runs/x")
    assert s.log_to_driver is False  # worker logs reach the driver only with `debug`
    debug = RefractorConfig(**{**cfg.model_dump(), "debug": True})
    assert RaySettings.from_config(debug, run_dir="/runs/x").log_to_driver is True


def test_runtime_env_carries_the_run_environment(monkeypatch):
    for key in ("REFRACTOR_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_OFFLINE", "REFRACTOR_ENV_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VIRTUAL_ENV", "/venv")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    user = {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "MINE": "1"}, "pip": ["x"]}
    s = settings(runtime_env=user, propagate_active_venv=True, propagate_run_dir=True, pin_py_executable=True)
    env = build_runtime_env(s)
    assert env["env_vars"] == {
        "TOKENIZERS_PARALLELISM": "true",  # the user's value wins over the default
        "MINE": "1",
        "VIRTUAL_ENV": "/venv",
        "REFRACTOR_RUN_DIR": "/runs/x",
        "HF_HUB_OFFLINE": "1",
    }
    assert env["pip"] == ["x"] and env["py_executable"] == sys.executable
    assert user == {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "MINE": "1"}, "pip": ["x"]}  # not mutated


def test_runtime_env_defaults(monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/venv")
    s = settings(
        runtime_env=None, propagate_active_venv=False, propagate_run_dir=False, pin_py_executable=False
    )
    env = build_runtime_env(s)
    assert env["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    assert "VIRTUAL_ENV" not in env["env_vars"] and "REFRACTOR_RUN_DIR" not in env["env_vars"]
    assert "py_executable" not in env


def test_a_named_cluster_that_nobody_runs_is_an_error_at_once():
    """ray.init would retry a dead address for minutes (and hold off Ctrl-C meanwhile)."""
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    ray.shutdown()  # connected by an earlier test: init_ray would keep that connection
    with pytest.raises(ClusterError, match=f"cannot reach the Ray cluster at `ray_address: {dead}`"):
        init_ray(settings(address=dead))
    assert not ray.is_initialized()


def test_work_beside_the_start_that_fails_still_stops_the_cluster_it_started():
    """``meanwhile`` (the tokenizer load in ``refractor train``) runs while the cluster starts; its
    error comes out as is, after the cluster that was being started for the run is stopped."""
    ray.shutdown()
    host = RayHost()

    def load():
        raise ValueError("no tokenizer here")

    with pytest.raises(ValueError, match="no tokenizer here"):
        host.connect(settings(address="", namespace="refractor-test-cluster"), meanwhile=load)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray():
    ray.shutdown()
    started = init_ray(settings(address="", namespace="refractor-test-cluster"))
    yield started
    ray.shutdown()


def test_an_empty_address_starts_a_local_cluster_and_a_second_call_joins_it(local_ray):
    assert local_ray.started_local is True and ray.is_initialized()
    assert (local_ray.nodes, local_ray.cpus) == (1, ray.cluster_resources()["CPU"])
    again = init_ray(settings(address=""))
    assert again.started_local is False  # already connected: nothing started, nothing to stop


def test_the_run_leaves_a_joined_cluster_only_with_ray_shutdown_on_exit(local_ray):
    joined = init_ray(settings(address=""))
    assert joined.started_local is False
    assert settings().shuts_down(local_ray) and settings().shuts_down(joined) is False
    cfg = RefractorConfig(model="some/model", environments=[{"name": "countdown"}], ray_shutdown_on_exit=True)
    assert RaySettings.from_config(cfg, run_dir="/runs/x").shuts_down(joined)
    assert settings(shutdown_on_exit=True).shuts_down(None) is False  # nothing was connected


def test_a_reservation_too_large_for_the_cluster_names_the_keys(local_ray):
    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(ClusterError) as err:
        reserve("trainer", 2, cpus, 0, "PACK", 5, "ray_trainer_cpus_per_worker", "trainer_num_workers")
    message = str(err.value)
    assert f"trainer needs 2 bundle(s) of {cpus:g} CPU + 0 GPU" in message
    assert "Lower `ray_trainer_cpus_per_worker` or `trainer_num_workers`" in message


def test_a_reservation_that_fits_is_ready_and_one_that_waits_times_out(local_ray):
    cpus = ray.cluster_resources()["CPU"]
    held = reserve("servers", 1, cpus, 0, "PACK", 30, "cpus_key", "count_key")
    try:
        assert (held.count, held.cpus, held.gpus) == (1, cpus, 0)
        ray.get(held.group.ready(), timeout=5)
        # the cluster is big enough in total, but every CPU is held: the wait ends with a clear error
        with pytest.raises(ClusterError, match=r"was not ready after 1 s \(`ray_placement_timeout_s`\)"):
            reserve("trainer", 1, 1, 0, "PACK", 1, "cpus_key", "count_key")
    finally:
        remove_placement_group(held.group)


def test_a_dead_cluster_address_is_found_stale_and_a_live_one_is_not(tmp_path, monkeypatch):
    """``ray_address: auto`` with the address file of a cluster killed without its shutdown would
    retry the dead address for minutes; refractor sees nobody listens there and starts its own."""
    from refractor.runtime.cluster import stale_auto_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert stale_auto_address() is None  # no address file: nothing to join
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = f"127.0.0.1:{listener.getsockname()[1]}"
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(live + "\n")
        assert stale_auto_address() is None
    # the listener is closed now: the same file names a dead cluster
    assert stale_auto_address() == live
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the environment wins over the file
    assert stale_auto_address() == "127.0.0.1:1"
