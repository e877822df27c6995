"""CUDA graphs of the shim's own, captured mid-serving: one memory pool, one side stream, and a
capture that leaves the process usable when the captured code cannot be held by a graph.

Used by the embeds buffer's lookup (worker_shim/model/embeds.py) and by a model's `talker_mtp`
(worker_shim/model/mtp_graphs.py). The graphs of one SideGraphs never run at once (each is
replayed on the stream that runs the step), so they share one pool.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("vllm.omni_sidecar.shim.graphs")


class SideGraphs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Any = None
        self._side: Any = None  # the stream they are captured on

    def capture(self, work: Callable[[], Any]) -> tuple[Any, Any, str | None]:
        """(graph, what `work` returned while captured, None), or (None, None, the reason) when no
        graph could hold it. `work` must have run eagerly once before (warm-up: lazy compiles,
        first allocations); a capture runs nothing, so its results are filled by `replay()` only."""
        graph, failure, rng_state, result = torch.cuda.CUDAGraph(), None, None, None
        try:
            # The generator's seed and offset, should the capture break (`_undo_capture`).
            rng_state = torch.cuda.default_generators[self.device.index or 0].get_state()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._side):
                # Not `torch.cuda.graph(...)`: its entry synchronizes, collects and empties the cache,
                # mid-serving. Thread-local: vLLM's other threads may call CUDA meanwhile.
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    result = work()
                except Exception as exc:  # noqa: BLE001 - the cause, reported below
                    failure = exc
                graph.capture_end()  # raises when the capture broke inside CUDA (a host read, a sync)
        except Exception as exc:  # noqa: BLE001 - any model's code: eager is always right
            failure = failure or exc
            self._stop_pool()
        if failure is not None:
            self._undo_capture(graph, rng_state)
            first_line = (str(failure).strip().splitlines() or [""])[0]  # CUDA errors add a paragraph of advice
            return None, None, f"{type(failure).__name__}: {first_line}"
        return graph, result, None

    def _stop_pool(self) -> None:
        """A capture that broke inside CUDA raises from `capture_end` before torch's allocator stops
        routing the capturing stream's allocations to our pool, and while it routes, the allocator
        defers freeing memory that other streams used: stop it (a no-op error if it had stopped)."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None and self._pool is not None:
            try:
                end(self.device.index, self._pool)
            except Exception:  # noqa: BLE001 - already stopped
                pass

    def _undo_capture(self, graph: Any, rng_state: torch.Tensor | None) -> None:
        """A capture that broke leaves the device's default random generator marked as capturing
        (on torch 2.11 neither resetting the broken graph nor an empty capture of our own right
        after cleared the mark): every random op of the process then raises ("Offset increment
        outside graph capture encountered unexpectedly"), vLLM's sampling among them (seen on the
        H200, torch 2.11). The generator is handed a fresh state
        holding the seed and offset it had before the capture (`graphsafe_set_state`). Graphs
        captured before keep the old state: one holding random ops would raise at replay (vLLM's
        model graphs hold none; sampling runs outside them)."""
        try:
            graph.reset()
        except Exception:  # noqa: BLE001 - nothing left to reset
            pass
        if rng_state is None or self._rng_usable():
            return
        try:
            fresh = torch.Generator(device=self.device)
            fresh.set_state(rng_state)
            torch.cuda.default_generators[self.device.index or 0].graphsafe_set_state(fresh)
        except Exception as exc:  # noqa: BLE001 - reported below
            log.debug("could not reset the random generator: %s", exc)
        if not self._rng_usable():
            log.error("omni-sidecar shim: after a failed CUDA graph capture, random ops on %s still fail; "
                      "restart the engine with embeds_graphs=off and talker_mtp_graphs=off", self.device)

    def _rng_usable(self) -> bool:
        try:
            torch.empty(1, device=self.device).uniform_()
            return True
        except RuntimeError:
            return False
