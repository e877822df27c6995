"""vllm-omni's Qwen3-Omni-MoE classes as upstream vLLM loads them (stages.py).

The module stands the vllm_omni package in before it imports from it, so whichever process
imports it first (the engine's, a spawned worker, the registry's inspection subprocess) loads
vllm-omni's classes without its `__init__.py` and patches. The config classes are
transformers' own (`qwen3_omni_moe`), so nothing is registered with AutoConfig.
"""
