"""One Qwen3-Omni pipeline, thinker -> talker -> code2wav, its three engines in one process.

  python deploy/gpu/qwen3_omni_engines.py job.json result.json     (job["kind"]: omni or shim)

`omni`: vllm-omni 0.26's own stages (`OmniEngineArgs` per stage, as its Qwen3-Omni pipeline
config names them: AR worker and runner for the thinker and talker, the generation worker and
runner for code2wav, on vLLM's V1 runner, its schedulers), each stage's outputs read from its
engine-core outputs (`multimodal_output`).

`shim`: upstream vLLM V2 with the shim as worker for each stage (vllm-omni's Qwen3-Omni class
loaded without its patches, one registered architecture per stage: worker_shim/omni_models/
qwen3_omni/) and one `omni-sidecar serve` per stage at `job["endpoints"]` (thinker: `omni`, its
captured layers as outputs; talker: `omni-talker`; code2wav: `omni-code2wav`), each stage's
outputs read from its sidecar.

Both: the same checkpoint (tests/tiny_models/qwen3_omni.py), prompts, greedy sampling (the talker's
code predictor too, set as its model loads, unless `job["code_predictor"]` is "vllm-omni": its own
top-k 50 / top-p 0.8 from the global random generator; worker_shim/omni_models/qwen3_omni/
code_predictor.py), and the same hand-overs: vllm-omni's non-streaming ones (its `async_chunk:
false` mode: a request moves on when it finishes), built by vllm-omni's own functions
(`thinker2talker_full_payload`, `_compute_talker_prompt_ids_length`, `talker2code2wav_full_payload`, called through
worker_shim/omni_models/qwen3_omni/handover.py, as omni-serve calls them) from each pipeline's stage
outputs. The process steps the three engines in turn and moves each request on as its stage
finishes it; per request it records the thinker's tokens, the talker's codes (and, for the parity
requests, its top two logprobs per token), the waveform and the time from its arrival to its audio
(TTFA: the code2wav step that returned its waveform).
Each engine of a pipeline reports the vllm-omni patches found in its process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine cores in this process: their outputs are readable
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STAGES = ("thinker", "talker", "code2wav")
OUTER_ARCH = "Qwen3OmniMoeForConditionalGeneration"
# vllm-omni's Qwen3-Omni pipeline (its models/qwen3_omni/pipeline.py) per stage: model_stage, worker,
# output type, the config section its ModelConfig reads, its scheduler.
# Every vllm-omni stage is stage 0 here: its schedulers park a request of a later stage (talker,
# code2wav without async_chunk) in WAITING_FOR_INPUT until its orchestrator's connector delivers the
# previous stage's payload (vllm_omni/core/sched/omni_scheduling_coordinator.py); this driver hands
# the payload over with the request itself, as the shim's pipeline does.
OMNI_STAGE_ARGS = {
    "thinker": dict(stage_id=0, model_stage="thinker", worker_type="ar", engine_output_type="latent",
                    hf_config_name="thinker_config",
                    scheduler_cls="vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler"),
    "talker": dict(stage_id=0, model_stage="talker", worker_type="ar", engine_output_type="latent",
                   hf_config_name="talker_config",
                   scheduler_cls="vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler"),
    "code2wav": dict(stage_id=0, model_stage="code2wav", worker_type="generation", engine_output_type="audio",
                     hf_config_name="thinker_config", disable_hybrid_kv_cache_manager=True,
                     enable_chunked_prefill=False,
                     scheduler_cls="vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler"),
}
# code2wav runs eager in both pipelines: vllm-omni sizes its inner CUDA graph from its connector's chunk
# settings, which a stage driven without its orchestrator does not have.
# The whole codes in one chunk (vllm-omni's non-streaming code2wav input); its model then decodes
# them in its own chunks (chunked_decode), the same in both pipelines.
WHOLE_CODES = {"codec_chunk_frames": 1 << 16, "codec_left_context_frames": 0}
CODE2WAV_PLACEHOLDER = 0  # the shim's code2wav prompt token: a clock (docs/ARCHITECTURE.md, "Generation-only stages")
TEXT_ONLY = {"image": 0, "video": 0, "audio": 0}
ONE_IMAGE = {"image": 1, "video": 0, "audio": 0}  # the thinker's, where the job has text + image requests
STEP_DEADLINE_S = 120  # no output from any stage for this long: stuck
TRACEBACK_TAIL = 6000  # characters of a traceback kept in the result: its last frames


def thinker_prompt(text_len: int, seed: int, image: bool = False) -> list[int]:
    """A one-turn chat (tests/tiny_models/qwen3_omni.py's `chat_prompt`) of TEXT_LEN random byte tokens;
    with IMAGE, one image's placeholder before them (`image_chat_prompt`)."""
    import numpy as np

    from tests.tiny_models.qwen3_omni import chat_prompt, image_chat_prompt

    text = np.random.default_rng(seed).integers(0, 256, text_len).tolist()
    return image_chat_prompt(text) if image else chat_prompt(text)


def generated_image(spec: dict) -> Any:
    """The text + image requests' image: seeded random RGB pixels of spec's width and height."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(spec["seed"]).integers(0, 256, (spec["height"], spec["width"], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def engine_args(job: dict, stage: str) -> dict:
    limits = job["limits"][stage]
    args = dict(model=job["model"], dtype=job["dtype"], seed=0, enforce_eager=job["enforce_eager"],
                load_format=load_format(job, stage),
                skip_tokenizer_init=True, enable_prefix_caching=False, async_scheduling=False,
                max_model_len=limits["max_model_len"], max_num_seqs=job["max_num_seqs"],
                max_num_batched_tokens=limits["max_num_batched_tokens"],
                kv_cache_memory_bytes=job["kv_cache_memory_bytes"], limit_mm_per_prompt=TEXT_ONLY)
    if stage == "thinker" and job.get("image"):
        # vLLM's multimodal processor expands the image placeholder with the checkpoint's tokenizer.
        args.update(limit_mm_per_prompt=ONE_IMAGE, skip_tokenizer_init=False)
    if job.get("gpu_memory_utilization"):
        args["gpu_memory_utilization"] = job["gpu_memory_utilization"]
    return args


def load_format(job: dict, stage: str) -> str:
    """vLLM's default loader; for the talker with `job["code_predictor"]` greedy, the load format that
    sets its code predictor greedy as it loads, before any CUDA graph is captured (registered in this
    process, where both kinds' engines load their models)."""
    if stage != "talker" or job["code_predictor"] != "greedy":
        return "auto"
    from worker_shim.omni_models.qwen3_omni.code_predictor import register_greedy_load_format

    return register_greedy_load_format()


class Recorder:
    """An in-process engine core's outputs per request: new tokens, multimodal outputs (tensors kept)."""

    def __init__(self, engine: Any) -> None:
        self.mm: dict[str, list[dict]] = {}
        self.finished: set[str] = set()
        core = engine.engine_core
        inner = core.get_output

        def get_output() -> Any:
            outs = inner()
            for o in getattr(outs, "outputs", []) or []:
                rid = o.request_id.rsplit("-", 1)[0]  # vLLM suffixes the client's id (ours have no "-")
                mm = getattr(o, "multimodal_output", None) or getattr(o, "pooling_output", None)
                if isinstance(mm, dict) and mm:
                    self.mm.setdefault(rid, []).append(_detached(mm))
                if getattr(o, "finish_reason", None) is not None:
                    self.finished.add(rid)
            return outs

        core.get_output = get_output


def _detached(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_detached(v) for v in obj]
    return obj


def pooled(records: list[dict]) -> dict[str, Any]:
    """A request's per-step multimodal outputs joined as vllm-omni's full-payload accumulator joins them
    (its `accumulate_full_payload_output`): flat dotted keys; a tensor of 2+ dims is concatenated along
    rows with the earlier ones of the same trailing shape, anything else replaced by the latest."""
    import torch

    out: dict[str, Any] = {}
    for rec in records:
        for key, value in _flat(rec).items():
            if isinstance(value, list) and len(value) == 1 and isinstance(value[0], torch.Tensor):
                value = value[0]  # one request's entry of a per-request list
            before = out.get(key)
            if (isinstance(value, torch.Tensor) and value.dim() >= 2 and isinstance(before, torch.Tensor)
                    and before.dim() >= 2 and before.shape[1:] == value.shape[1:]):
                out[key] = torch.cat([before, value])
            else:
                out[key] = value
    return out


def _flat(node: dict, prefix: str = "") -> dict[str, Any]:
    """{"hidden_states": {"layers": {0: t}}} -> {"hidden_states.layer_0": t}; other nesting -> dotted keys."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "layers" and isinstance(value, dict):
            out.update({f"{prefix}layer_{int(k)}": v for k, v in value.items()})
        elif isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Pipeline:
    """The three engines of one kind, and how a request enters each stage and leaves it."""

    def __init__(self, job: dict) -> None:
        self.job = job
        self.kind = job["kind"]
        self.engines: dict[str, Any] = {}
        self.recorders: dict[str, Recorder] = {}
        self.clients: dict[str, Any] = {}
        from vllm.v1.engine.llm_engine import LLMEngine

        for stage in STAGES:
            t0 = time.monotonic()
            args = self._omni_args(stage) if self.kind == "omni" else self._shim_args(stage)
            self.engines[stage] = LLMEngine.from_engine_args(args)
            self.recorders[stage] = Recorder(self.engines[stage])
            job.setdefault("start_s", {})[stage] = round(time.monotonic() - t0, 1)
        if self.kind == "shim":
            from omni_sidecar.client import SidecarClient

            self.clients = {stage: SidecarClient(job["endpoints"][stage]) for stage in STAGES}
        self.tts_embeds = self._tts_embeds() if self.kind == "shim" else None
        from worker_shim.omni_models.qwen3_omni.code_predictor import code_predictor_sampling

        # What the talker's code predictor samples with, read back in its worker (the engine cores
        # run in this process: the function is called, not sent anywhere).
        self.code_predictor = self.engines["talker"].collective_rpc(code_predictor_sampling)[0]

    def _omni_args(self, stage: str) -> Any:
        from vllm_omni.engine.arg_utils import OmniEngineArgs

        eager = {"enforce_eager": True} if stage == "code2wav" else {}
        return OmniEngineArgs(**{**engine_args(self.job, stage), **OMNI_STAGE_ARGS[stage], **eager}, model_arch=OUTER_ARCH)

    def _shim_args(self, stage: str) -> Any:
        from vllm.engine.arg_utils import EngineArgs

        from worker_shim.omni_models.qwen3_omni.config import talker_stage_config
        from worker_shim.omni_models.registration import QWEN3_OMNI_STAGES

        overrides: Any = (talker_stage_config if stage == "talker"
                          else {"architectures": [QWEN3_OMNI_STAGES[stage]]})
        extra: dict = {"enforce_eager": True} if stage == "code2wav" else {}
        if stage == "thinker":
            # Its forward returns the captured layers beside its hidden states, which a FULL graph's
            # replay would not return (the shim refuses FULL graphs then).
            extra["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
        return EngineArgs(**{**engine_args(self.job, stage), **extra}, worker_cls="worker_shim.Worker", hf_overrides=overrides,
                          additional_config={"omni_sidecar": {"endpoint": self.job["endpoints"][stage]}})

    def _tts_embeds(self) -> dict[str, Any]:
        """The thinker's embeddings of tts_bos / tts_eos / tts_pad (vllm-omni's thinker stage computes
        them in its forward's outputs from the same table; the shim's returns token rows only)."""
        import torch

        from worker_shim.omni_models.qwen3_omni.handover import tts_embeddings

        return tts_embeddings(self.job["model"], getattr(torch, self.job["dtype"]))

    # -- entering a stage ------------------------------------------------------------------

    def add(self, stage: str, rid: str, prompt: list[int], params: Any, payload: dict | None,
            image: Any = None) -> None:
        engine = self.engines[stage]
        if image is not None:
            # A thinker request with an image, in both pipelines through the engine's input processor
            # (vLLM's multimodal processor: the model's, vllm-omni's thinker processor in both), as
            # vllm-omni's stage-0 input processor takes one.
            engine.add_request(rid, {"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}, params)
            return
        if self.kind == "omni":
            from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

            tokens: dict[str, Any] = {"prompt_token_ids": prompt}
            if payload is not None:
                # Where vllm-omni's connector puts a whole-request payload: the runner's
                # model_intermediate_buffer, tensors as they are. `additional_information` would
                # serialize them through numpy, which has no bfloat16 (the thinker's rows are).
                tokens["model_intermediate_buffer"] = payload
            engine.add_request(rid, build_engine_core_request_from_tokens(rid, tokens, params), params)
            return
        if payload is not None:
            from omni_sidecar.hook_sets.omni.wire import encode_additional_information

            params = params.clone()
            params.extra_args = {"omni_sidecar": {"additional_information": encode_additional_information(payload)}}
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    # -- leaving a stage -------------------------------------------------------------------

    def stage_outputs(self, stage: str, rid: str) -> dict[str, Any]:
        """The request's multimodal outputs of a stage, as flat dotted keys."""
        if self.kind == "omni":
            return pooled(self.recorders[stage].mm.get(rid, []))
        import torch

        # The sidecar may hand float rows back in another float type than the model's (bf16 <-> fp32
        # is exact); the next stage's model takes its own.
        dtype = getattr(torch, self.job["dtype"])
        return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in (self.clients[stage].outputs(rid) or {}).items()}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def sampling(max_tokens: int, stop: list[int] | None = None, logprobs: int | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not stop, stop_token_ids=stop or None,
                          detokenize=False, logprobs=logprobs)


