"""Tiny random-weight models built on first use, for the tests, the demo and the benchmarks (not shipped).

llama: the tiny Llama and its offline tokenizer; vl: a tiny Qwen2-VL (the demo's thinker);
talker: a Qwen3-TTS-shaped talker carrying vllm-omni's model hooks; code2wav: a tiny codec decoder;
qwen3_tts: a checkpoint in the published Qwen3-TTS layout for vllm-omni's own talker and code2wav classes.
"""
