"""What control clients ask: status, a request's outputs, and its streamed chunks; and what they
append to a running request (routed to its session, omni_sidecar/sessions/appends.py).

Outputs are looked up among live requests first (a streaming client reads them
while vLLM still runs the request), then in the finished store. Tensors travel
as bytes (TensorBlob); JSON-like values as they are.
"""

from __future__ import annotations

import os
import time

import torch

from omni_sidecar import __version__
from omni_sidecar.sessions.appends import unknown
from omni_sidecar.hook_api.hook_set import OmniHooks
from omni_sidecar.serve.peers import PeerTable
from omni_sidecar.serve.collector import CollectorPacer
from omni_sidecar.sessions.store import FinishedOutputs
from omni_arena.views import tensor_to_bytes
from proto.messages import AppendPayload, Message, OutputChunk, OutputsQuery, OutputsReply, StatusReply, TensorBlob
from proto.version import PROTOCOL_VERSION


class Queries:
    def __init__(self, hooks: OmniHooks, peers: PeerTable, finished: FinishedOutputs,
                 collector: CollectorPacer | None = None) -> None:
        self.hooks = hooks
        self.peers = peers
        self.finished = finished
        self.collector = collector or CollectorPacer(paced=False)
        self.started = time.monotonic()

    def status(self, draining: bool, rejected_frames: int) -> StatusReply:
        return StatusReply(
            sidecar_version=__version__,
            protocol=PROTOCOL_VERSION,
            hook_set=self.hooks.name,
            needs=self.hooks.needs,
            uptime_s=time.monotonic() - self.started,
            draining=draining,
            rejected_frames=rejected_frames,
            sessions=[s.status() for s in self.peers.sessions()],
            pid=os.getpid(),
            collections=dict(self.collector.counts),
            collection_pause_us_max=self.collector.pause_us_max,
        )

    def answer(self, ident: bytes, msg: OutputsQuery | AppendPayload) -> Message | None:
        """A query about one request; None: an append's reply goes out when its step ends."""
        if isinstance(msg, OutputsQuery):
            return self.outputs(msg)
        live = self.peers.live_request(msg.req_id)
        if live is None:
            return unknown(msg.req_id, self.finished)
        return live[0].appends.receive(msg, lambda reply: self.peers.send(ident, reply))

    def outputs(self, q: OutputsQuery) -> OutputsReply:
        live = self.peers.live_request(q.req_id)
        if live is not None:
            session, req_id = live
            outputs = self.hooks.get_outputs(req_id) if q.since < 0 else None
            chunks = self.hooks.output_chunks(req_id) if q.since >= 0 else None
            error = session.errors_by_request.get(req_id, "")
        else:
            entry = self.finished.get(q.req_id, q.pop)
            if entry is None:
                return OutputsReply(req_id=q.req_id, found=False)
            outputs, chunks, error = entry.outputs, entry.chunks, entry.error
        tensors, values = split_outputs(outputs or {})
        out_chunks = []
        if q.since >= 0 and chunks:
            out_chunks = [OutputChunk(*split_outputs(c)) for c in chunks[q.since :]]
        return OutputsReply(
            req_id=q.req_id,
            found=True,
            finished=live is None,
            tensors=tensors,
            values=values,
            chunks=out_chunks,
            cursor=max(q.since, 0) + len(out_chunks),
            error=error,
        )


def split_outputs(outputs: dict) -> tuple[dict[str, TensorBlob], dict]:
    """Tensors become blobs; JSON-like values travel as they are."""
    tensors, values = {}, {}
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor):
            data, shape, dtype = tensor_to_bytes(value)
            tensors[name] = TensorBlob(shape, dtype, data)
        else:
            values[name] = value
    return tensors, values
