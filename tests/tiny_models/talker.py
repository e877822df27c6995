"""A tiny Qwen3-TTS-shaped talker for tests and benchmarks (not shipped).

The talker turns a thinker's hidden rows (payload `hidden_states.output`
[T_text, H_thinker] and `embed.tts_pad` [1, H_thinker]) into audio codes:
a Qwen3 backbone samples code 0 of each frame over codebook 0 (+ EOS), and a
small code predictor fills codebooks 1..Q-1 greedily from the backbone's last
hidden row. The sum of a frame's Q code embeddings plus the next projected
thinker row is the next step's input, so every frame depends on the previous.

Written by us in the shape of vllm-omni's `Qwen3TTSTalkerForConditionalGeneration`
(none of its code): the same hook names and signatures (`TalkerHooks`), the
same order of calls. All talker-specific weights and maths live in one plain
module (`TalkerHeads`) used both by the vLLM model class
(tests/support/talker_model.py) and by the direct reference forward
(tests/support/talker_reference.py), so comparing the two checks the bridge
that calls the hooks, not the maths twice.

This module imports torch and transformers only; `register()` imports vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from omni_serve.speech.handover import ThinkerOutput

ARCH = "OmniTinyTalkerForConditionalGeneration"
CODEBOOK_SIZE = 64
# Specials sit after codebook 0 in the backbone's vocabulary; only codebook 0 and EOS are ever sampled.
CODEC_BOS_ID = CODEBOOK_SIZE
CODEC_EOS_ID = CODEBOOK_SIZE + 1
CODEC_PAD_ID = CODEBOOK_SIZE + 2
TALKER_CONFIG = dict(
    vocab_size=CODEBOOK_SIZE + 3,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=CODEC_BOS_ID,
    eos_token_id=CODEC_EOS_ID,
    pad_token_id=CODEC_PAD_ID,
    # talker fields (extra config keys; HF keeps them as attributes)
    codebook_size=CODEBOOK_SIZE,
    num_code_groups=4,
    thinker_hidden_size=96,
    codec_bos_id=CODEC_BOS_ID,
    codec_eos_id=CODEC_EOS_ID,
    codec_pad_id=CODEC_PAD_ID,
)
# Heads are scaled up so greedy argmax has clear winners (as llama.py does for its LM head).
HEAD_SCALE = 8.0
_STAMP = "omni-tiny-talker-v1"


class TalkerHeads(nn.Module):
    """Every talker weight outside the backbone, and the maths of the hooks.

    `config` is the checkpoint's config (an HF `Qwen3Config` carrying the talker
    fields of `TALKER_CONFIG`). Code 0 is embedded by the backbone's own token
    embedding; the residual codebooks 1..Q-1 by `residual_embeds`.
    """

    def __init__(self, config: Any):
        super().__init__()
        hidden, thinker = int(config.hidden_size), int(config.thinker_hidden_size)
        self.codebook_size = int(config.codebook_size)
        self.num_code_groups = int(config.num_code_groups)
        self.text_fc1 = nn.Linear(thinker, thinker)
        self.text_fc2 = nn.Linear(thinker, hidden)
        self.residual_embeds = nn.ModuleList(
            nn.Embedding(self.codebook_size, hidden) for _ in range(self.num_code_groups - 1)
        )
        self.predictor_in = nn.Linear(hidden, hidden)
        self.predictor_heads = nn.ModuleList(
            nn.Linear(hidden, self.codebook_size, bias=False) for _ in range(self.num_code_groups - 1)
        )
        self.codec_head = nn.Linear(hidden, int(config.vocab_size), bias=False)
        sampled = torch.zeros(int(config.vocab_size), dtype=torch.bool)
        sampled[: self.codebook_size] = True
        sampled[int(config.codec_eos_id)] = True
        self.register_buffer("_never_sampled", ~sampled, persistent=False)

    def project_text(self, rows: torch.Tensor) -> torch.Tensor:
        """Thinker rows [n, H_thinker] -> talker width [n, H]."""
        rows = rows.to(device=self.text_fc1.weight.device, dtype=self.text_fc1.weight.dtype)
        return self.text_fc2(nn.functional.silu(self.text_fc1(rows)))

    def prompt_text_rows(self, info: dict[str, Any], start: int, count: int) -> torch.Tensor:
        """Projected thinker rows for prompt rows [start, start+count); tts_pad past the thinker's end."""
        output = info["hidden_states"]["output"]
        rows = output[start : start + count]
        missing = count - int(rows.shape[0])
        if missing > 0:
            pad = info["embed"]["tts_pad"].reshape(1, -1).to(rows.dtype)
            rows = torch.cat([rows, pad.expand(missing, -1)])
        return self.project_text(rows)

    def start_text_steps(self, info: dict[str, Any]) -> dict[str, Any]:
        """The decode steps read thinker rows from the first one past the prompt (set once)."""
        return {} if "text_pos" in info.get("meta", {}) else {"meta": {"text_pos": 0}}

    def next_text_step(self, info: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """This decode step's text row [1, H]: thinker row `text_pos` past the prompt, projected.

        The rows come in the payload (`hidden_states.output` past the prompt) or streamed in while
        the request runs (`embed.decode`, span-indexed from the first row past the prompt, as
        vllm-omni's streamed decode rows are); past them, the projected `tts_pad`. A row is
        projected alone either way, so a streamed run and one given every row up front compute
        the same. A streaming driver steps a request only once its next row is there."""
        pos = int(info["meta"]["text_pos"])
        return self.project_text(_thinker_row(info, pos)), {"meta": {"text_pos": pos + 1}}

    def predict_codes(
        self, code0: torch.Tensor, code0_embeds: torch.Tensor, last_hidden: torch.Tensor, text_step: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual codes (greedy, one codebook after the other) -> (next inputs_embeds [B,H], codes [B,Q]).

        A code 0 outside codebook 0 (EOS, BOS, PAD) is written as 0 in the frame, as vllm-omni's
        talker does: every code a frame carries is one a codec can decode."""
        state = last_hidden.reshape(code0_embeds.shape) + code0_embeds
        frame_embeds = code0_embeds
        code0 = code0.reshape(-1).to(torch.long)
        codes = [torch.where(code0 < self.codebook_size, code0, torch.zeros_like(code0))]
        for head, embed in zip(self.predictor_heads, self.residual_embeds):
            code = head(nn.functional.silu(self.predictor_in(state))).argmax(dim=-1)
            code_embeds = embed(code)
            state = state + code_embeds
            frame_embeds = frame_embeds + code_embeds
            codes.append(code)
        return frame_embeds + text_step.reshape(frame_embeds.shape), torch.stack(codes, dim=1)

    def codec_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary; only codebook 0 and EOS can win."""
        return self.codec_head(hidden).masked_fill(self._never_sampled, float("-inf"))


def _thinker_row(info: dict[str, Any], pos: int) -> torch.Tensor:
    """Thinker row `pos` past the prompt [1, H_thinker] (see `TalkerHeads.next_text_step`)."""
    output = info["hidden_states"]["output"]
    index = int(info["_omni_prompt_len"]) + pos
    if index < int(output.shape[0]):
        return output[index : index + 1]
    streamed = info.get("embed", {})
    if streamed.get("decode") is not None:
        start, end = int(streamed["decode_token_start"]), int(streamed["decode_token_end"])
        if start <= pos < end:
            return streamed["decode"][pos - start : pos - start + 1]
    return info["embed"]["tts_pad"].reshape(1, -1)


def _is_prefill(info: dict[str, Any]) -> bool:
    flag = info.get("_omni_is_prefill")
    if isinstance(flag, bool):
        return flag
    return int(info["_omni_num_computed_tokens"]) < int(info["_omni_prompt_len"])


def _last_hidden(info: dict[str, Any]) -> torch.Tensor:
    last = info.get("hidden_states", {}).get("last")
    if not isinstance(last, torch.Tensor):
        raise RuntimeError(f"request {info.get('request_id')}: no hidden_states.last (postprocess did not run)")
    return last.reshape(1, -1)


class TalkerHooks:
    """vllm-omni's model-hook API, as its runner calls it (docs/ARCHITECTURE.md, "Model hooks").

    A class mixing this in provides `heads: TalkerHeads` and `embed_input_ids(ids)`
    (the backbone's code-0 embedding). `info` is the request's state plus the
    runner's `request_id`, `_omni_prompt_len`, `_omni_num_computed_tokens`,
    `_omni_is_prefill`.
    """

    heads: TalkerHeads
    has_preprocess = True
    has_postprocess = True
    talker_mtp_output_key = ("codes", "audio")
    # talker_mtp has no host sync and no data-dependent control flow: a CUDA graph may capture it
    talker_mtp_graph_safe = True
    gpu_resident_buffer_keys = {("codes", "audio"), ("hidden_states", "last")}

    def preprocess(
        self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None, **info: Any
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        code_embeds = self.embed_input_ids(input_ids)
        span = int(input_ids.shape[0])
        if _is_prefill(info):
            start = int(info["_omni_num_computed_tokens"])
            embeds = code_embeds + self.heads.prompt_text_rows(info, start, span)
            return input_ids, embeds, self.heads.start_text_steps(info)
        if span > 1:
            return input_ids, code_embeds, {}
        text_step, update = self.heads.next_text_step(info)
        update["mtp_inputs"] = (_last_hidden(info), text_step)
        return input_ids, code_embeds, update

    def preprocess_decode_batch(
        self, *, input_ids: torch.Tensor, req_infos: list[dict[str, Any]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
        steps = [self.heads.next_text_step(info) for info in req_infos]
        last_hidden = torch.cat([_last_hidden(info) for info in req_infos])
        text_steps = torch.cat([step for step, _ in steps])
        input_ids = input_ids.reshape(-1)
        return input_ids, self.embed_input_ids(input_ids), last_hidden, text_steps, [u for _, u in steps]

    def talker_mtp(
        self,
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads.predict_codes(input_ids, input_embeds, last_talker_hidden, text_step)

    def postprocess(self, hidden_states: torch.Tensor, **_: Any) -> dict[str, Any]:
        if hidden_states.shape[0] == 0:
            return {}
        return {"hidden_states": {"last": hidden_states[-1:].detach()}}


def load_talker_config(model_dir: str | Path):
    from transformers import Qwen3Config

    return Qwen3Config.from_pretrained(str(model_dir))


def build_tiny_talker(path: str | Path, seed: int = 0) -> Path:
    """Create (once) the tiny talker checkpoint in `path`: config.json + model.safetensors."""
    path = Path(path)
    stamp = path / "omni_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("stamp") == _STAMP:
        return path
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    path.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**TALKER_CONFIG, architectures=[ARCH], torch_dtype="float32")
    torch.manual_seed(seed)
    backbone = Qwen3Model(config)
    heads = TalkerHeads(config)
    with torch.no_grad():
        for name, param in heads.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, config.initializer_range)
        heads.codec_head.weight.mul_(HEAD_SCALE)
        for head in heads.predictor_heads:
            head.weight.mul_(HEAD_SCALE)
    tensors = {f"model.{k}": v for k, v in backbone.state_dict().items()}
    tensors.update({f"heads.{k}": v for k, v in heads.state_dict().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config.save_pretrained(path)
    stamp.write_text(json.dumps({"stamp": _STAMP, "seed": seed}))
    return path


def register() -> None:
    """Registers the talker's vLLM class with vLLM's ModelRegistry in this process.

    Call it before `LLM(...)`. vLLM's CPU platform starts engine and worker processes with
    `spawn` (multiprocessing on): call it at the top level of the main script, which each
    spawned process imports again (tests/support/talker_plain_job.py does).
    """
    from vllm import ModelRegistry

    from tests.support.talker_model import OmniTinyTalkerForConditionalGeneration

    ModelRegistry.register_model(ARCH, OmniTinyTalkerForConditionalGeneration)


SPEECH_PROMPT_ROWS = 2  # BOS + PAD: the rest of the text is read one row per decode step


def speech_prompt(text: str, voice: int) -> tuple[list[int], dict[str, Any]]:
    """The tiny talker's request for a text (what `omni-serve` calls: deploy/speech/tiny.toml).

    Stands in for a real Qwen3-TTS talker's speaker and text embeddings: one fixed random row per
    voice, then one fixed random row per UTF-8 byte (tables seeded once); the voice's row is the
    first prompt row, so every frame depends on it. Returns the prompt ids and the payload (numpy
    arrays, vllm-omni's keys): `hidden_states.output` [1 + bytes, H_thinker] and `embed.tts_pad`
    [1, H_thinker].
    """
    import numpy as np

    width = TALKER_CONFIG["thinker_hidden_size"]
    table = np.random.default_rng(1234).standard_normal((256, width), dtype=np.float32)
    speaker = np.random.default_rng(5678 + voice).standard_normal((1, width), dtype=np.float32)
    rows = np.concatenate([speaker, table[np.frombuffer(text.encode("utf-8"), dtype=np.uint8)]])
    pad = np.random.default_rng(91).standard_normal((1, width), dtype=np.float32)
    prompt = [CODEC_BOS_ID] + [CODEC_PAD_ID] * (SPEECH_PROMPT_ROWS - 1)
    return prompt, {"hidden_states": {"output": rows}, "embed": {"tts_pad": pad}}


def thinker_talker_prompt(thinker: "ThinkerOutput") -> tuple[list[int], dict[str, Any]]:
    """The talker's request from a thinker's last-layer rows (numpy [rows, H]: its prompt's, then one
    per token it generated but the last), as examples/demo.py hands them over whole (its
    `talker_inputs`): one codec row per thinker prompt row; all rows, cut to the width the talker
    reads, as `hidden_states.output`; `embed.tts_pad` the prompt rows' mean (what omni-serve's
    three-stage pipeline calls: deploy/speech/tiny-thinker.toml)."""
    import numpy as np

    from omni_serve.speech.handover import HIDDEN

    prompt_len = len(thinker.prompt_ids)
    rows = np.ascontiguousarray(thinker.outputs[HIDDEN][:, :TALKER_CONFIG["thinker_hidden_size"]], dtype=np.float32)
    pad = rows[:prompt_len].mean(axis=0, keepdims=True, dtype=np.float32)
    return [CODEC_BOS_ID] + [CODEC_PAD_ID] * (prompt_len - 1), {"hidden_states": {"output": rows},
                                                                "embed": {"tts_pad": pad}}