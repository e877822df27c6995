"""A model's `talker_mtp` (its code predictor) replayed from CUDA graphs of the shim's own.

vllm-omni's runner wraps `talker_mtp` in a FULL CUDA graph when the model says
`talker_mtp_graph_safe` and vLLM runs FULL graphs (vllm-omni 0.26 `_init_talker_mtp`,
`_talker_mtp_forward`): the decode rows are padded to vLLM's next capture size and the
whole code predictor (its Q-1 autoregressive steps, sampling included) replays as one
graph. Run eagerly it is hundreds of small kernels launched from Python each step. Here
the same: the rows go into persistent input buffers, padded to the next of vLLM's capture
sizes (rows past the step's are whatever an earlier step left: each row is its own), and
each size is captured the first time a step has it, after one eager call at that size
(which is that step's result and warms the model's own compiled code up). More rows than
the largest size, or a capture that fails, run eagerly unpadded, as vllm-omni does past its
sizes. Sampling inside the graph draws from the device's default generator, as in vllm-omni's
graph (per-request `generators` are not passed: vllm-omni drops them under FULL graphs too).
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Iterable, Mapping

import torch

from worker_shim.model.graphs import SideGraphs

log = logging.getLogger("vllm.omni_sidecar.shim.mtp_graphs")

MtpResult = tuple[torch.Tensor, Any]  # (next inputs_embeds rows [B, H], codes [B, Q] or None)


class TalkerMtpGraphs:
    def __init__(self, talker_mtp: Callable[..., MtpResult], kwargs: Mapping[str, Any], sizes: Iterable[int],
                 device: torch.device) -> None:
        self.talker_mtp = talker_mtp
        self.kwargs = dict(kwargs)
        self.sizes = sorted({int(n) for n in sizes if int(n) > 0}) if device.type == "cuda" else []
        self._capturer = SideGraphs(device)
        self._inputs: list[torch.Tensor] | None = None  # ids, embeds, last hidden, text step: max size rows
        self._graphs: dict[int, tuple[Any, MtpResult]] = {}  # size -> (graph, its output tensors)
        self.graph_replays = 0

    def padded(self, num_rows: int) -> int | None:
        """vLLM's next capture size holding `num_rows` (None: more rows than any)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def __call__(self, ids: torch.Tensor, embeds: torch.Tensor, last_hidden: torch.Tensor,
                 text_step: torch.Tensor) -> MtpResult:
        n = int(ids.shape[0])
        size = self.padded(n)
        if size is None:
            return self.talker_mtp(ids, embeds, last_hidden, text_step, **self.kwargs)
        inputs = self._static_inputs((ids, embeds, last_hidden, text_step))
        for buf, src in zip(inputs, (ids, embeds, last_hidden, text_step)):
            buf[:n].copy_(src.reshape(buf[:n].shape))
        args = [buf[:size] for buf in inputs]
        captured = self._graphs.get(size)
        if captured is not None:
            graph, (out_embeds, codes) = captured
            graph.replay()
            self.graph_replays += 1
            return out_embeds[:n], (codes[:n] if codes is not None else None)
        out_embeds, codes = self.talker_mtp(*args, **self.kwargs)  # this step's, and the warm-up of the size
        graph, outputs, failure = self._capturer.capture(lambda: self.talker_mtp(*args, **self.kwargs))
        if failure is not None:
            log.warning("omni-sidecar shim: the model's talker_mtp could not be captured in a CUDA graph (%s); "
                        "it runs eagerly every step (correct; set talker_mtp_graphs=off to skip the attempt)",
                        failure)
            self.sizes = []
        else:
            self._graphs[size] = (graph, outputs)
        return out_embeds[:n], (codes[:n] if codes is not None else None)

    def _static_inputs(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The persistent input buffers, made at the first call from its dtypes and widths (zeros: the
        padding rows of a first step are read too)."""
        if self._inputs is None:
            rows = self.sizes[-1]
            self._inputs = [torch.zeros((rows, *t.reshape(t.shape[0], -1).shape[1:]) if t.dim() > 1 else (rows,),
                                        dtype=t.dtype, device=t.device) for t in tensors]
        return self._inputs
