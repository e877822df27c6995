"""GPU smoke run of the skeleton's identity check (vLLM 0.26, CUDA graphs on).

Plain V2 vs shim + passthrough sidecar, same prompts, same settings; prints the tokens'
agreement and the sidecar's counts. Usage (on the GPU host, bundle installed):
  PYTHONPATH=/opt/omni-site:. python3 deploy/gpu/smoke.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tests.tiny_models.llama import build_tiny_llama  # noqa: E402
from tests.support.procs import SidecarProcess, run_engine  # noqa: E402


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="omni-gpu-"))
    model = str(build_tiny_llama(work / "tiny"))
    rng = np.random.default_rng(1)
    prompts = [{"token_ids": rng.integers(4, 380, n).tolist()} for n in (3, 7, 12, 20, 33, 50, 90, 150)]
    common = {"model": model, "prompts": prompts, "max_tokens": 24,
              "llm_kwargs": {"enforce_eager": False, "kv_cache_memory_bytes": 1 << 30,
                             "max_num_batched_tokens": 64}}
    plain = run_engine(common, work, "plain")
    print("plain ok:", plain["ok"], plain.get("error", ""), f"start {plain.get('start_s', 0):.1f}s")
    endpoint = f"ipc://{work}/sc.sock"
    sidecar = SidecarProcess(endpoint, "passthrough", work / "sidecar.log")
    try:
        shim = run_engine({**common, "shim": True, "endpoint": endpoint, "flush": True, "sidecar_status": True},
                          work, "shim")
    finally:
        sidecar.stop()
    print("shim ok:", shim["ok"], shim.get("error", ""))
    if not (plain["ok"] and shim["ok"]):
        print(open(shim["log_path"]).read()[-4000:])
        return
    same = sum(a == b for a, b in zip(plain["tokens"], shim["tokens"]))
    print(f"identical requests: {same}/{len(prompts)}")
    log = open(shim["log_path"]).read()
    print("V2:", "Using V2 Model Runner" in log, "| graphs:", "CUDA graph" in log or "cudagraph" in log.lower())
    print("shim stats:", json.dumps({k: v for k, v in shim["shim_stats"][0].items() if "us" not in k}))
    print("sidecar:", json.dumps(shim["sidecar_status"]["sessions"][0]))


if __name__ == "__main__":
    main()
