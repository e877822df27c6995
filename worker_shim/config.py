"""Shim settings: `additional_config["omni_sidecar"]` first, then env, then defaults.

The one module of the shim that reads its environment. Each setting's default
is its dataclass field's default; limits both sides share come from
proto/settings.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

from proto.endpoint import check_endpoint, default_endpoint
from proto.settings import (
    ENV_ENDPOINT,
    ENV_PREFIX,
    ENV_RING,
    ENV_RING_KIB,
    ENV_RING_SLEEP_MS,
    ENV_RING_SPIN_US,
    RING_KIB,
    RING_SLEEP_MS,
    RING_SLEEP_MS_MAX,
    RING_SPIN_US,
)

LossPolicy = Literal["fail-all", "fail-payload"]
ArenaChoice = Literal["auto", "shm", "cuda_ipc"]
EmbedsSetting = Literal["auto", "on", "off"]
# auto: the embeds buffer's lookup replays from CUDA graphs where vLLM runs graphs (one GPU, TP 1, no
# LoRA); off: it runs eagerly every step (worker_shim/model/embeds.py).
EmbedsGraphs = Literal["auto", "off"]
# auto: a model's graph-safe talker_mtp replays from CUDA graphs of the shim's own where vLLM runs FULL
# graphs, as vllm-omni's runner does; off: it runs eagerly every step (worker_shim/model/mtp_graphs.py).
MtpGraphs = Literal["auto", "off"]
# vllm-omni's `subtalker_sampling_params`: how a model's talker_mtp samples its residual codes.
SUBTALKER_SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")

ENV_SELECT = "OMNI_SIDECAR"  # "1" selects the shim where the endpoint is the default one
ENV_TRITON_INTERPRET = "TRITON_INTERPRET"  # vLLM's Triton kernels run in the interpreter
# auto: where vllm-omni is installed and its package not imported, the shim's plugin registers its
# Qwen3-TTS and Qwen3-Omni classes with upstream vLLM, loaded without its patches
# (worker_shim/omni_models/); off: not.
ENV_VLLM_OMNI_MODELS = "OMNI_SIDECAR_VLLM_OMNI_MODELS"
VllmOmniModels = Literal["auto", "off"]


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
    capacity_kib: int = RING_KIB
    spin_us: int = RING_SPIN_US
    sleep_ms: int = RING_SLEEP_MS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RingConfig":
        env = os.environ if environ is None else environ
        flag = env.get(ENV_RING, "1").strip().lower()
        if flag not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise ValueError(f"{ENV_RING}={flag!r}: use 1 (shared-memory ring for step messages) "
                                  "or 0 (everything over ZeroMQ)")
        cfg = cls(
            enabled=flag in ("1", "true", "on", "yes"),
            capacity_kib=int(env.get(ENV_RING_KIB, cls.capacity_kib)),
            spin_us=int(env.get(ENV_RING_SPIN_US, cls.spin_us)),
            sleep_ms=int(env.get(ENV_RING_SLEEP_MS, cls.sleep_ms)),
        )
        if not 4 <= cfg.capacity_kib <= 256 << 10 or cfg.spin_us < 0 or not 1 <= cfg.sleep_ms <= RING_SLEEP_MS_MAX:
            raise ValueError(f"{ENV_RING_KIB} must be in [4, 262144], {ENV_RING_SPIN_US} >= 0, "
                                  f"{ENV_RING_SLEEP_MS} in [1, {RING_SLEEP_MS_MAX}]")
        return cfg


_RING_KEYS = {"ring": ENV_RING, "ring_kib": ENV_RING_KIB, "ring_spin_us": ENV_RING_SPIN_US,
              "ring_sleep_ms": ENV_RING_SLEEP_MS}


@dataclass(frozen=True)
class ShimConfig:
    endpoint: str
    connect_timeout_s: float = 30.0
    step_timeout_s: float = 10.0
    hidden_slots: int = 2
    model_io_mib: float = 16.0  # per hidden slot: room for model updates and outputs (model hooks)
    loss_policy: LossPolicy = "fail-all"
    curve_keys: str = ""  # tcp:// only: dir with client.key_secret and server.key
    arena: ArenaChoice = "auto"  # how tensors cross to the sidecar
    embeds_buffer: EmbedsSetting = "auto"  # persistent inputs_embeds for overlays
    embeds_graphs: EmbedsGraphs = "auto"  # its per-step lookup from CUDA graphs of the shim's own
    talker_mtp_graphs: MtpGraphs = "auto"  # a model's talker_mtp from CUDA graphs of the shim's own
    ring: RingConfig = field(default_factory=RingConfig)  # the shared-memory ring fast path
    # Passed to a model's talker_mtp as keyword arguments, as vllm-omni's runner passes its
    # `subtalker_sampling_params`; empty: the model's own defaults (docs/ARCHITECTURE.md, "Model hooks").
    subtalker_sampling: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_vllm(cls, vllm_config: object) -> "ShimConfig":
        extra = getattr(vllm_config, "additional_config", None) or {}
        mine = extra.get("omni_sidecar", {}) if isinstance(extra, dict) else {}
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}

        def pick(key: str, env_suffix: str) -> str:
            default = defaults[key]
            return str(mine.get(key, os.environ.get(ENV_PREFIX + env_suffix, default)))

        endpoint = str(mine.get("endpoint", default_endpoint()))
        curve_keys = pick("curve_keys", "CURVE_KEYS")
        check_endpoint(endpoint, curve_keys or None)
        return cls(
            endpoint=endpoint,
            connect_timeout_s=float(pick("connect_timeout_s", "CONNECT_TIMEOUT")),
            step_timeout_s=float(pick("step_timeout_s", "STEP_TIMEOUT")),
            hidden_slots=_hidden_slots(int(pick("hidden_slots", "HIDDEN_SLOTS"))),
            model_io_mib=float(pick("model_io_mib", "MODEL_IO_MIB")),
            loss_policy=_loss_policy(pick("loss_policy", "LOSS_POLICY")),
            curve_keys=curve_keys,
            arena=_choice(pick("arena", "ARENA"), "arena", ArenaChoice,
                          "auto picks CUDA IPC on CUDA GPUs and host shared memory elsewhere"),
            embeds_buffer=_choice(pick("embeds_buffer", "EMBEDS_BUFFER"), "embeds_buffer", EmbedsSetting,
                                  "auto feeds the model from a persistent inputs_embeds buffer "
                                  "when the sidecar's hooks run before the forward"),
            embeds_graphs=_choice(pick("embeds_graphs", "EMBEDS_GRAPHS"), "embeds_graphs", EmbedsGraphs,
                                  "auto replays the embeds buffer's lookup from CUDA graphs where vLLM runs "
                                  "graphs (one GPU, TP 1, no LoRA); off looks up eagerly every step"),
            talker_mtp_graphs=_choice(pick("talker_mtp_graphs", "TALKER_MTP_GRAPHS"), "talker_mtp_graphs",
                                      MtpGraphs, "auto replays a graph-safe talker_mtp from CUDA graphs where "
                                      "vLLM runs FULL graphs, as vllm-omni does; off runs it eagerly"),
            ring=RingConfig.from_env({**os.environ, **{env: str(mine[key]) for key, env in _RING_KEYS.items()
                                                       if key in mine}}),
            subtalker_sampling=_subtalker_sampling(mine.get("subtalker_sampling", {})),
        )


def shim_selected() -> bool:
    """Is the shim meant to run in this process (`OMNI_SIDECAR_ENDPOINT` set, or `OMNI_SIDECAR=1`)?"""
    return bool(os.environ.get(ENV_ENDPOINT)) or os.environ.get(ENV_SELECT) == "1"


def vllm_omni_models() -> VllmOmniModels:
    """`OMNI_SIDECAR_VLLM_OMNI_MODELS` (auto by default): does the plugin register vllm-omni's models?"""
    return _choice(os.environ.get(ENV_VLLM_OMNI_MODELS, "auto").strip().lower(), ENV_VLLM_OMNI_MODELS,
                   VllmOmniModels, "auto registers vllm-omni's Qwen3-TTS and Qwen3-Omni classes, loaded without its "
                   "patches, where vllm-omni is installed; off leaves them alone")


