"""Errors a run reports to the user as one clear message (no traceback): what failed, and where."""

from __future__ import annotations


def _user_errors() -> tuple[type[BaseException], ...]:
    from refractor.envs.registry import EnvironmentNotFoundError
    from refractor.runtime.cluster import ClusterError
    from refractor.runtime.health import ComponentFailure
    from refractor.runtime.server_group import ServerStartError
    from refractor.train import RunSetupError
    from refractor.trainer.checkpoint import CheckpointError
    from refractor.weight_sync import WeightSyncError

    return (
        RunSetupError,
        ClusterError,
        ComponentFailure,
        ServerStartError,
        WeightSyncError,
        EnvironmentNotFoundError,
        CheckpointError,
    )


USER_ERRORS = _user_errors()
