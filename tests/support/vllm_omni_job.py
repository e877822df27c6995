"""vllm-omni's own Qwen3-TTS classes on real vLLM V2 + the shim, loaded without its patches.

With `build_into`, it builds the tiny checkpoint there instead. The job puts the installed vllm-omni (and what its modules import that this venv lacks) on
sys.path, as an install in site-packages would, and sets the job's environment (VLLM_PLUGINS:
whether vllm-omni's own `vllm.general_plugins` entry point may run). It then starts one engine
on the tiny checkpoint (tests/tiny_models/qwen3_tts.py) with the architecture the job names and
writes: what vllm-omni's patches left in this process and, by RPC, in the worker's
(worker_shim/omni_models/patches.py), the model config upstream parsed, the class vLLM's
registry resolves for it, its M-RoPE positions, and, for code2wav requests, each request's waveform from the sidecar;
or the error that stopped the engine.
Usage: python vllm_omni_job.py job.json result.json
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.support.engine_job import exit_with, record_error  # noqa: E402  (numpy only; vLLM comes later)


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    os.environ.update(job["env"])
    for name in job.get("env_unset", []):
        os.environ.pop(name, None)
    sys.path[:0] = job["sys_path"]  # this process (a fork of the test session's engine server) ...
    os.environ["PYTHONPATH"] = os.pathsep.join([*job["sys_path"], os.environ.get("PYTHONPATH", "")])  # ... children
    result: dict = {"ok": False}
    llm, t0 = None, time.monotonic()
    try:
        from worker_shim.omni_models.patches import patches_applied

        if "build_into" in job:  # the tiny checkpoint, built here: vllm-omni importable as in the engines
            from tests.tiny_models.qwen3_tts import build

            result.update(model=str(build(job["build_into"])), patches_front_end=patches_applied(), ok=True)
            exit_with(result, result_path, t0, None)
        if job.get("load_plugins"):  # vLLM's general plugins as every vLLM process loads them
            from vllm.plugins import load_general_plugins

            try:
                load_general_plugins()
            finally:
                result["patches_after_plugins"] = patches_applied()
        from vllm import LLM

        llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
                  skip_tokenizer_init=True, worker_cls="worker_shim.Worker", kv_cache_memory_bytes=16 << 20,
                  hf_overrides={"architectures": [job["arch"]]},
                  additional_config={"omni_sidecar": {"endpoint": job["endpoint"]}}, **job["llm_kwargs"])
        model_config = llm.llm_engine.model_config
        rope = getattr(model_config.hf_text_config, "rope_parameters", None) or {}
        result.update(
            patches_front_end=patches_applied(),
            patches_workers=llm.collective_rpc("omni_sidecar_vllm_omni_patches"),
            uses_mrope=bool(model_config.uses_mrope), mrope_section=rope.get("mrope_section"),
            hf_config_class=f"{type(model_config.hf_config).__module__}.{type(model_config.hf_config).__name__}",
            model_class=_model_class(model_config), vllm_omni_modules=_vllm_omni_modules(),
        )
        if job["arch"] != "Qwen3TTSCode2Wav":
            result["mrope_positions"] = _mrope_positions(model_config, job["mrope_tokens"])
        if job.get("requests"):
            result.update(_generate(llm, job))
        if job.get("talker_requests"):
            result.update(_talk(llm, job))
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        record_error(result, exc)
    exit_with(result, result_path, t0, llm)


def _model_class(model_config) -> list[str]:
    """The class vLLM's registry resolves for the engine's config (here, as the worker does)."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cls, _ = get_model_architecture(model_config)
    return [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__[:2]]


def _vllm_omni_modules() -> dict:
    """Where this process's vllm_omni modules came from: the stand-in, and how many of its files loaded."""
    from worker_shim.omni_models.package import is_stand_in

    return {"stand_in": is_stand_in(sys.modules.get("vllm_omni")),
            "loaded": sum(name.startswith("vllm_omni.") for name in sys.modules)}


