"""vllm-omni hook semantics in the sidecar (docs/ARCHITECTURE.md, "vllm-omni semantics"): payloads, state, outputs."""
