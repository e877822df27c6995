"""Every upstream vLLM name the shim relies on, checked once at start-up.

The shim overrides these and calls super(); it never copies their bodies. If
an upgrade of vLLM renames one, start-up fails here with the list of what is
missing instead of failing mid-step.
"""

from __future__ import annotations

import importlib

from worker_shim.channel import SidecarError

# (module, dotted attribute) pairs resolved at import time.
UPSTREAM_NAMES: list[tuple[str, str]] = [
    ("vllm", "__version__"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.finish_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.add_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.load_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"),
    # Read at shutdown only (worker_shim/finishes.py), each with a fallback.
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput"),
    ("vllm.sampling_params", "SamplingParams.eos_token_id"),
    ("vllm.sampling_params", "SamplingParams.stop_token_ids"),
    ("vllm.v1.worker.gpu.model_runner", "ExecuteModelState"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch"),
    ("vllm.platforms", "current_platform"),
    ("vllm.distributed.parallel_state", "get_tp_group"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.broadcast"),
]
CPU_NAMES: list[tuple[str, str]] = [
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device"),
    ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
]
CUDA_NAMES: list[tuple[str, str]] = [
    ("vllm.v1.worker.gpu_worker", "Worker.init_device"),
]
# plugin.py routes top-k/top-p to torch when Triton runs interpreted; skipped when absent
# (start-up must not fail on it).
TOPK_TOPP_TRITON_FLAG = ("vllm.v1.sample.ops.topk_topp_sampler", "HAS_TRITON")
# Optional ModelConfig method, with a fallback to get_hidden_size (worker_shim/embeds.py
# `embeds_width`): the inputs_embeds width.
INPUTS_EMBEDS_SIZE_METHOD = "get_inputs_embeds_size"
# Model-state seam where upstream builds inputs_embeds (encoder rows merged in), 0.32's and
# 0.26's name; one must exist for multimodal models (worker_shim/runner.py).
MODEL_STATE_EMBEDS_METHODS = ["prepare_inputs_embeds", "get_mm_embeddings"]
# Layer capture (worker_shim/layers.py): multimodal models expose their language model by
# this method; its decoder layers are the ModuleList of this name, each called as
# layer(positions, hidden_states, residual) (vLLM's decoder-layer convention).
LANGUAGE_MODEL_METHOD = "get_language_model"
DECODER_LAYERS_ATTR = "layers"
# Attributes of live objects, checked on the instances once they exist.
RUNNER_INIT_ATTRS = ["vllm_config", "max_num_tokens"]  # before load_model
RUNNER_ATTRS = ["model_state", "model", "execute_model_state", "req_states", *RUNNER_INIT_ATTRS]
MODEL_STATE_METHODS = ["prepare_inputs", "prepare_dummy_inputs"]
# Read every step (worker_shim/batch.py); is_prefilling_np is used when present (0.26 lacks it).
INPUT_BATCH_FIELDS = [
    "req_ids",
    "num_tokens",
    "num_tokens_after_padding",
    "query_start_loc_np",
    "num_computed_tokens_np",
    "prefill_len_np",
    "input_ids",
]
# vLLM 0.12 made request ids unique per engine: the engine's id is the client's plus
# "-" and 8 random characters (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set).
REQUEST_ID_SUFFIX_SINCE = (0, 12)
REQUEST_ID_SUFFIX_LEN = 9


class ShimCompatError(SidecarError):
    """This vLLM lacks something the shim relies on (the message lists what)."""


def _resolve(module: str, dotted: str):
    obj = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_upstream(platform: str) -> None:
    names = UPSTREAM_NAMES + (CPU_NAMES if platform == "cpu" else CUDA_NAMES)
    missing = []
    for module, dotted in names:
        try:
            _resolve(module, dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module}.{dotted} ({type(exc).__name__})")
    if missing:
        raise ShimCompatError(_message(missing))
    try:
        from vllm.v1.worker.gpu.input_batch import InputBatch

        fields = getattr(InputBatch, "__dataclass_fields__", {})
        absent = [f for f in INPUT_BATCH_FIELDS if f not in fields]
    except ImportError:  # already reported above
        absent = []
    if absent:
        raise ShimCompatError(_message([f"InputBatch.{f}" for f in absent]))


def check_instance(obj: object, attrs: list[str], what: str) -> None:
    missing = [f"{what}.{a}" for a in attrs if not hasattr(obj, a)]
    if missing:
        raise ShimCompatError(_message(missing))


def check_one_of(obj: object, attrs: list[str], what: str) -> None:
    """At least one of `attrs` (names of one seam across vLLM versions)."""
    if not any(hasattr(obj, a) for a in attrs):
        raise ShimCompatError(_message([f"{what}.{' or '.join(attrs)}"]))


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"


def request_ids_suffixed(version: str, randomization_disabled: bool = False) -> bool:
    """Does this vLLM add its own suffix to the client's request id?"""
    if randomization_disabled:
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return True  # an unparsable (development) version: the current behaviour
    return (major, minor) >= REQUEST_ID_SUFFIX_SINCE


def upstream_request_ids_suffixed() -> bool:
    """`request_ids_suffixed` for the running vLLM (its own env flag read through vllm.envs)."""
    try:
        import vllm.envs as envs

        disabled = bool(getattr(envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", False))
    except Exception:
        disabled = False
    return request_ids_suffixed(vllm_version(), disabled)


def client_request_id(req_id: str, suffixed: bool) -> str:
    """The id the client gave vLLM ("7-1a2b3c4d" -> "7"); "" when it is `req_id` itself."""
    cut = REQUEST_ID_SUFFIX_LEN
    if suffixed and len(req_id) > cut and req_id[-cut] == "-":
        return req_id[:-cut]
    return ""


def _message(missing: list[str]) -> str:
    return (
        f"omni-sidecar's shim cannot run on vLLM {vllm_version()}: upstream names it "
        f"relies on are missing: {', '.join(missing)}. Supported: vLLM 0.32.x (CPU) and "
        "0.26.x (CUDA); see worker_shim/compat.py."
    )
