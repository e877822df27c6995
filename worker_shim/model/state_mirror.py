"""The model's view of each live request's state: vllm-omni's `model_intermediate_buffer`, mirrored.

The sidecar owns the state (docs/ARCHITECTURE.md, "Model hooks"); this mirror is
what the model's hooks read as `**info` in the vLLM process. It is filled once per
request from the sidecar's plan (the decoded payload), then updated in place by the
model's own updates with vllm-omni's runner rules (`_update_intermediate_buffer`:
two-level merge, `{cat: {qual: v}}` replaces per qualifier; tensors under the
model's `gpu_resident_buffer_keys` stay on its device, the others go to the host).
Every update is also kept, merged the same way, as the step's update for the
sidecar. Clients' appends arrive as MirrorUpdates and merge at a step start
(`apply_appended`, not a model update). Kept across preemption (vLLM re-adds the same id);
freed at finish.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from omni_arena.spans import merge_category

ResidentKeys = frozenset[tuple[str, str]]


class StateMirror:
    def __init__(self, resident_keys: ResidentKeys = frozenset()) -> None:
        self.resident_keys = resident_keys
        self.states: dict[str, dict[str, Any]] = {}
        self.unserved: set[str] = set()  # the sidecar failed their state: model hooks skip them
        self.step_updates: dict[str, dict[str, Any]] = {}
        self.step_outputs: dict[str, dict[str, Any]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.states

    def missing(self, req_ids: Iterable[str]) -> list[str]:
        return [r for r in req_ids if r not in self.states]

    def fill(self, req_id: str, initial: dict[str, Any] | None, served: bool = True) -> None:
        """A request's first state (the sidecar's decoded payload; {} when none serves it)."""
        self.states[req_id] = {}
        if not served:
            self.unserved.add(req_id)
        if initial:
            self._merge_into(self.states[req_id], initial)

    def owned(self, value: torch.Tensor, key: tuple[str, str]) -> torch.Tensor:
        """`value` stored as a merge under `key` would store it: a batch's tensor copied once, whose
        per-request rows (views) then merge with `owned=True`."""
        return self._stored(value, key in self.resident_keys)

    def merge(self, req_id: str, update: Any, owned: bool = False, private: torch.Tensor | None = None) -> None:
        """A model update: into the state the hooks read next, and into this step's update.
        `owned`: its tensors are the mirror's already (`owned()`), stored as they are. `private`: a
        copy made for the hook that returned `update`: resident views of it are stored as they are."""
        state = self.states.get(req_id)
        if state is None or not isinstance(update, dict) or not update:
            return
        base = private.untyped_storage().data_ptr() if private is not None else None
        # The stored values, not the model's: the sidecar gets exactly what the mirror holds.
        sent = self.step_updates.get(req_id)
        if sent is None:
            sent = self.step_updates[req_id] = {}
        for key, value in update.items():
            if isinstance(value, dict):
                slot, out = state.get(key), sent.get(key)
                if not isinstance(slot, dict):
                    slot = state[key] = {}
                if not isinstance(out, dict):
                    out = sent[key] = {}
                for qual, v in value.items():
                    if not owned:
                        resident = (key, qual) in self.resident_keys
                        v = (v.detach() if resident and base is not None and isinstance(v, torch.Tensor)
                             and v.untyped_storage().data_ptr() == base else self._stored(v, resident))
                    slot[qual] = out[qual] = v
            else:
                state[key] = sent[key] = value if owned else self._stored(value, False)

    def apply_appended(self, req_id: str, entries: dict[str, Any], device: Any = None) -> None:
        """A client's append the sidecar sent (MirrorUpdate, its delta): merged as the sidecar merges it
        (`embed.decode` spans appended, omni_arena/spans.py) into the state the hooks read next, not into
        the step's update (the sidecar holds it already). Resident keys go to `device`. SpanError: a gap."""
        state = self.states.get(req_id)
        if state is None or req_id in self.unserved:
            return
        for key, value in entries.items():
            if isinstance(value, dict):
                if device is not None:
                    value = {q: v.to(device) if isinstance(v, torch.Tensor) and (key, q) in self.resident_keys else v
                             for q, v in value.items()}
                slot = state.get(key)
                value = merge_category(slot if isinstance(slot, dict) else {}, key, value)
            self._merge_into(state, {key: value})

    def add_output(self, req_id: str, output: dict[str, Any]) -> None:
        """Per-request outputs of this step (MTP codes, model-returned tensors), two-level."""
        if req_id not in self.states:
            return
        mine = self.step_outputs.setdefault(req_id, {})
        for key, value in output.items():
            if isinstance(value, dict) and isinstance(mine.get(key), dict):
                mine[key].update(value)
            else:
                mine[key] = value

    def take_step(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This step's updates and outputs per request (for its StepEnd); starts the next step."""
        taken = self.step_updates, self.step_outputs
        self.step_updates, self.step_outputs = {}, {}
        return taken

    def free(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)
            self.unserved.discard(req_id)
            self.step_updates.pop(req_id, None)
            self.step_outputs.pop(req_id, None)

    def _merge_into(self, state: dict[str, Any], update: dict[str, Any], owned: bool = False) -> None:
        for key, value in update.items():
            if isinstance(value, dict):
                slot = state.get(key)
                if not isinstance(slot, dict):
                    slot = state[key] = {}
                for qual, v in value.items():
                    slot[qual] = v if owned else self._stored(v, (key, qual) in self.resident_keys)
            else:
                state[key] = value if owned else self._stored(value, False)

    @staticmethod
    def _stored(value: Any, resident: bool) -> Any:
        """vllm-omni's `_store_value`, except that host tensors are copied too: a model's
        update may alias a buffer the next forward overwrites."""
        if isinstance(value, torch.Tensor):
            t = value.detach()
            return t.clone() if resident else t.to("cpu", copy=True).contiguous()
        if isinstance(value, list):
            return [v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for v in value]
        return value