def _mrope_positions(model_config, n: int) -> dict:
    """The resolved class's M-RoPE positions for an n-token prompt (the method reads no weights)."""
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models.interfaces import supports_mrope

    cls, _ = get_model_architecture(model_config)
    positions, delta = cls.get_mrope_input_positions(None, list(range(n)), [])
    return {"supports_mrope": supports_mrope(cls), "positions": positions.tolist(), "delta": delta}


def _generate(llm, job: dict) -> dict:
    """Code2wav requests (tests/support/code2wav_payload.py's shape), each waveform from the sidecar."""
    from vllm import SamplingParams

    from omni_sidecar.client import SidecarClient
    from tests.support.code2wav_payload import code2wav_request

    prompts, params = [], []
    for spec in job["requests"]:
        req = code2wav_request(**spec)
        prompts.append({"prompt_token_ids": req["prompt_token_ids"]})
        params.append(SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                     extra_args={"omni_sidecar": {"additional_information": req["payload"]}}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    waves = []
    with SidecarClient(job["endpoint"]) as client:
        for out in outs:
            got = client.outputs(out.request_id) or {}
            wave = got.get("waveform")
            waves.append({"waveform": None if wave is None else wave.reshape(-1).tolist(),
                          "sr": int(got["sr"]) if "sr" in got else None})
    return {"waveforms": waves, "shim_stats": llm.collective_rpc("omni_sidecar_stats"),
            "direct": llm.collective_rpc(_direct_code2wav, args=(job["requests"],))}


def _direct_code2wav(worker, specs: list[dict]) -> list[dict]:
    """The reference, in the worker: vllm-omni's own `Qwen3TTSCode2Wav.forward` (not the shim's
    subclass, not the bridge's wrapper) on the engine's loaded weights, called once per chunk
    with the chunk's runtime info built as the sidecar builds it, one request at a time; and
    one call on each request's whole codes."""
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    from omni_sidecar.hook_sets.omni.code2wav import chunk_input, num_chunks
    from tests.support.code2wav_payload import request_codes

    model = worker.model_runner.model
    placeholder = torch.zeros(1, dtype=torch.long)

    def wave(info: dict) -> list[float]:
        with torch.no_grad():
            out = Qwen3TTSCode2Wav.forward(model, placeholder, placeholder, runtime_additional_information=[info])
        return out.multimodal_outputs["model_outputs"][0].reshape(-1).tolist()

    out = []
    for spec in specs:
        codes = request_codes(spec["frames"], spec["seed"])
        chunks = [wave(chunk_input(codes, k, spec["chunk_frames"], spec["left_context"]))
                  for k in range(num_chunks(spec["frames"], spec["chunk_frames"]))]
        whole = wave({"codes": {"audio": codes.t().contiguous().reshape(-1)}})
        out.append({"chunks": chunks, "whole": whole})
    return out


def _talk(llm, job: dict) -> dict:
    """Talker requests (VoiceDesign, text ids precomputed, non-streaming); codes from the sidecar, or the
    error that stopped the step."""
    import torch
    from vllm import SamplingParams

    from omni_sidecar.client import SidecarClient
    from omni_sidecar.hook_sets.omni.wire import encode_additional_information
    from tests.tiny_models.qwen3_tts import IM_END, IM_START

    prompts, params = [], []
    for spec in job["talker_requests"]:
        text = [(7 * spec["seed"] + 3 * i) % 200 for i in range(spec["text_len"])]
        ids = [IM_START, 1, 2] + text + [IM_END, 3, IM_START, 1, 2]
        info = {"_qwen3_tts_text_ids": torch.tensor([ids], dtype=torch.long), "task_type": ["VoiceDesign"],
                "non_streaming_mode": [True]}
        prompts.append({"prompt_token_ids": [5] * (9 + spec["text_len"])})
        params.append(SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                     extra_args={"omni_sidecar": {"additional_information":
                                                                  encode_additional_information(info)}}))
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:
        import traceback

        return {"talker_error": f"{type(exc).__name__}: {exc}"[:2000], "talker_traceback": traceback.format_exc()[-3000:]}
    with SidecarClient(job["endpoint"]) as client:
        got = [client.outputs(o.request_id) or {} for o in outs]
    return {"talker_codes": [g["codes.audio"].tolist() if "codes.audio" in g else None for g in got]}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
