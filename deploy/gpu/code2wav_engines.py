"""One engine serving vllm-omni's Qwen3-TTS code2wav stage, in a process of its own.

  python deploy/gpu/code2wav_engines.py job.json result.json     (job["kind"]: omni or shim)

`omni`: vllm-omni 0.26's own generation stage (`OmniEngineArgs`: generation worker and runner on
vLLM's V1 runner, its generation scheduler), as the first stage of its pipeline (no connector to
wait for), fed what its non-streaming Qwen3-TTS pipeline hands that stage
(`talker2code2wav_token_only` / `_full_payload`): one prompt of Q x frames tokens, the codes
codebook-major flat in `codes.audio` (and as the prompt's ids), the waveform read from its
engine-core output (`multimodal_output`).

`shim`: upstream vLLM V2 + the shim (vllm-omni's class loaded without its patches,
worker_shim/omni_models/) + `omni-sidecar serve --hooks omni-code2wav` at `job["endpoint"]`:
one placeholder prompt token and `codes.audio` [frames, Q] in the payload, with the chunking
each request names (`meta.codec_chunk_frames` / `codec_left_context_frames`); the waveform
from the sidecar.

Both: the same checkpoint (tests/tiny_models/qwen3_tts.py), the same codes, bf16, CUDA graphs
on; each reports the vllm-omni patches found in its processes (worker_shim/omni_models/patches.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: its outputs are readable
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from talker_engines import OutputRecorder, common_engine_args, load_job  # noqa: E402

ARCH = "Qwen3TTSCode2Wav"


def request_codes(frames: int, seed: int) -> Any:
    """Random codec frames [frames, Q] (a talker's `codes.audio`)."""
    import torch

    from tests.tiny_models.qwen3_tts import CODEBOOK, TALKER

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK, (frames, TALKER["num_code_groups"]), generator=g)


STEP_DEADLINE_S = 60  # a generation request is one step: an engine still stepping after this is stuck
MAX_LEN = 1024  # the tiny decoder's max_position_embeddings; the longest request is Q x 130 = 520 tokens


def engine_args(job: dict) -> dict:
    # The whole codes of a request in one prefill (vllm-omni's deploy: max_num_batched_tokens >= Q x frames).
    return {**common_engine_args(job), "max_model_len": MAX_LEN, "max_num_batched_tokens": MAX_LEN}


def direct_forward(worker: Any, specs: list[dict]) -> list[list[float]]:
    """The reference in the shim's worker: vllm-omni's own `Qwen3TTSCode2Wav.forward` (its class, not
    the shim's subclass, not the bridge's wrapper) on the engine's weights, each request's whole codes
    in one call (vllm-omni's non-streaming stage input)."""
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    model = worker.model_runner.model
    placeholder = torch.zeros(1, dtype=torch.long)
    out = []
    for spec in specs:
        info = {"codes": {"audio": request_codes(spec["frames"], spec["seed"]).t().contiguous().reshape(-1)}}
        with torch.no_grad():
            wave = Qwen3TTSCode2Wav.forward(model, placeholder, placeholder, runtime_additional_information=[info])
        out.append(wave.multimodal_outputs["model_outputs"][0].reshape(-1).float().tolist())
    return out


def omni_engine(job: dict) -> tuple[Any, Any]:
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_omni.engine.arg_utils import OmniEngineArgs
    from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

    # Stage 0: its scheduler parks a request of a later stage (Qwen3-TTS's code2wav is stage 1) until
    # vllm-omni's connector delivers its full payload from the talker stage
    # (`uses_full_payload_input_coordinator`, core/sched/omni_scheduling_coordinator.py), which no
    # producer here sends; a first stage takes its input in the request: the codes below, which its
    # runner decodes from the request's additional_information (worker/gpu_model_runner.py).
    args = OmniEngineArgs(**engine_args(job), stage_id=0, model_stage="code2wav", model_arch=ARCH,
                          worker_type="generation", engine_output_type="audio",
                          disable_hybrid_kv_cache_manager=True,
                          scheduler_cls="vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler")
    engine = LLMEngine.from_engine_args(args)

    def add(rid: str, codes: Any, chunking: dict, params: Any) -> None:
        flat = codes.t().contiguous().reshape(-1)  # codebook-major, as talker2code2wav_full_payload
        ecr = build_engine_core_request_from_tokens(
            rid, {"prompt_token_ids": flat.tolist(), "additional_information": {"codes": {"audio": flat}}}, params)
        engine.add_request(rid, ecr, params)

    return engine, add