def top_logprobs(steps: Any, n: int) -> list[list[list]] | None:
    """A request's per-token logprobs (vLLM's list of {token id: Logprob}) as, per token, its N best
    [token id, logprob] pairs, best first; None where the engine returned none."""
    if steps is None:
        return None
    return [[[int(t), float(lp.logprob)] for t, lp in sorted((step or {}).items(), key=lambda e: -e[1].logprob)]
            [:n] for step in steps]


def talker_input(pipe: Pipeline, rid: str, prompt: list[int], tokens: list[int]) -> tuple[list[int], dict] | None:
    """vllm-omni's thinker -> talker hand-over: its payload from the thinker's outputs, and the
    talker's placeholder prompt of the length it computes. Imported here, not at the top: the omni
    pipeline has loaded vllm-omni's own package by then (the module would otherwise stand in for it)."""
    from worker_shim.omni_models.qwen3_omni.handover import accept_hidden_layer
    from worker_shim.omni_models.qwen3_omni.handover import talker_input as handed_over

    out = pipe.stage_outputs("thinker", rid)
    if pipe.tts_embeds is not None:
        out = {**pipe.tts_embeds, **out}
    return handed_over(out, prompt, tokens, rid, hidden_layer=accept_hidden_layer(pipe.job["model"]))


