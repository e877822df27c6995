"""One rank of the TP broadcast test: `python tp_job.py RANK INIT_FILE RESULT.json` (gloo, CPU).

A stand-in for vLLM's GroupCoordinator carries the same attributes the shim
uses (rank_in_group, world_size, ranks, cpu_group, broadcast on the device group).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from proto.messages import HookNeeds
from worker_shim.step.batch import PayloadTracker, payload_of
from worker_shim.step.tp import TensorParallelSync


class Group:
    def __init__(self, rank: int) -> None:
        self.rank_in_group, self.world_size, self.ranks = rank, 2, [0, 1]
        self.cpu_group = dist.group.WORLD

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=self.ranks[src], group=dist.group.WORLD)
        return tensor


def request(req_id: str, payload: bool) -> SimpleNamespace:
    extra = {"omni_sidecar": {"x": 1}} if payload else None
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(extra_args=extra))


def main(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    payloads = PayloadTracker()  # the rank's link feeds it in a real runner
    sync = TensorParallelSync(Group(rank), payloads)
    needs = sync.share_needs(HookNeeds(pre_forward="prefill", pre_forward_scope="payload") if rank == 0 else None)
    for req in (request("a", True), request("b", False)):
        payloads.note_new(req.req_id, payload_of(req))
    prefill = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_np=np.array([0, 5]),
                              prefill_len_np=np.array([4, 5]))
    decode = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_np=np.array([4, 6]),
                             prefill_len_np=np.array([4, 5]))
    schedule = [sync.step_needs_broadcast(prefill), sync.step_needs_broadcast(decode)]
    # Every rank filled its own embeds buffer from the token ids; rank 0 then overlaid rows 1..2.
    embeds = torch.zeros(6, 4)
    extra = {}
    if rank == 0:
        embeds[1:3] = torch.arange(8, dtype=torch.float32).view(2, 4) + 1
        extra = {"inputs_embeds": embeds, "spans": [[0, 4]], "tensor_kwarg": torch.ones(2)}
    got = sync.exchange(extra, embeds, 6, 4, torch.float32, torch.device("cpu"))
    payloads.note_finished({"a"})
    after = sync.step_needs_broadcast(prefill)
    result = {"needs": needs.pre_forward, "schedule": schedule, "after_finish": after,
              "keys": sorted(got), "spans": got.get("spans"), "embeds": got["inputs_embeds"].tolist(),
              "same_buffer": got["inputs_embeds"].data_ptr() == embeds.data_ptr()}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
