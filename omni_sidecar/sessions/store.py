"""What clients can still ask for after a request is gone from the engine."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from proto.settings import ERROR_TEXT_MAX


Deferred = Callable[[], tuple[dict[str, Any] | None, list[dict[str, Any]] | None]]


class FinishedEntry:
    """What a finished request leaves: outputs, per-step chunks, an error, the client's id.

    With `deferred` (`OmniHooks.deferred_outputs`) the outputs and chunks are made when first read:
    a batch of requests that finish in one step made every request's outputs in that step (on a
    GPU host ~1.5 ms a request, the shim's next step waiting), whether or not a client ever asked."""

    __slots__ = ("_outputs", "_chunks", "error", "client_id", "_deferred")

    def __init__(self, outputs: dict[str, Any] | None, chunks: list[dict[str, Any]] | None, error: str = "",
                 client_id: str = "", deferred: Deferred | None = None) -> None:
        self._outputs = outputs
        self._chunks = chunks
        self.error = error
        self.client_id = client_id  # the id the client gave the request, when it differs from vLLM's
        self._deferred = deferred

    def _resolve(self) -> None:
        deferred = self._deferred
        if deferred is None:
            return
        self._deferred = None
        try:
            self._outputs, self._chunks = deferred()
        except Exception as exc:  # e.g. chunks that do not concatenate: the request's error, not the reader's
            self._outputs = self._chunks = None
            self.error = self.error or f"outputs: {type(exc).__name__}: {exc}"[:ERROR_TEXT_MAX]

    @property
    def outputs(self) -> dict[str, Any] | None:
        self._resolve()
        return self._outputs

    @property
    def chunks(self) -> list[dict[str, Any]] | None:
        self._resolve()
        return self._chunks

    def drop_outputs(self) -> None:
        """Outputs and chunks gone (the request failed): never made, never handed out."""
        self._outputs = self._chunks = self._deferred = None

    @property
    def holds_anything(self) -> bool:
        """Anything for a client (without making deferred outputs)."""
        return self._deferred is not None or self._outputs is not None or self._chunks is not None or bool(self.error)


@dataclass
class FinishedOutputs:
    """Finished requests' outputs and errors, oldest dropped first.

    Found by vLLM's request id or by the client's own id (`NewRequest.client_req_id`).
    """

    capacity: int
    _items: OrderedDict[str, FinishedEntry] = field(default_factory=OrderedDict)
    _by_client_id: dict[str, str] = field(default_factory=dict)

    def put(self, req_id: str, entry: FinishedEntry, client_id: str = "") -> None:
        entry.client_id = client_id or entry.client_id
        self._items[req_id] = entry
        self._items.move_to_end(req_id)
        if entry.client_id:
            self._by_client_id[entry.client_id] = req_id
        while len(self._items) > self.capacity:
            old, dropped = self._items.popitem(last=False)
            if dropped.client_id and self._by_client_id.get(dropped.client_id) == old:
                del self._by_client_id[dropped.client_id]

    def fail(self, req_id: str, message: str, client_id: str = "") -> None:
        """`req_id` failed after it finished: its outputs are no longer handed out as complete."""
        entry = self._items.get(req_id)
        if entry is None:
            self.put(req_id, FinishedEntry(None, None, message), client_id)
        elif not entry.error:
            entry.drop_outputs()
            entry.error = message

    def export(self) -> dict[str, list]:
        return {r: [e.outputs, e.chunks, e.error, e.client_id] for r, e in self._items.items()}

    def restore(self, doc: dict[str, list]) -> None:
        for req_id, (outputs, chunks, error, *client) in doc.items():
            self.put(req_id, FinishedEntry(outputs, chunks, error), client[0] if client else "")

    def get(self, req_id: str, pop: bool = False) -> FinishedEntry | None:
        key = req_id if req_id in self._items else self._by_client_id.get(req_id, req_id)
        entry = self._items.pop(key, None) if pop else self._items.get(key)
        if pop and entry is not None and self._by_client_id.get(entry.client_id) == key:
            del self._by_client_id[entry.client_id]
        return entry
