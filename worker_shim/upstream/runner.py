"""Interception of the upstream V2 runner without copying it.

After upstream builds the runner (and its model state), the instance's class
is swapped for a dynamic subclass of `type(instance)` carrying the methods of
a mixin below. Upstream's own internal calls (`self.add_requests(...)` inside
`execute_model`) then reach these overrides, each of which calls the upstream
method through `super(<dynamic class>, self)` and adds only the sidecar work.

Why not `class X(Mixin, Upstream)`: CPython allows `__class__` assignment only
between classes of the same layout lineage, and upstream's classes differ
(GPUModelRunner roots at a plain mixin, model states at ABC), so a mixin
base that fits one refuses the other. A single-inheritance subclass always fits.
"""

from __future__ import annotations

import time
from typing import Any

from worker_shim.upstream.compat import (
    LORA_CONFIG_FIELD,
    MODEL_STATE_EMBEDS_METHODS,
    MODEL_STATE_METHODS,
    RUNNER_ATTRS,
    RUNNER_BLOCK_TABLES,
    RUNNER_INIT_ATTRS,
    check_instance,
    check_one_of,
    full_graph_sizes,
    graph_sizes,
    is_dummy_run,
    model_outputs_refusal,
    prompt_len_of,
    staged_writes_fail_without_kv_cache,
)
from worker_shim.errors import SidecarError
from worker_shim.model.embeds import LAYERS_GRAPH_KEY, EmbedsBuffer, embeds_width, mark_compiled_graph
from worker_shim.config import ShimConfig
from worker_shim.model.embeds import wanted as embeds_wanted
from worker_shim.model.layers import LayerCapture
from worker_shim.step.link import SidecarLink
from worker_shim.model.bridge import ModelBridge, attach_bridge, model_class_has_hooks, talker_mtp_graphed
from worker_shim.step.tp import TensorParallelFollower, TensorParallelSync
from worker_shim.step.plan_read import model_device


