"""vllm-omni hook semantics in the sidecar (DESIGN §3): payloads, state, outputs."""
