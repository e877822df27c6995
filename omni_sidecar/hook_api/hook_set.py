"""The hook API a sidecar hook set implements (docs/ARCHITECTURE.md, "Step sequence").

Per step the shim's traffic drives, in order: `on_new_requests`,
`model_states` (a model with its own hooks asks for new requests' states),
`prepare_prefill_embeds` and `build_extra_kwargs` (only when `needs.pre_forward`
says so), the upstream forward in vLLM (and the model's own hooks around it),
`on_model_results`, `process_model_output`, and `on_finished` (just before it, with async
scheduling, `on_discarded` for the finished requests' forwards vLLM discarded). `get_outputs` serves clients asking for a request's outputs.
Between two steps, `on_payload_appended` takes what a client appended to a running request.

Errors: raise `RequestHookError` (one request) or `HookErrors` (several) to
fail those requests; any other exception fails every request of the call (the
step's batch, the new or preempted ones, or for `on_finished` the finished
ones, whose outputs are then no longer handed out as complete). Every failure
is logged, counted (`omni_sidecar_request_errors`, the session's `errors`) and
becomes the request's error: the shim gets it with the step's reply, clients
get RequestFailed. Nothing is swallowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import torch

from omni_sidecar.errors import OmniSidecarError
from proto.messages import HookNeeds
from proto.packed import StepLayout


class HookErrors(OmniSidecarError):
    """Fail the named requests (req_id -> message); the others go on."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{r}: {m}" for r, m in errors.items()))
        self.errors = errors


class RequestHookError(HookErrors):
    def __init__(self, req_id: str, message: str) -> None:
        super().__init__({req_id: message})
        self.req_id = req_id
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class RequestInfo:
    req_id: str
    prompt_len: int
    prompt_token_ids: list[int]
    payload: dict[str, Any] | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepBatch:
    """A step's batch as hooks see it; row math lives here, once."""

    step: int
    layout: StepLayout
    known: dict[str, RequestInfo] = field(default_factory=dict)
    # In process_model_output: rows of the captured layers (HookNeeds.hidden_layers), token
    # aligned like the hidden states; shared memory valid only during the call.
    hidden_layers: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def requests(self) -> list[RequestInfo]:
        """RequestInfo per batch row (built on demand: most steps never need it)."""
        lay = self.layout
        return [
            self.known.get(r) or RequestInfo(r, lay.prefill_lens[i], [])
            for i, r in enumerate(lay.req_ids)
        ]

    @property
    def req_ids(self) -> list[str]:
        return self.layout.req_ids

    def rows(self, i: int) -> tuple[int, int]:
        qsl = self.layout.query_start_loc
        return qsl[i], qsl[i + 1]

    def input_ids(self, i: int) -> list[int]:
        """The input token ids of request i's rows (a decode row's is the token the previous step
        sampled); needs `HookNeeds(input_ids=True)`."""
        ids = self.layout.input_ids
        if ids is None:
            raise ValueError("the layout carries no input ids: declare HookNeeds(input_ids=True)")
        start, end = self.rows(i)
        return ids[start:end]

    def prefill_rows(self, i: int) -> tuple[int, int, int]:
        """(first batch row, number of prompt rows k, prompt position nc) of request i.

        Rows [qsl[i], qsl[i]+k) hold prompt tokens nc..nc+k-1, where
        nc = computed tokens and k = min(scheduled, max(0, prompt_len - nc)).
        Chunked prefill therefore needs no special case.
        """
        start, end = self.rows(i)
        nc = self.layout.num_computed_tokens[i]
        k = min(end - start, max(0, self.layout.prefill_lens[i] - nc))
        return start, k, nc


