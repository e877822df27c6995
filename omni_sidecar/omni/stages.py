"""A thinker -> talker pair of hook sets, the shape of Qwen-Omni's and Qwen3-TTS's stages.

`omni-thinker`: assembles each request's last-layer hidden states (token
aligned), which a client hands to the next stage as its prompt payload.

`omni-talker`: for a talker model that carries vllm-omni's own hooks (preprocess,
talker_mtp, postprocess), which the shim calls in the vLLM process
(docs/ARCHITECTURE.md, "Model hooks"). What remains here needs no weights: each
request's payload is decoded into the state the model reads (sent to the shim once),
the model's per-step updates are merged into that state (so it survives a hot
upgrade), and its code-predictor codes are assembled per request as `codes.audio`
[decode steps, codebooks], streamed per step. It needs no hidden states and no
blocking exchange except on steps that bring new requests.
"""

from __future__ import annotations

from omni_sidecar.omni.hooks import OmniStateHooks
from proto.messages import HookNeeds


class ThinkerHooks(OmniStateHooks):
    name = "omni-thinker"


class TalkerHooks(OmniStateHooks):
    name = "omni-talker"

    def __init__(self, state_cap_mib: str = "256", resident_keys: str = "") -> None:
        super().__init__(state_cap_mib=state_cap_mib, resident_keys=resident_keys)
        self.needs = HookNeeds(pre_forward="never", hidden_states=False, prefix_cache_safe=False,
                               model_states=True)
