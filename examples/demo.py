"""`make demo`: a real vLLM V2 engine with the omni-sidecar shim and a sidecar process.

Builds a tiny random-weight Llama (fixed seed) if missing, starts
`omni-sidecar serve --hooks capture`, generates for a few prompts with
`worker_cls="worker_shim.Worker"`, and prints the text, each request's
captured hidden states (fetched from the sidecar) and per-step hook latency.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for key, value in {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

from omni_sidecar.client import SidecarClient, SidecarUnavailable  # noqa: E402
from omni_sidecar.testing import build_tiny_llama  # noqa: E402

PROMPTS = [
    "the quick brown fox",
    "a sidecar hosts the omni hooks",
    "every step they exchange small messages",
    "thinker talker code to wave",
]


def start_sidecar(endpoint: str, log_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks", "capture"],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
    )
    for _ in range(200):
        try:
            with SidecarClient(endpoint, timeout_s=0.3) as c:
                c.ping()
                return proc
        except SidecarUnavailable:
            if proc.poll() is not None:
                raise SystemExit(f"sidecar failed to start:\n{log_path.read_text()}")
    raise SystemExit("sidecar did not become ready")


def main() -> None:
    model = build_tiny_llama(ROOT / ".cache" / "tiny-llama")
    run_dir = Path(tempfile.mkdtemp(prefix="omni-demo-"))
    endpoint = f"ipc://{run_dir}/sidecar.sock"
    os.environ["OMNI_SIDECAR_ENDPOINT"] = endpoint
    print(f"== starting omni-sidecar (hooks: capture) at {endpoint}")
    sidecar = start_sidecar(endpoint, run_dir / "sidecar.log")
    try:
        from vllm import LLM, SamplingParams

        t0 = time.monotonic()
        llm = LLM(model=str(model), dtype="float32", max_model_len=512, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
                  worker_cls="worker_shim.Worker")
        print(f"== vLLM V2 + shim ready in {time.monotonic() - t0:.1f}s")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        (shim,) = llm.collective_rpc("omni_sidecar_stats")
        with SidecarClient(endpoint) as client:
            print("\n== generated (random weights, so the text is noise)")
            for o in outs:
                print(f"[{o.request_id}] {o.prompt!r} -> {o.outputs[0].text!r}")
                print(f"     token ids: {list(o.outputs[0].token_ids)}")
            print("\n== per-request captured outputs (from the sidecar)")
            for o in outs:
                hs = client.outputs(o.request_id)["hidden_states"]
                n_prompt = len(o.prompt_token_ids)
                print(f"[{o.request_id}] hidden_states {list(hs.shape)} {hs.dtype} = {n_prompt} prompt "
                      f"+ {hs.shape[0] - n_prompt} decoded tokens; mean |h| {hs.abs().mean():.4f}")
            status = client.status()
        (session,) = status.sessions
        print("\n== per-step hook latency")
        print(f"sidecar hook time per step: p50 {session.step_latency_us_p50:.0f} us, "
              f"p99 {session.step_latency_us_p99:.0f} us over {session.steps} steps")
        print(f"shim StepEnd cost per step (copy hidden states + send): p50 {shim['post_us_p50']:.0f} us, "
              f"p99 {shim['post_us_p99']:.0f} us; blocking round trips: {shim['blocking_exchanges']}")
        print(f"sidecar saw {session.steps} steps, {session.new_requests} requests, "
              f"{session.scheduled_tokens} tokens; shim sent {shim['steps']} / {shim['new_requests']} / "
              f"{shim['scheduled_tokens']}")
    finally:
        sidecar.terminate()
        sidecar.wait(10)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
