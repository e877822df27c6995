"""A thinker -> talker pair of hook sets, the shape of Qwen-Omni's first two stages.

`omni-thinker`: assembles each request's last-layer hidden states (token
aligned), which a client hands to the next stage as its prompt payload.

`omni-talker`: overlays those hidden states as prompt embeddings in prefill,
and for every sampled token runs a small "code predictor" in the sidecar that
turns the hidden row into Q codebook codes; each code depends on the previous
token's codes kept in per-request state, so state must survive across decode
steps. Output "codes" is [generated tokens, Q].
"""

from __future__ import annotations

from typing import Any

import torch

from omni_sidecar.omni.hooks import OmniStateHooks

NUM_CODEBOOKS = 4
CODEBOOK_SIZE = 16


class ThinkerHooks(OmniStateHooks):
    name = "omni-thinker"


class CodePredictor:
    """Deterministic stand-in for a talker's code head: codes from (hidden row, previous codes)."""

    def __init__(self, hidden_size: int, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.proj = torch.randn(hidden_size, NUM_CODEBOOKS * CODEBOOK_SIZE, generator=gen)
        self.prev_bias = torch.randn(NUM_CODEBOOKS, CODEBOOK_SIZE, CODEBOOK_SIZE, generator=gen)

    def step(self, row: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        logits = (row.float() @ self.proj).view(NUM_CODEBOOKS, CODEBOOK_SIZE)
        if prev is not None:
            logits = logits + self.prev_bias[torch.arange(NUM_CODEBOOKS), prev]
        return logits.argmax(dim=-1)

    def run(self, rows: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        codes = []
        for row in rows:
            prev = self.step(row, prev)
            codes.append(prev)
        return torch.stack(codes) if codes else torch.empty(0, NUM_CODEBOOKS, dtype=torch.int64)


class TalkerHooks(OmniStateHooks):
    name = "omni-talker"

    def __init__(self, **options: str) -> None:
        super().__init__(**options)
        self._predictor: CodePredictor | None = None

    def multimodal_outputs(self, batch, hidden: torch.Tensor) -> dict[str, Any]:
        return {}

    def postprocess(self, req_id: str, hidden_rows: torch.Tensor, state: dict[str, Any]):
        if self._predictor is None:
            self._predictor = CodePredictor(hidden_rows.shape[1])
        meta = state.get("meta", {})
        before = int(meta.get("num_processed_tokens", 0))
        prompt_len = int(meta.get("prompt_len", 0))
        n = int(hidden_rows.shape[0])
        # Rows at positions >= prompt_len - 1 each produced a sampled token.
        first = max(0, prompt_len - 1 - before)
        codes = self._predictor.run(hidden_rows[first:], state.get("codes", {}).get("last"))
        update: dict[str, Any] = {"meta": {"num_processed_tokens": before + n}}
        if codes.shape[0]:
            update["codes"] = {"last": codes[-1]}
        return update, {"codes": codes}
