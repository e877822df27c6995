"""A three-stage speech pipeline on upstream vLLM V2 + the shim + omni sidecars (`make demo`).

thinker (tiny Qwen2-VL: text + an image, M-RoPE; `omni-thinker` sidecar, hidden states)
  -> talker (tiny Qwen3-TTS-shaped talker with its code predictor; `omni-talker` sidecar)
  -> code2wav (tiny codec decoder, generation only; `omni-code2wav` sidecar) -> a WAV per request.

Each stage is its own process with its own engine and sidecar (`python -m
examples.pipeline.stage NAME CONFIG`). Stages hand over only through the sidecars: a stage
follows the previous stage's per-step outputs (`SidecarClient.poll`) and streams them into
its own running requests (`SidecarClient.append`), the way vllm-omni's async-chunk stages do:
- the talker request starts once the thinker's prompt rows are there (its prompt is one
  codec row per thinker prompt row), and every thinker row generated after that is appended
  as `embed.decode` rows;
- the code2wav request starts once the talker has a chunk of frames, its codes are appended
  as they come, and `meta.codec_final` closes them.
Upstream V2's scheduler runs every scheduled request every step; a request cannot wait
for its input there. So a stage's driver steps its engine only when each running request
has what its next step reads (its next thinker row, its next chunk of frames), or its
input has ended. `--by-hand` then runs the talker and code2wav stages again one after the
other, each given the previous stage's whole output up front; codes and audio must come out
the same.
"""

STAGES = ("thinker", "talker", "code2wav")
