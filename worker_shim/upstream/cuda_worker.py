"""The shim on vLLM's CUDA worker; shares the runner interception with the CPU one."""

from vllm.v1.worker.gpu_worker import Worker

from worker_shim.upstream.worker import ShimWorkerMixin


class ShimCUDAWorker(ShimWorkerMixin, Worker):
    omni_platform = "cuda"
