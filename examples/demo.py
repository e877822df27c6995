"""`make demo`: a thinker -> talker pipeline on real vLLM V2 engines with omni sidecars.

Stage 1 (thinker, tiny Llama A) runs with `omni-sidecar serve --hooks omni-thinker`:
the sidecar assembles each request's last-layer hidden states. A client fetches
them and hands them to stage 2 as a vllm-omni `additional_information` payload.
Stage 2 (talker: tiny_talker.py, a Qwen3-TTS-shaped model carrying vllm-omni's
own hooks) runs with `--hooks omni-talker`: the shim calls the talker's
preprocess / talker_mtp / postprocess in the vLLM process, its sidecar decodes
the payload into the state those hooks read, keeps it, and assembles the code
predictor's `codes.audio` [decode steps, codebooks], streamed to the client step
by step. Both models are random-weight and built on first use with a fixed seed,
so the "text" and codes are noise; the plumbing is real.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for key, value in {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

from omni_sidecar.client import SidecarClient, SidecarUnavailable, wait_ready  # noqa: E402
from omni_sidecar.omni.wire import encode_additional_information  # noqa: E402
from tiny_models import build_tiny_llama  # noqa: E402
from tiny_talker import CODEC_BOS_ID, CODEC_PAD_ID, TALKER_CONFIG, build_tiny_talker, register  # noqa: E402

PROMPTS = [
    "the quick brown fox",
    "a sidecar hosts the omni hooks",
    "every step they exchange small messages",
    "thinker talker code to wave",
]
ENGINE = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
              enable_prefix_caching=False, worker_cls="worker_shim.Worker")


def start_sidecar(endpoint: str, hooks: str, log_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks", hooks],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(endpoint, 90, proc)
    except SidecarUnavailable as exc:
        raise SystemExit(f"sidecar failed to start: {exc}\n{log_path.read_text()}") from None
    return proc


def make_llm(model: Path, endpoint: str, **kwargs):
    from vllm import LLM

    t0 = time.monotonic()
    register()  # the talker's vLLM class (harmless for the thinker)
    llm = LLM(model=str(model), additional_config={"omni_sidecar": {"endpoint": endpoint}}, **ENGINE, **kwargs)
    print(f"   vLLM V2 + shim ready in {time.monotonic() - t0:.1f}s (sidecar at {endpoint})")
    return llm


def close_llm(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def print_latency(llm, endpoint: str) -> None:
    (shim,) = llm.collective_rpc("omni_sidecar_stats")
    with SidecarClient(endpoint) as client:
        (session,) = client.status().sessions
    print(f"   per-step hook latency: sidecar p50 {session.step_latency_us_p50:.0f} us / "
          f"p99 {session.step_latency_us_p99:.0f} us; shim StepEnd p50 {shim['post_us_p50']:.0f} us / "
          f"p99 {shim['post_us_p99']:.0f} us; blocking round trips {shim['blocking_exchanges']} "
          f"(p50 {shim['exchange_us_p50']:.0f} us) over {shim['steps']} steps")
    print(f"   sidecar saw {session.steps} steps, {session.new_requests} requests, "
          f"{session.scheduled_tokens} tokens (shim sent {shim['steps']} / {shim['new_requests']} / "
          f"{shim['scheduled_tokens']})")


def main() -> None:
    from vllm import SamplingParams

    thinker = build_tiny_llama(ROOT / ".cache" / "tiny-thinker", seed=0)
    talker = build_tiny_talker(ROOT / ".cache" / "tiny-qwen3-tts-talker", seed=1)
    run_dir = Path(tempfile.mkdtemp(prefix="omni-demo-"))
    ep1, ep2 = f"ipc://{run_dir}/thinker.sock", f"ipc://{run_dir}/talker.sock"
    sidecars = [start_sidecar(ep1, "omni-thinker", run_dir / "thinker.log"),
                start_sidecar(ep2, "omni-talker", run_dir / "talker.log")]
    try:
        print("== stage 1: thinker (hooks: omni-thinker)")
        llm = make_llm(thinker, ep1)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        stage2_inputs = []
        with SidecarClient(ep1) as client:
            for o in outs:
                got = client.outputs(o.request_id)
                hs = got["hidden_states"]
                print(f"   [{o.request_id}] {o.prompt!r} -> {o.outputs[0].text!r}")
                print(f"       token ids {list(o.outputs[0].token_ids)}")
                print(f"       thinker hidden states {list(hs.shape)} ({len(o.prompt_token_ids)} prompt + "
                      f"{hs.shape[0] - len(o.prompt_token_ids)} generated rows), processed_trace "
                      f"{got['processed_trace'][:, 1].tolist()}")
                stage2_inputs.append((o.request_id, hs))
        print_latency(llm, ep1)
        close_llm(llm)

        print("== stage 2: talker (hooks: omni-talker; the model's own hooks run in the shim), "
              "fed the thinker hidden states")
        llm = make_llm(talker, ep2, skip_tokenizer_init=True)  # codes, not text: no tokenizer
        width = TALKER_CONFIG["thinker_hidden_size"]
        prompts, params = [], []
        for (rid, hs), o in zip(stage2_inputs, outs):
            # The thinker's rows as vllm-omni hands them over (`hidden_states.output`); the tiny
            # thinker is wider than the tiny talker reads, so it gets the first `width` columns.
            text = hs[:, :width].contiguous()
            info = encode_additional_information({"hidden_states": {"output": text},
                                                  "embed": {"tts_pad": text.mean(dim=0, keepdim=True)}})
            prompt_len = len(o.prompt_token_ids)  # one codec row per thinker prompt row
            prompts.append({"prompt_token_ids": [CODEC_BOS_ID] + [CODEC_PAD_ID] * (prompt_len - 1)})
            params.append(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False,
                                         extra_args={"omni_sidecar": {"additional_information": info}}))
        streamed: list[tuple[float, int]] = []

        def follow(req_id: str) -> None:
            with SidecarClient(ep2) as client:
                for chunk in client.stream(req_id, timeout_s=120):
                    streamed.append((time.monotonic(), int(chunk["codes.audio"].shape[0])))

        follower = threading.Thread(target=follow, args=("0",), daemon=True)
        follower.start()
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        follower.join(30)
        with SidecarClient(ep2) as client:
            for o in outs:
                codes = client.outputs(o.request_id)["codes.audio"]
                print(f"   [{o.request_id}] codes.audio {list(codes.shape)} (decode steps x codebooks); "
                      f"first rows {codes[:3].tolist()}")
        print(f"   streamed request 0 in {len(streamed)} chunks, "
              f"{sum(n for _, n in streamed)} code rows, first after "
              f"{(streamed[0][0] - t0) * 1e3:.0f} ms" if streamed else "   (no chunks streamed)")
        print_latency(llm, ep2)
        close_llm(llm)
        print("== done: two stages, two sidecars, upstream vLLM V2 unmodified")
    finally:
        for proc in sidecars:
            proc.terminate()
            proc.wait(10)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
