"""Shim workers: upstream CPU / CUDA workers plus the sidecar connection.

`init_device` (upstream) builds the V2 runner; the shim then checks the
upstream names it uses, connects to the sidecar (failing fast with a clear
message), and swaps the runner's class for the interception subclass.
"""

from __future__ import annotations

import logging
import os
import statistics

import msgspec
from typing import Any

from proto.arena import sweep_stale
from proto.endpoint import pid_namespace
from proto.messages import ArenaKind, Hello
from proto.tensors import DTYPE_ITEMSIZE
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from worker_shim import __version__
from worker_shim.errors import SidecarError
from worker_shim.wire.connection import SidecarConnection
from worker_shim.step.batch import BatchReader, PayloadTracker
from worker_shim.upstream.compat import (ShimCompatError, check_upstream, has_own_prefill_flags,
                                         parallel_sizes, start_refusal, upstream_request_ids_suffixed, vllm_version,
                                         welcome_refusal)
from worker_shim.model.bridge import model_class_has_hooks
from worker_shim.config import ArenaChoice, ShimConfig
from worker_shim.omni_models.patches import patches_applied, require_unpatched
from worker_shim.step.link import SidecarLink
from worker_shim.upstream.runner import SidecarRunnerMixin, swap_class
from worker_shim.step.tp import TensorParallelFollower, TensorParallelSync
from worker_shim.step.slots import hidden_arena_size
from omni_arena.views import dtype_name

log = logging.getLogger("vllm.omni_sidecar.shim")


