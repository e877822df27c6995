"""The shim's start-up refusal of extra-kwargs hooks under FULL CUDA graphs, checked on the GPU.

`python -m bench.gpu` runs it (part `refusal`, in a thread while the first engines start): one engine
with the omni hook set passing extra kwargs and FULL_AND_PIECEWISE graphs must fail to start with the
shim's one-line message (docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs").
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.gpu_ab import Sizes
from bench.gpu_models import build_model_dir, engine_kwargs

REFUSAL = "FULL CUDA graph replay would drop"


def refusal_check(work: Path, sizes: Sizes) -> dict:
    """The shim with extra-kwargs hooks under FULL_AND_PIECEWISE graphs must refuse to start, with
    its one-line message (docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs"). One engine in a
    process of its own (engine core in-process, so the error comes back whole); it fails in the
    worker's init_device, before the model loads."""
    from tests.support.procs import SidecarProcess, run_engine

    if sizes.smoke:
        return {"status": "not applicable", "why": "no CUDA graphs on CPU (tests/test_graph_kwargs.py covers it)"}
    kwargs = engine_kwargs(build_model_dir(work / "refusal", "tiny"), smoke=False, graphs="FULL_AND_PIECEWISE",
                           num_seqs=4)
    kwargs["enforce_eager"] = False  # the job's default (eager, for CPU tests) would turn the graphs off
    endpoint = f"ipc://{work}/refusal.sock"
    sidecar = SidecarProcess(endpoint, "omni", work / "refusal-sidecar.log", options=["extra_kwargs=1"],
                             extra_args=["--log-level", "WARNING"])
    t0 = time.monotonic()
    try:
        res = run_engine({"model": kwargs.pop("model"), "prompts": [{"token_ids": [5, 6, 7]}], "max_tokens": 2,
                          "shim": True, "endpoint": endpoint, "mp": 0, "llm_kwargs": kwargs}, work, "refusal",
                         timeout_s=240)
    except Exception as exc:
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        sidecar.stop()
    error = res.get("error") or ""
    log = Path(res["log_path"]).read_text() if res.get("log_path") else ""
    refused = not res.get("ok") and (REFUSAL in error or REFUSAL in log)
    line = next((ln.strip() for ln in (error + "\n" + log).splitlines() if REFUSAL in ln), error[:300])
    out = {"status": "refused" if refused else ("STARTED" if res.get("ok") else "failed otherwise"),
           "message": line[-400:], "s": round(time.monotonic() - t0, 1)}
    print(f"[refusal] {out['status']}: {out['message']}", flush=True)
    return out
