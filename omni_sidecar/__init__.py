"""omni-sidecar: omni / TTS hook logic in a process of its own, next to vLLM.

Imports no vLLM: the sidecar is immune to vLLM version skew and can be
upgraded or restarted without restarting the engine.
"""

__version__ = "0.1.0"
