"""The persistent inputs_embeds buffer the model reads when sidecar hooks may overlay rows.

Why: CUDA graphs replay fixed addresses. A FULL graph reads whatever its
captured input buffers hold, and a piecewise graph traced on the input_ids
path cannot take a fresh inputs_embeds tensor (docs/ARCHITECTURE.md, "CUDA graphs"). So when the hook
set runs before the forward, the model always takes `inputs_embeds` from this
one buffer: graphs are captured reading it (`prepare_dummy_inputs`), each step
writes the token embeddings into it outside the graph, overlay rows land in it
in place, and the replay sees them. The cost is one embedding lookup per step
outside the graph.

That lookup is itself replayed from a CUDA graph of our own where vLLM runs graphs (a size of
its `cudagraph_capture_sizes`, one GPU, tensor parallel size 1, no LoRA, `embeds_graphs=auto`):
eagerly it is the model's embedding module called from Python, a cast, the lookup and a copy
(~34 µs of host time in a hot loop on the H200 host, ~90 µs a step inside the engine by session
11's profile; a replay 2.4 µs), where plain V2 runs the lookup inside its first piecewise graph.
Each size is captured the first time a step has it (its lookup run once eagerly first, which is
that step's fill), reading vLLM's persistent input_ids buffer; a step whose input_ids are
elsewhere, or any size once a capture failed, looks up eagerly. The graph holds the lookup as a
function of the input ids alone (docs/ARCHITECTURE.md, "CUDA graphs").
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from worker_shim.model.graphs import SideGraphs
from worker_shim.upstream.compat import INPUTS_EMBEDS_SIZE_METHOD

log = logging.getLogger("vllm.omni_sidecar.shim.embeds")


class EmbedsBuffer:
    def __init__(self, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 graph_sizes: Iterable[int] = ()) -> None:
        self.buf = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        # Sizes whose lookup runs from a graph of ours: only on CUDA, only sizes vLLM pads steps to.
        self._graph_sizes = frozenset(n for n in graph_sizes if 0 < n <= max_tokens) if device.type == "cuda" else frozenset()
        self._graphs: dict[int, tuple[Any, int]] = {}  # size -> (graph, the input_ids address it reads)
        self._capturer = SideGraphs(device)
        self.graph_replays = 0

    def fill(self, model: Any, input_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This step's token embeddings in rows [0, num_tokens) (padding rows included)."""
        rows = self.buf[:num_tokens]
        if num_tokens in self._graph_sizes:
            captured = self._graphs.get(num_tokens)
            if captured is None:
                self._capture(model, input_ids, num_tokens)  # its warm-up lookup is this step's fill
                return rows
            graph, address = captured
            if address == input_ids.data_ptr():
                graph.replay()
                self.graph_replays += 1
                return rows
        rows.copy_(model.embed_input_ids(input_ids[:num_tokens]))
        return rows

    def _capture(self, model: Any, input_ids: torch.Tensor, num_tokens: int) -> None:
        """This step's fill, eagerly (it is this step's; the first call of a size also warms the lookup
        up), then the same fill captured on a side stream; on a failure to capture, every size fills
        eagerly from now on."""
        rows, ids = self.buf[:num_tokens], input_ids[:num_tokens]
        rows.copy_(model.embed_input_ids(ids))  # raises as the eager fill would
        graph, _, failure = self._capturer.capture(lambda: rows.copy_(model.embed_input_ids(ids)))
        if failure is not None:
            self._no_graphs(failure)
            return
        self._graphs[num_tokens] = (graph, input_ids.data_ptr())

    def _no_graphs(self, exc: str) -> None:
        log.warning("omni-sidecar shim: the model's embedding lookup could not be captured in a CUDA graph "
                    "(%s); it runs eagerly every step (correct; set embeds_graphs=off to skip the attempt)", exc)
        self._graph_sizes = frozenset()
        self._graphs.clear()

    def rows(self, num_tokens: int) -> torch.Tensor:
        return self.buf[:num_tokens]


def wanted(setting: str, pre_forward: str, upstream_embeds: bool) -> bool:
    """`auto`: only when hooks may overlay rows; never where upstream builds inputs_embeds.

    Upstream builds them for multimodal models (token embeddings with the encoder's
    rows merged in) and for prompt embeds, in its own persistent buffer, which its
    graphs are captured reading: overlays are written into those rows
    (worker_shim/upstream/runner.py `SidecarModelStateMixin`).
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
