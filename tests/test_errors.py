"""User errors share one base the CLI catches, and keep their builtin base so handlers written against the
builtin type catch them too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import refractor.errors
from refractor.config import ConfigError
from refractor.envs.data import DatasetLoadError
from refractor.envs.registry import EnvironmentNotFoundError
from refractor.errors import RefractorUserError, RunSetupError
from refractor.hub import ModelNotFoundError
from refractor.inference.process import ServerStartError
from refractor.models.config import UnsupportedModelError
from refractor.orchestrator.eval_runner import EvalSetupError
from refractor.runtime.cluster import ClusterError
from refractor.runtime.health import ComponentFailure
from refractor.trainer.checkpoint import CheckpointError
from refractor.weight_sync.control_plane import WeightSyncError


@pytest.mark.parametrize(
    ("error", "builtin_base"),
    [
        (RunSetupError, RuntimeError),
        (ClusterError, RuntimeError),
        (ComponentFailure, RuntimeError),
        (ServerStartError, RuntimeError),
        (WeightSyncError, RuntimeError),
        (EnvironmentNotFoundError, LookupError),
        (CheckpointError, RuntimeError),
        (EvalSetupError, RuntimeError),
        (ConfigError, ValueError),
        (ModelNotFoundError, FileNotFoundError),
        (UnsupportedModelError, ValueError),
        (DatasetLoadError, RuntimeError),
    ],
)
def test_each_user_error_is_a_refractor_user_error_and_keeps_its_builtin_base(error, builtin_base):
    err = error("what failed and what to change")
    assert isinstance(err, RefractorUserError)
    assert isinstance(err, builtin_base)
    assert str(err) == "what failed and what to change"


def test_the_errors_module_imports_nothing_from_refractor():
    tree = ast.parse(Path(refractor.errors.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name and name.startswith("refractor")]
