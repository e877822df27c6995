"""One engine configuration's decode throughput, printed as JSON (run in its own process).

Usage: python -m bench.engine_throughput MODEL {plain|shim} [ENDPOINT]
"""

from __future__ import annotations

import json
import os
import sys
import time

for key, value in {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

NUM_PROMPTS = 16
PROMPT_LEN = 16
MAX_TOKENS = 64
ROUNDS = 3


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams

    kwargs = dict(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=256,
                  max_num_seqs=NUM_PROMPTS, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
                  enable_prefix_caching=False)
    if mode == "shim":
        kwargs["worker_cls"] = "worker_shim.Worker"
        kwargs["additional_config"] = {"omni_sidecar": {"endpoint": sys.argv[3]}}
    llm = LLM(**kwargs)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 4 for j in range(PROMPT_LEN)]} for i in range(NUM_PROMPTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    result = {"mode": mode, "tokens_per_s": rates}
    if mode == "shim":
        (stats,) = llm.collective_rpc("omni_sidecar_stats")
        result["shim"] = {k: stats[k] for k in ("steps", "blocking_exchanges", "post_us_p50", "post_us_p99")}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
