"""The built-in hook sets: the reference ones and vllm-omni's (omni/)."""