def shim_engine(job: dict) -> tuple[Any, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from omni_sidecar.hook_sets.omni.wire import encode_additional_information
    from tests.tiny_models.code2wav import PLACEHOLDER_TOKEN

    # omni-code2wav passes extra forward kwargs (each request's runtime info), which FULL graph replay
    # would drop: the shim refuses FULL graphs for it, PIECEWISE graphs stay.
    args = EngineArgs(**engine_args(job), worker_cls="worker_shim.Worker", hf_overrides={"architectures": [ARCH]},
                      compilation_config={"cudagraph_mode": "PIECEWISE"},
                      additional_config={"omni_sidecar": {"endpoint": job["endpoint"]}})
    engine = LLMEngine.from_engine_args(args)

    def add(rid: str, codes: Any, chunking: dict, params: Any) -> None:
        from omni_sidecar.hook_sets.omni.code2wav import num_chunks

        info = {"codes": {"audio": codes}, "meta": chunking}
        params = params.clone()
        params.max_tokens = num_chunks(int(codes.shape[0]), chunking["codec_chunk_frames"])
        params.extra_args = {"omni_sidecar": {"additional_information": encode_additional_information(info)}}
        engine.add_request(rid, {"prompt_token_ids": [PLACEHOLDER_TOKEN]}, params)

    return engine, add


def scheduler_state(engine: Any) -> str:
    """How many requests the in-process engine core's scheduler holds waiting and running."""
    scheduler = getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)
    if scheduler is None:
        return "not reachable"
    waiting = list(getattr(scheduler, "waiting", []))
    statuses = sorted({str(getattr(r, "status", "?")) for r in waiting})
    parked = len(getattr(getattr(scheduler, "input_coordinator", None), "_waiting_for_input", []))
    return (f"{len(waiting)} waiting ({', '.join(statuses) or '-'}), {len(getattr(scheduler, 'running', []))} "
            f"running, {parked} parked for a connector's input")


def omni_waveform(records: list[dict]) -> list[float] | None:
    """The waveform in vllm-omni's engine-core outputs (`model_outputs` / `audio`), concatenated."""
    wave: list[float] = []
    for rec in records:
        mm = rec["mm"] or {}
        value = mm.get("model_outputs") or mm.get("audio")
        while isinstance(value, list) and len(value) == 1 and isinstance(value[0], (list, dict)):
            value = value[0]
        if isinstance(value, dict) and "values" in value:
            wave.extend(_flat(value["values"]))
    return wave or None


def _flat(values: Any) -> list[float]:
    if isinstance(values, list):
        return [x for v in values for x in _flat(v)]
    return [float(values)]


def main(job_path: str, result_path: str) -> None:
    job, result = load_job(job_path)
    kind = job["kind"]
    try:
        from vllm import SamplingParams

        from worker_shim.omni_models.patches import patches_applied

        t0 = time.monotonic()
        engine, add = (omni_engine if kind == "omni" else shim_engine)(job)
        result["start_s"] = time.monotonic() - t0
        result["async_scheduling"] = bool(getattr(engine.vllm_config.scheduler_config, "async_scheduling", False))
        recorder = OutputRecorder(engine)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        rids = []
        for i, spec in enumerate(job["requests"]):
            codes = request_codes(spec["frames"], spec["seed"])
            for chunking in job["chunkings"] if kind == "shim" else [None]:
                rid = f"c2w-{i}-{chunking['codec_chunk_frames'] if chunking else 'whole'}"
                add(rid, codes, chunking or {}, params)
                rids.append(rid)
        deadline = time.monotonic() + STEP_DEADLINE_S

        def unfinished() -> bool:
            if kind == "omni":  # every request's last engine-core output says finished
                return not all(any(r["finished"] for r in recorder.by_request.get(rid, [])) for rid in rids)
            return engine.has_unfinished_requests()

        while unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests unfinished after {STEP_DEADLINE_S} s of steps (one step each); "
                                   f"scheduler: {scheduler_state(engine)}")
            # vLLM's output processor expects tokens or a pooling output from each request (vllm-omni's
            # orchestrator brings its own for generation stages): vllm-omni's engine core is stepped
            # directly (in this process `get_output` runs one step).
            if kind == "omni":
                engine.engine_core.get_output()
            else:
                engine.step()
        if kind == "omni":
            result["waveforms"] = {rid: omni_waveform(recorder.by_request.get(rid, [])) for rid in rids}
            first = next(iter(recorder.by_request.values()), [])
            result["output_layout"] = repr([{k: (type(v).__name__, (v.get("shape") if isinstance(v, dict) else None))
                                             for k, v in (r["mm"] or {}).items()} for r in first])[:2000]
        else:
            from omni_sidecar.client import SidecarClient

            with SidecarClient(job["endpoint"]) as client:
                got = {rid: client.outputs(rid) or {} for rid in rids}
            result["waveforms"] = {rid: g["waveform"].reshape(-1).float().tolist() if "waveform" in g else None
                                   for rid, g in got.items()}
            result["patches_workers"] = engine.collective_rpc("omni_sidecar_vllm_omni_patches")
            result["direct"] = engine.collective_rpc(direct_forward, args=(job["requests"],))[0]
        result["patches_engine"] = patches_applied()
        result["ok"] = True
    except BaseException as exc:  # the check reads the error
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    Path(job["workdir"], f"ready-{job['name']}").touch()  # the talker engines' timed rounds wait for this
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
