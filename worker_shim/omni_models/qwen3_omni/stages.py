"""vllm-omni's Qwen3-Omni-MoE model, one registered class per pipeline stage.

vllm-omni serves every stage of Qwen3-Omni with one class, `Qwen3OmniMoeForConditionalGeneration`
(its qwen3_omni.py), which builds the thinker, the talker or code2wav inside it from the
`model_stage` its own engine arguments add to the ModelConfig (and reads `async_chunk` from there
too). Upstream's ModelConfig has neither field, and upstream already owns that architecture name
(it resolves to upstream's own thinker). So each stage is a subclass here, under its own name,
that sets the two fields vllm-omni's engine would before calling vllm-omni's `__init__`. The inner
classes the outer one builds through upstream's registry (`init_vllm_registered_model` with
vllm-omni's names, which upstream does not have) are vllm-omni's own, named from thinker.py,
talker.py and code2wav.py.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_omni import qwen3_omni  # noqa: E402

# vllm-omni's engine-argument default (OmniEngineArgs.async_chunk): whole-request hand-overs.
ASYNC_CHUNK = False


def _set_stage_fields(model_config: Any, stage: str, async_chunk: bool) -> None:
    """The fields vllm-omni's OmniModelConfig adds, on upstream's ModelConfig (this process's copy)."""
    for name, value in (("model_stage", stage), ("async_chunk", async_chunk)):
        if getattr(model_config, name, None) is None:
            object.__setattr__(model_config, name, value)


class Qwen3OmniMoeStage(qwen3_omni.Qwen3OmniMoeForConditionalGeneration):
    """vllm-omni's Qwen3-Omni class, built as the stage `stage` names."""

    stage: str
    async_chunk = ASYNC_CHUNK

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        _set_stage_fields(vllm_config.model_config, self.stage, self.async_chunk)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class Qwen3OmniMoeThinkerStage(Qwen3OmniMoeStage):
    """vllm-omni's Qwen3-Omni as its thinker stage: multimodal input, M-RoPE, MoE, and the
    hidden layers the talker reads.

    vllm-omni's forward returns (hidden, {"hidden_states": {"layers": {0: rows, 24: rows}}}) and its
    runner flattens the layers to `hidden_states.layer_N` (the keys its thinker -> talker hand-over
    reads). The shim takes two-level outputs (category, name) of token-aligned rows, so the forward
    here returns the same rows under those flat names, in vllm-omni's OmniOutput."""

    stage = "thinker"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward(*args, **kwargs)
        if not isinstance(output, tuple):
            return output  # intermediate tensors (pipeline parallel)
        hidden, captured = output
        layers = ((captured or {}).get("hidden_states") or {}).get("layers") or {}
        if not layers:
            return hidden
        flat = {"hidden_states": {f"layer_{int(i)}": rows for i, rows in layers.items()}}
        return qwen3_omni.OmniOutput(text_hidden_states=hidden, multimodal_outputs=flat)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = super().load_weights(weights)
        # The deepstack buffers (a plain list, made inside upstream's tower context) stay on the meta
        # device when the vision tower is off (limit_mm_per_prompt image 0), and the forward reads them
        # whenever it is given input embeddings, which the shim gives a model with vllm-omni hooks
        # every step. With no image they hold zeros: made here on the model's device.
        thinker = self.thinker
        buffers = getattr(thinker, "deepstack_input_embeds", None)
        if buffers and any(t.is_meta for t in buffers):
            weight = thinker.language_model.model.embed_tokens.weight
            thinker.deepstack_input_embeds = [torch.zeros(t.shape, dtype=weight.dtype, device=weight.device)
                                              for t in buffers]
        return loaded


class Qwen3OmniMoeTalkerStage(Qwen3OmniMoeStage):
    """vllm-omni's Qwen3-Omni as its talker stage (preprocess / postprocess / talker_mtp hooks).
    Load it with `hf_overrides=config.talker_stage_config`, which gives upstream the talker's text
    config and names this architecture."""

    stage = "talker"


class Qwen3OmniMoeCode2WavStage(Qwen3OmniMoeStage):
    """vllm-omni's Qwen3-Omni as its code2wav stage (a generation-only stage), run as a clock on V2.

    vllm-omni's generation runner puts a request's codes (codebook-major, flat) in the step's
    input_ids, with `seq_token_counts`, and samples nothing. On V2 a code2wav request is one
    placeholder token a step (docs/ARCHITECTURE.md, "Generation-only stages"); the shim's
    `omni-code2wav` sidecar hands each request's codes for the step in
    `runtime_additional_information` (`codes.audio`, the same flat layout). So the forward here
    gives vllm-omni's forward those codes as its input_ids and counts, and gives V2 zero hidden
    rows and equal (zero) logits, as the Qwen3-TTS code2wav does (qwen3_tts/code2wav.py); with no
    attention layer it has no KV cache, which the shim's runner and worker take on every vLLM
    (compat's STAGED_WRITES_WITHOUT_KV_SINCE, V2_WARMUP_WITHOUT_KV_SINCE). The waveforms are
    vllm-omni's, one per request of the step (empty for one with no codes).

    The sidecar may hand a request its codes chunk by chunk, each with frames of left context
    (`meta.left_context_size`, omni-serve's chunk requests), whose samples vllm-omni's decoder cuts
    only in its streaming decode (`async_chunk`); so this stage decodes that way. A request's whole
    codes (left context 0) decode the same either way up to vllm-omni's non-streaming chunk of 300
    frames (one forward over them all)."""

    stage = "code2wav"
    async_chunk = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any,
                runtime_additional_information: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
        rows = int(positions.shape[-1])
        infos = runtime_additional_information or []
        codes = [(info.get("codes") or {}).get("audio") if isinstance(info, dict) else None for info in infos]
        present = [i for i, c in enumerate(codes) if isinstance(c, torch.Tensor) and c.numel()]
        # One entry per request of the step (the shim cuts lists by request); None: no codes this step.
        waves: list[torch.Tensor | None] = [None] * len(infos)
        rates: list[torch.Tensor | None] = [None] * len(infos)
        if present:
            flat = torch.cat([codes[i].reshape(-1) for i in present]).to(device=input_ids.device, dtype=torch.long)
            kwargs.pop("seq_token_counts", None)  # the placeholder rows' counts; the codes' are below
            audio = super().forward(flat, positions, *args, seq_token_counts=[int(codes[i].numel()) for i in present],
                                    runtime_additional_information=[infos[i] for i in present], **kwargs)
            made = self.make_omni_output(audio).multimodal_outputs
            for k, i in enumerate(present):
                waves[i], rates[i] = made["model_outputs"][k].reshape(-1), made["sr"][k]
        model_config = self.vllm_config.model_config
        hidden = torch.zeros(rows, model_config.get_hidden_size(), dtype=model_config.dtype, device=input_ids.device)
        return qwen3_omni.OmniOutput(text_hidden_states=hidden, multimodal_outputs={"model_outputs": waves, "sr": rates})

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # vllm-omni's compute_logits asks its code2wav module, which has none (its runner never calls it).
        return hidden_states.new_zeros(hidden_states.shape[0], self.vllm_config.model_config.get_vocab_size())
