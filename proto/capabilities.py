"""What each side offers and needs, agreed at the handshake: arenas, the hook set's needs, the model's hooks.

Part of the wire schema (proto/messages.py re-exports every name here).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Name = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
MAX_LAYERS = 64  # captured decoder layers per step
LayerIndex = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]

IpcHandle = Annotated[bytes, msgspec.Meta(max_length=256)]
# "shm": POSIX shared memory (CPU, or host staging for accelerators); "cuda_ipc": device memory.
ArenaKind = Literal["shm", "cuda_ipc"]


class CudaIpcInfo(msgspec.Struct, frozen=True):
    """What the peer needs to open a CUDA IPC arena once: the buffer and its event ring.

    The fields are torch's `UntypedStorage._share_cuda_()` export (device memory
    handle, the storage's place in its allocation, torch's cross-process
    ref-counter) plus the producer's interprocess "ready" events, one per slot.
    `device_uuid` lets the peer pick the same physical GPU whatever its
    CUDA_VISIBLE_DEVICES numbering.
    """

    device_uuid: Name
    mem_handle: IpcHandle
    storage_size: Count
    storage_offset: Count
    ref_counter_handle: IpcHandle
    ref_counter_offset: Count
    alloc_event_handle: IpcHandle
    alloc_event_sync: bool
    ready_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=64)] = []


class ArenaInfo(msgspec.Struct, frozen=True):
    """A shared buffer one side created; the other side opens it once."""

    kind: ArenaKind
    name: Name
    size: Count
    device: Name = "cpu"
    cuda: CudaIpcInfo | None = None


class HookNeeds(msgspec.Struct, frozen=True):
    """What the loaded hook set needs from the shim; decides the per-step traffic.

    pre_forward: when the shim must ask before the forward (a blocking StepBegin):
      "never", "prefill" (only on steps that schedule prompt tokens) or "always".
    hidden_states: the last-layer hidden states of every scheduled token.
    pre_forward_scope: "all" requests, or only requests that carry a payload
      (`extra_args["omni_sidecar"]`); a step whose requests need nothing gets no
      blocking exchange at all.
    prefix_cache_safe: False when hooks change what a prompt token means (overlaid
      embeddings), so KV computed for one request must not be reused by another.

    input_ids: each row's input token id in the layout (`BatchLayout.input_ids`; for a decode
      row, the token the previous step sampled), so hooks that write decode rows need no vLLM
      internals; costs a device-to-host copy per step, so only hook sets that read them ask.
    model_states: the hook set keeps the per-request state of a model that carries its own
      hooks (docs/ARCHITECTURE.md, "Model hooks"): it answers `StepBegin.want_states` with
      `StepPlan.model_states` and takes `StepEnd.model_updates` / `model_outputs`.
    hidden_layers: decoder layers whose input hidden states (vllm-omni's
      `hidden_states["layers"][N]`: N = 0 is the embeddings) the hooks get with
      the last-layer ones, every scheduled token; needs hidden_states.
    extra_kwargs: the plans carry extra model forward kwargs (`build_extra_kwargs`). A FULL
      CUDA graph replays what it captured and never sees them, so the shim refuses FULL graphs
      with such hooks at start-up (docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs").
    step_layouts: the hooks read every step's layout (`process_model_output`). False: a
      step that brings the sidecar nothing new (no request changes, tensors or failures) ends
      with a fixed-size StepTick instead of a StepEnd (docs/ARCHITECTURE.md, Step sequence).
      The sidecar's Welcome turns it off for a hook set that does not override
      `process_model_output`.
    """

    pre_forward: Literal["never", "prefill", "always"] = "never"
    pre_forward_scope: Literal["all", "payload"] = "all"
    hidden_states: bool = False
    prefix_cache_safe: bool = True
    model_states: bool = False
    input_ids: bool = False
    hidden_layers: Annotated[list[LayerIndex], msgspec.Meta(max_length=MAX_LAYERS)] = []
    extra_kwargs: bool = False
    step_layouts: bool = True


class ModelHooks(msgspec.Struct, frozen=True, array_like=True):
    """The vllm-omni hooks the served model carries (found on the model once vLLM loaded it).

    mtp_output_key: "cat.qual" its talker_mtp codes go under ("" without talker_mtp).
    resident_keys: "cat.qual" state entries the model keeps on its device.
    """

    has_preprocess: bool = False
    has_postprocess: bool = False
    batch_decode_preprocess: bool = False
    mtp_output_key: Name = ""
    resident_keys: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
