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
