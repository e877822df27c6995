"""vllm-omni's Qwen3-TTS classes as upstream vLLM loads them (config.py, talker.py, code2wav.py).

Each module stands the vllm_omni package in before it imports from it, so whichever process
imports one first (the engine's, a spawned one unpickling a config, the registry's inspection
subprocess) loads vllm-omni's classes without its `__init__.py` and patches.
"""
