"""vLLM-facing half of omni-sidecar: a worker that hosts upstream Model Runner V2.

Use `worker_cls="worker_shim.Worker"` (or `--worker-cls worker_shim.Worker`);
it resolves to the shim for the current platform. Only vLLM imports this.

Rooms:
- upstream/: what vLLM calls (the workers, the runner's class swaps) and compat.py, the one list
  of upstream names the shim relies on;
- step/: one step with the sidecar: link.py (the runner's entry), protocol.py (which message,
  what it waits for), port.py (the sidecar as a step sees it), the batch read, the plan read,
  the step end, the hidden slots, finishes, tensor parallelism;
- model/: what the shim adds around the model: the embeds buffer, layer capture, the model's own
  hooks (bridge.py) and their state mirror;
- wire/: one connection to one sidecar: the channel (socket and rings) and the connection;
- session/: which sidecar serves and what it was told: recovery (loss, reconnect, hand-over)
  and the request notices;
- omni_models/: vllm-omni's own model classes loaded without its patches, registered with
  upstream, and the start-up check that no vllm-omni patch is in the process;
- config.py (settings), errors.py, plugin.py (vLLM's `general_plugins` entry point).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Worker":
        from worker_shim.upstream.worker import platform_worker_class

        return platform_worker_class()
    raise AttributeError(name)