class ShimWorkerMixin:
    """Mixed in front of an upstream worker class; every override calls super()."""

    omni_link: SidecarLink | TensorParallelFollower | None = None
    omni_platform = "cpu"

    def init_device(self) -> None:
        check_upstream(self.omni_platform)
        require_unpatched("the worker starting")
        vcfg = self.vllm_config  # type: ignore[attr-defined]
        tp_size, _ = parallel_sizes(vcfg)
        refusal = start_refusal(vcfg, tp_size > 1 and model_class_has_hooks(vcfg))
        if refusal:
            raise SidecarError(refusal)
        super().init_device()  # type: ignore[misc]
        if not getattr(self, "use_v2_model_runner", False):
            raise ShimCompatError(
                "omni-sidecar's shim hosts Model Runner V2 only, but vLLM picked the V1 runner. "
                "Set VLLM_USE_V2_MODEL_RUNNER=1 (and check the log for the V2 feature it refused)."
            )
        payloads = PayloadTracker()  # one per rank: its link feeds it, its TP sync reads it
        batches = BatchReader(has_own_prefill_flags())  # this vLLM's batch, as every step reads it
        tp = TensorParallelSync.from_vllm(payloads, batches)
        link: SidecarLink | TensorParallelFollower
        if tp is None or tp.driver:
            link = self._connect_sidecar(payloads, batches)
            if tp is not None:
                tp.share_needs(link.needs)
        else:
            cfg = ShimConfig.from_vllm(self.vllm_config)  # type: ignore[attr-defined]
            link = TensorParallelFollower(tp.share_needs(None), cfg.embeds_buffer, payloads)
            log.info("omni-sidecar shim: TP rank %d follows rank 0's sidecar (needs %s)", tp.rank, link.needs)
        self.omni_link = link
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.omni_link = link
        runner.omni_tp = tp
        swap_class(runner, SidecarRunnerMixin)

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        require_unpatched("the worker, its model loaded")  # a model's imports may have pulled vllm_omni in
        return result

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        """Upstream's warm-up runs real steps with requests of its own (V2 `warmup_kernels`,
        kernel warm-ups; worker_shim/upstream/compat.py): the runner marks every request added meanwhile
        as vLLM's, so model hooks skip them, whatever their ids."""
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.omni_refuse_lost_outputs()  # the profile run called the forward
            runner.omni_warming_up = True
        try:
            out = super().compile_or_warm_up_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            if runner is not None:
                runner.omni_warming_up = False
        if runner is not None:
            runner.omni_refuse_lost_outputs()  # graph capture called it (before the engine takes requests)
        return out

    def _connect_sidecar(self, payloads: PayloadTracker, batches: BatchReader) -> SidecarLink:
        stale = sweep_stale()
        if stale:
            log.info("omni-sidecar shim: removed %d stale arena(s) of dead processes from /dev/shm", len(stale))
        vcfg = self.vllm_config  # type: ignore[attr-defined]
        cfg = ShimConfig.from_vllm(vcfg)
        mcfg = vcfg.model_config
        dtype = dtype_name(mcfg.dtype)
        hidden_size = int(mcfg.get_hidden_size())
        max_tokens = int(vcfg.scheduler_config.max_num_batched_tokens)
        layer_room = [0]  # captured layers a slot has room for: what the last sidecar wanted
        # vLLM launches a step before it reads the last one's samples: a finish may discard a forward.
        async_scheduling = bool(getattr(vcfg.scheduler_config, "async_scheduling", False))
        hello = Hello(
            protocol_major=PROTOCOL_MAJOR,
            protocol_minor=PROTOCOL_MINOR,
            shim_version=__version__,
            vllm_version=vllm_version(),
            platform=self.omni_platform,
            rank=int(self.rank),  # type: ignore[attr-defined]
            world_size=int(vcfg.parallel_config.world_size),
            model=str(mcfg.model),
            hidden_size=hidden_size,
            dtype=dtype,
            max_num_tokens=max_tokens,
            arenas=[],
            pid=os.getpid(),
            pid_namespace=pid_namespace(),
            async_scheduling=async_scheduling,
        )

        device, arena_kind = self._arena_choice(cfg.arena)

        def connect(endpoint: str | None = None, resume_token: str = "") -> SidecarConnection:
            hidden_bytes = hidden_arena_size(max_tokens, hidden_size, DTYPE_ITEMSIZE.get(dtype, 4), cfg.hidden_slots,
                                             int(cfg.model_io_mib * (1 << 20)), 1 + layer_room[0])
            return SidecarConnection(
                endpoint or cfg.endpoint, cfg.step_timeout_s,
                msgspec.structs.replace(hello, resume_token=resume_token), hidden_bytes, cfg.hidden_slots,
                arena_prefix=f"omni-shim-r{self.rank}",  # type: ignore[attr-defined]
                curve_keys=cfg.curve_keys or None, device=device, arena_kind=arena_kind, ring=cfg.ring,
            )

        first = connect()
        welcome = first.connect(cfg.connect_timeout_s)
        if len(welcome.needs.hidden_layers) > layer_room[0]:
            # The Hello offers the arena before the hooks' needs are known: once more, with room.
            first.close()
            layer_room[0] = len(welcome.needs.hidden_layers)
            first = connect()
            welcome = first.connect(cfg.connect_timeout_s)
        refusal = welcome_refusal(welcome.needs, welcome.hook_set, vcfg)
        if refusal:
            first.close()
            raise SidecarError(refusal)
        log.info(
            "omni-sidecar shim %s connected to %s: hook set %r (sidecar %s, session %d, needs %s, "
            "tensors via %s)", __version__, cfg.endpoint, welcome.hook_set, welcome.sidecar_version,
            welcome.session, welcome.needs, arena_kind,
        )
        # With speculative decoding a row's sample count is known only after verification.
        length_finishes = getattr(vcfg, "speculative_config", None) is None
        return SidecarLink(connect, first, cfg.loss_policy, cfg.embeds_buffer,
                           suffixed_ids=upstream_request_ids_suffixed(), payloads=payloads,
                           length_finishes=length_finishes, batches=batches, async_scheduling=async_scheduling)

    def _arena_choice(self, setting: ArenaChoice) -> tuple[Any, ArenaKind]:
        """CUDA IPC on CUDA GPUs; host shared memory (staging) on CPU and accelerators without it."""
        import torch

        device = torch.device(getattr(self, "device", None) or "cpu")
        if setting == "shm" or device.type == "cpu":
            return device, "shm"
        from omni_arena.cuda_ipc import check_torch, cuda_ipc_available

        if setting == "cuda_ipc":
            check_torch()
            if device.type != "cuda":
                raise ShimCompatError(f"OMNI_SIDECAR_ARENA=cuda_ipc needs a CUDA device, this worker runs on {device}")
            return device, "cuda_ipc"
        if cuda_ipc_available(device):
            return device, "cuda_ipc"
        log.warning("omni-sidecar: no CUDA IPC on %s; tensors are staged through host shared memory", device)
        return device, "shm"

    def omni_sidecar_stats(self) -> dict[str, Any]:
        """For `llm.collective_rpc("omni_sidecar_stats")`: what the shim sent and measured."""
        assert self.omni_link is not None
        stats = self.omni_link.stats()
        for key in ("exchange_us", "plan_read_us", "post_us", "plan_read_cpu_us", "step_end_cpu_us", "model_hook_us",
                    "switch_us"):
            lat = sorted(stats.pop(key, []))
            stats[f"{key}_p50"] = statistics.median(lat) if lat else 0.0
            stats[f"{key}_p99"] = lat[round(0.99 * (len(lat) - 1))] if lat else 0.0
            stats[f"{key}_n"] = len(lat)
        embeds = getattr(getattr(self, "model_runner", None), "omni_embeds", None)
        stats["embeds_graph_replays"] = embeds.graph_replays if embeds is not None else 0  # worker_shim/model/embeds.py
        return stats

    def omni_sidecar_vllm_omni_patches(self) -> list[str]:
        """For `llm.collective_rpc("omni_sidecar_vllm_omni_patches")`: vllm-omni's patches found in this
        worker's process (worker_shim/omni_models/patches.py); [] when upstream vLLM is untouched."""
        return patches_applied()

    def omni_sidecar_mirror_waiting(self) -> int:
        """For `llm.collective_rpc("omni_sidecar_mirror_waiting")`, between steps: how many appends
        to mirrored state (MirrorUpdates) have reached this worker and wait for the next step's
        start. A driver that must have an append in a step waits for it here before stepping
        (examples/pipeline); the sidecar answers the append only once a step applied it."""
        assert self.omni_link is not None
        return self.omni_link.mirror_updates_waiting()

    def omni_sidecar_reconnect(self) -> bool:
        """For `llm.collective_rpc("omni_sidecar_reconnect")`, between steps: a sidecar started again
        after a loss (omni-serve's supervisor asks once it answers) is taken up now rather than at the
        next step, which an idle engine does not run; the requests the loss failed are told to it at
        once. True when connected (a tensor-parallel follower: always, rank 0 connects)."""
        assert self.omni_link is not None
        return self.omni_link.reconnect_idle()

    def shutdown(self) -> None:
        if self.omni_link is not None:
            self.omni_link.close()
            self.omni_link = None
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()


def platform_worker_class() -> type:
    """The shim worker for the platform vLLM detected."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from worker_shim.upstream.cpu_worker import ShimCPUWorker

        return ShimCPUWorker
    if current_platform.is_cuda_alike():
        from worker_shim.upstream.cuda_worker import ShimCUDAWorker

        return ShimCUDAWorker
    raise ShimCompatError(
        f"omni-sidecar's shim has no worker for platform {current_platform.device_name!r} yet"
    )
