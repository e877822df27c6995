"""`omni-serve`: an OpenAI-compatible speech server over free-running vLLM V2 stages.

Each stage is an upstream `AsyncLLM` (Model Runner V2, the shim as its worker) with its own
omni sidecar, started and supervised here as an `omni-sidecar serve` process or attached to one
already running. Stages hand over through the sidecars (the previous stage's per-step outputs
followed, the next stage's requests fed), never through a patched scheduler. This package may
import vLLM, `worker_shim` and `proto`, never `omni_sidecar` (which stays vLLM-free).
"""
