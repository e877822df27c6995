"""Reading vLLM's batch: request payloads, prefill flags, the layout the sidecar sees.

Everything the shim knows about vLLM's scheduler output and `InputBatch` is
read here (what differs between vLLM minors through worker_shim/upstream/compat.py).
`PayloadTracker` is the one record of which live requests carry a sidecar
payload; the link and the TP broadcast both decide from it (`exchange_needed`),
so every rank takes the same decision from the same scheduler output.
"""

from __future__ import annotations

from typing import Any, Iterable

from proto.messages import BatchLayout, HookNeeds, NewRequest
from proto.packed import packed_layout
from worker_shim.upstream.compat import client_request_id, prefill_flags, prompt_len_of

PAYLOAD_KEY = "omni_sidecar"


def payload_of(req: Any) -> dict | None:
    """The request's sidecar payload (`extra_args["omni_sidecar"]`), if it carries one."""
    sp = req.sampling_params
    extra = (sp.extra_args or {}) if sp is not None else {}
    payload = extra.get(PAYLOAD_KEY)
    return payload if isinstance(payload, dict) else None


def new_request(req: Any, payload: dict | None, suffixed_ids: bool) -> NewRequest:
    """The NewRequest message for one of vLLM's `NewRequestData`."""
    return NewRequest(
        req_id=req.req_id,
        prompt_len=prompt_len_of(req),
        prompt_token_ids=list(req.prompt_token_ids or []),
        payload=payload,
        client_req_id=client_request_id(req.req_id, suffixed_ids),
    )


def batch_layout(batch: Any, prev_ids: list[str] | None, with_input_ids: bool = False) -> BatchLayout:
    """Where each request's rows lie: vLLM's numpy arrays as their bytes (u32), no Python int per
    request (proto/packed.py); `req_ids` only when they differ from what the sidecar has; each
    row's input token id when the hooks asked (a device-to-host copy: the decode rows' ids are
    the previous step's samples, written on the device)."""
    n = len(batch.req_ids)
    ids = batch.req_ids
    input_ids = None
    if with_input_ids:
        input_ids = batch.input_ids[: int(batch.num_tokens)]
        if hasattr(input_ids, "cpu"):  # a torch tensor on the device: its host copy as numpy
            input_ids = input_ids.cpu().numpy()
    return packed_layout(None if ids == prev_ids else list(ids), batch.query_start_loc_np[: n + 1],
                         batch.num_computed_tokens_np[:n], batch.prefill_len_np[:n], input_ids)


class PayloadTracker:
    """Which of vLLM's live requests carry a sidecar payload (fed once per scheduler output)."""

    def __init__(self) -> None:
        self.payload_reqs: set[str] = set()

    def note_new(self, req_id: str, payload: dict | None) -> None:
        if payload is not None:
            self.payload_reqs.add(req_id)

    def note_finished(self, finished: Iterable[str]) -> None:
        self.payload_reqs.difference_update(finished)

    def carries_payload(self, req_id: str) -> bool:
        return req_id in self.payload_reqs

    def exchange_needed(self, needs: HookNeeds, input_batch: Any,
                        among: set[str] | None = None) -> bool:
        """Does any scheduled request need the sidecar before this forward?

        The declared needs applied to one batch; `among` narrows the payload
        requests to those a sidecar session knows (the link's view after a loss).
        """
        mode = needs.pre_forward
        if mode == "never":
            return False
        if needs.pre_forward_scope == "all":
            return mode == "always" or bool(prefill_flags(input_batch).any())
        payload = self.payload_reqs
        if not payload:
            return False

        def counts(req_id: str) -> bool:
            return req_id in payload and (among is None or req_id in among)

        ids = input_batch.req_ids
        if mode == "always":
            return any(counts(r) for r in ids)
        flags = prefill_flags(input_batch)
        return any(flags[i] and counts(r) for i, r in enumerate(ids))
