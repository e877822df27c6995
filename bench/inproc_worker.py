"""Bench-only vLLM workers running a hook set in-process: `worker_cls="bench.inproc_worker.Worker"`.

The shim's own workers (worker_shim/upstream/worker.py), with one override: instead of connecting to
a sidecar, `_connect_sidecar` loads the hook set into this process and gives the shim's
unchanged `SidecarLink` an `InProcessConnection` (bench/inproc.py) as its port. Everything else of the
shim (runner interception, embeds buffer, layer capture, length finishes, the refusal of
extra kwargs under FULL CUDA graphs) is the shim's, so the in-process engine differs from
the shim + sidecar engine only in where the hooks run and what crossing to them costs.

This lives in bench/, not worker_shim/: the shim must never import omni_sidecar (the
sidecar is a separate process by design); only the baseline that measures that design does.

Settings: `additional_config["omni_inproc"] = {"hooks": "omni", "options": ["extra_kwargs=1"],
"keep_finished": 256}` (`hooks`: a built-in set or `module:Class`, as `omni-sidecar serve
--hooks`; `options`: its `--hook-option`s). Plain and shim engines ignore that key, so a bench
can give all its engines the same additional_config (it enters vLLM's compile-cache key).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from omni_arena.views import dtype_name
from proto.messages import Hello
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from worker_shim import __version__
from worker_shim.step.batch import BatchReader, PayloadTracker
from worker_shim.errors import SidecarError
from worker_shim.upstream.compat import upstream_request_ids_suffixed, vllm_version, welcome_refusal
from worker_shim.config import ShimConfig
from worker_shim.step.link import SidecarLink
from worker_shim.step.port import RecoveryPort

if TYPE_CHECKING:
    from bench.inproc import InProcessConnection

log = logging.getLogger("vllm.omni_sidecar.inproc")

CONFIG_KEY = "omni_inproc"


def inproc_config(hooks: str, options: list[str] = (), keep_finished: int = 256) -> dict[str, Any]:
    """The `additional_config` entry that selects the hook set of an in-process engine."""
    return {CONFIG_KEY: {"hooks": hooks, "options": list(options), "keep_finished": keep_finished}}


class InProcessHooksMixin:
    """Mixed in front of a shim worker: the hooks in this process instead of a sidecar."""

    omni_inproc: InProcessConnection | None = None

    def _connect_sidecar(self, payloads: PayloadTracker, batches: BatchReader) -> SidecarLink:
        from bench.inproc import InProcessConnection
        from omni_sidecar.hook_api.loader import load_hooks, parse_options
        from omni_sidecar.sessions.store import FinishedOutputs

        vcfg = self.vllm_config  # type: ignore[attr-defined]
        extra = getattr(vcfg, "additional_config", None) or {}
        mine = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        if not isinstance(mine, dict) or not mine.get("hooks"):
            raise SidecarError(f"bench.inproc_worker needs additional_config[{CONFIG_KEY!r}] naming the hooks "
                               "(bench.inproc_worker.inproc_config)")
        hooks = load_hooks(str(mine["hooks"]), parse_options(list(mine.get("options", []))))
        cfg = ShimConfig.from_vllm(vcfg)  # loss policy, embeds buffer: the shim's own settings
        mcfg = vcfg.model_config
        hello = Hello(  # what a sidecar would learn of this worker (the session's status reads it)
            protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR, shim_version=__version__,
            vllm_version=vllm_version(), platform=self.omni_platform,  # type: ignore[attr-defined]
            rank=int(self.rank), world_size=int(vcfg.parallel_config.world_size),  # type: ignore[attr-defined]
            model=str(mcfg.model), hidden_size=int(mcfg.get_hidden_size()), dtype=dtype_name(mcfg.dtype),
            max_num_tokens=int(vcfg.scheduler_config.max_num_batched_tokens), arenas=[], pid=os.getpid(),
        )
        conn = InProcessConnection(hello, hooks, FinishedOutputs(int(mine.get("keep_finished", 256))))
        refusal = welcome_refusal(conn.needs, conn.hook_set, vcfg)  # the same refusals as through a sidecar
        if refusal:
            raise SidecarError(refusal)
        log.info("omni-sidecar in-process baseline: hook set %r runs in this worker (needs %s)",
                 conn.hook_set, conn.needs)

        def no_reconnect(endpoint: str | None = None, resume_token: str = "") -> RecoveryPort:
            raise SidecarError("the in-process baseline has nothing to reconnect to")

        self.omni_inproc = conn

        length_finishes = getattr(vcfg, "speculative_config", None) is None
        return SidecarLink(no_reconnect, conn, cfg.loss_policy, cfg.embeds_buffer,
                           suffixed_ids=upstream_request_ids_suffixed(), payloads=payloads,
                           length_finishes=length_finishes, batches=batches)

    def omni_inproc_outputs(self, req_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        """For `llm.collective_rpc("omni_inproc_outputs", args=(ids,))`: each request's assembled
        outputs, as `SidecarClient.outputs` reads them from a sidecar (tensors as CPU tensors)."""
        import torch

        link, conn = self.omni_link, self.omni_inproc  # type: ignore[attr-defined]
        if link is None or conn is None:
            return {r: None for r in req_ids}
        link.flush()
        out: dict[str, dict[str, Any] | None] = {}
        for req_id in req_ids:
            found = conn.outputs(req_id)
            out[req_id] = None if found is None else {
                k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v) for k, v in found.items()}
        return out


def _cpu_worker() -> type:
    from worker_shim.upstream.cpu_worker import ShimCPUWorker

    return type("InProcessCPUWorker", (InProcessHooksMixin, ShimCPUWorker), {"__module__": __name__})


def _cuda_worker() -> type:
    from worker_shim.upstream.cuda_worker import ShimCUDAWorker

    return type("InProcessCUDAWorker", (InProcessHooksMixin, ShimCUDAWorker), {"__module__": __name__})


def __getattr__(name: str) -> type:
    """`Worker`: the in-process worker for the platform vLLM detected (as `worker_shim.Worker`)."""
    if name != "Worker":
        raise AttributeError(name)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        cls = _cpu_worker()
    elif current_platform.is_cuda_alike():
        cls = _cuda_worker()
    else:
        raise SidecarError(f"no in-process baseline worker for platform {current_platform.device_name!r}")
    globals()["Worker"] = cls  # one class per process: vLLM may resolve the name more than once
    return cls