def talker_codes(pipe: Pipeline, rid: str, prompt_len: int) -> Any:
    """The talker's codes.audio rows of the request, as vllm-omni's pooled output holds them: a zero row
    per prompt row (its preprocess writes those in prefill), then one row per decode step."""
    import torch

    out = pipe.stage_outputs("talker", rid)
    codes = out.get("codes.audio")
    if not isinstance(codes, torch.Tensor):
        return None
    codes = codes.reshape(-1, codes.shape[-1]).to(torch.long)
    if pipe.kind == "shim":  # the sidecar assembles the decode steps' rows only
        codes = torch.cat([torch.zeros(prompt_len, codes.shape[-1], dtype=torch.long), codes])
    return codes


def code2wav_input(pipe: Pipeline, rid: str, raw_codes: Any, tokens: list[int]) -> tuple[list[int], dict] | None:
    """vllm-omni's talker -> code2wav hand-over: the valid codec rows, codebook-major, flat."""
    import torch

    from worker_shim.omni_models.qwen3_omni.handover import codec_codes

    flat = codec_codes(raw_codes, tokens, rid)
    if flat is None:
        return None
    if pipe.kind == "omni":
        return flat, {"codes": {"audio": torch.tensor(flat, dtype=torch.long)},
                      "meta": {"finished": torch.tensor(True, dtype=torch.bool)}}
    q = int(raw_codes.shape[-1])
    frames = torch.tensor(flat, dtype=torch.long).reshape(q, -1).t().contiguous()  # [frames, Q]
    return [CODE2WAV_PLACEHOLDER], {"codes": {"audio": frames}, "meta": dict(WHOLE_CODES)}