def triton_interpreted() -> bool:
    return os.environ.get(ENV_TRITON_INTERPRET) == "1"


def _loss_policy(value: str) -> LossPolicy:
    if value not in get_args(LossPolicy):
        raise ValueError(
            f"loss_policy {value!r}: use fail-all (every request the lost sidecar served fails) or "
            "fail-payload (only requests carrying a sidecar payload fail; others run on unhooked)"
        )
    return value  # type: ignore[return-value]


def _hidden_slots(value: int) -> int:
    # A step's slot is rewritten only once the sidecar answered the step that last used it: with one
    # slot every step would wait for the sidecar's work on the step before (with two, the one before that).
    if value < 2:
        raise ValueError(f"omni_sidecar hidden_slots {value}: use 2 or more (with one slot each step "
                         "would wait for the sidecar's work on the previous step)")
    return value


def _subtalker_sampling(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not set(value) <= set(SUBTALKER_SAMPLING_KEYS):
        raise ValueError(f"omni_sidecar subtalker_sampling {value!r}: a dict with keys among "
                         f"{', '.join(SUBTALKER_SAMPLING_KEYS)} (vllm-omni's subtalker_sampling_params)")
    return dict(value)


def _choice(value: str, key: str, allowed: Any, why: str) -> Any:
    choices = get_args(allowed)
    if value not in choices:
        raise ValueError(f"omni_sidecar {key} {value!r}: use one of {', '.join(choices)} ({why})")
    return value
