"""The persistent inputs_embeds buffer the model reads when sidecar hooks may overlay rows.

Why: CUDA graphs replay fixed addresses. A FULL graph reads whatever its
captured input buffers hold, and a piecewise graph traced on the input_ids
path cannot take a fresh inputs_embeds tensor (docs/ARCHITECTURE.md, "CUDA graphs"). So when the hook
set runs before the forward, the model always takes `inputs_embeds` from this
one buffer: graphs are captured reading it (`prepare_dummy_inputs`), each step
writes the token embeddings into it outside the graph, overlay rows land in it
in place, and the replay sees them. The cost is one embedding lookup per step
outside the graph.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_shim.compat import INPUTS_EMBEDS_SIZE_METHOD


class EmbedsBuffer:
    def __init__(self, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buf = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)

    def fill(self, model: Any, input_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This step's token embeddings in rows [0, num_tokens) (padding rows included)."""
        rows = self.buf[:num_tokens]
        rows.copy_(model.embed_input_ids(input_ids[:num_tokens]))
        return rows

    def rows(self, num_tokens: int) -> torch.Tensor:
        return self.buf[:num_tokens]


def wanted(setting: str, pre_forward: str, upstream_embeds: bool) -> bool:
    """`auto`: only when hooks may overlay rows; never where upstream builds inputs_embeds.

    Upstream builds them for multimodal models (token embeddings with the encoder's
    rows merged in) and for prompt embeds, in its own persistent buffer, which its
    graphs are captured reading: overlays are written into those rows
    (worker_shim/runner.py `SidecarModelStateMixin`).
    """
    if setting == "off" or upstream_embeds:
        return False
    return setting == "on" or pre_forward != "never"


def embeds_width(model_config: Any) -> int:
    """Width of the model's inputs_embeds rows; differs from the hidden size on some models
    (a Qwen2.5-Omni talker takes thinker-width rows). Hidden size where vLLM has no such method."""
    method = getattr(model_config, INPUTS_EMBEDS_SIZE_METHOD, None)
    return int(method() if method is not None else model_config.get_hidden_size())


GRAPH_KEY = "omni_sidecar_model_inputs"
LAYERS_GRAPH_KEY = "omni_sidecar_hidden_layers"


def mark_compiled_graph(vllm_config: Any, key: str = GRAPH_KEY, value: Any = "inputs_embeds") -> None:
    """Give graphs that read the embeds buffer (or carry layer-capture hooks, `LAYERS_GRAPH_KEY`)
    their own torch.compile cache entry.

    vLLM caches compiled graphs (AOT artifacts, Inductor) under a hash of the
    config. A graph compiled by a plain run takes input_ids and ignores
    inputs_embeds; loaded from that cache, overlay rows would silently have no
    effect (seen on the H200). Likewise torch.compile traces the capture hooks'
    copies into the graph, so a graph compiled without them captures nothing.
    `additional_config` is vLLM's documented way to add out-of-tree factors to
    that hash; only this worker's copy changes.
    """
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise RuntimeError(
            "omni-sidecar needs additional_config to be a dict to key its compiled graphs "
            f"(got {type(extra).__name__}); or set omni_sidecar embeds_buffer=off and enforce_eager"
        )
    extra[key] = value
