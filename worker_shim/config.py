"""Shim settings: `additional_config["omni_sidecar"]` first, then env, then defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass

from proto.endpoint import check_endpoint, default_endpoint


@dataclass(frozen=True)
class ShimConfig:
    endpoint: str
    connect_timeout_s: float
    step_timeout_s: float
    hidden_slots: int
    loss_policy: str  # "fail-all" | "fail-payload"
    curve_keys: str  # tcp:// only: dir with client.key_secret and server.key
    arena: str = "auto"  # "auto" | "shm" | "cuda_ipc": how tensors cross to the sidecar
    embeds_buffer: str = "auto"  # "auto" | "on" | "off": persistent inputs_embeds for overlays
    ring: "RingConfig | None" = None  # the shared-memory ring fast path (None: from the environment)

    @classmethod
    def from_vllm(cls, vllm_config: object) -> "ShimConfig":
        extra = getattr(vllm_config, "additional_config", None) or {}
        mine = extra.get("omni_sidecar", {}) if isinstance(extra, dict) else {}

        def pick(key: str, env: str, default: str) -> str:
            return str(mine.get(key, os.environ.get(env, default)))

        endpoint = pick("endpoint", "OMNI_SIDECAR_ENDPOINT", default_endpoint())
        curve_keys = pick("curve_keys", "OMNI_SIDECAR_CURVE_KEYS", "")
        check_endpoint(endpoint, curve_keys or None)
        return cls(
            endpoint=endpoint,
            connect_timeout_s=float(pick("connect_timeout_s", "OMNI_SIDECAR_CONNECT_TIMEOUT", "30")),
            step_timeout_s=float(pick("step_timeout_s", "OMNI_SIDECAR_STEP_TIMEOUT", "10")),
            hidden_slots=int(pick("hidden_slots", "OMNI_SIDECAR_HIDDEN_SLOTS", "2")),
            loss_policy=_policy(pick("loss_policy", "OMNI_SIDECAR_LOSS_POLICY", "fail-all")),
            curve_keys=curve_keys,
            arena=_choice(pick("arena", "OMNI_SIDECAR_ARENA", "auto"), "arena",
                          ("auto", "shm", "cuda_ipc"),
                          "auto picks CUDA IPC on CUDA GPUs and host shared memory elsewhere"),
            embeds_buffer=_choice(pick("embeds_buffer", "OMNI_SIDECAR_EMBEDS_BUFFER", "auto"),
                                  "embeds_buffer", ("auto", "on", "off"),
                                  "auto feeds the model from a persistent inputs_embeds buffer "
                                  "when the sidecar's hooks run before the forward"),
            ring=RingConfig.from_env({**os.environ, **{env: str(mine[key]) for key, env in _RING_KEYS.items()
                                                       if key in mine}}),
        )


def _policy(value: str) -> str:
    if value not in ("fail-all", "fail-payload"):
        raise ValueError(
            f"loss_policy {value!r}: use fail-all (every request the lost sidecar served fails) or "
            "fail-payload (only requests carrying a sidecar payload fail; others run on unhooked)"
        )
    return value


def _choice(value: str, key: str, allowed: tuple[str, ...], why: str) -> str:
    if value not in allowed:
        raise ValueError(f"omni_sidecar {key} {value!r}: use one of {', '.join(allowed)} ({why})")
    return value


@dataclass(frozen=True)
class RingConfig:
    """The shared-memory ring fast path (proto/shmring.py), from `OMNI_SIDECAR_RING*`.

    From `additional_config["omni_sidecar"]` (keys ring, ring_kib, ring_spin_us,
    ring_sleep_ms) over the environment; every connection (start-up, reconnect, hot
    upgrade) gets the same settings.

    spin_us: how long the shim polls the ring (yielding the CPU each time, never a hot
    loop) for a reply before it sleeps on the socket. A StepPlan usually comes within
    tens of µs; sleeping costs a kick and a kernel wake-up (~35-70 µs here), spinning
    costs a core that vLLM's own threads may want, hence a bounded window.
    sleep_ms: how long a sleeper blocks (whole ms, what zmq_poll takes) before re-checking
    the ring. The sidecar's kick normally wakes it at once; Python has no store-load
    fence, so a kick can be missed (rarely), and this bounds what that costs.
    """

    enabled: bool = True
    capacity_kib: int = 1024
    spin_us: int = 2000
    sleep_ms: int = 2

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "RingConfig":
        env = os.environ if environ is None else environ
        flag = env.get("OMNI_SIDECAR_RING", "1").strip().lower()
        if flag not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise ValueError(f"OMNI_SIDECAR_RING={flag!r}: use 1 (shared-memory ring for step messages) or 0 "
                             "(everything over ZeroMQ)")
        cfg = cls(
            enabled=flag in ("1", "true", "on", "yes"),
            capacity_kib=int(env.get("OMNI_SIDECAR_RING_KIB", "1024")),
            spin_us=int(env.get("OMNI_SIDECAR_RING_SPIN_US", "2000")),
            sleep_ms=int(env.get("OMNI_SIDECAR_RING_SLEEP_MS", "2")),
        )
        if not 4 <= cfg.capacity_kib <= 256 << 10 or cfg.spin_us < 0 or not 1 <= cfg.sleep_ms <= 1000:
            raise ValueError("OMNI_SIDECAR_RING_KIB must be in [4, 262144], OMNI_SIDECAR_RING_SPIN_US >= 0, "
                             "OMNI_SIDECAR_RING_SLEEP_MS in [1, 1000]")
        return cfg


_RING_KEYS = {"ring": "OMNI_SIDECAR_RING", "ring_kib": "OMNI_SIDECAR_RING_KIB",
              "ring_spin_us": "OMNI_SIDECAR_RING_SPIN_US", "ring_sleep_ms": "OMNI_SIDECAR_RING_SLEEP_MS"}
