"""What the thinker stage hands the talker: one record of its request, for the config's `talker_prompt`.

Plain numpy and ids (no vLLM), so a model's hand-over function can be written and tested without
an engine. The record holds everything a thinker stage made of the request; a hand-over reads what
its talker needs (the tiny demo's talker: the last layer's rows; vllm-omni's Qwen3-Omni talker:
the captured layers 0 and 24, the prompt and output ids, the thinker's own embeddings of its
text-to-speech tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

HIDDEN = "hidden_states"  # the thinker sidecar's last-layer rows [rows, H] (the omni-thinker hook set)
LAYER_PREFIX = f"{HIDDEN}.layer_"  # `hidden_states.layer_N`: layer N's rows, where the thinker captures layers


@dataclass
class ThinkerOutput:
    """The thinker's request, finished: its sidecar's assembled outputs and its ids."""

    outputs: dict[str, np.ndarray]  # name -> array; token-aligned rows (one per token the thinker ran) float32
    prompt_ids: list[int]  # the prompt as the engine ran it (multimodal placeholders expanded)
    output_ids: list[int]  # the tokens it generated
    model: str  # the thinker's checkpoint: what a hand-over reads beside the outputs (special tokens' embeddings)
    payload: dict[str, Any] = field(default_factory=dict)  # the request's own (thinker_prompt's), e.g. its speaker

    @property
    def layers(self) -> dict[int, np.ndarray]:
        """The captured layers' rows by layer index."""
        return {int(name[len(LAYER_PREFIX):]): rows for name, rows in self.outputs.items()
                if name.startswith(LAYER_PREFIX) and name[len(LAYER_PREFIX):].isdigit()}

    def rows(self) -> dict[str, np.ndarray]:
        """The token-aligned outputs (2-D float arrays), by name."""
        return {name: value for name, value in self.outputs.items()
                if isinstance(value, np.ndarray) and value.ndim == 2 and value.dtype.kind == "f"}


# The thinker's record -> the talker's prompt ids and its payload (nested dicts of numpy arrays,
# lists and scalars: omni_serve/stages/payload.py encodes them).
TalkerPrompt = Callable[[ThinkerOutput], tuple[list[int], dict[str, Any]]]
