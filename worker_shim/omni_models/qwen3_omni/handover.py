"""vllm-omni's Qwen3-Omni hand-overs between its stages, for a pipeline that runs the stages itself.

vllm-omni's orchestrator moves a finished thinker request to the talker (its non-streaming mode,
`async_chunk: false`) with `thinker2talker_full_payload` (the thinker's layer-0 rows as
`embed.prefill`, its layer-24 rows as `hidden_states.output`, the thinker's embeddings of its
tts_bos / tts_eos / tts_pad tokens, the prompt and all ids) and a talker prompt of placeholders as
long as `_compute_talker_prompt_ids_length` says; a finished talker request goes on to code2wav
with `talker2code2wav_full_payload` (the codec rows its output ids vouch for, codebook-major).
Here those functions are called, unpatched, with what a pipeline outside vllm-omni's orchestrator
has of a request (its outputs by dotted key, its ids): deploy/gpu/qwen3_omni_engines.py and
omni-serve (omni_serve/speech/qwen3_omni.py) both hand over through this module.

The tts embeddings: vllm-omni's thinker stage adds them to its outputs (its embedding of the
config's tts_*_token_id), which are not token-aligned rows and so not what the shim's thinker
stage returns (stages.py); `tts_embeddings` reads the same rows from the checkpoint's table.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.stage_input_processors import qwen3_omni as vllm_omni_handover  # noqa: E402

TTS_TOKENS = ("tts_bos", "tts_eos", "tts_pad")
EMBED_TABLE = "thinker.model.embed_tokens.weight"  # the thinker's token embeddings, as published
TALKER_PLACEHOLDER = 0  # the talker's prompt ids: vllm-omni's `thinker2talker_token_only` writes zeros
PUBLISHED_ACCEPT_HIDDEN_LAYER = 24  # the thinker layer the talker reads (vllm-omni 0.26 has it written in)


def accept_hidden_layer(model_dir: str | Path) -> int:
    """The thinker layer the checkpoint's talker reads (its talker_config's `accept_hidden_layer`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("talker_config", {}).get("accept_hidden_layer", PUBLISHED_ACCEPT_HIDDEN_LAYER))


def tts_embeddings(model_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The thinker's embeddings of its tts tokens, as vllm-omni's thinker outputs name them
    (`embed.tts_bos`, ... each [1, 1, H]), read from the checkpoint (one file or shards)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    index = model_dir / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][EMBED_TABLE] if index.is_file() else "model.safetensors"
    with safe_open(str(model_dir / shard), "pt") as f:
        table = f.get_slice(EMBED_TABLE)
        rows = {name: table[int(config[f"{name}_token_id"]):int(config[f"{name}_token_id"]) + 1]
                for name in TTS_TOKENS}
    return {f"embed.{name}": (row if dtype is None else row.to(dtype)).reshape(1, 1, -1) for name, row in rows.items()}


def talker_input(thinker_outputs: Mapping[str, Any], prompt_ids: list[int], output_ids: list[int],
                 request_id: str = "", speaker: str | None = None,
                 hidden_layer: int = PUBLISHED_ACCEPT_HIDDEN_LAYER) -> tuple[list[int], dict[str, Any]] | None:
    """The talker's prompt ids and payload for a finished thinker request, as vllm-omni's orchestrator
    makes them: `thinker_outputs` holds `hidden_states.layer_0` and `hidden_states.layer_N`, N the
    layer the talker reads (rows for the prompt and every generated token), and `embed.tts_*`; None
    where vllm-omni's function finds them missing."""
    all_ids = list(prompt_ids) + list(output_ids)
    # vllm-omni reads the speaker from the request's additional information (its wire entries).
    info = (SimpleNamespace(entries={"speaker": SimpleNamespace(list_data=[speaker])}) if speaker else None)
    request = SimpleNamespace(request_id=request_id, external_req_id=request_id, prompt_token_ids=list(prompt_ids),
                              output_token_ids=list(output_ids), all_token_ids=all_ids, additional_information=info)
    # Later vllm-omni releases read the talker's layer from their transfer manager's model config.
    config = SimpleNamespace(hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=hidden_layer)))
    payload = vllm_omni_handover.thinker2talker_full_payload(SimpleNamespace(config=config), dict(thinker_outputs),
                                                             request)
    if payload is None:
        return None
    length = vllm_omni_handover._compute_talker_prompt_ids_length(
        {"ids": {"all": all_ids, "prompt": list(prompt_ids)}}, device="cpu")
    return [TALKER_PLACEHOLDER] * length, payload


def codec_codes(codes: torch.Tensor, output_ids: list[int], request_id: str = "") -> list[int] | None:
    """A finished talker request's codes for code2wav, as vllm-omni's orchestrator hands them on:
    the rows of `codes` ([rows, Q], the last aligned with the output ids) whose output id and codes
    are in the codebook, codebook-major and flat; None where none are."""
    payload = vllm_omni_handover.talker2code2wav_full_payload(
        None, {"codes.audio": codes}, SimpleNamespace(request_id=request_id, output_token_ids=list(output_ids)))
    return None if payload is None else list(payload["codes"]["audio"])
