"""Tensor parallelism: rank 0 drives the sidecar, the other ranks get what the forward needs.

Decision: one sidecar session per engine, held by TP rank 0. The hooks run
once per step (stateful omni hooks would otherwise see every request once per
rank), and the hidden states rank 0 sends are the replicated final ones. What
must be identical on every rank before the forward — the inputs_embeds with
overlay rows, JSON-like extra kwargs — rank 0 broadcasts over vLLM's own TP
group: a small header over the CPU group (no device sync), the embeddings over
the device group (NCCL, enqueued on the stream). Every rank decides from the
same scheduler output and the needs rank 0 shared at start-up whether a step
needs a broadcast, so all ranks enter the same collectives.

Limits: tensor-valued extra kwargs are not broadcast, so hooks that declare extra
kwargs are refused at start-up with TP > 1 (compat's `welcome_refusal`; a hot
upgrade to such hooks gets each tensor kwarg dropped on every rank with an error);
a hot upgrade to a hook set with different needs keeps the start-up broadcast
schedule.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from proto.messages import HookNeeds
from worker_shim.step.batch import BatchReader, PayloadTracker, payload_of
from worker_shim.errors import SidecarError
from worker_shim.config import EmbedsSetting
from worker_shim.step.protocol import before_forward

log = logging.getLogger("vllm.omni_sidecar.shim.tp")
MAX_KWARGS_BYTES = 16 << 20


class TensorParallelSync:
    def __init__(self, group: Any, payloads: PayloadTracker, batches: BatchReader | None = None) -> None:
        self.group = group
        self.rank = int(group.rank_in_group)
        self.size = int(group.world_size)
        self.needs = HookNeeds()
        self.payloads = payloads  # the rank's link feeds it; every rank holds the same
        self.batches = batches if batches is not None else BatchReader()

    @classmethod
    def from_vllm(cls, payloads: PayloadTracker, batches: BatchReader) -> "TensorParallelSync | None":
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return cls(group, payloads, batches) if int(group.world_size) > 1 else None

    @property
    def driver(self) -> bool:
        return self.rank == 0

    def _bcast_bytes(self, data: bytes | None) -> bytes:
        """Length then bytes from rank 0 over the CPU group (gloo; msgspec bytes, never Python objects)."""
        src = self.group.ranks[0]
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        torch.distributed.broadcast(length, src=src, group=self.group.cpu_group)
        n = int(length.item())
        if n == 0:
            return b""
        if n > MAX_KWARGS_BYTES:
            raise SidecarError(f"TP broadcast of {n} bytes exceeds {MAX_KWARGS_BYTES}")
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.driver
               else torch.empty(n, dtype=torch.uint8))
        torch.distributed.broadcast(buf, src=src, group=self.group.cpu_group)
        return buf.numpy().tobytes()

    def share_needs(self, needs: HookNeeds | None) -> HookNeeds:
        """Start-up: rank 0's handshake result reaches every rank (they build the same buffers)."""
        data = self._bcast_bytes(msgspec.msgpack.encode(needs) if self.driver else None)
        self.needs = msgspec.msgpack.decode(data, type=HookNeeds)
        return self.needs

    # -- per step -----------------------------------------------------------------

    def step_needs_broadcast(self, input_batch: Any) -> bool:
        """The link's decision (the step protocol's) with the start-up needs (every rank's copy of them)."""
        return before_forward(self.needs, input_batch.req_ids, lambda: self.batches.prefilling(input_batch),
                              self.payloads.payload_reqs).send is not None

    def exchange(self, extra: dict[str, Any], embeds: torch.Tensor | None, num_tokens: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """Rank 0's extra inputs become every rank's (call on all ranks, same steps)."""
        header = None
        if self.driver:
            kwargs = {}
            for key, value in extra.items():
                if key == "inputs_embeds":
                    continue
                try:
                    msgspec.msgpack.encode(value)
                    kwargs[key] = value
                except TypeError:
                    log.error("extra kwarg %r holds tensors, which TP>1 does not broadcast yet; "
                              "dropped on every rank", key)
            header = msgspec.msgpack.encode({"embeds": "inputs_embeds" in extra, "kwargs": kwargs})
        doc = msgspec.msgpack.decode(self._bcast_bytes(header))
        out: dict[str, Any] = dict(doc["kwargs"])
        if doc["embeds"]:
            if self.driver:
                rows = extra["inputs_embeds"]
            else:
                rows = embeds if embeds is not None else torch.empty(
                    num_tokens, hidden_size, dtype=dtype, device=device)
            self.group.broadcast(rows, src=0)
            out["inputs_embeds"] = rows
        return out


class TensorParallelFollower:
    """The runner's link on TP ranks > 0: no sidecar of its own; tracks payloads, counts steps."""

    def __init__(self, needs: HookNeeds, embeds_setting: EmbedsSetting, payloads: PayloadTracker) -> None:
        self.needs = needs
        self.embeds_setting = embeds_setting
        self.payloads = payloads
        self.hook_set = ""
        self.in_step = False
        self.steps = 0

    def note_finished(self, finished: set[str], preempted: set[str] | None) -> None:
        self.payloads.note_finished(finished)

    def note_new(self, new_reqs: list[Any]) -> None:
        for req in new_reqs:
            self.payloads.note_new(req.req_id, payload_of(req))

    def begin_step(self) -> None:
        self.in_step = True

    def abort_step(self) -> None:
        self.in_step = False

    def ask_early(self, input_batch: Any, bridge: Any = None) -> None:
        pass  # rank 0 asks; the plan reaches this rank by broadcast

    def pre_forward(self, input_batch: Any, model: Any, embeds: torch.Tensor | None = None,
                    bridge: Any = None) -> dict[str, Any]:
        return {}  # model hooks run with TP size 1 only (worker_shim/model/bridge.py)

    def end_step(self, state: Any, model_results: Any = None) -> None:
        self.in_step = False
        if state is not None:
            self.steps += 1

    def note_sampled(self, output: Any) -> None:
        pass  # finishes are rank 0's to tell

    def mirror_updates_waiting(self) -> int:
        return 0  # rank 0's link receives them

    def reconnect_idle(self) -> bool:
        return True  # rank 0's link connects

    def stats(self) -> dict[str, Any]:
        return {"role": "tp-follower", "steps": self.steps, "connected": False,
                "hook_set": self.hook_set, "request_errors": {}}

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