class SidecarRunnerMixin:
    """Overrides on the upstream GPUModelRunner / CPUModelRunner (V2)."""

    omni_link: SidecarLink | TensorParallelFollower
    omni_embeds: EmbedsBuffer | None = None
    omni_tp: TensorParallelSync | None = None  # TP>1: rank 0 drives, others follow
    omni_bridge: ModelBridge | None = None  # the model carries its own vllm-omni hooks
    omni_warming_up = False  # inside the worker's compile_or_warm_up_model: requests are vLLM's own
    omni_outputs_checked = False  # a forward that returned outputs was checked against the graph mode

    def finish_requests(self, scheduler_output: Any) -> None:
        self.omni_link.note_finished(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids)
        if self.omni_bridge is not None:
            self.omni_bridge.note_finished(scheduler_output.finished_req_ids)
        return _up(self).finish_requests(scheduler_output)  # type: ignore[misc]

    def add_requests(self, scheduler_output: Any) -> None:
        self.omni_link.note_new(scheduler_output.scheduled_new_reqs)
        if self.omni_bridge is not None:
            for req in scheduler_output.scheduled_new_reqs:
                self.omni_bridge.note_new(req.req_id, prompt_len_of(req), warmup=self.omni_warming_up)
        return _up(self).add_requests(scheduler_output)  # type: ignore[misc]

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if is_dummy_run(args, kwargs):
            return _up(self).execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        self.omni_link.begin_step()
        before = self.execute_model_state
        try:
            out = _up(self).execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self.omni_link.abort_step()
            raise
        state = self.execute_model_state
        # Steps without a forward (finish-only) leave the state untouched.
        state = None if state is before else state
        bridge = self.omni_bridge
        results = None
        if bridge is not None and state is not None:
            t0 = time.perf_counter()
            self.omni_link.note_model_errors(bridge.after_forward(state.input_batch, state.hidden_states))
            results = bridge.take_step()
            if bridge.forward_returns_outputs and not self.omni_outputs_checked:
                self.omni_refuse_lost_outputs()  # a forward that returned none in vLLM's warm-up runs
            if isinstance(self.omni_link, SidecarLink):  # model hooks run with TP size 1 only
                counters = self.omni_link.counters
                counters.record_timing(counters.model_hook_us, bridge.host_us + (time.perf_counter() - t0) * 1e6)
            bridge.host_us = 0.0
        self.omni_link.end_step(state, results)
        return out

    def omni_refuse_lost_outputs(self) -> None:
        """A forward that returned outputs beside its hidden states, under FULL CUDA graphs: refused
        (compat's `model_outputs_refusal`). Asked after vLLM's profile run and graph capture (start-up),
        and at the first real step whose forward returned outputs where those runs' did not."""
        bridge = self.omni_bridge
        if self.omni_outputs_checked or bridge is None or not bridge.forward_returns_outputs:
            return
        refusal = model_outputs_refusal(self.vllm_config)
        if refusal:
            raise SidecarError(refusal)
        self.omni_outputs_checked = True

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        """Upstream's; for a model without KV cache on a vLLM whose block tables cannot apply their
        staged writes then (compat's STAGED_WRITES_WITHOUT_KV_SINCE), the tables' writes are skipped."""
        out = _up(self).initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]
        block_tables = getattr(self, RUNNER_BLOCK_TABLES, None)
        if block_tables is not None and staged_writes_fail_without_kv_cache(block_tables):
            swap_class(block_tables, BlockTablesWithoutKVMixin)
        return out

    def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """The step's batch, as vLLM built it: its StepBegin goes now, when it needs a plan, and
        `SidecarModelStateMixin.prepare_inputs` takes the plan after vLLM's attention metadata and
        the embeds (the sidecar plans meanwhile)."""
        input_batch = _up(self).prepare_inputs(*args, **kwargs)  # type: ignore[misc]
        if self.omni_bridge is not None:
            self.omni_bridge.clear_written_ids(input_batch)
        link = self.omni_link
        if link.in_step:
            link.ask_early(input_batch, self.omni_bridge)
        return input_batch

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = _up(self).sample_tokens(*args, **kwargs)  # type: ignore[misc]
        self.omni_link.note_sampled(out)
        return out

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        check_instance(self, RUNNER_INIT_ATTRS, "GPUModelRunner")
        link = self.omni_link
        mcfg = self.vllm_config.model_config
        upstream_embeds = bool(getattr(self, "supports_mm_inputs", False) or
                               getattr(mcfg, "enable_prompt_embeds", False))
        hooked = model_class_has_hooks(self.vllm_config)
        use_embeds = hooked or embeds_wanted(link.embeds_setting, link.needs.pre_forward, upstream_embeds)
        if use_embeds:
            mark_compiled_graph(self.vllm_config)
        capture_layers = bool(link.needs.hidden_layers) and isinstance(link, SidecarLink)  # rank 0 sends them
        if capture_layers:
            mark_compiled_graph(self.vllm_config, LAYERS_GRAPH_KEY, sorted(link.needs.hidden_layers))
        out = _up(self).load_model(*args, **kwargs)  # type: ignore[misc]
        check_instance(self, RUNNER_ATTRS, "GPUModelRunner")
        check_instance(self.model_state, MODEL_STATE_METHODS, "model_state")
        if upstream_embeds:
            check_one_of(self.model_state, MODEL_STATE_EMBEDS_METHODS, "model_state")
        swap_class(self.model_state, SidecarModelStateMixin)
        self.model_state.omni_runner = self
        settings = ShimConfig.from_vllm(self.vllm_config)
        # The model's talker_mtp from graphs of ours where vllm-omni's runner replays it from one.
        mtp_sizes = (full_graph_sizes(self.vllm_config) if settings.talker_mtp_graphs == "auto"
                     and talker_mtp_graphed(self.model) else [])
        self.omni_bridge = attach_bridge(self.model, self.omni_tp, link.embeds_setting, settings.subtalker_sampling,
                                         mtp_sizes)
        if self.omni_bridge is not None:
            link.mirror_sink = self.omni_bridge.apply_appended
        if self.omni_bridge is not None and not use_embeds:  # hooks set on the instance only
            mark_compiled_graph(self.vllm_config)
            use_embeds = True
        if use_embeds:
            # Not captured: TP > 1 (the lookup all-reduces across ranks); LoRA (its embedding reads host
            # state per step that a graph would freeze); a user's `embeds_graphs=off`.
            graphs = (self.omni_tp is None and getattr(self.vllm_config, LORA_CONFIG_FIELD, None) is None
                      and settings.embeds_graphs == "auto")
            sizes = graph_sizes(self.vllm_config) if graphs else []
            self.omni_embeds = EmbedsBuffer(int(self.max_num_tokens), embeds_width(mcfg),
                                            mcfg.dtype, model_device(self.model), sizes)
        if capture_layers:
            link.ends.layer_capture = LayerCapture(
                self.model, int(mcfg.hf_text_config.num_hidden_layers), list(link.needs.hidden_layers),
                int(self.max_num_tokens), int(mcfg.get_hidden_size()), mcfg.dtype, model_device(self.model))
        return out


