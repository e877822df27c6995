"""Device-side tensor arenas shared by the shim and the sidecar (imports torch, never vllm)."""
