"""Daemon settings from flags, environment and a TOML file.

Precedence, highest first: command-line flags, `OMNI_SIDECAR_*` environment
variables, the TOML file (`--config` or `$OMNI_SIDECAR_CONFIG`), defaults.
SIGHUP re-reads the file and environment and applies what can change while
serving (log level and format, finished-output retention).
"""

from __future__ import annotations

import os
import tomllib
from typing import Any, Literal, NamedTuple

import msgspec
import msgspec.inspect

from omni_sidecar.errors import OmniSidecarError
from proto.codec import DEFAULT_MAX_FRAME_BYTES
from proto.endpoint import default_endpoint
from proto.settings import ENV_PREFIX, RING_SLEEP_MS, RING_SLEEP_MS_MAX, RING_SPIN_US


# The hook sets `--hooks` names (omni_sidecar/hook_sets/reference.py); here, so that the CLI builds its
# help without importing torch.
BUILTIN_NAMES = ("passthrough", "capture", "overlay", "omni", "omni-thinker", "omni-talker",
                 "omni-code2wav")


# Every setting's help text (the CLI's, through `settings`), by field of ServeConfig.
HELP: dict[str, str] = {
    "endpoint": "ZeroMQ ipc:// endpoint (default: $OMNI_SIDECAR_ENDPOINT or a socket under $XDG_RUNTIME_DIR)",
    "hooks": (f"hook set: built-in ({', '.join(BUILTIN_NAMES)}) or module:Class "
              "(a subclass of omni_sidecar.hook_api.hook_set.OmniHooks)"),
    "hook_options": ("passed to the hook set's constructor; repeatable (e.g. extra_kwargs=1, "
                     "state_cap_mib=64 for --hooks omni)"),
    "arena_mib": ("minimum size of the sidecar->shim arena for overlay rows and kwargs tensors "
                  "(0: sized from the shim's max tokens x hidden size)"),
    "keep_finished": "finished requests whose outputs stay available to clients",
    "max_frame_mib": "reject larger frames",
    "metrics_port": "serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off)",
    "log_level": "DEBUG, INFO, WARNING",
    "log_format": "plain or json lines",
    "drain_timeout_s": "longest SIGTERM drain in seconds",
    "allow_uids": "besides this user, let this uid connect (repeatable)",
    "warm_spare": ("keep a spare process with torch imported next to the socket: `omni-sidecar upgrade` "
                   "forks the new sidecar from it and completes in well under a second instead of a cold "
                   "start (costs the memory of an idle torch import)"),
    "curve_keys": "directory with server.key_secret and authorized/ client keys; required for tcp://",
    "ring": ("accept the shared-memory rings shims offer for per-step messages (--no-ring keeps "
             "everything on ZeroMQ; shims turn it off with OMNI_SIDECAR_RING=0)"),
    "ring_spin_us": ("after its last ring message the sidecar keeps polling the rings this long, yielding "
                     "the CPU each time, before it sleeps until a shim's kick. Longer keeps the "
                     "next step's exchange at a few us when steps come further apart, at the price of a CPU "
                     "that polls; keep it short on small hosts where vLLM needs the cores"),
    "ring_spin_max_us": ("while a shim steps regularly, keep polling through the quiet spell between its steps (the "
                         "longest of the last few, plus a quarter) up to this long: a sleeping sidecar costs each "
                         "step a kick and a kernel wake-up on the shim's critical path. -1 (auto): 20000 with 8 or "
                         "more CPUs to run on (affinity, capped by a cgroup quota), else ring_spin_us (no stretching); "
                         "never when ring_spin_us is 0"),
    "gc_between_steps": ("run Python's cycle collector where no shim waits (after a StepEnd is answered and the "
                         "next plan built), with start-up's objects frozen out of its walks, instead of inside "
                         "whichever step an allocation trips it (a pause of up to tens of ms on the shim's critical "
                         "path); --no-gc-between-steps leaves the interpreter's default"),
    "torch_threads": ("torch's intra-op threads in the sidecar (0: torch's default, one per core). The sidecar's "
                      "tensor work is small and per step, beside a vLLM that keeps the cores busy: a pool that "
                      "wakes a thread per core for each larger copy costs more than it gives; raise it for "
                      "hooks that compute heavily on the CPU"),
    "ring_sleep_ms": ("a sleeping sidecar re-checks the rings at least this often: bounds the "
                      "cost of a missed kick (Python has no store-load fence)"),
}


class ServeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every `serve` setting and its default (its help in HELP; the CLI is generated from both)."""

    endpoint: str = ""
    hooks: str = "passthrough"
    hook_options: dict[str, str] = {}
    arena_mib: int = 0
    keep_finished: int = 10_000
    max_frame_mib: int = DEFAULT_MAX_FRAME_BYTES >> 20
    metrics_port: int = 0
    log_level: str = "INFO"
    log_format: Literal["plain", "json"] = "plain"
    drain_timeout_s: float = 10.0
    allow_uids: list[int] = []
    warm_spare: bool = False
    curve_keys: str = ""
    # The ring env names (OMNI_SIDECAR_RING, _RING_SPIN_US, _RING_SLEEP_MS) are the shim's too.
    ring: bool = True
    ring_spin_us: int = RING_SPIN_US
    ring_spin_max_us: int = -1
    gc_between_steps: bool = True
    torch_threads: int = 1
    ring_sleep_ms: int = RING_SLEEP_MS

    def __post_init__(self) -> None:
        if self.ring_spin_us < 0 or self.ring_spin_max_us < -1 or not 1 <= self.ring_sleep_ms <= RING_SLEEP_MS_MAX:
            raise ValueError(f"ring_spin_us must be >= 0, ring_spin_max_us >= -1 (auto) and ring_sleep_ms in "
                             f"[1, {RING_SLEEP_MS_MAX}]")
        if self.keep_finished < 0 or self.max_frame_mib <= 0 or self.arena_mib < 0 or self.torch_threads < 0:
            raise ValueError("keep_finished, arena_mib, torch_threads must be >= 0 and max_frame_mib > 0")

    @property
    def max_frame_bytes(self) -> int:
        return self.max_frame_mib << 20

    @property
    def arena_bytes(self) -> int:
        return self.arena_mib << 20


# Flags whose name is not the field's (repeatable ones are singular).
FLAG_NAMES = {"hook_options": "--hook-option", "allow_uids": "--allow-uid", "drain_timeout_s": "--drain-timeout"}


class Setting(NamedTuple):
    field: str
    flag: str
    default: Any  # msgspec.NODEFAULT for the repeatable ones (an empty collection)
    help: str
    choices: tuple[str, ...] | None


def settings() -> list[Setting]:
    """Every setting in declaration order, as the CLI offers it."""
    out = []
    for field in msgspec.inspect.type_info(ServeConfig).fields:
        values = getattr(field.type, "values", None)  # a Literal's
        flag = FLAG_NAMES.get(field.name, "--" + field.name.replace("_", "-"))
        out.append(Setting(field.name, flag, field.default, HELP[field.name],
                           tuple(values) if values else None))
    return out


RELOADABLE = ("log_level", "log_format", "keep_finished")
_ENV_KEYS = {  # env name -> field (OMNI_SIDECAR_ENDPOINT is shared with the shim)
    f"{ENV_PREFIX}{name.upper()}": name
    for name in ServeConfig.__struct_fields__
    if name not in ("hook_options", "allow_uids")
}


class ConfigError(OmniSidecarError, ValueError):
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
