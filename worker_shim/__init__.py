"""vLLM-facing half of omni-sidecar: a worker that hosts upstream Model Runner V2.

Use `worker_cls="worker_shim.Worker"` (or `--worker-cls worker_shim.Worker`);
it resolves to the shim for the current platform. Only vLLM imports this.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Worker":
        from worker_shim.upstream.worker import platform_worker_class

        return platform_worker_class()
    raise AttributeError(name)
