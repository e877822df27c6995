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


def per_request_outputs(outputs: dict[str, Any], num_tokens: int, num_reqs: int) -> dict[str, Any]:
    """The batch-level outputs a request's chunk takes a part of (the module's rule): token-aligned
    tensors (sliced by rows) and lists with an item per request (copied: a hook may reuse its list)."""
    kept: dict[str, Any] = {}
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_tokens:
            kept[name] = value
        elif isinstance(value, (list, tuple)) and len(value) == num_reqs:
            kept[name] = list(value)
    return kept


def slice_per_request(
    outputs: dict[str, Any], query_start_loc: list[int], num_reqs: int
) -> list[dict[str, Any]]:
    per_req: list[dict[str, Any]] = [{} for _ in range(num_reqs)]
    lengths = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_reqs)]
    for name, value in per_request_outputs(outputs, query_start_loc[num_reqs], num_reqs).items():
        if type(value) is list:
            for i in range(num_reqs):
                if value[i] is not None:
                    per_req[i][name] = value[i]
        else:
            for i, part in enumerate(value.split(lengths)):  # one call for all views, not one slice each
                per_req[i][name] = part
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


class _LoggedStep:
    """One step's outputs, logged whole; request i's chunk of it is cut when first read
    (`slice_per_request`'s rules, then row i of each of `rows`, kept 2-d)."""

    __slots__ = ("outputs", "query_start_loc", "num_reqs", "rows", "_parts")

    def __init__(self, outputs: dict[str, Any], query_start_loc: list[int], num_reqs: int,
                 rows: dict[str, Callable[[], torch.Tensor]]) -> None:
        # Only what a request's chunk takes: the rest would only be kept alive.
        self.outputs = per_request_outputs(outputs, query_start_loc[num_reqs], num_reqs)
        self.query_start_loc = query_start_loc
        self.num_reqs = num_reqs
        self.rows = rows
        self._parts: dict[str, tuple[torch.Tensor, ...]] | None = None

    def chunk(self, i: int) -> dict[str, Any]:
        qsl = self.query_start_loc
        chunk: dict[str, Any] = {}
        for name, value in self.outputs.items():
            if type(value) is not list:
                chunk[name] = value[qsl[i] : qsl[i + 1]]
            elif value[i] is not None:
                chunk[name] = value[i]
        if self.rows:
            if self._parts is None:  # all of a step's rows in one call each, the first time one is read
                self._parts = {name: make().split(1) for name, make in self.rows.items()}
            for name, views in self._parts.items():
                chunk[name] = views[i]
        return chunk


Logged = dict[str, Any] | tuple[_LoggedStep, int]  # a chunk, or request i's part of a logged step


def _cut(log: list[Logged], start: int) -> int:
    """The log's entries from `start` on made chunks (in place); returns the log's length."""
    for k in range(start, len(log)):
        entry = log[k]
        if type(entry) is tuple:
            log[k] = entry[0].chunk(entry[1])
    return len(log)