class OmniHooks:
    """Base hook set: does nothing, needs nothing. Subclass and override.

    Hot upgrade: `state_version` names the layout of what `export_state`
    returns; a successor lists in `accepts_state` the versions its
    `import_state` understands, and a takeover between sets that do not match
    is refused before anything switches.
    """

    name = "base"
    needs = HookNeeds()
    # True when `prepare_prefill_embeds` and `build_extra_kwargs` are pure functions of the batch
    # and the hooks' state: the sidecar may then call them for the batch a steady decode brings
    # next, before it comes, and use the plan if it does (omni_sidecar/sessions/plan_ahead.py).
    plans_ahead = False
    state_version = "stateless/1"
    accepts_state: tuple[str, ...] = ("stateless/1",)
    # The step whose messages the hooks are handling (set by the session before that step's first
    # hook call): `on_model_results` and `on_discarded` name outputs by it.
    current_step = -1
    # The engine schedules asynchronously (its Hello; set by the session): a running request's
    # outputs of the latest step may yet be withdrawn (`on_discarded`), so streaming reads of a
    # running request stop before them.
    async_scheduling = False

    def export_state(self) -> dict[str, Any]:
        """Everything a successor needs to go on serving the live requests."""
        return {}

    def import_state(self, state: dict[str, Any]) -> None:
        pass

    def on_new_requests(self, requests: list[RequestInfo]) -> None:
        pass

    def prepare_prefill_embeds(self, batch: StepBatch) -> list[tuple[int, torch.Tensor]]:
        """Return (first batch row, rows[k, hidden]) pairs to overlay on inputs_embeds."""
        return []

    def build_extra_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        return {}

    def process_model_output(self, batch: StepBatch, hidden_states: torch.Tensor | None) -> None:
        """`hidden_states` aliases shared memory valid only during this call: copy to keep."""

    def between_steps(self) -> None:
        """Called once a step is answered and the next step's plan, if built ahead, is out: work
        `process_model_output` may put off (the omni set cuts its outputs per request here), off
        the path the shim waits on. Reads of outputs must not depend on it having run."""

    def get_outputs(self, req_id: str) -> dict[str, Any] | None:
        """The request's assembled outputs so far (None: not a request these hooks know)."""
        return None

    def output_chunks(self, req_id: str) -> list[dict[str, Any]] | None:
        """Per-step outputs in step order, for streaming clients (None: not kept)."""
        return None

    def deferred_outputs(self, req_id: str) -> Callable[[], tuple[dict[str, Any] | None, list[dict[str, Any]] | None]] | None:
        """A finishing request's (outputs, chunks), made by the returned call when a client first
        asks, not in the step it finished; the call runs after `on_finished`, so it must not read
        the hooks' per-request state. None (the default): `get_outputs` and `output_chunks` are
        called as the request finishes."""
        return None

    def model_states(self, req_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Initial state of requests new to a model that carries its own hooks (needs.model_states):
        what its preprocess / postprocess read as `**info` in the vLLM process."""
        return {}

    def on_model_results(self, updates: dict[str, dict[str, Any]], outputs: dict[str, dict[str, Any]]) -> None:
        """A step's model updates (merge into state) and outputs (e.g. {"codes": {"audio": [1, Q]}})
        per request, returned by the model's own hooks in the vLLM process. Tensors are copies."""

    def on_payload_appended(self, req_id: str, payload: bytes) -> None:
        """A client appended `payload` (vllm-omni's additional_information, msgpack bytes) to the running
        request `req_id`; called between two steps, in arrival order (docs/ARCHITECTURE.md, Streaming
        payloads). Raise to refuse it: the error goes to that client only, the request runs on, so leave
        its state as it was. Untrusted bytes: decode them only with a msgspec schema (omni/wire.py)."""
        raise RequestHookError(req_id, f"hook set {self.name!r} takes no appended payloads")

    def stage_mirrored_append(self, req_id: str, payload: bytes, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """An append to a request whose state the shim mirrors (the model's own hooks): check it against
        the state plus `earlier` (staged, not yet applied), leave the state as it is, and return the
        entries to apply on both sides (`commit_mirrored_append` once the shim applied them). Raise to
        refuse it (docs/ARCHITECTURE.md, Streaming payloads)."""
        raise RequestHookError(req_id, f"hook set {self.name!r} takes no appended payloads")

    def commit_mirrored_append(self, req_id: str, entries: dict[str, Any]) -> None:
        """The shim applied `entries` (from `stage_mirrored_append`) before a step: now the state's too."""

    def on_discarded(self, steps: dict[str, int]) -> None:
        """req_id -> a step whose forward of that request vLLM discarded: with async scheduling vLLM
        launches a step before it reads the last one's samples, so a request finished by them (a
        stop token, a stop string, an abort) ran once more; its finish notice comes with this call.
        Withdraw what that step added to the request's outputs (its last step), so they equal those
        with async scheduling off (docs/ARCHITECTURE.md, "Async scheduling"). Hook sets that keep
        per-step outputs override it."""

    def on_preempted(self, req_ids: list[str]) -> None:
        """vLLM preempted these; they come back later through `on_new_requests`."""

    def on_finished(self, req_ids: list[str]) -> None:
        pass


def wire_needs(hooks: OmniHooks) -> HookNeeds:
    """The needs the Welcome tells the shim: the hook set's own, with `step_layouts` off when the
    set does not override `process_model_output` (nothing of it reads a step's layout, so a step
    that brings nothing new ends with a StepTick; docs/ARCHITECTURE.md, Step sequence)."""
    needs = hooks.needs
    if needs.step_layouts and type(hooks).process_model_output is OmniHooks.process_model_output:
        return msgspec.structs.replace(needs, step_layouts=False)
    return needs
