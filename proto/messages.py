"""Every message the shim, the sidecar and control clients exchange.

One tagged union, msgpack on the wire. Tensors never travel inline on the hot
path: messages carry `TensorRef`s into arenas opened once at handshake. Lists
and strings carry length bounds so a decoder rejects absurd frames early.

Conversation (see README "Protocol"):
  shim -> Hello, sidecar -> Welcome | Reject                    (once per connection)
  shim -> StepBegin, sidecar -> StepPlan    (only when the sidecar declared
                                              `needs.pre_forward` and the step has rows)
  shim -> StepEnd,   sidecar -> StepResult  (a step that brings the sidecar something; the shim
                                              does not wait for the result before the next step)
  shim -> StepTick                          (any other step, when the hooks read no per-step
                                              layout; answered only by a StepResult with switch_to)
  any  -> Ping / StatusQuery / OutputsQuery / Drain   (control, any client)
  any  -> AppendPayload, sidecar -> AppendReply | ErrorReply  (entries into a running request)
  sidecar -> MirrorUpdate, unsolicited; acknowledged by StepStart.mirror_seq (appends to mirrored state)
  any  -> ErrorReply                         (a frame was rejected; the peer keeps serving)

The handshake and control messages are here; the per-step ones in proto/steps.py, the hot-upgrade
ones in proto/upgrade.py. This module is the one union of them all: import any message from here.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from proto.capabilities import ArenaInfo, ArenaKind, Count, CudaIpcInfo, HookNeeds, IpcHandle, ModelHooks, Name, Text
from proto.steps import (BatchLayout, Discarded, MAX_BATCH, MAX_ID_LEN, MAX_PLAN_TENSORS, MAX_STEP_TOKENS, NewRequest,
                         Overlay, ReqId, RequestError, StepBegin, StepEnd, StepPlan, StepResult, StepStart, StepTick,
                         U32_BYTES)
from proto.upgrade import SwitchAck, SwitchReady, Takeover, TakeoverState


# -- handshake ---------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    protocol_major: int
    protocol_minor: int
    shim_version: Name
    vllm_version: Name
    platform: Name
    rank: Count
    world_size: Count
    model: Text
    hidden_size: Count
    dtype: Name
    max_num_tokens: Count
    arenas: Annotated[list[ArenaInfo], msgspec.Meta(max_length=16)]
    # Set when switching to a sidecar that took over: names the state it imported.
    resume_token: Name = ""
    # Shared-memory rings the shim offers for the per-step messages (proto/shmring.py):
    # [shim -> sidecar, sidecar -> shim]. Empty: everything over the socket.
    rings: Annotated[list[ArenaInfo], msgspec.Meta(max_length=2)] = []
    # CUDA IPC: the shim's "done" events for the sidecar's arena (it waits on them before reuse).
    consumer_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=64)] = []
    # The shim's process and PID namespace: a sidecar in the same namespace notices when that
    # process is gone and ends its session (ZeroMQ tells a ROUTER nothing per peer).
    pid: Count = 0
    pid_namespace: Name = ""
    # vLLM schedules asynchronously: a request's latest step may yet be discarded (StepEnd.discarded).
    async_scheduling: bool = False


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """The sidecar accepts a Hello: what it speaks, which hooks serve, what they need."""

    protocol_major: int
    protocol_minor: int
    sidecar_version: Name
    hook_set: Name
    needs: HookNeeds
    session: Count
    arenas: Annotated[list[ArenaInfo], msgspec.Meta(max_length=16)] = []
    # The sidecar mapped the Hello's rings: step messages travel through them from now on.
    rings: bool = False
    # CUDA IPC: the sidecar's "done" events, one per slot of the shim's hidden-state arena.
    consumer_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=64)] = []


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """Handshake refused; `reason` is meant for a human and says what to do."""

    reason: Text


# -- control -----------------------------------------------------------------


class Ping(msgspec.Struct, tag="ping", frozen=True):
    nonce: int = 0


class Pong(msgspec.Struct, tag="pong", frozen=True):
    nonce: int = 0


class StatusQuery(msgspec.Struct, tag="status", frozen=True):
    pass


class SessionStatus(msgspec.Struct, frozen=True):
    session: Count
    rank: Count
    world_size: Count
    vllm_version: Name
    platform: Name
    model: Text
    connected_s: float
    steps: Count
    new_requests: Count
    finished_requests: Count
    scheduled_tokens: Count
    errors: Count
    step_latency_us_p50: float
    step_latency_us_p99: float
    # CUDA IPC: device buffers and events this session opened (once per connection).
    arena_opens: Count = 0
    event_opens: Count = 0
    # Steady decode steps whose plan the sidecar built before their StepBegin, and those it used.
    plans_ahead_built: Count = 0
    plans_ahead_used: Count = 0
    stacked_rows: Count = 0  # tensors its plans sent as rows of stacks


class StatusReply(msgspec.Struct, tag="status_reply", frozen=True):
    sidecar_version: Name
    protocol: Name
    hook_set: Name
    needs: HookNeeds
    uptime_s: float
    draining: bool
    rejected_frames: Count
    sessions: list[SessionStatus] = []
    pid: int = 0
    # Python's cycle collections in the sidecar by where they ran (omni_sidecar/serve/collector.py:
    # between_steps with no shim waiting, idle, overdue on a loop turn, elsewhere by the interpreter
    # or a hook), and the longest pause of any.
    collections: Annotated[dict[Name, Count], msgspec.Meta(max_length=16)] = {}
    collection_pause_us_max: float = 0.0


class TensorBlob(msgspec.Struct, frozen=True, array_like=True):
    """A tensor copied inline; only for control replies (outputs) and MirrorUpdate, never per step."""

    shape: Annotated[list[Count], msgspec.Meta(max_length=8)]
    dtype: Name
    data: bytes


class OutputsQuery(msgspec.Struct, tag="outputs", frozen=True):
    """A request's outputs by vLLM request id (internal, or the client's own).

    since < 0: the assembled outputs. since >= 0: the per-step chunks from that
    index on (streaming; the reply's `cursor` is the next index to ask for).
    """

    req_id: ReqId
    pop: bool = False
    since: int = -1


class OutputChunk(msgspec.Struct, frozen=True, array_like=True):
    tensors: dict[Name, TensorBlob] = {}
    values: dict[Name, Any] = {}


class OutputsReply(msgspec.Struct, tag="outputs_reply", frozen=True):
    req_id: ReqId
    found: bool
    finished: bool = False
    tensors: dict[Name, TensorBlob] = {}
    values: dict[Name, Any] = {}
    chunks: list[OutputChunk] = []
    cursor: Count = 0
    error: Text = ""


class AppendPayload(msgspec.Struct, tag="append", frozen=True):
    """Append entries to a running request (by vLLM's id or the client's own): `payload` is
    vllm-omni's additional_information in msgpack ({"entries": {dotted key: entry}}). Applied between
    two steps, in arrival order (docs/ARCHITECTURE.md, Streaming payloads)."""

    req_id: ReqId
    payload: bytes


class AppendReply(msgspec.Struct, tag="append_reply", frozen=True):
    """The append is in the request's state: steps after `after_step` see it (-1: every step)."""

    req_id: ReqId
    after_step: int


class MirrorUpdate(msgspec.Struct, tag="mirror_update", frozen=True):
    """Sidecar -> shim, unsolicited: an append to a request whose state the shim mirrors; the shim
    applies it at its next step start and says so in StepStart.mirror_seq. `entries`: the append's
    delta (decoded; `embed.decode` rows past the span held) as a msgpack tree whose tensors are
    extension values naming `blobs` (proto/plan_trees.py, as a plan's), their bytes inline."""

    seq: Count
    req_id: ReqId
    entries: bytes
    blobs: Annotated[list[TensorBlob], msgspec.Meta(max_length=MAX_PLAN_TENSORS)] = []


class Drain(msgspec.Struct, tag="drain", frozen=True):
    pass


class Drained(msgspec.Struct, tag="drained", frozen=True):
    sessions_left: Count


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    """A frame was rejected. The sender learns why; the receiver keeps serving."""

    code: Name
    message: Text


__all__ = ["ArenaInfo", "ArenaKind", "CudaIpcInfo", "HookNeeds", "IpcHandle", "ModelHooks",  # re-exported
           "SwitchAck", "SwitchReady", "Takeover", "TakeoverState",
           "MAX_BATCH", "MAX_ID_LEN", "MAX_PLAN_TENSORS", "MAX_STEP_TOKENS", "U32_BYTES",  # proto.steps
           "BatchLayout", "Discarded", "NewRequest", "Overlay", "ReqId", "RequestError", "StepBegin", "StepEnd",
           "StepPlan", "StepResult", "StepStart", "StepTick"]

Message = Union[
    Hello,
    Welcome,
    Reject,
    StepBegin,
    StepPlan,
    StepEnd,
    StepResult,
    Ping,
    Pong,
    StatusQuery,
    StatusReply,
    OutputsQuery,
    OutputsReply,
    Drain,
    Drained,
    ErrorReply,
    Takeover,
    TakeoverState,
    SwitchReady,
    SwitchAck,
    StepStart,
    AppendPayload,
    AppendReply,
    MirrorUpdate,
    StepTick,
]
