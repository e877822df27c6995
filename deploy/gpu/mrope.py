"""GPU check: the tiny Qwen2-VL (M-RoPE, an image per prompt) through the shim + a
pass-through sidecar gives the same greedy tokens as plain V2, CUDA graphs on, bf16, the prefill
chunked across the image tokens. Prints one PASS/FAIL line per check and writes mrope.json.

  PYTHONPATH=.:/tmp/omni-site python3 deploy/gpu/mrope.py --model DIR --out DIR
(DIR made by tests.tiny_models.vl.build_tiny_vl(DIR, architecture=VLLM_ARCH); deploy/gpu/run_omni.sh runs it.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.procs import SidecarProcess, run_engine  # noqa: E402

FULL_GRAPHS = "Capturing CUDA graphs (FULL"
PROMPTS = [{"text": "the quick brown fox", "image_seed": 0}, {"text": "a plain text prompt"},
           {"text": "thinker talker code", "image_seed": 1}, {"text": "one more image", "image_seed": 2}]
ENGINE = {"dtype": "bfloat16", "enforce_eager": False, "max_num_batched_tokens": 16, "max_model_len": 256,
          "max_num_seqs": 4, "enable_prefix_caching": False, "limit_mm_per_prompt": {"image": 1},
          "kv_cache_memory_bytes": 256 << 20, "gpu_memory_utilization": 0.3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    job = {"model": args.model, "prompts": PROMPTS, "max_tokens": 24, "register_vl_model": True, "llm_kwargs": ENGINE}
    plain = run_engine(job, args.out, "mrope-plain", timeout_s=300)
    sockets = args.out / "sockets"  # the sidecar accepts only a directory no one else can enter
    sockets.mkdir(mode=0o700, exist_ok=True)
    sockets.chmod(0o700)
    endpoint = f"ipc://{sockets}/mrope.sock"
    sidecar = SidecarProcess(endpoint, "passthrough", args.out / "mrope-sidecar.log")
    try:
        shim = run_engine({**job, "shim": True, "endpoint": endpoint}, args.out, "mrope-shim", timeout_s=300)
    finally:
        sidecar.stop()
    checks = []

    def check(ok: bool, what: str) -> None:
        checks.append({"ok": bool(ok), "what": what})
        print(f"[{'PASS' if ok else 'FAIL'}] {what}", flush=True)

    check(plain.get("ok"), f"plain V2 ran ({plain.get('error', 'ok')})")
    check(shim.get("ok"), f"shim + pass-through sidecar ran ({shim.get('error', 'ok')})")
    if plain.get("ok") and shim.get("ok"):
        same = [a == b for a, b in zip(plain["tokens"], shim["tokens"])]
        check(all(same) and len(same) == len(PROMPTS), f"greedy tokens identical {sum(same)}/{len(PROMPTS)}")
        image_lens = [len(p) for p, q in zip(shim["prompt_token_ids"], PROMPTS) if "image_seed" in q]
        check(min(image_lens) > ENGINE["max_num_batched_tokens"],
              f"image prompts ({image_lens} tokens) longer than a step's {ENGINE['max_num_batched_tokens']} "
              "tokens: prefill chunked across the image")
        for name, res in (("plain", plain), ("shim", shim)):
            check(FULL_GRAPHS in Path(res["log_path"]).read_text(), f"{name}: FULL CUDA graphs captured")
    (args.out / "mrope.json").write_text(json.dumps({"checks": checks, "plain": plain, "shim": shim}))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
