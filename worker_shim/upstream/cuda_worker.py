"""The shim on vLLM's CUDA worker; shares the runner interception with the CPU one."""

import logging
from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from worker_shim.upstream.compat import WORKER_V2_FLAG, v2_warmup_fails_without_kv_cache
from worker_shim.upstream.worker import ShimWorkerMixin

log = logging.getLogger("vllm.omni_sidecar.shim")


class ShimCUDAWorker(ShimWorkerMixin, Worker):
    omni_platform = "cuda"

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        """Upstream's, whole. Where this vLLM's V2 kernel warm-up divides by the KV blocks a request
        needs and the model has none (a generation-only stage such as code2wav; compat's
        V2_WARMUP_WITHOUT_KV_SINCE), the worker reads its V2 flag cleared for the call, so it takes
        its other warm-up branch: a dummy forward and a sampler run on the same V2 runner, which its
        profile run went through already. The flag is set again before anything else reads it."""
        if not v2_warmup_fails_without_kv_cache(self):
            return super().compile_or_warm_up_model(*args, **kwargs)
        log.info("omni-sidecar shim: the model has no KV cache, which this vLLM's V2 kernel warm-up divides by; "
                 "the worker's dummy-run warm-up instead")
        setattr(self, WORKER_V2_FLAG, False)
        try:
            return super().compile_or_warm_up_model(*args, **kwargs)
        finally:
            setattr(self, WORKER_V2_FLAG, True)
