"""The record that ends a step on the wire: a StepEnd with what the sidecar has not seen, or a StepTick.

What a step that ran its forward leaves for the sidecar. Which of the two goes is the step
protocol's (worker_shim/step/protocol.py); here they are written: the StepTick's scalars, or the
StepEnd with the step's notices, failures, layout (when no StepBegin carried it), hidden rows and
the model's results, its tensors in the step's hidden slot (docs/ARCHITECTURE.md, Step sequence).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from omni_arena.tensor_tree import TreeEncoder
from proto.messages import StepEnd, StepTick
from worker_shim.model.layers import LayerCapture
from worker_shim.session.requests import FailureReports
from worker_shim.step.batch import BatchReader
from worker_shim.step.port import SidecarPort, StepSlot
from worker_shim.step.protocol import Notices

if TYPE_CHECKING:
    from worker_shim.step.link import StepCounters

ModelResults = tuple[dict[str, Any], dict[str, Any]]  # per request: state updates, outputs


class StepEnds:
    """Writes each step's end record to the port; the hook errors of results read on the way go to
    the failures (a result's `switch_to` stays in the port's channel, for the next step's start)."""

    def __init__(self, notices: Notices, batches: BatchReader, failures: FailureReports,
                 counters: StepCounters) -> None:
        self.notices = notices
        self.batches = batches
        self.failures = failures
        self.counters = counters  # this thread's CPU time in each StepEnd's record goes there
        self.layer_capture: LayerCapture | None = None  # set by the runner at load (hidden_layers)
        self._encoder = TreeEncoder()

    def tick(self, port: SidecarPort, step: int, num_tokens: int, exchange_us: float, post_us: float) -> None:
        """The fixed-size StepTick: counters and timings, nothing that grows with the batch. Only a
        StepResult with `switch_to` answers it; a non-blocking look at the ring finds that one."""
        port.send(StepTick(step, num_tokens, exchange_us, post_us))
        results = port.channel.poll_ring_results()  # [] but when a hot upgrade asks: one look at the ring
        if results:
            self.failures.note_results(results)

    def end(self, port: SidecarPort, step: int, batch: Any, state: Any, num_tokens: int,
            model_results: ModelResults | None, with_layout: bool, exchange_us: float, post_us: float) -> None:
        cpu0 = time.thread_time()
        hidden_ref, layer_refs, hidden_event, slot = None, {}, -1, None
        updates, outputs = model_results or ({}, {})
        if not port.needs.model_states:
            updates, outputs = {}, {}
        tensors: list[Any] = []
        model_updates = model_outputs = b""
        send_hidden = batch is not None and port.sends_hidden and state.hidden_states is not None
        if send_hidden or updates or outputs:
            # One slot per step: hidden rows and captured layers first, then the model's updates and outputs.
            slot = port.claim_slot(step, lambda s: self.failures.note_results(
                port.channel.take_results(until_step=s)))
            if send_hidden:
                hidden_ref, layer_refs = slot.put_hidden(state.hidden_states[:num_tokens],
                                                         self._layer_rows(port, num_tokens))
            model_updates = self._encode(updates, slot, tensors)
            model_outputs = self._encode(outputs, slot, tensors)
            hidden_event = slot.seal()
        new, finished, preempted, discarded = self.notices.take()
        layout = (self.batches.layout(batch, port.peer_req_ids, port.needs.input_ids)
                  if batch is not None and with_layout else None)
        port.send(StepEnd(
            step=step,
            batch=layout,
            new_requests=new,
            finished=finished,
            preempted=preempted,
            hidden=hidden_ref,
            hidden_layers=layer_refs,
            hidden_event=hidden_event,
            model_updates=model_updates,
            model_outputs=model_outputs,
            tensors=tensors,
            num_tokens=num_tokens,
            shim_exchange_us=exchange_us,
            shim_post_us=post_us,
            failed=self.failures.take_pending(),
            discarded=discarded,
        ))
        if slot is not None:
            slot.sent()
        self.failures.note_results(port.channel.take_results())
        self.counters.record_timing(self.counters.step_end_cpu_us, (time.thread_time() - cpu0) * 1e6)

    def _encode(self, tree: dict[str, Any], slot: StepSlot, tensors: list[Any]) -> bytes:
        """{req_id: tree} as the StepEnd carries it: each tensor put into the step's slot (a kind's
        rows stacked there in one write), its place in the tree a mark naming `tensors`. A request
        whose tree msgpack cannot carry (a tensor of more than MAX_TENSOR_DIMS, a value of no wire
        type) fails alone, as a failed model hook does; the others' results go."""
        def put_whole(tensor: torch.Tensor) -> int:
            tensors.append(slot.put(tensor))
            return len(tensors) - 1

        def put_stack(rows: list[torch.Tensor]) -> int:
            tensors.append(slot.put_stack(rows))
            return len(tensors) - 1

        try:
            return self._encoder.encode(tree, put_whole, put_stack, first=len(tensors))
        except TypeError:  # raised in the walk, before anything was put
            unfit = self._encoder.unfit(tree)
            if not unfit:
                raise
        for req_id, why in unfit.items():
            self.failures.fail(req_id, f"the model's results for this request cannot be sent: {why}")
        fit = {req_id: value for req_id, value in tree.items() if req_id not in unfit}
        return self._encoder.encode(fit, put_whole, put_stack, first=len(tensors))

    def _layer_rows(self, port: SidecarPort, num_tokens: int) -> dict[int, torch.Tensor] | None:
        """The captured layers this sidecar wants (those captured since load; a later sidecar
        wanting others gets the ones there are, docs/ARCHITECTURE.md "Layer capture")."""
        wanted = port.needs.hidden_layers
        if not wanted or self.layer_capture is None:
            return None
        return {n: rows for n, rows in self.layer_capture.rows(num_tokens).items() if n in wanted}
