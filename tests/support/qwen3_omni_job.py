"""vllm-omni's Qwen3-Omni classes and upstream's Qwen3-Omni thinker on a tiny published-layout checkpoint.

One process (a fork of the test session's engine server, or a fresh Python): it builds the
checkpoint (tests/tiny_models/qwen3_omni.py), then writes
- what upstream parses of its config (M-RoPE section, text config, the class upstream resolves);
- what the shim's loader registers for Qwen3-Omni and where each name points;
- the talker stage's config as upstream reads it with `hf_overrides=talker_stage_config` (its text
  config and the sizes upstream's architecture convertor derives from it);
- whether vllm-omni's Qwen3-Omni stage classes import here (vllm-omni's thinker module needs names
  of the vLLM it was built for), and the exact error if not;
- vllm-omni's code2wav class built as its outer class builds it (`with_hf_config(code2wav_config)`),
  the checkpoint's `code2wav.*` loaded by its own `load_weights`, its waveform and transformers'
  `Qwen3OmniMoeCode2Wav` on the same codes and weights;
- upstream's thinker in a real V2 engine with the shim: greedy tokens, and transformers' own
  thinker's greedy tokens on the same prompts;
- what of vllm-omni's patches is in this process at the end.
Usage: python qwen3_omni_job.py job.json result.json
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

from tests.support.engine_job import exit_with, record_error  # noqa: E402  (numpy only; vLLM comes later)

TEXT_ONLY = {"image": 0, "video": 0, "audio": 0}  # the processor files are not in the tiny checkpoint


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    os.environ.update(job["env"])
    sys.path[:0] = job["sys_path"]
    os.environ["PYTHONPATH"] = os.pathsep.join([*job["sys_path"], os.environ.get("PYTHONPATH", "")])
    importlib.import_module("sitecustomize")  # a fork does not run start-up hooks; its children do
    result: dict = {"ok": False}
    llm, t0 = None, time.monotonic()
    try:
        from tests.tiny_models.qwen3_omni import build
        from worker_shim.omni_models.patches import patches_applied
        from worker_shim.omni_models.registration import register_vllm_omni_models

        model = str(build(job["build_into"]))
        result["model"] = model
        result["checkpoint_keys"] = _checkpoint_keys(model)
        result["tokenizer"] = _tokenizer(model)
        result["registered"] = register_vllm_omni_models()
        result["registry"] = _registry(result["registered"])
        vllm_config = _vllm_config(model)
        result.update(_parsed(vllm_config))
        result["talker_stage"] = _talker_stage(model)
        result.update(_stage_classes())
        result.update(_code2wav(vllm_config, model, job["codes"]))
        result["patches_before_engine"] = patches_applied()
        llm, tokens = _thinker_engine(model, job)
        result["engine_tokens"] = tokens
        result["patches_workers"] = llm.collective_rpc("omni_sidecar_vllm_omni_patches")
        result["reference_tokens"] = _transformers_thinker(model, job["prompts"], job["max_tokens"])
        result["patches_front_end"] = patches_applied()
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        record_error(result, exc)
    exit_with(result, result_path, t0, llm)


def _checkpoint_keys(model: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def _tokenizer(model: str) -> dict:
    """The checkpoint's tokenizer as vLLM and vllm-omni load it: the tokens at the config's ids."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    named = {f"thinker_config.{k}": getattr(config.thinker_config, k) for k in
             ("audio_start_token_id", "audio_end_token_id", "audio_token_id", "image_token_id", "video_token_id",
              "vision_start_token_id", "vision_end_token_id")}
    named.update({k: getattr(config, k) for k in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id",
                                                  "tts_bos_token_id", "tts_eos_token_id")})
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    # The named multimodal tokens Qwen3OmniMoeProcessor reads (tokenizer.image_token, ..._id).
    multimodal = {name: [getattr(tokenizer, name, None), getattr(tokenizer, f"{name}_id", None)]
                  for name in ("image_token", "video_token", "audio_token", "vision_bos_token", "vision_eos_token",
                               "audio_bos_token", "audio_eos_token")}
    return {"size": len(tokenizer), "tokens": {k: tokenizer.convert_ids_to_tokens(v) for k, v in named.items()},
            "text_ids": tokenizer("hi there")["input_ids"], "chat": chat, "multimodal_tokens": multimodal,
            "stamp": json.loads((Path(model) / "omni_tiny.json").read_text()),
            "processor_files": sorted(f.name for f in Path(model).iterdir() if "processor" in f.name)}


