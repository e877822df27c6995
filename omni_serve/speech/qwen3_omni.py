"""vllm-omni's Qwen3-Omni through omni-serve: its thinker -> talker hand-over, for a pipeline config's
`talker_prompt` (deploy/speech/qwen3-omni-gpu.toml).

The thinker stage (vllm-omni's class through the shim, sidecar hook set `omni`) returns its
captured layers 0 and 24 as `hidden_states.layer_N`; `talker_prompt` hands them, the thinker's ids
and its tts embeddings to vllm-omni's own hand-over functions
(worker_shim/omni_models/qwen3_omni/handover.py, which the H200 driver
deploy/gpu/qwen3_omni_engines.py calls too) and gives the talker's placeholder prompt and payload
in vllm-omni's format. The talker -> code2wav hand-over is omni-serve's streamed one (chunks of
the talker's frames to the `omni-code2wav` hook set), which keeps only the frames in the codebook
(the talker's stop frame is not), as vllm-omni's does.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from omni_serve.speech.handover import ThinkerOutput

SPEAKER = "speaker"  # the request payload's voice (vllm-omni's key), handed on to the talker


@functools.lru_cache(maxsize=4)
def _checkpoint(model: str) -> tuple[dict[str, Any], int]:
    """What the hand-over reads of the thinker's checkpoint: its tts embeddings, the talker's layer."""
    from worker_shim.omni_models.qwen3_omni.handover import accept_hidden_layer, tts_embeddings

    return tts_embeddings(model), accept_hidden_layer(model)


def talker_prompt(thinker: ThinkerOutput) -> tuple[list[int], dict[str, Any]]:
    """The talker's prompt ids and payload (nested, numpy) from the thinker's record; ValueError where
    vllm-omni's hand-over finds the thinker's layers missing."""
    import torch

    from worker_shim.omni_models.qwen3_omni.handover import talker_input

    try:
        tts, layer = _checkpoint(thinker.model)
    except (OSError, KeyError) as exc:  # a hub id, not a local checkpoint; a file missing from it
        raise ValueError(f"the thinker's checkpoint {thinker.model!r} must be a local folder with its "
                         f"config.json and safetensors ({type(exc).__name__}: {exc})") from None
    outputs = {**tts, **{name: torch.from_numpy(rows) for name, rows in thinker.rows().items()}}
    speaker = thinker.payload.get(SPEAKER)
    if isinstance(speaker, (list, tuple)):
        speaker = speaker[0] if speaker else None
    handed = talker_input(outputs, thinker.prompt_ids, thinker.output_ids, speaker=speaker, hidden_layer=layer)
    if handed is None:
        raise ValueError(f"vllm-omni's thinker -> talker hand-over found no layers 0 and {layer} among the "
                         f"thinker's outputs ({sorted(thinker.outputs)})")
    prompt_ids, payload = handed
    return prompt_ids, numpy_payload(payload)


def numpy_payload(node: Any) -> Any:
    """vllm-omni's payload (tensors, lists, scalars; None for what it lacks) as omni-serve's payload
    encoder takes it: tensors as numpy (bfloat16 widened to float32), None left out."""
    import torch

    if isinstance(node, dict):
        return {key: numpy_payload(value) for key, value in node.items() if value is not None}
    if isinstance(node, torch.Tensor):
        value = node.detach().cpu()
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float16):
            value = value.float()
        return np.ascontiguousarray(value.numpy())
    return node