def waveform(pipe: Pipeline, rid: str) -> Any:
    import torch

    out = pipe.stage_outputs("code2wav", rid)
    for key in ("waveform", "model_outputs", "audio"):
        value = out.get(key)
        if isinstance(value, list):
            value = torch.cat([v.reshape(-1) for v in value if isinstance(v, torch.Tensor)]) if value else None
        if isinstance(value, torch.Tensor):
            return value.reshape(-1).float()
    return None


def run_requests(pipe: Pipeline, reqs: list[dict], job: dict, keep: bool, deadline: float,
                 state: dict[str, dict]) -> dict:
    """Every request enters the thinker at once; the engines step in turn; each request moves on as
    its stage finishes it. Per request, into `state` (the caller keeps what a failure leaves): tokens,
    codes, TTFA; when `keep` (the parity requests) also the waveform and the talker's top logprobs."""
    limits = job["max_tokens"]
    t0 = time.perf_counter()
    for r in reqs:
        state[r["rid"]] = {"prompt": r["prompt"], "t_in": time.perf_counter()}
        pipe.add("thinker", r["rid"], r["prompt"], sampling(limits["thinker"]), None, r.get("image"))
    audio_samples = 0
    last_progress = time.monotonic()
    errors: dict[str, str] = {}
    tracebacks: dict[str, str] = {}  # per failed request, where it failed
    open_reqs: dict[str, set[str]] = {"thinker": {r["rid"] for r in reqs}, "talker": set(), "code2wav": set()}
    while any(open_reqs.values()):
        if time.monotonic() > deadline:
            raise TimeoutError("the run's limit came first")
        if time.monotonic() - last_progress > STEP_DEADLINE_S:
            raise TimeoutError(f"no stage finished a request for {STEP_DEADLINE_S} s")
        for stage in STAGES:
            if not open_reqs[stage]:
                continue
            engine = pipe.engines[stage]
            if pipe.kind == "omni" and stage == "code2wav":
                # vLLM's output processor wants tokens or a pooling output from each request; vllm-omni's
                # orchestrator brings its own for generation stages: its engine core is stepped directly.
                engine.engine_core.get_output()
                done = open_reqs[stage] & pipe.recorders[stage].finished
                outs = [SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(token_ids=[])])
                        for rid in sorted(done)]
            else:
                outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if keep and stage == "talker" and o.request_id in state and o.outputs:
                    # Every step's (cumulative) output, not only the last: on CPU the talker's
                    # decode step fails after its prefill step sampled the first token.
                    state[o.request_id]["talker_tokens"] = list(o.outputs[0].token_ids)
                    state[o.request_id]["talker_logprobs"] = top_logprobs(o.outputs[0].logprobs,
                                                                          job["talker_logprobs"])
                if not o.finished:
                    continue
                last_progress = time.monotonic()
                rid, st = o.request_id, state.get(o.request_id)
                if st is None or rid not in open_reqs[stage]:
                    continue
                open_reqs[stage].discard(rid)
                tokens = list(o.outputs[0].token_ids)
                try:
                    if stage == "thinker":
                        st["thinker_tokens"] = tokens
                        # The prompt the thinker ran: an image's placeholder expanded to its tokens.
                        st["thinker_prompt_len"] = len(o.prompt_token_ids or st["prompt"])
                        handed = talker_input(pipe, rid, list(o.prompt_token_ids or st["prompt"]), tokens)
                        if handed is None:
                            raise RuntimeError("no thinker -> talker payload (thinker outputs missing)")
                        st["talker_prompt_len"] = len(handed[0])
                        pipe.add("talker", rid, handed[0], sampling(limits["talker"], [job["codec_eos"]],
                                                                     job["talker_logprobs"] if keep else None),
                                 handed[1])
                        open_reqs["talker"].add(rid)
                        st["stage"] = "talker"
                    elif stage == "talker":
                        st["talker_tokens"] = tokens
                        raw = talker_codes(pipe, rid, st["talker_prompt_len"])
                        if raw is None:
                            raise RuntimeError("no talker codes")
                        st["raw_codes"] = raw
                        handed = code2wav_input(pipe, rid, raw, tokens)
                        if handed is None:
                            raise RuntimeError("no talker -> code2wav payload (no valid codec rows)")
                        st["codes"] = handed[1]["codes"]["audio"]
                        pipe.add("code2wav", rid, handed[0], sampling(1), handed[1])
                        open_reqs["code2wav"].add(rid)
                        st["stage"] = "code2wav"
                    else:
                        st["t_audio"] = now
                        st["stage"] = "done"
                        wave = waveform(pipe, rid)
                        if wave is None:
                            raise RuntimeError("no waveform")
                        audio_samples += int(wave.numel())
                        if keep:
                            st["waveform"] = wave
                except Exception as exc:  # this request stops here; the others go on
                    errors[rid] = f"{stage}: {type(exc).__name__}: {exc}"
                    tracebacks[rid] = traceback.format_exc()[-TRACEBACK_TAIL:]
                    st["t_audio"] = now
    wall = time.perf_counter() - t0
    ttfa = [st["t_audio"] - st["t_in"] for rid, st in state.items() if "t_audio" in st and rid not in errors]
    return {"state": state, "errors": errors, "tracebacks": tracebacks, "wall_s": wall, "ttfa_s": ttfa,
            "audio_samples": audio_samples}


