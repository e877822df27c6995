"""Multimodal output assembly (vllm-omni semantics) and per-step chunks for streaming.

A step's batch-level dict is cut per request: tensors whose dim 0 equals the
step's token count are token-aligned and sliced by query_start_loc; lists of
length num_reqs are per request; anything else is ignored with a counter.
Across steps a request's outputs accumulate: tensors of >= 2 dims concatenate
on dim 0, 0/1-dim values (and non-tensors) are replaced by the latest.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def slice_per_request(
    outputs: dict[str, Any], query_start_loc: list[int], num_reqs: int
) -> list[dict[str, Any]]:
    total = query_start_loc[num_reqs]
    per_req: list[dict[str, Any]] = [{} for _ in range(num_reqs)]
    lengths = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_reqs)]
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == total:
            for i, part in enumerate(value.split(lengths)):  # one call for all views, not one slice each
                per_req[i][name] = part
        elif isinstance(value, (list, tuple)) and len(value) == num_reqs:
            for i in range(num_reqs):
                if value[i] is not None:
                    per_req[i][name] = value[i]
    return per_req


def dotted_outputs(nested: Any) -> dict[str, Any]:
    """A model's two-level outputs ({"codes": {"audio": t}}) under dotted names ("codes.audio")."""
    if not isinstance(nested, dict):
        raise ValueError(f"model outputs must be a dict, got {type(nested).__name__}")
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{qual}": v for qual, v in value.items()})
        else:
            flat[str(key)] = value
    return flat


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    parts: dict[str, list[torch.Tensor]] = {}
    for chunk in chunks:
        for name, value in chunk.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                parts.setdefault(name, []).append(value)
            else:
                out[name] = value
                parts.pop(name, None)
    for name, pieces in parts.items():
        out[name] = torch.cat(pieces, dim=0)
    return out


class OutputLog:
    """Per-request chunks in step order; `since(cursor)` serves streaming clients.

    A step's chunks may be logged whole (`add_step`) and cut per request later (`settle`): the
    sidecar cuts them once the next step's plan is out, off the path the shim waits on. Every
    read and every other write settles first, so the order and the contents are those of cutting
    them at once."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[dict[str, Any]]] = {}
        self._steps: list[tuple[list[str], dict[str, Any], list[int], dict[str, Callable[[], torch.Tensor]], set[str]]] = []

    def start(self, req_id: str) -> None:
        self._chunks.setdefault(req_id, [])

    def add(self, req_id: str, chunk: dict[str, Any], owned: bool = False) -> None:
        """`chunk` joins the request's step outputs; its tensors are copied unless `owned` (the
        caller copied them already, e.g. once for the whole step)."""
        if self._steps:
            self.settle()
        if chunk and req_id in self._chunks:
            self._chunks[req_id].append(chunk if owned else {k: own_copy(v) for k, v in chunk.items()})

    def add_step(self, req_ids: list[str], outputs: dict[str, Any], query_start_loc: list[int],
                 rows: dict[str, Callable[[], torch.Tensor]], skip: set[str]) -> None:
        """A step's outputs for every request of `req_ids` but `skip`, cut when settled: the
        batch-level `outputs` (owned; `slice_per_request`'s rules) and `rows`, each made when
        settled (its row i, kept 2-d, is request i's). At most one step waits: one whose settling
        never came is settled now."""
        if self._steps:
            self.settle()
        self._steps.append((req_ids, outputs, query_start_loc, rows, skip))

    def settle(self) -> None:
        """Steps logged whole, cut per request now (a step that raises is dropped: its error fails
        the requests of the call, as any hook error does)."""
        while self._steps:
            req_ids, outputs, qsl, rows, skip = self._steps.pop(0)
            n = len(req_ids)
            per_req = slice_per_request(outputs, qsl, n)
            parts = {name: make().split(1) for name, make in rows.items()}  # all views in one call each
            for i, req_id in enumerate(req_ids):
                log = self._chunks.get(req_id)
                if log is None or req_id in skip:
                    continue
                chunk = per_req[i]
                for name, views in parts.items():
                    chunk[name] = views[i]
                log.append(chunk)

    def chunks(self, req_id: str) -> list[dict[str, Any]] | None:
        if self._steps:
            self.settle()
        return self._chunks.get(req_id)

    def pop(self, req_id: str) -> list[dict[str, Any]] | None:
        if self._steps:
            self.settle()
        return self._chunks.pop(req_id, None)

    def export(self) -> dict[str, list[dict[str, Any]]]:
        self.settle()
        return dict(self._chunks)

    def restore(self, chunks: dict[str, list[dict[str, Any]]]) -> None:
        self.settle()
        self._chunks.update(chunks)


def own_copy(value: Any) -> Any:
    """Copy tensors that may alias shared memory the shim will overwrite."""
    return value.clone() if isinstance(value, torch.Tensor) else value
