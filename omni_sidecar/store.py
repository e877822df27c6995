"""What clients can still ask for after a request is gone from the engine."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def client_request_id(req_id: str) -> str | None:
    """The id the client gave vLLM: vLLM appends "-<8 random chars>" internally."""
    if len(req_id) > 9 and req_id[-9] == "-":
        return req_id[:-9]
    return None


@dataclass
class FinishedEntry:
    outputs: dict[str, Any] | None
    chunks: list[dict[str, Any]] | None
    error: str = ""


@dataclass
class FinishedOutputs:
    """Finished requests' outputs and errors, oldest dropped first.

    Found by vLLM's internal request id or by the client's own id.
    """

    capacity: int
    _items: OrderedDict[str, FinishedEntry] = field(default_factory=OrderedDict)
    _alias: dict[str, str] = field(default_factory=dict)

    def put(self, req_id: str, entry: FinishedEntry) -> None:
        self._items[req_id] = entry
        self._items.move_to_end(req_id)
        client_id = client_request_id(req_id)
        if client_id is not None:
            self._alias[client_id] = req_id
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            old_client = client_request_id(old)
            if old_client is not None and self._alias.get(old_client) == old:
                del self._alias[old_client]

    def export(self) -> dict[str, list]:
        return {r: [e.outputs, e.chunks, e.error] for r, e in self._items.items()}

    def restore(self, doc: dict[str, list]) -> None:
        for req_id, (outputs, chunks, error) in doc.items():
            self.put(req_id, FinishedEntry(outputs, chunks, error))

    def get(self, req_id: str, pop: bool = False) -> FinishedEntry | None:
        key = req_id if req_id in self._items else self._alias.get(req_id, req_id)
        return self._items.pop(key, None) if pop else self._items.get(key)
