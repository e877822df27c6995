"""The tiny talker's codes from a direct step-by-step forward, outside vLLM.

Same weights and the same `TalkerHeads`/`TalkerHooks` as the vLLM model class;
the backbone is Hugging Face's own Qwen3Model with a KV cache. The hooks run in
vllm-omni's runner order, one request at a time, greedy:
prefill chunk(s): preprocess -> forward -> postprocess; sample code 0;
each decode step: preprocess (mtp_inputs) -> talker_mtp -> forward with MTP's
inputs_embeds -> postprocess -> sample. State updates merge as vllm-omni's
`model_intermediate_buffer` does (two levels: dict values merge per key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models.talker import TalkerHeads, TalkerHooks, load_talker_config


def merge_update(state: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict):
            state.setdefault(key, {}).update(value)
        else:
            state[key] = value


class ReferenceTalker(TalkerHooks):
    def __init__(self, model_dir: str | Path):
        from safetensors.torch import load_file
        from transformers import Qwen3Model

        config = load_talker_config(model_dir)
        config._attn_implementation = "eager"
        weights = load_file(str(Path(model_dir) / "model.safetensors"))
        self.backbone = Qwen3Model(config).eval()
        self.backbone.load_state_dict(_under(weights, "model."), strict=True)
        self.heads = TalkerHeads(config).eval()
        self.heads.load_state_dict(_under(weights, "heads."), strict=True)
        self.eos_id = int(config.codec_eos_id)
        self._gaps: list[float] = []
        self.heads.codec_head.register_forward_hook(self._record_gap)
        for head in self.heads.predictor_heads:
            head.register_forward_hook(self._record_gap)

    def _record_gap(self, module, _inputs, logits: torch.Tensor) -> None:
        """Top1-top2 logit gap of every greedy choice: how far the codes are from a near-tie."""
        if module is self.heads.codec_head:
            logits = logits.masked_fill(self.heads._never_sampled, float("-inf"))
        top = logits.topk(2, dim=-1).values
        self._gaps.extend((top[..., 0] - top[..., 1]).reshape(-1).tolist())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_tokens(input_ids)

    def _forward(self, embeds: torch.Tensor, start: int, cache) -> torch.Tensor:
        positions = torch.arange(start, start + int(embeds.shape[0])).unsqueeze(0)
        out = self.backbone(inputs_embeds=embeds.unsqueeze(0), position_ids=positions,
                            past_key_values=cache, use_cache=True)
        return out.last_hidden_state[0]

    def _sample(self, hidden: torch.Tensor) -> int:
        return int(self.heads.codec_logits(hidden[-1:]).argmax(dim=-1))

    @torch.inference_mode()
    def generate(self, request: dict[str, Any], prefill_chunk: int | None = None) -> dict[str, Any]:
        """request: prompt_token_ids, info (the decoded payload), max_tokens, ignore_eos (default False)."""
        from transformers import DynamicCache

        prompt = torch.tensor(request["prompt_token_ids"], dtype=torch.long)
        prompt_len = int(prompt.shape[0])
        state = {k: dict(v) if isinstance(v, dict) else v for k, v in request["info"].items()}
        cache = DynamicCache()
        self._gaps.clear()

        def step_info(num_computed: int) -> dict[str, Any]:
            return {**state, "request_id": request.get("request_id", "ref"), "_omni_prompt_len": prompt_len,
                    "_omni_num_computed_tokens": num_computed, "_omni_is_prefill": num_computed < prompt_len}

        def forward_and_postprocess(embeds: torch.Tensor, start: int) -> torch.Tensor:
            hidden = self._forward(embeds, start, cache)
            # as vllm-omni's runner: the state without hidden_states (postprocess's positional name)
            without_hidden = {k: v for k, v in state.items() if k != "hidden_states"}
            merge_update(state, self.postprocess(hidden, **without_hidden))
            return hidden

        num_computed = 0
        while num_computed < prompt_len:
            count = min(prefill_chunk or prompt_len, prompt_len - num_computed)
            ids = prompt[num_computed : num_computed + count]
            _, embeds, update = self.preprocess(ids, None, **step_info(num_computed))
            merge_update(state, update)
            hidden = forward_and_postprocess(embeds, num_computed)
            num_computed += count
        tokens = [self._sample(hidden)]
        code_rows: list[torch.Tensor] = []
        while len(tokens) < int(request["max_tokens"]):
            if tokens[-1] == self.eos_id and not request.get("ignore_eos", False):
                break
            ids = torch.tensor([tokens[-1]], dtype=torch.long)
            ids, embeds, update = self.preprocess(ids, None, **step_info(num_computed))
            last_hidden, text_step = update.pop("mtp_inputs")
            merge_update(state, update)
            embeds, codes = self.talker_mtp(ids, embeds, last_hidden, text_step)
            code_rows.append(codes)
            hidden = forward_and_postprocess(embeds, num_computed)
            num_computed += 1
            tokens.append(self._sample(hidden))
        num_groups = self.heads.num_code_groups
        codes = torch.cat(code_rows) if code_rows else torch.zeros((0, num_groups), dtype=torch.long)
        return {"codes": codes, "tokens": tokens, "min_gap": min(self._gaps)}

    @torch.inference_mode()
    def plain_greedy(self, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """What vLLM computes with no hook bridge: ids embedded as code-0 tokens; stops at EOS.

        Returns the sampled ids and each one's logprob.
        """
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = torch.tensor(prompt_token_ids, dtype=torch.long)
        hidden = self._forward(self.embed_input_ids(ids), 0, cache)
        tokens: list[int] = []
        logprobs: list[float] = []
        while True:
            logits = self.heads.codec_logits(hidden[-1:]).log_softmax(dim=-1)[0]
            tokens.append(int(logits.argmax()))
            logprobs.append(float(logits[tokens[-1]]))
            if len(tokens) == max_tokens or tokens[-1] == self.eos_id:
                return tokens, logprobs
            position = len(prompt_token_ids) + len(tokens) - 1
            hidden = self._forward(self.embed_input_ids(torch.tensor(tokens[-1:])), position, cache)


def _under(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def reference_codes(model_dir: str | Path, requests: list[dict[str, Any]],
                    prefill_chunk: int | None = None) -> list[dict[str, Any]]:
    """Per request {"codes": [T, Q] long (one row per decode step), "tokens": sampled code-0 ids,
    "min_gap": the smallest top1-top2 logit gap of its greedy choices (near 0: a near-tie that
    another, numerically different forward may break the other way)}.

    vLLM stops a request at EOS only when asked (`stop_token_ids=[CODEC_EOS_ID]`: the talker has
    no tokenizer); requests run there with `ignore_eos=True` need `"ignore_eos": True` here.
    """
    talker = ReferenceTalker(model_dir)
    return [talker.generate(request, prefill_chunk) for request in requests]
