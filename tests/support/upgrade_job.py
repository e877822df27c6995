"""Hot upgrades during a streaming batch, inside one live vLLM engine.

Runs the batch once without upgrades (reference), then again while another
thread hot-upgrades the sidecar N times. Writes tokens, shim stats and the
hook outputs to one JSON result.
Usage: python upgrade_job.py MODEL ENDPOINT N OUT_JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
HOOKS = "tests.support.state_hooks:StateCheckHooks"


def main() -> None:
    model, endpoint, upgrades, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams

    from omni_sidecar.client import SidecarClient

    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=256,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, worker_cls="worker_shim.Worker",
              enable_prefix_caching=False,
              additional_config={"omni_sidecar": {"endpoint": endpoint, "connect_timeout_s": 30}})
    prompts = [{"prompt_token_ids": [4 + (7 * j) % 300 for _ in range(8)]} for j in range(8)]
    params = SamplingParams(max_tokens=int(os.environ.get("UPGRADE_MAX_TOKENS", "480")), temperature=0.0,
                            ignore_eos=True)
    ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    results: list[dict] = []

    def upgrade_loop() -> None:
        time.sleep(0.5)
        for _ in range(upgrades):
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", endpoint, "--timeout", "60",
                 "--", "--hooks", HOOKS],
                capture_output=True, text=True,
            )
            results.append({"rc": proc.returncode, "out": proc.stdout.strip(), "err": proc.stderr[-2000:],
                            "seconds": time.monotonic() - t0})

    upgrader = threading.Thread(target=upgrade_loop)
    upgrader.start()
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.monotonic() - t0
    upgrader.join()
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)  # deliver finishes
    (stats,) = llm.collective_rpc("omni_sidecar_stats")
    traces = {}
    with SidecarClient(endpoint) as client:
        for o in outs:
            got = client.outputs(o.request_id)
            traces[o.request_id] = got["processed_trace"].tolist() if got else None
    with open(out_path, "w") as f:
        json.dump({"ref": ref, "tokens": [list(o.outputs[0].token_ids) for o in outs], "stats": stats,
                   "upgrades": results, "generate_s": took, "traces": traces,
                   "prompt_lens": [len(o.prompt_token_ids) for o in outs]}, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
