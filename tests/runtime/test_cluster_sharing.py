"""Runs that share a machine stay apart: `ray_address: auto` does not join another live run's
private cluster, a namespace held by a live run is refused, a dead run's claims are void.

Another run is a real driver process (its own Ray job) that started its cluster through
``init_ray`` and stays alive while the test connects.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import ray

from refractor.config import RefractorConfig
from refractor.runtime.cluster import ClusterError, RaySettings, init_ray

OTHER_RUN = textwrap.dedent(
    """
    import sys, time
    from refractor.config import RefractorConfig
    from refractor.runtime.cluster import RaySettings, init_ray
    cfg = RefractorConfig(environments=[{"name": "countdown"}], ray_address="")
    connection = init_ray(RaySettings.from_config(cfg, run_dir="/runs/other"))
    print(connection.address, flush=True)
    sys.stdin.read()  # live until the test closes our stdin
    """
)


def settings(**overrides) -> RaySettings:
    cfg = RefractorConfig(environments=[{"name": "countdown"}])
    return replace(RaySettings.from_config(cfg, run_dir="/runs/mine"), **overrides)


@pytest.fixture(scope="module")
def other_run():
    ray.shutdown()
    proc = subprocess.Popen(
        [sys.executable, "-c", OTHER_RUN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    address = proc.stdout.readline().strip()
    assert address, "the other run did not start its cluster"
    yield address
    proc.stdin.close()
    proc.wait(120)


@pytest.fixture
def fresh():
    ray.shutdown()
    yield
    ray.shutdown()


def test_auto_starts_a_cluster_of_its_own_beside_another_runs(other_run, fresh):
    mine = init_ray(settings(address="auto"))
    assert mine.started_local and mine.address != other_run


def test_auto_without_local_start_refuses_naming_the_other_run(other_run, fresh):
    with pytest.raises(ClusterError, match=r"private Ray cluster of the run /runs/other \(driver pid \d+"):
        init_ray(settings(address="auto", auto_start_local=False))
    assert not ray.is_initialized()


def test_naming_the_address_joins_but_a_live_runs_namespace_is_refused(other_run, fresh):
    with pytest.raises(ClusterError, match=r"namespace 'refractor' .* in use by the run /runs/other"):
        init_ray(settings(address=other_run))
    ray.shutdown()
    joined = init_ray(settings(address=other_run, namespace="refractor-second"))
    assert not joined.started_local and joined.address == other_run


def test_a_finished_runs_namespace_is_free_again(other_run, fresh):
    sharer = textwrap.dedent(
        f"""
        import dataclasses
        from refractor.config import RefractorConfig
        from refractor.runtime.cluster import RaySettings, init_ray
        cfg = RefractorConfig(environments=[{{"name": "countdown"}}], ray_namespace="shared")
        s = dataclasses.replace(RaySettings.from_config(cfg, run_dir="/runs/done"), address={other_run!r})
        print(init_ray(s).started_local)
        """
    )
    done = subprocess.run([sys.executable, "-c", sharer], capture_output=True, text=True, timeout=180)
    assert done.stdout.strip() == "False", done.stderr  # it joined, claimed "shared", and ended
    joined = init_ray(settings(address=other_run, namespace="shared"))
    assert not joined.started_local