class OutputLog:
    """Per-request chunks in step order; `since(cursor)` serves streaming clients.

    A step's outputs are logged whole (`add_step`) and each request's chunk of them is cut when
    something reads it (a streaming client, the finished outputs, a hand-over): cutting every
    request's chunk every step (a view per request and output) was most of the sidecar's work
    between two steps on a GPU host, and a client may never read them. `settle`, between steps,
    only notes which requests a logged step belongs to; every read and write settles first, so
    order and contents are those of cutting at once. Each request's entries of its latest step are
    marked, so that step can be withdrawn (`withdraw`: a forward vLLM discarded)."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[Logged]] = {}
        self._cut_upto: dict[str, int] = {}  # entries before this index are chunks already
        self._steps: list[tuple[list[str], _LoggedStep, set[str], int]] = []
        self._latest: dict[str, tuple[int, int]] = {}  # req_id -> (its latest step, that step's first entry)

    def start(self, req_id: str) -> None:
        self._chunks.setdefault(req_id, [])

    def add(self, req_id: str, chunk: dict[str, Any], step: int, owned: bool = False) -> None:
        """`chunk` joins the request's outputs of `step`; its tensors are copied unless `owned` (the
        caller copied them already, e.g. once for the whole step)."""
        if self._steps:
            self.settle()
        log = self._chunks.get(req_id)
        if chunk and log is not None:
            self._mark(req_id, step, len(log))
            log.append(chunk if owned else {k: own_copy(v) for k, v in chunk.items()})

    def add_step(self, req_ids: list[str], outputs: dict[str, Any], query_start_loc: list[int],
                 rows: dict[str, Callable[[], torch.Tensor]], skip: set[str], step: int) -> None:
        """A step's outputs for every request of `req_ids` but `skip`: the batch-level `outputs`
        (owned; `slice_per_request`'s rules) and `rows`, each made when first read (its row i,
        kept 2-d, is request i's). At most one step waits to be settled."""
        if self._steps:
            self.settle()
        self._steps.append((req_ids, _LoggedStep(outputs, query_start_loc, len(req_ids), rows), skip, step))

    def settle(self) -> None:
        """Steps logged whole, noted in each request's log (a step that raises is dropped: its
        error fails the requests of the call, as any hook error does)."""
        while self._steps:
            req_ids, logged, skip, step = self._steps.pop(0)
            logs, latest = self._chunks, self._latest
            for i, req_id in enumerate(req_ids):
                log = logs.get(req_id)
                if log is not None and req_id not in skip:
                    mark = latest.get(req_id)
                    if mark is None or mark[0] != step:
                        latest[req_id] = (step, len(log))
                    log.append((logged, i))

    def _mark(self, req_id: str, step: int, index: int) -> None:
        mark = self._latest.get(req_id)
        if mark is None or mark[0] != step:
            self._latest[req_id] = (step, index)

    def before_step(self, req_id: str, step: int) -> int:
        """How many of the request's entries came before `step` (its latest step's first entry, when
        that step is `step` or later; else all)."""
        if self._steps:
            self.settle()
        mark, log = self._latest.get(req_id), self._chunks.get(req_id)
        if log is None:
            return 0
        return mark[1] if mark is not None and mark[0] >= step else len(log)

    def withdraw(self, req_id: str, step: int) -> None:
        """The request's entries of `step`, its latest, taken out (vLLM discarded that forward)."""
        if self._steps:
            self.settle()
        mark, log = self._latest.get(req_id), self._chunks.get(req_id)
        if mark is None or log is None or mark[0] != step:
            return
        del log[mark[1]:]
        del self._latest[req_id]
        if self._cut_upto.get(req_id, 0) > mark[1]:
            self._cut_upto[req_id] = mark[1]

    def chunks(self, req_id: str) -> list[dict[str, Any]] | None:
        if self._steps:
            self.settle()
        log = self._chunks.get(req_id)
        if log is not None and (start := self._cut_upto.get(req_id, 0)) < len(log):
            self._cut_upto[req_id] = _cut(log, start)
        return log  # type: ignore[return-value]  # all chunks now

    def detach(self, req_id: str) -> Callable[[], list[dict[str, Any]]] | None:
        """The request's log, taken out (a finished request): a call that cuts its chunks, for
        whoever reads them later. None: not a request the log knows."""
        if self._steps:
            self.settle()
        log = self._chunks.pop(req_id, None)
        start = self._cut_upto.pop(req_id, 0)
        self._latest.pop(req_id, None)
        if log is None:
            return None

        def cut() -> list[dict[str, Any]]:
            _cut(log, start)
            return log  # type: ignore[return-value]

        return cut

    def forget(self, req_id: str) -> None:
        if self._steps:
            self.settle()
        self._chunks.pop(req_id, None)
        self._cut_upto.pop(req_id, None)
        self._latest.pop(req_id, None)

    def export(self) -> dict[str, list[dict[str, Any]]]:
        return {r: self.chunks(r) for r in list(self._chunks)}  # type: ignore[misc]

    def restore(self, chunks: dict[str, list[dict[str, Any]]]) -> None:
        self.settle()
        for req_id, log in chunks.items():
            self._chunks[req_id] = log
            self._cut_upto.pop(req_id, None)
            self._latest.pop(req_id, None)


def own_copy(value: Any) -> Any:
    """Copy tensors that may alias shared memory the shim will overwrite."""
    return value.clone() if isinstance(value, torch.Tensor) else value
