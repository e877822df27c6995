"""The record that ends a step on the wire: a StepEnd with what the sidecar has not seen, or a StepTick.

A mixin of worker_shim/step/link.py's `SidecarLink` (the step protocol), kept apart as its own concern:
what a step that ran its forward leaves for the sidecar. A step whose hooks read no per-step layout
and that brings nothing new (no request change, failure, hidden states or model results) sends the
fixed-size StepTick; any other step the StepEnd, its tensors in the step's hidden slot
(docs/ARCHITECTURE.md, Step sequence: Pass-through steps).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from omni_arena.tensor_tree import store_tree
from proto.messages import StepEnd, StepTick
from proto.settings import TIMINGS_KEPT
from worker_shim.step.batch import wire_layout

ModelResults = tuple[dict[str, Any], dict[str, Any]]  # per request: state updates, outputs


def record_timing(samples: list[float], value: float) -> None:
    """Append a per-step timing, keeping the latest TIMINGS_KEPT (trimmed in chunks: O(1) a step)."""
    samples.append(value)
    if len(samples) > 2 * TIMINGS_KEPT:
        del samples[:-TIMINGS_KEPT]


class StepEndRecords:
    """Needs the link's `step`, `requests`, `failures`, `recovery`, `conn`, `layer_capture`, `counters`,
    `_layout_sent`, `_step_exchange_us` and `_last_post_us`."""

    def _brings_nothing_new(self, conn: Any, batch: Any, state: Any, model_results: ModelResults | None) -> bool:
        """Does this step leave the sidecar with nothing to do but count it? Only when its hooks read
        no per-step layout (HookNeeds.step_layouts, 1.5) and the step brings no request change, no
        failure, no hidden states and no model results (docs/ARCHITECTURE.md, Step sequence)."""
        needs = conn.needs
        requests = self.requests
        if needs.step_layouts or requests.new or requests.finished or requests.preempted or self.failures.pending:
            return False
        if needs.hidden_states and batch is not None and conn.sends_hidden and state.hidden_states is not None:
            return False
        return not (model_results and needs.model_states and (model_results[0] or model_results[1]))

    def _send_step_tick(self, conn: Any, num_tokens: int) -> None:
        """The fixed-size StepTick: counters and timings, nothing that grows with the batch. Only a
        StepResult with `switch_to` answers it; a non-blocking look at the ring finds that one."""
        conn.send_tick(StepTick(self.step, num_tokens, self._step_exchange_us, self._last_post_us))
        self._step_exchange_us = 0.0
        results = conn.poll_results()  # [] but when a hot upgrade asks: one look at the ring
        if results:
            self.recovery.note_results(results)

    def _send_step_end(self, conn: Any, batch: Any, state: Any, num_tokens: int,
                       model_results: ModelResults | None) -> None:
        cpu0 = time.thread_time()
        self._record_step_end(conn, batch, state, num_tokens, model_results)
        record_timing(self.counters.step_end_cpu_us, (time.thread_time() - cpu0) * 1e6)

    def _record_step_end(self, conn: Any, batch: Any, state: Any, num_tokens: int,
                         model_results: ModelResults | None) -> None:
        hidden_ref, layer_refs, hidden_event, slot = None, {}, -1, None
        updates, outputs = model_results or ({}, {})
        if not conn.needs.model_states:
            updates, outputs = {}, {}
        send_hidden = batch is not None and conn.sends_hidden and state.hidden_states is not None
        if send_hidden or updates or outputs:
            # One slot per step: hidden rows and captured layers first, then the model's updates and outputs.
            slot = conn.claim_slot(self.step, self._wait_answered)
            if send_hidden:
                hidden_ref, layer_refs = slot.put_hidden(state.hidden_states[:num_tokens],
                                                         self._layer_rows(conn, num_tokens))
            updates, outputs = store_tree(updates, slot.put), store_tree(outputs, slot.put)
            hidden_event = slot.seal()
        new, finished, preempted = self.requests.take_notices()
        layout = packed = None
        if batch is not None and not self._layout_sent:
            layout, packed = wire_layout(batch, conn)
        msg = StepEnd(
            step=self.step,
            batch=layout,
            packed=packed,
            new_requests=new,
            finished=finished,
            preempted=preempted,
            hidden=hidden_ref,
            hidden_layers=layer_refs,
            hidden_event=hidden_event,
            model_updates=updates,
            model_outputs=outputs,
            num_tokens=num_tokens,
            shim_exchange_us=self._step_exchange_us,
            shim_post_us=self._last_post_us,
            failed=self.failures.take_pending(),
        )
        self._step_exchange_us = 0.0
        conn.send(msg)
        if slot is not None:
            conn.slot_sent(self.step)
        self.recovery.note_results(conn.take_results())

    def _layer_rows(self, conn: Any, num_tokens: int) -> dict[int, torch.Tensor] | None:
        """The captured layers this sidecar wants (those captured since load; a later sidecar
        wanting others gets the ones there are, docs/ARCHITECTURE.md "Layer capture")."""
        wanted = conn.needs.hidden_layers
        if not wanted or self.layer_capture is None:
            return None
        return {n: rows for n, rows in self.layer_capture.rows(num_tokens).items() if n in wanted}

    def _wait_answered(self, step: int) -> None:
        """Block (up to the step timeout) until `step`'s result arrived."""
        self.recovery.note_results(self.conn.take_results(until_step=step))
