"""The per-step messages: the batch layout, StepStart, StepBegin -> StepPlan, StepEnd | StepTick -> StepResult.

Part of proto.messages' one tagged union (see its docstring for the conversation); importers may
take these names from either module: the same classes, the same tags. The hot path: request ids and
per-request lists carry length bounds so a decoder rejects absurd frames early.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from proto.capabilities import Count, LayerIndex, MAX_LAYERS, ModelHooks, Text
from proto.tensors import TensorRef

MAX_BATCH = 1 << 16
MAX_PLAN_TENSORS = 1 << 16  # tensors beside one message's trees (StepPlan.stacks, StepEnd.tensors)
MAX_STEP_TOKENS = 1 << 20
MAX_ID_LEN = 256
ReqId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]


class NewRequest(msgspec.Struct, frozen=True, array_like=True):
    req_id: ReqId  # vLLM's id for the request (unique while it lives)
    prompt_len: Count
    prompt_token_ids: Annotated[list[int], msgspec.Meta(max_length=1 << 24)]
    # The request's `extra_args["omni_sidecar"]`: JSON-like values and bytes.
    payload: dict[str, Any] | None = None
    # The id the client gave the request (vLLM may add a suffix to make `req_id` unique);
    # "" when it equals `req_id`. Clients look outputs up by either.
    client_req_id: ReqId = ""


U32_BYTES = 4  # one entry of a BatchLayout array


class BatchLayout(msgspec.Struct, frozen=True, array_like=True):
    """The scheduled batch in the runner's row order, its per-request ints as packed arrays.

    Request i owns rows [query_start_loc[i], query_start_loc[i+1]) of the step's token-major
    tensors (inputs_embeds, hidden states). `req_ids` is None when it equals the previous layout's
    on this connection (steady decode): decoding request-id strings is the bulk of a step
    message's cost. Each array is little-endian u32 (proto/packed.py packs, checks and unpacks
    them): the shim writes vLLM's numpy arrays as they are, and the sidecar makes ints only when a
    hook reads them (a msgpack list costs a Python int per entry on both ends). Lengths are
    checked against the request count before any hook sees the layout.
    """

    req_ids: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_BATCH)] | None
    query_start_loc: Annotated[bytes, msgspec.Meta(max_length=U32_BYTES * (MAX_BATCH + 1))]
    num_computed_tokens: Annotated[bytes, msgspec.Meta(max_length=U32_BYTES * MAX_BATCH)]
    # Tokens of each request that are prefill (vLLM's prefill_len: the prompt, plus the output
    # tokens a resumed request recomputes); rows at or past it are decode rows.
    prefill_lens: Annotated[bytes, msgspec.Meta(max_length=U32_BYTES * MAX_BATCH)]
    # Only when the hook set's needs ask (HookNeeds.input_ids): each row's input token id.
    input_ids: Annotated[bytes, msgspec.Meta(max_length=U32_BYTES * MAX_STEP_TOKENS)] | None = None


class Discarded(msgspec.Struct, frozen=True, array_like=True):
    """A request's forward whose sample vLLM discarded: with async scheduling vLLM launches step N+1
    before it reads step N's samples, so a request that step N finished (a stop token, a stop string,
    an abort) ran once more in `step`. What that step added to the request's outputs is not the
    request's; it comes with the request's finish notice (docs/ARCHITECTURE.md, "Async scheduling")."""

    req_id: ReqId
    step: Count


class StepBegin(msgspec.Struct, tag="step_begin", frozen=True):
    step: Count
    batch: BatchLayout
    new_requests: Annotated[list[NewRequest], msgspec.Meta(max_length=MAX_BATCH)] = []
    finished: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_BATCH)] = []
    preempted: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_BATCH)] = []
    # Model hooks: requests whose initial state the shim's mirror lacks (new to this
    # shim); the plan answers with `model_states`. `model_hooks` rides along because the
    # Hello goes out before vLLM loads the model (only then are its hooks known).
    want_states: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_BATCH)] = []
    model_hooks: ModelHooks | None = None
    discarded: Annotated[list[Discarded], msgspec.Meta(max_length=MAX_BATCH)] = []


class Overlay(msgspec.Struct, frozen=True, array_like=True):
    """Rows [row_start, row_start + rows.shape[0]) of inputs_embeds take `rows`."""

    row_start: Count
    rows: TensorRef


class RequestError(msgspec.Struct, frozen=True, array_like=True):
    req_id: ReqId
    message: Text
    # Shim -> sidecar (StepEnd.failed): the client's id for a request the sidecar may never have
    # seen, so clients asking by their own id learn the failure too; "" when it equals req_id.
    client_req_id: ReqId = ""


class StepPlan(msgspec.Struct, tag="step_plan", frozen=True):
    """Overlay rows, extra forward kwargs and initial model states for this step.

    `extra_kwargs` and `model_states` are msgpack trees (proto/plan_trees.py; b"": empty) whose
    tensors are extension values naming `stacks`, tensors in the sidecar's arena: the shim copies
    the stacks out, then decodes each tree with every tensor put in place as it is met.
    `model_states` decodes as {req_id: state}; a state is any tree, not a str-keyed dict
    (vllm-omni's `hidden_states.layers` is keyed by int).
    """

    step: Count
    overlays: Annotated[list[Overlay], msgspec.Meta(max_length=MAX_BATCH)] = []
    extra_kwargs: bytes = b""
    errors: Annotated[list[RequestError], msgspec.Meta(max_length=MAX_BATCH)] = []
    # CUDA IPC: the ready event the shim's stream waits on before reading this plan's tensors.
    event: Annotated[int, msgspec.Meta(ge=-1, le=63)] = -1
    # The state of each request named in `want_states` (the sidecar's decoded payload).
    model_states: bytes = b""
    # Every tensor of the plan's trees: same-shaped ones stacked into one, a tensor alone of its
    # kind a stack used whole (omni_arena/tensor_tree.py, TreeEncoder).
    stacks: Annotated[list[TensorRef], msgspec.Meta(max_length=MAX_PLAN_TENSORS)] = []


class StepEnd(msgspec.Struct, tag="step_end", frozen=True):
    """Sent after the forward of every step (and for finish-only steps, batch=None).

    Carries what a StepBegin did not already carry for this step.
    """

    step: Count
    batch: BatchLayout | None = None
    new_requests: Annotated[list[NewRequest], msgspec.Meta(max_length=MAX_BATCH)] = []
    finished: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_BATCH)] = []
    preempted: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_BATCH)] = []
    hidden: TensorRef | None = None
    # Captured decoder layers' input hidden states (HookNeeds.hidden_layers), same slot and event.
    hidden_layers: Annotated[dict[LayerIndex, TensorRef], msgspec.Meta(max_length=MAX_LAYERS)] = {}
    num_tokens: Count = 0
    # Shim-side timings of this step, exported by the sidecar's /metrics.
    shim_exchange_us: float = 0.0
    shim_post_us: float = 0.0
    # Requests the shim failed because no sidecar served them (a previous one died):
    # the sidecar records the errors so clients asking it get them.
    failed: Annotated[list[RequestError], msgspec.Meta(max_length=1 << 17)] = []
    # CUDA IPC: the ready event recorded after this step's slot was written (hidden states,
    # model updates and outputs; -1: none).
    hidden_event: Annotated[int, msgspec.Meta(ge=-1, le=63)] = -1
    # Model hooks: per request, this step's merged state updates and its outputs (e.g.
    # {"codes": {"audio": [1, Q]}}), each a msgpack tree {req_id: tree} (b"": none) whose tensors
    # are extension values naming `tensors` (proto/plan_trees.py, as a plan's).
    model_updates: bytes = b""
    model_outputs: bytes = b""
    # The trees' tensors: refs into the step's hidden slot, after the hidden rows.
    tensors: Annotated[list[TensorRef], msgspec.Meta(max_length=MAX_PLAN_TENSORS)] = []
    discarded: Annotated[list[Discarded], msgspec.Meta(max_length=MAX_BATCH)] = []


class StepTick(msgspec.Struct, tag="step_tick", frozen=True):
    """Ends a step that brought the sidecar nothing new (no request changes, tensors, model
    results or failures) when its hooks read no per-step layout (`HookNeeds.step_layouts` False).

    Scalars only, so its size does not grow with the batch (under 100 bytes): what the sidecar
    counts per step (`status`, /metrics) and the shim's timings. Not answered, except by a
    StepResult carrying `switch_to` while a hot upgrade waits (docs/ARCHITECTURE.md, Step sequence).
    """

    step: Count
    num_tokens: Count = 0
    shim_exchange_us: float = 0.0
    shim_post_us: float = 0.0


class StepResult(msgspec.Struct, tag="step_result", frozen=True):
    step: Count
    errors: Annotated[list[RequestError], msgspec.Meta(max_length=MAX_BATCH)] = []
    hook_us: float = 0.0
    # A successor sidecar is ready: switch to it at the next step boundary.
    switch_to: Text = ""


class StepStart(msgspec.Struct, tag="step_start", frozen=True):
    """The shim, first thing in a step: a sidecar hands a session over on its own
    only between steps (docs/ARCHITECTURE.md, Hot upgrade). `answer`: the shim was quiet long
    enough that the sidecar may be handing it over right now; it waits for Pong(step), or finds
    the SwitchAck before it."""

    step: Count
    answer: bool = False
    # The last MirrorUpdate the shim applied to its mirror before this step (0: none yet).
    mirror_seq: Count = 0
