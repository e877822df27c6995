"""Multimodal output assembly (vllm-omni semantics) and per-step chunks for streaming.

A step's batch-level dict is cut per request: tensors whose dim 0 equals the
step's token count are token-aligned and sliced by query_start_loc; lists of
length num_reqs are per request; anything else is ignored with a counter.
Across steps a request's outputs accumulate: tensors of >= 2 dims concatenate
on dim 0, 0/1-dim values (and non-tensors) are replaced by the latest.
"""

from __future__ import annotations

from typing import Any

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
    """Per-request chunks in step order; `since(cursor)` serves streaming clients."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[dict[str, Any]]] = {}

    def start(self, req_id: str) -> None:
        self._chunks.setdefault(req_id, [])

    def add(self, req_id: str, chunk: dict[str, Any], owned: bool = False) -> None:
        """`chunk` joins the request's step outputs; its tensors are copied unless `owned` (the
        caller copied them already, e.g. once for the whole step)."""
        if chunk and req_id in self._chunks:
            self._chunks[req_id].append(chunk if owned else {k: own_copy(v) for k, v in chunk.items()})

    def chunks(self, req_id: str) -> list[dict[str, Any]] | None:
        return self._chunks.get(req_id)

    def pop(self, req_id: str) -> list[dict[str, Any]] | None:
        return self._chunks.pop(req_id, None)

    def export(self) -> dict[str, list[dict[str, Any]]]:
        return dict(self._chunks)

    def restore(self, chunks: dict[str, list[dict[str, Any]]]) -> None:
        self._chunks.update(chunks)


def own_copy(value: Any) -> Any:
    """Copy tensors that may alias shared memory the shim will overwrite."""
    return value.clone() if isinstance(value, torch.Tensor) else value