class SidecarModelStateMixin:
    """Adds the sidecar's overlay rows and extra kwargs to the model inputs.

    Upstream merges the dict `model_state.prepare_inputs` returns over the
    default model inputs ("values returned by prepare_inputs will override the
    default values"), so this is where inputs_embeds and extra kwargs go.

    Where upstream builds inputs_embeds itself (multimodal models: token
    embeddings with the encoder's rows merged in; prompt embeds), overlays land
    on those rows in place, never on a re-embedding of input_ids
    (docs/ARCHITECTURE.md, "Multimodal inputs").
    """

    omni_runner: Any
    omni_upstream_embeds: Any = None  # this step's inputs_embeds as upstream built them

    def prepare_inputs_embeds(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM 0.32: the merged inputs_embeds, kept for this step's overlays."""
        embeds = _up(self).prepare_inputs_embeds(*args, **kwargs)  # type: ignore[misc]
        self.omni_upstream_embeds = embeds
        return embeds

    def get_mm_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM 0.26's name for prepare_inputs_embeds."""
        embeds = _up(self).get_mm_embeddings(*args, **kwargs)  # type: ignore[misc]
        self.omni_upstream_embeds = embeds
        return embeds

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        inputs = _up(self).prepare_inputs(input_batch, req_states)  # type: ignore[misc]
        runner = self.omni_runner
        link: SidecarLink | TensorParallelFollower = runner.omni_link
        buffer: EmbedsBuffer | None = runner.omni_embeds
        # Upstream calls the embeds seam (if at all) just before this, in the same step.
        embeds, self.omni_upstream_embeds = self.omni_upstream_embeds, None
        if embeds is None and buffer is not None:
            n = int(input_batch.num_tokens_after_padding)
            embeds = buffer.fill(runner.model, input_batch.input_ids, n)
            # input_ids stay: models that read raw tokens next to the embeddings still get them.
            inputs = {**inputs, "inputs_embeds": embeds}
        bridge: ModelBridge | None = runner.omni_bridge
        if link.in_step:
            extra = link.pre_forward(input_batch, runner.model, embeds, bridge)
            tp: TensorParallelSync | None = runner.omni_tp
            if tp is not None and tp.step_needs_broadcast(input_batch):
                mcfg = runner.vllm_config.model_config
                extra = tp.exchange(extra, embeds, int(input_batch.num_tokens_after_padding),
                                    embeds_width(mcfg), mcfg.dtype, model_device(runner.model))
            if extra:
                inputs = {**inputs, **extra}
            if bridge is not None and embeds is not None:
                t0 = time.perf_counter()
                bridge.before_forward(input_batch, embeds)  # after the plan: states, overlays in place
                bridge.host_us += (time.perf_counter() - t0) * 1e6
        return inputs

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        """Graph capture: graphs are captured reading the embeds real steps will use."""
        inputs = _up(self).prepare_dummy_inputs(num_reqs, num_tokens)  # type: ignore[misc]
        buffer: EmbedsBuffer | None = self.omni_runner.omni_embeds
        # Where upstream brings its own persistent embeds, real steps use those too (prepare_inputs).
        if buffer is not None and inputs.get("inputs_embeds") is None:
            inputs = {**inputs, "inputs_embeds": buffer.rows(num_tokens)}
        return inputs


class BlockTablesWithoutKVMixin:
    """On upstream's V2 BlockTables of a runner without KV cache groups, where that vLLM's
    `apply_staged_writes` takes its multi-group branch then: no table, nothing to write."""

    def apply_staged_writes(self, *args: Any, **kwargs: Any) -> Any:
        if self.num_kv_cache_groups == 0:  # type: ignore[attr-defined]
            return None
        return _up(self).apply_staged_writes(*args, **kwargs)  # type: ignore[misc]


def _up(obj: Any) -> Any:
    """`super()` of the swapped-in class: the upstream class the instance had."""
    return super(obj._omni_cls, obj)


_SUBCLASS_CACHE: dict[tuple[type, type], type] = {}


def swap_class(obj: object, mixin: type) -> None:
    base = type(obj)
    if getattr(base, "_omni_mixin", None) is mixin:
        return
    key = (mixin, base)
    cls = _SUBCLASS_CACHE.get(key)
    if cls is None:
        methods = {k: v for k, v in vars(mixin).items() if not k.startswith("__")}
        cls = type(
            f"Omni{base.__name__}",
            (base,),
            {**methods, "__module__": __name__, "__doc__": mixin.__doc__, "_omni_mixin": mixin},
        )
        cls._omni_cls = cls
        _SUBCLASS_CACHE[key] = cls
    obj.__class__ = cls
