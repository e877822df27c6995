"""Capture of chosen decoder layers' hidden states (HookNeeds.hidden_layers).

Layer N's capture is what vllm-omni calls `hidden_states["layers"][N]`: the
logical decoder state entering layer N (N = 0: the input embeddings, after any
encoder rows were merged in). vLLM's decoder layers take `(positions,
hidden_states, residual)` and defer the residual add to the next norm, so the
state is `hidden_states + residual` (just `hidden_states` where residual is None).

How: a forward pre-hook on each chosen layer, registered once at load, copies
that state into a static per-layer buffer (`max_num_tokens` rows); after the
forward the shim sends rows [0, num_tokens) of each through the arena with the
last-layer hidden states. A copy into a fixed buffer is what a CUDA graph can
replay; module hooks are traced into compiled graphs only where torch.compile
inlines them (docs/ARCHITECTURE.md, "Layer capture").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_shim.errors import SidecarError
from worker_shim.upstream.compat import DECODER_LAYERS_ATTR, LANGUAGE_MODEL_METHOD


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The language model's decoder layers: the ModuleList named `layers` with `num_layers` entries."""
    get_lm = getattr(model, LANGUAGE_MODEL_METHOD, None)
    root = get_lm() if callable(get_lm) else model
    for name, module in root.named_modules():
        if name.rsplit(".", 1)[-1] == DECODER_LAYERS_ATTR and isinstance(module, nn.ModuleList) \
                and len(module) == num_layers:
            return module
    raise SidecarError(f"found no decoder layer list of {num_layers} layers in {type(model).__name__}")


class LayerCapture:
    """Static buffers filled by pre-hooks on the chosen decoder layers."""

    def __init__(self, model: nn.Module, num_layers: int, layers: list[int], max_tokens: int,
                 width: int, dtype: torch.dtype, device: torch.device) -> None:
        bad = [n for n in layers if not 0 <= n < num_layers]
        if bad:
            raise SidecarError(f"the hook set wants hidden layers {bad}; this model has layers 0..{num_layers - 1}")
        modules = decoder_layers(model, num_layers)
        self.buffers = {n: torch.zeros(max_tokens, width, dtype=dtype, device=device) for n in sorted(set(layers))}
        self._handles = [modules[n].register_forward_pre_hook(self._hook(buf), with_kwargs=True)
                         for n, buf in self.buffers.items()]

    @staticmethod
    def _hook(buf: torch.Tensor) -> Any:
        def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            state = hidden if residual is None else hidden + residual
            buf[: state.shape[0]].copy_(state.reshape(state.shape[0], -1))

        return capture

    def rows(self, num_tokens: int) -> dict[int, torch.Tensor]:
        """This step's captured rows per layer (views of the buffers)."""
        return {n: buf[:num_tokens] for n, buf in self.buffers.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