def parity_record(st: dict) -> dict:
    codes = st.get("codes")
    if codes is not None and not isinstance(codes, list):
        codes = codes.t().reshape(-1).tolist()  # [frames, Q] -> codebook-major flat, as vllm-omni's
    return {"stage": st.get("stage", "thinker"), "thinker_tokens": st.get("thinker_tokens"),
            "talker_tokens": st.get("talker_tokens"), "talker_logprobs": st.get("talker_logprobs"),
            "thinker_prompt_len": st.get("thinker_prompt_len"), "talker_prompt_len": st.get("talker_prompt_len"),
            "codes": codes, "code_rows": int(st["raw_codes"].shape[0]) if st.get("raw_codes") is not None else None,
            "waveform": st["waveform"].tolist() if st.get("waveform") is not None else None}


def code2wav_direct(pipe: Pipeline, job: dict, deadline: float) -> dict:
    """The code2wav stage alone on the same random codes in both pipelines (it needs no talker)."""
    import torch

    from tests.tiny_models.qwen3_omni import CODE2WAV, NUM_CODE_GROUPS

    spec = job["code2wav_direct"]
    g = torch.Generator().manual_seed(spec["seed"])
    codes = torch.randint(0, CODE2WAV["codebook_size"], (spec["frames"], NUM_CODE_GROUPS), generator=g)
    flat = codes.t().contiguous().reshape(-1).tolist()
    if pipe.kind == "omni":
        prompt, payload = flat, {"codes": {"audio": torch.tensor(flat)}, "meta": {"finished": torch.tensor(True)}}
    else:
        prompt, payload = [CODE2WAV_PLACEHOLDER], {"codes": {"audio": codes}, "meta": dict(WHOLE_CODES)}
    rid = "direct0"
    pipe.add("code2wav", rid, prompt, sampling(1), payload)
    engine = pipe.engines["code2wav"]
    t0 = time.perf_counter()
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the run's limit came first")
        if pipe.kind == "omni":
            engine.engine_core.get_output()
            if rid in pipe.recorders["code2wav"].finished:
                break
        elif any(o.finished for o in engine.step() if o.request_id == rid):
            break
    wave = waveform(pipe, rid)
    return {"frames": spec["frames"], "seed": spec["seed"], "codes": flat, "wall_s": time.perf_counter() - t0,
            "waveform": wave.tolist() if wave is not None else None}


