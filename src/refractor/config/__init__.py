"""Configuration: one frozen pydantic model, loaded in layers (defaults -> file -> CLI)."""

from refractor.config.loader import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
    parse_overrides,
)
from refractor.config.schema import EnvironmentEntry, EvalEntry, RefractorConfig

__all__ = [
    "ConfigError",
    "EnvironmentEntry",
    "EvalEntry",
    "RefractorConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "parse_overrides",
]
