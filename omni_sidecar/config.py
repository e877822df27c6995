"""Daemon settings from flags, environment and a TOML file.

Precedence, highest first: command-line flags, `OMNI_SIDECAR_*` environment
variables, the TOML file (`--config` or `$OMNI_SIDECAR_CONFIG`), defaults.
SIGHUP re-reads the file and environment and applies what can change while
serving (log level and format, finished-output retention).
"""

from __future__ import annotations

import os
import tomllib
from typing import Any

import msgspec

from proto.endpoint import default_endpoint


class ServeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    endpoint: str = ""
    hooks: str = "passthrough"
    hook_options: dict[str, str] = {}
    arena_mib: int = 0
    keep_finished: int = 10_000
    max_frame_mib: int = 64
    metrics_port: int = 0
    log_level: str = "INFO"
    log_format: str = "plain"  # or "json"
    drain_timeout_s: float = 10.0
    allow_uids: list[int] = []
    curve_keys: str = ""
    # Shared-memory rings for per-step messages (omni_sidecar/server.py docstring). The env
    # names (OMNI_SIDECAR_RING, _RING_SPIN_US, _RING_SLEEP_MS) are the shim's too, like ENDPOINT.
    ring: bool = True
    ring_spin_us: int = 2000
    ring_sleep_ms: int = 2

    def __post_init__(self) -> None:
        if self.ring_spin_us < 0 or not 1 <= self.ring_sleep_ms <= 1000:
            raise ValueError("ring_spin_us must be >= 0 and ring_sleep_ms in [1, 1000]")
        if self.log_format not in ("plain", "json"):
            raise ValueError(f"log_format must be 'plain' or 'json', got {self.log_format!r}")
        if self.keep_finished < 0 or self.max_frame_mib <= 0 or self.arena_mib < 0:
            raise ValueError("keep_finished, arena_mib must be >= 0 and max_frame_mib > 0")


RELOADABLE = ("log_level", "log_format", "keep_finished")
ENV_PREFIX = "OMNI_SIDECAR_"
_ENV_KEYS = {  # env name -> field (OMNI_SIDECAR_ENDPOINT is shared with the shim)
    f"{ENV_PREFIX}{name.upper()}": name
    for name in ServeConfig.__struct_fields__
    if name not in ("hook_options", "allow_uids")
}


class ConfigError(ValueError):
    pass


def load_config(cli: dict[str, Any], config_path: str | None = None,
                environ: dict[str, str] | None = None) -> ServeConfig:
    """Merge the layers; `cli` holds only flags the user actually gave."""
    environ = dict(os.environ if environ is None else environ)
    merged: dict[str, Any] = {}
    path = config_path or environ.get(f"{ENV_PREFIX}CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                merged.update(tomllib.load(f))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    for env_name, field in _ENV_KEYS.items():
        if env_name in environ:
            merged[field] = environ[env_name]
    hook_options = dict(merged.get("hook_options", {}))
    hook_options.update(cli.pop("hook_options", {}) or {})
    merged.update({k: v for k, v in cli.items() if v is not None})
    merged["hook_options"] = {str(k): str(v) for k, v in hook_options.items()}
    try:
        config = msgspec.convert(merged, ServeConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    if not config.endpoint:
        config = msgspec.structs.replace(config, endpoint=default_endpoint())
    return config
