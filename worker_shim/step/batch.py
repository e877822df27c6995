"""Reading vLLM's batch: request payloads, prefill flags, the layout the sidecar sees.

Everything the shim knows about vLLM's scheduler output and `InputBatch` is
read here (what differs between vLLM minors is chosen at start-up through
worker_shim/upstream/compat.py). `PayloadTracker` is the one record of which live
requests carry a sidecar payload; the link and the TP broadcast both decide from it
and the batch's prefill flags (the step protocol's `before_forward`), so every rank
takes the same decision from the same scheduler output.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, Iterable

import numpy as np

from proto.messages import BatchLayout, NewRequest
from proto.packed import packed_layout
from worker_shim.upstream.compat import client_request_id, prompt_len_of

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


class BatchReader:
    """Reads vLLM's `InputBatch` as this vLLM lays it out: its prefill flags are upstream's own
    array when it has one (compat's `has_own_prefill_flags`, asked once at start-up), else derived
    from the computed and prompt lengths (what upstream's array holds)."""

    def __init__(self, own_prefill_flags: bool = False) -> None:
        # Upstream's own array is an attribute read (attrgetter: no Python call a step).
        self.prefilling: Callable[[Any], np.ndarray] = (attrgetter("is_prefilling_np") if own_prefill_flags
                                                        else self._derived_flags)

    @staticmethod
    def _derived_flags(batch: Any) -> np.ndarray:
        n = len(batch.req_ids)
        return batch.num_computed_tokens_np[:n] < batch.prefill_len_np[:n]

    @staticmethod
    def layout(batch: Any, prev_ids: list[str] | None, with_input_ids: bool = False) -> BatchLayout:
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
