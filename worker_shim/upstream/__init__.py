"""What vLLM calls: the shim workers, the runner's class swaps, and the upstream names they rely on."""
