"""vllm-omni's model classes on unmodified upstream vLLM.

Importing `vllm_omni` runs its `__init__.py`, which runs `patch.py`: it replaces vLLM classes
process-wide. The shim loads vllm-omni's Qwen3-TTS and Qwen3-Omni classes without that
(package.py stands the package in), registers them with upstream's registries (registration.py,
from the shim's plugin), adds what upstream V2 needs to them by subclassing (qwen3_tts/,
qwen3_omni/), and checks at start-up that nothing of vllm-omni's patches is in the process
(patches.py).
"""