def _registry(names: list[str]) -> dict[str, str]:
    """Where upstream's ModelRegistry points each Qwen3-Omni name the loader registered."""
    from vllm.model_executor.models.registry import ModelRegistry

    models = ModelRegistry.models
    return {n: f"{models[n].module_name}:{models[n].class_name}" for n in names if n.startswith("Qwen3Omni")}


def _vllm_config(model: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                      limit_mm_per_prompt=TEXT_ONLY).create_engine_config()


def _parsed(vllm_config) -> dict:
    from vllm.model_executor.model_loader.utils import get_model_architecture

    mc = vllm_config.model_config
    cls, _ = get_model_architecture(mc)
    return {"hf_config_class": type(mc.hf_config).__name__, "hf_text_config_class": type(mc.hf_text_config).__name__,
            "uses_mrope": bool(mc.uses_mrope), "rope_parameters": dict(mc.hf_text_config.rope_parameters),
            "upstream_class": f"{cls.__module__}.{cls.__qualname__}",
            "sections": sorted(k for k in mc.hf_config.to_dict() if k.endswith("_config"))}


def _talker_stage(model: str) -> dict:
    """What upstream's ModelConfig would take from the talker stage's config (the architecture's
    inspection is left out: vllm-omni's stage class must import for that)."""
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (MODEL_ARCH_CONFIG_CONVERTORS,
                                                                      ModelArchConfigConvertorBase)

    from worker_shim.omni_models.qwen3_omni.config import talker_stage_config

    config = get_config(model, trust_remote_code=False, hf_overrides_fn=talker_stage_config)
    text = get_hf_text_config(config)
    arch = MODEL_ARCH_CONFIG_CONVERTORS.get(config.model_type, ModelArchConfigConvertorBase)(config, text).convert()
    return {"architectures": config.architectures, "text_config_class": type(text).__name__,
            "mrope_section": text.rope_parameters.get("mrope_section"), "vocab_size": arch.vocab_size,
            "hidden_size": arch.hidden_size, "layers": arch.total_num_hidden_layers, "num_experts": arch.num_experts}


def _stage_classes() -> dict:
    """vllm-omni's outer class (all three stages) and its thinker and talker, imported as the registry would."""
    out: dict = {"import_errors": {}}
    for module in ("thinker", "talker", "code2wav", "stages"):
        try:
            importlib.import_module(f"worker_shim.omni_models.qwen3_omni.{module}")
        except ImportError as exc:
            out["import_errors"][module] = f"{type(exc).__name__}: {exc}"
    return out


def _code2wav(vllm_config, model: str, codes_spec: dict) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav as Reference
    from vllm.config import set_current_vllm_config

    from worker_shim.omni_models.qwen3_omni.code2wav import Qwen3OmniMoeCode2Wav

    code2wav_config = vllm_config.model_config.hf_config.code2wav_config
    stage_config = vllm_config.with_hf_config(code2wav_config, architectures=["Qwen3OmniMoeCode2Wav"])
    with set_current_vllm_config(stage_config):
        ours = Qwen3OmniMoeCode2Wav(vllm_config=stage_config)
    weights = {k: v.float() for k, v in load_file(str(Path(model) / "model.safetensors")).items()
               if k.startswith("code2wav.")}
    loaded = ours.load_weights(list(weights.items()))
    reference = Reference._from_config(code2wav_config, dtype=torch.float32)
    reference.load_state_dict({k[len("code2wav."):]: v for k, v in weights.items()}, strict=True)
    gen = torch.Generator().manual_seed(codes_spec["seed"])
    codes = torch.randint(0, code2wav_config.codebook_size, (1, code2wav_config.num_quantizers, codes_spec["frames"]),
                          generator=gen)
    with torch.no_grad():
        wave, ref = ours.eval()(codes), reference.eval()(codes)
    return {"code2wav": {"loaded": len(loaded), "checkpoint": len(weights), "waveform": wave.reshape(-1).tolist(),
                         "reference": ref.reshape(-1).tolist(), "total_upsample": int(ours.total_upsample)}}


def _thinker_engine(model: str, job: dict):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
              skip_tokenizer_init=True, worker_cls="worker_shim.Worker", kv_cache_memory_bytes=16 << 20,
              limit_mm_per_prompt=TEXT_ONLY, additional_config={"omni_sidecar": {"endpoint": job["endpoint"]}},
              max_model_len=128, max_num_batched_tokens=128, max_num_seqs=4)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def _transformers_thinker(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers' own Qwen3-Omni thinker (M-RoPE positions from its get_rope_index)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    thinker = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).thinker.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   do_sample=False)
        out.append(gen[0, len(prompt):].tolist())
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