def wait_turn(job: dict) -> None:
    """The pipelines start side by side but time their runs one at a time, in `job["bench_order"]`:
    this one's turn comes when each one before it has benched (or is gone)."""
    work = Path(job["workdir"])
    order = job.get("bench_order", [job["name"]])
    before = order[: order.index(job["name"])] if job["name"] in order else []
    end = time.monotonic() + job.get("turn_wait_s", 300)
    while time.monotonic() < end and not all((work / f"benched-{name}").exists() for name in before):
        time.sleep(0.05)


def patches(pipe: Pipeline) -> dict:
    from worker_shim.omni_models.patches import patches_applied

    found = {"process": patches_applied()}
    if pipe.kind == "shim":
        found["workers"] = {s: e.collective_rpc("omni_sidecar_vllm_omni_patches") for s, e in pipe.engines.items()}
    return found


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    for key, value in job.get("env", {}).items():
        os.environ[key] = str(value)
    result: dict = {"ok": False, "kind": job["kind"], "name": job["name"], "runs": {}}
    deadline = time.monotonic() + job["limit_s"]
    pipe = None
    try:
        t0 = time.monotonic()
        pipe = Pipeline(job)
        result["start_s"] = job.get("start_s")
        result["start_total_s"] = round(time.monotonic() - t0, 1)
        result["code_predictor"] = pipe.code_predictor
        prompts = {r["rid"]: thinker_prompt(r["text_len"], r["seed"], bool(r.get("image"))) for r in job["requests"]}
        image = generated_image(job["image"]) if job.get("image") else None
        result["code2wav_direct"] = code2wav_direct(pipe, job, deadline)
        reqs = [{"rid": r["rid"], "prompt": prompts[r["rid"]], "image": image if r.get("image") else None}
                for r in job["requests"]]
        state: dict[str, dict] = {}
        try:
            run = run_requests(pipe, reqs, job, True, deadline, state)
        finally:
            result["parity"] = {rid: parity_record(st) for rid, st in state.items()}
        result["errors"] = run["errors"]
        result["request_tracebacks"] = run["tracebacks"]
        result["patches"] = patches(pipe)
        result["ok"] = not run["errors"]
        sr = job["sample_rate"]
        wait_turn(job)
        for n in job["concurrency"]:
            if time.monotonic() > deadline - job.get("bench_reserve_s", 0):
                result["runs"][str(n)] = {"skipped": "the run's limit"}
                continue
            text = [r["rid"] for r in job["requests"] if not r.get("image")]  # timed on the text requests
            reqs = [{"rid": f"c{n}r{i}", "prompt": prompts[text[i % len(text)]]} for i in range(n)]
            try:
                run = run_requests(pipe, reqs, job, False, deadline, {})
            except TimeoutError as exc:
                result["runs"][str(n)] = {"skipped": str(exc)}
                break
            result["request_tracebacks"].update(run["tracebacks"])  # their ids name the run
            ttfa = sorted(run["ttfa_s"])
            result["runs"][str(n)] = {
                "requests": n, "errors": run["errors"], "wall_s": round(run["wall_s"], 4),
                "ttfa_median_s": round(ttfa[len(ttfa) // 2], 4) if ttfa else None,
                "ttfa_max_s": round(ttfa[-1], 4) if ttfa else None,
                "audio_s": round(run["audio_samples"] / sr, 4),
                "audio_s_per_s": round(run["audio_samples"] / sr / run["wall_s"], 3) if run["wall_s"] else None}
    except BaseException as exc:  # the driver reads the error
        if pipe is not None and "patches" not in result:
            try:
                result["patches"] = patches(pipe)
            except Exception as why:  # an engine that died answers no RPC
                result["patches_error"] = repr(why)
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-TRACEBACK_TAIL:]
    finally:
        Path(job["workdir"], f"benched-{job['name']}").touch()  # the next pipeline's turn
        if pipe is not None:
            pipe.close()
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
