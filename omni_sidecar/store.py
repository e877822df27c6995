"""What clients can still ask for after a request is gone from the engine."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FinishedEntry:
    outputs: dict[str, Any] | None
    chunks: list[dict[str, Any]] | None
    error: str = ""
    client_id: str = ""  # the id the client gave the request, when it differs from vLLM's


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
            entry.outputs = entry.chunks = None
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
