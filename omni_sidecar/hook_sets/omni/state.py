"""Per-request state: vllm-omni's `model_intermediate_buffer`, with its merge rules.

Semantics (vllm-omni 0.30 gpu_model_runner.py :2136-2194, payload_span.py):
- two-level deep merge in place: `{cat: {qual: v}}` updates replace per qualifier;
- tensors under a device-resident (category, qualifier) stay where they are,
  all others are moved to host memory;
- an empty update, or one for an unknown request, is a no-op;
- replace mode keeps only `meta.num_processed_tokens` and `meta.resumable`;
- `embed.decode` with `embed.decode_token_start/end` span-merges: a contiguous
  append concatenates, an overlap is trimmed, a gap is an error.
Unlike vllm-omni, memory is bounded: a request whose state outgrows the cap
gets a `StateError` (reported to the client as that request's error).

Preemption policy: state is kept when vLLM preempts a request and is there
again when it resumes (vLLM V2 re-adds it as a new request); it is freed only
on finish or abort.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_arena.spans import SPAN_KEYS, SpanError, has_span, merge_category, span_delta
from omni_sidecar.errors import OmniSidecarError

KEEP_ON_REPLACE = ("num_processed_tokens", "resumable")


class StateError(OmniSidecarError, ValueError):
    pass


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})
_TENSOR = torch.Tensor  # exactly: a subclass takes the `isinstance` below


def _nbytes(value: Any) -> int:
    kind = type(value)
    if kind in _SCALARS:  # most values a merge sizes (meta counters), every request every step
        return 0
    if kind is _TENSOR:  # the rest: each request's rows
        return value.nbytes
    if kind is dict:  # before the tensor check: isinstance(x, torch.Tensor) is slow for a non-tensor
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class IntermediateBuffer:
    def __init__(
        self,
        resident_keys: set[tuple[str, str]] | None = None,
        host_device: str | torch.device = "cpu",
        max_bytes_per_request: int = 256 << 20,
    ) -> None:
        self.resident_keys = resident_keys or set()
        self.host_device = torch.device(host_device)
        self._host_is_cpu = self.host_device.type == "cpu"  # `is_cpu` is a tenth of `.to`'s cost on a no-op
        self.max_bytes = max_bytes_per_request
        self._states: dict[str, dict[str, Any]] = {}
        # Bytes each state holds, kept up to date by every merge: sizing the whole state on each
        # merge (every step of every request) walked all of it, the bulk of a step's hook time.
        self._sizes: dict[str, int] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def get(self, req_id: str) -> dict[str, Any] | None:
        return self._states.get(req_id)

    def column(self, req_ids: list[str], category: str, qualifier: str, default: Any = None) -> list[Any]:
        """`state[category][qualifier]` of each request, in order (`default` where there is none):
        one pass, no call or default dict per request."""
        states = self._states
        values = []
        for req_id in req_ids:
            state = states.get(req_id)
            slot = state.get(category) if state is not None else None
            values.append(slot.get(qualifier, default) if type(slot) is dict else default)
        return values

    def missing(self, req_ids: list[str]) -> set[str]:
        """Those of `req_ids` without a state (one set operation, not a look-up call each)."""
        return set(req_ids).difference(self._states)

    def create(self, req_id: str, initial: dict[str, Any] | None = None) -> None:
        """A new request; a resumed one (same id, state kept) keeps its state."""
        if req_id in self._states:
            if initial:
                self.merge(req_id, initial)
            return
        self._states[req_id] = {}
        self._sizes[req_id] = 0
        if initial:
            try:
                self.merge(req_id, initial)
            except StateError:
                del self._states[req_id], self._sizes[req_id]
                raise

    def req_ids(self) -> list[str]:
        return list(self._states)

    def restore(self, req_id: str, state: dict[str, Any]) -> None:
        """A request's state handed over by a predecessor sidecar (hot upgrade)."""
        self._states[req_id] = state
        self._sizes[req_id] = _nbytes(state)

    def free(self, req_id: str) -> None:
        self._states.pop(req_id, None)
        self._sizes.pop(req_id, None)

    def own_storage(self, req_id: str) -> None:
        """Tensors of the state that view a larger tensor (a batch's rows) copied into storage of
        their own: what the state keeps alive is then what the cap counts."""
        state = self._states.get(req_id)
        for holder in [state or {}, *(v for v in (state or {}).values() if isinstance(v, dict))]:
            for key, value in holder.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
                    holder[key] = value.clone()

    def nbytes(self, req_id: str) -> int:
        return self._sizes.get(req_id, 0)

    def merge(self, req_id: str, update: dict[str, Any] | None, replace: bool = False) -> None:
        """All or nothing: an update that raises (a span gap, over the cap) leaves the state as it was
        (`_merge` checks everything before it writes)."""
        state = self._states.get(req_id)
        if state is None or not update:
            return
        self._sizes[req_id] = self._merge(state, update, replace, self._sizes[req_id])

    def merge_columns(self, req_ids: list[str], columns: dict[tuple[str, str], list[Any]],
                      placed: bool = False) -> dict[str, str]:
        """`{category: {qualifier: columns[category, qualifier][i]}}` merged into request i's state, for
        every request of `req_ids`: what one `merge` each would do (all or nothing per request,
        the cap), in one pass over the batch; one update dict and one general merge per request and
        step were most of a step's state work. `placed`: the caller put every value where `place`
        would (a column's rows are views of one placed tensor: a `place` per row was a third to half of the
        pass). Returns the requests refused (a message each)."""
        keys = list(columns)
        if any(c == "embed" and q in SPAN_KEYS for c, q in keys):  # span rules: the general merge
            return self._merge_each(req_ids, keys, columns)
        placed_columns = ([columns[k] for k in keys] if placed
                          else [[self.place(c, q, v) for v in columns[c, q]] for c, q in keys])
        # Explicit loops and scalars sized inline: a comprehension or generator per request (each a
        # call in CPython 3.11) and four `_nbytes` calls were most of this pass.
        cells = [(c, q, column) for (c, q), column in zip(keys, placed_columns)]
        states, sizes, scalars = self._states, self._sizes, _SCALARS
        errors: dict[str, str] = {}
        for i, req_id in enumerate(req_ids):
            state = states.get(req_id)
            if state is None:
                continue
            size = sizes[req_id]
            slots = []
            for c, q, column in cells:
                slot = state.get(c)
                if type(slot) is not dict:  # a category not yet a dict: the general merge
                    break
                new, old = column[i], slot.get(q)
                size += (0 if type(new) in scalars else _nbytes(new)) - (0 if type(old) in scalars else _nbytes(old))
                slots.append(slot)
            else:
                if size > self.max_bytes:
                    errors[req_id] = self._over_cap(size)
                    continue
                for (_, q, column), slot in zip(cells, slots):
                    slot[q] = column[i]
                sizes[req_id] = size
                continue
            errors.update(self._merge_each([req_id], keys, {k: [columns[k][i]] for k in keys}))
        return errors

    def _merge_each(self, req_ids: list[str], keys: list[tuple[str, str]],
                    columns: dict[tuple[str, str], list[Any]]) -> dict[str, str]:
        errors = {}
        for i, req_id in enumerate(req_ids):
            update: dict[str, dict[str, Any]] = {}
            for c, q in keys:
                update.setdefault(c, {})[q] = columns[c, q][i]
            try:
                self.merge(req_id, update)
            except StateError as exc:
                errors[req_id] = str(exc)
        return errors

    def trial_merge(self, req_id: str, earlier: list[dict[str, Any]], update: dict[str, Any]) -> dict[str, Any]:
        """`update` checked (its rules, the cap) on a copy of the state with the `earlier` deltas
        merged; the state is untouched. Returns its delta (the `embed.decode` rows past the span
        there is), which both sides of the mirror then `merge`."""
        state = self._states.get(req_id)
        if state is None:
            raise StateError("the request has no state")
        trial = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
        size = self._sizes[req_id]
        for entries in earlier:
            size = self._merge(trial, entries, False, size)
        delta = dict(update or {})
        embed = delta.get("embed")
        if has_span("embed", embed):
            try:
                span = span_delta(trial.get("embed", {}), embed)
            except SpanError as exc:
                raise StateError(str(exc)) from None
            delta["embed"] = {**{k: v for k, v in embed.items() if k not in SPAN_KEYS}, **span}
        self._merge(trial, delta, False, size)
        return delta

    def _merge(self, state: dict[str, Any], update: dict[str, Any], replace: bool, size: int) -> int:
        """`update` merged into `state` (`size` bytes before); returns the bytes after. Every value is
        placed and sized, and the cap checked, before anything is written: a merge that raises leaves
        `state` as it was, with no snapshot to restore (a merge runs for every request every step).
        Only the values replaced are sized, not the whole state."""
        base = state
        if replace:
            meta = state.get("meta", {})
            kept = {k: meta[k] for k in KEEP_ON_REPLACE if k in meta}
            base = {"meta": kept} if kept else {}
            size = 0
        writes: list[tuple[str, str | None, Any]] = []
        slots: list[str] = []  # categories a dict update makes dicts (an empty update too, as setdefault did)
        for category, value in update.items():
            current = base.get(category)
            if isinstance(value, dict):
                slots.append(category)
                slot = current if isinstance(current, dict) else None
                if current is not None and slot is None:
                    size -= _nbytes(current)  # a plain value the category's dict replaces
                try:
                    value = merge_category(slot or {}, category, value)
                except SpanError as exc:
                    raise StateError(str(exc)) from None
                for qualifier, v in value.items():
                    placed = self.place(category, qualifier, v)
                    size += _nbytes(placed) - (_nbytes(slot.get(qualifier)) if slot else 0)
                    writes.append((category, qualifier, placed))
            else:
                placed = self.place(category, None, value)
                size += _nbytes(placed) - _nbytes(current)
                writes.append((category, None, placed))
        if size > self.max_bytes:
            raise StateError(self._over_cap(size))
        if replace:
            state.clear()
            state.update(base)
        for category in slots:
            if not isinstance(state.get(category), dict):
                state[category] = {}
        for category, qualifier, placed in writes:
            if qualifier is None:
                state[category] = placed
            else:
                state[category][qualifier] = placed
        return size

    def _over_cap(self, size: int) -> str:
        return (f"request state holds {size} bytes, over the cap of {self.max_bytes} "
                "(raise it with --hook-option state_cap_mib=N)")

    def place(self, category: str, qualifier: str | None, value: Any) -> Any:
        """`value` where a merge keeps it (host memory unless the key is device-resident)."""
        if isinstance(value, torch.Tensor) and (category, qualifier) not in self.resident_keys:
            return value if self._host_is_cpu and value.is_cpu else value.to(self.host_device)
        if isinstance(value, dict):
            return {k: self.place(category, qualifier or k, v) for k, v in value.items()}
        return value
