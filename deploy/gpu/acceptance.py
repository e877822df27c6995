"""GPU acceptance of the shim on vLLM 0.26 with CUDA graphs on, on 1 or 2 GPUs.

Each check starts real vLLM engines (`tests/support/engine_job.py`, one process
each) and real `omni-sidecar serve` processes; single-GPU checks run in two
lanes, one per GPU, when two are visible. Prints PASS/FAIL per check with its
figures and writes results.json. Usage on the GPU host (bundle installed):

  PYTHONPATH=.:/opt/omni-site python3 deploy/gpu/acceptance.py --out DIR [--checks a,b,...]

Checks: identity (plain V2 vs shim + pass-through, bf16, graphs; plus decode
throughput of both), overlay (shim + overlay hooks vs the V1 runner's
prompt_embeds, which V2 0.26 refuses), capture (hidden states vs a direct
transformers forward, bf16; CUDA IPC opens counted), staging (the same capture
through host shared memory, the path of CUDA-alike devices without CUDA IPC), tp (TP=2
identity and overlay).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tests.tiny_models.llama import build_tiny_llama  # noqa: E402
from tests.support.procs import SidecarProcess, run_engine, write_embeds  # noqa: E402

HIDDEN = 128
EMBEDS_LENS = [5, 40, 100]  # 100 > max_num_batched_tokens=64: chunked prefill crosses overlay rows
FULL_GRAPHS = "Capturing CUDA graphs (FULL)"  # FULL decode graphs stay on with the shim
GRAPHS = {"enforce_eager": False, "dtype": "bfloat16", "kv_cache_memory_bytes": 1 << 30}


class Check:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ok = True
        self.figures: dict = {}
        self.failures: list[str] = []

    def expect(self, cond: bool, what: str) -> None:
        if not cond:
            self.ok = False
            self.failures.append(what)

    def report(self) -> dict:
        status = "PASS" if self.ok else "FAIL"
        print(f"[{status}] {self.name}: {json.dumps(self.figures)}", flush=True)
        for f in self.failures:
            print(f"    - {f}", flush=True)
        return {"name": self.name, "ok": self.ok, "figures": self.figures, "failures": self.failures}


def token_prompts() -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"token_ids": rng.integers(4, 380, n).tolist()} for n in (3, 7, 12, 20, 33, 50, 90, 150)]


def engine(job: dict, work: Path, name: str, gpus: str, must: Check) -> dict:
    job = {**job, "env": {"CUDA_VISIBLE_DEVICES": gpus, **job.get("env", {})}}
    res = run_engine(job, work, name, timeout_s=900)
    must.expect(res["ok"], f"{name}: {res.get('error', '')}")
    if not res["ok"]:
        print(open(res["log_path"]).read()[-3000:], flush=True)
    return res


def sidecar(work: Path, name: str, hooks: str, gpus: str) -> SidecarProcess:
    return SidecarProcess(f"ipc://{work}/{name}.sock", hooks, work / f"{name}.log",
                          env={"CUDA_VISIBLE_DEVICES": gpus})


def status_of(res: dict) -> dict:
    return res.get("sidecar_status", {}).get("sessions", [{}])[0]


def plain_and_passthrough(model: str, work: Path, gpus: str, c: Check, llm_kwargs: dict,
                          sfx: str) -> tuple[dict, dict, int]:
    """The same greedy prompts on plain V2 and on the shim + a pass-through sidecar."""
    common = {"model": model, "prompts": token_prompts(), "max_tokens": 24, "llm_kwargs": llm_kwargs}
    plain = engine(common, work, f"plain{sfx}", gpus, c)
    sc = sidecar(work, f"pass{sfx}", "passthrough", gpus)
    try:
        shim = engine({**common, "shim": True, "endpoint": sc.endpoint, "flush": True, "sidecar_status": True},
                      work, f"shim-pass{sfx}", gpus, c)
    finally:
        sc.stop()
    same = sum(a == b for a, b in zip(plain.get("tokens", []), shim.get("tokens", [])))
    return plain, shim, same


def check_identity(model: str, work: Path, gpus: str) -> dict:
    # Throughput is measured by `python -m bench.gpu` (engines side by side), not here: these lanes
    # share the host with other engines' start-up.
    c = Check("identity: shim + pass-through == plain V2 (bf16, CUDA graphs)")
    plain, shim, same = plain_and_passthrough(model, work, gpus, c, GRAPHS, "")
    if plain["ok"] and shim["ok"]:
        stats = shim["shim_stats"][0]
        log = open(shim["log_path"]).read()
        c.figures.update(
            identical=f"{same}/{len(plain['tokens'])}",
            steps=stats["steps"], blocking_exchanges=stats["blocking_exchanges"],
            arena=stats.get("arena_kind"), post_us_p50=round(stats.get("post_us_p50", 0), 1),
        )
        c.expect(same == len(plain["tokens"]), "tokens differ from plain V2")
        c.expect("Using V2 Model Runner" in log, "the V2 runner was not used")
        c.expect(FULL_GRAPHS in log, "the shim's engine captured no FULL CUDA graphs")
        c.expect(stats["blocking_exchanges"] == 0, "pass-through made blocking exchanges")
        c.expect(stats.get("arena_kind") == "cuda_ipc", "the CUDA IPC arena was not chosen")
        c.expect(status_of(shim).get("steps") == stats["steps"], "sidecar and shim step counts differ")
    return c.report()


def check_overlay(model: str, work: Path, gpus: str, tp: int = 1) -> dict:
    sfx = "" if tp == 1 else f"-tp{tp}"
    c = Check(f"overlay{sfx}: shim + overlay hooks == V1 prompt_embeds (bf16, CUDA graphs, chunked)")
    files = write_embeds(work, EMBEDS_LENS, HIDDEN)
    kw = {**GRAPHS, "enable_prefix_caching": False, "tensor_parallel_size": tp}
    placeholders = [{"token_ids": [3] * n} for n in EMBEDS_LENS]
    ref = engine({"model": model, "max_tokens": 16, "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
                  "prompts": [{"embeds_file": f} for f in files] + placeholders,
                  "llm_kwargs": {**kw, "enable_prompt_embeds": True}}, work, f"v1-embeds{sfx}", gpus, c)
    sc = sidecar(work, f"overlay{sfx}", "overlay", gpus)
    try:
        shim = engine({"model": model, "max_tokens": 16, "shim": True, "endpoint": sc.endpoint,
                       "prompts": [{"embeds_file": f, "as": "payload"} for f in files],
                       "llm_kwargs": kw, "sidecar_status": True, "flush": True}, work, f"shim-overlay{sfx}", gpus, c)
    finally:
        sc.stop()
    if ref["ok"] and shim["ok"]:
        n = len(files)
        same = sum(a == b for a, b in zip(ref["tokens"][:n], shim["tokens"]))
        stats = shim["shim_stats"][0]
        st = status_of(shim)
        c.figures.update(identical=f"{same}/{n}", blocking_exchanges=stats["blocking_exchanges"],
                         shim_opens=stats.get("arena_opens"),
                         sidecar_opens={"mem": st.get("arena_opens"), "events": st.get("event_opens")},
                         errors=stats["request_errors"], embeds_graph_replays=stats.get("embeds_graph_replays"))
        c.expect(same == n, "overlay tokens differ from prompt_embeds")
        c.expect(FULL_GRAPHS in open(shim["log_path"]).read(), "no FULL CUDA graphs with the embeds buffer")
        c.expect(ref["tokens"][n:] != shim["tokens"], "placeholders alone give the same tokens (overlay untested)")
        c.expect(not stats["request_errors"], "request errors")
        c.expect(stats["blocking_exchanges"] > 0, "no blocking exchange happened")
        if tp == 1:
            # Opened once per connection whatever the number of steps: the sidecar's arena + its ready
            # event on the shim; the shim's hidden arena + 2 ready events + 1 done event on the sidecar.
            c.expect(stats.get("arena_opens") == {"mem": 1, "events": 1}, "shim opens != 1 buffer + 1 event")
            c.expect((st.get("arena_opens"), st.get("event_opens")) == (1, 3), "sidecar opens != 1 buffer + 3 events")
            # Decode steps fill the embeds buffer from the shim's own graphs (worker_shim/model/embeds.py): the
            # tokens above are those of the replayed lookup.
            c.expect((stats.get("embeds_graph_replays") or 0) > 0, "the embeds lookup never replayed from a graph")
        else:
            c.expect(len(shim["shim_stats"]) == tp and shim["shim_stats"][1].get("role") == "tp-follower",
                     "rank 1 is not a follower")
    return c.report()


def check_capture(model: str, work: Path, gpus: str, arena: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    c = Check(f"capture via {arena}: hidden states == direct forward (bf16, CUDA graphs)")
    prompts = [token_prompts()[i] for i in (0, 4, 7)]
    sc = sidecar(work, f"capture-{arena}", "capture", gpus)
    try:
        res = engine({"model": model, "prompts": prompts, "max_tokens": 12, "shim": True, "endpoint": sc.endpoint,
                      "fetch_outputs": True, "sidecar_status": True, "llm_kwargs": GRAPHS,
                      "env": {"OMNI_SIDECAR_ARENA": arena}}, work, f"shim-capture-{arena}", gpus, c)
    finally:
        sc.stop()
    if not res["ok"]:
        return c.report()
    stats, st = res["shim_stats"][0], status_of(res)
    device = torch.device("cuda", 0)
    ref = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16).to(device).eval()
    worst = 0.0
    for rid, prompt, out in zip(res["request_ids"], res["prompt_token_ids"], res["tokens"]):
        files = res["outputs"].get(rid, {})
        c.expect("hidden_states" in files, f"no hidden states for {rid}")
        if "hidden_states" not in files:
            continue
        captured = torch.from_numpy(np.load(files["hidden_states"], allow_pickle=False))
        ids = prompt + out[:-1]
        with torch.no_grad():
            direct = ref.model(torch.tensor([ids], device=device)).last_hidden_state[0].float().cpu()
        c.expect(captured.shape == direct.shape, f"shape {tuple(captured.shape)} != {tuple(direct.shape)}")
        if captured.shape == direct.shape:
            worst = max(worst, float((captured - direct).abs().max()))
            c.expect(torch.allclose(captured, direct, atol=5e-2, rtol=5e-2), f"{rid}: not allclose in bf16")
    c.figures.update(max_abs_diff=round(worst, 4), arena=stats.get("arena_kind"), steps=stats["steps"],
                     shim_opens=stats.get("arena_opens"),
                     sidecar_opens={"mem": st.get("arena_opens"), "events": st.get("event_opens")})
    c.expect(stats.get("arena_kind") == arena, f"arena {stats.get('arena_kind')} != {arena}")
    if arena == "cuda_ipc":
        c.expect(stats.get("arena_opens") == {"mem": 0, "events": 2}, "shim opens != the sidecar's 2 done events")
        c.expect((st.get("arena_opens"), st.get("event_opens")) == (1, 2), "sidecar opens != 1 buffer + 2 events")
    return c.report()


def check_tp_identity(model: str, work: Path, gpus: str) -> dict:
    c = Check("tp2: shim + pass-through == plain V2 with TP=2 (bf16, CUDA graphs)")
    plain, shim, same = plain_and_passthrough(model, work, gpus, c, {**GRAPHS, "tensor_parallel_size": 2}, "-tp2")
    if plain["ok"] and shim["ok"]:
        sessions = shim.get("sidecar_status", {}).get("sessions", [])
        c.figures.update(identical=f"{same}/{len(plain['tokens'])}", sidecar_sessions=len(sessions),
                         roles=[s.get("role", "driver") for s in shim["shim_stats"]])
        c.expect(same == len(plain["tokens"]), "tokens differ from plain V2 TP=2")
        c.expect(len(sessions) == 1, "expected one sidecar session (rank 0 drives)")
    return c.report()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="omni-gpu-"))
    ap.add_argument("--checks", default="identity,overlay,capture,staging,tp")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="omni-gpu-work-"))
    model = str(build_tiny_llama(work / "tiny"))
    import torch

    n_gpus = torch.cuda.device_count()
    wanted = args.checks.split(",")
    lanes: list[list] = [[], []]
    if "identity" in wanted:
        lanes[0].append(lambda g: check_identity(model, work, g))
    if "overlay" in wanted:
        lanes[1].append(lambda g: check_overlay(model, work, g))
    if "capture" in wanted:
        lanes[1].append(lambda g: check_capture(model, work, g, "cuda_ipc"))
    if "staging" in wanted:
        lanes[0].append(lambda g: check_capture(model, work, g, "shm"))

    def run_lane(fns: list, gpu: str) -> list[dict]:
        out_ = []
        for fn in fns:
            try:
                out_.append(fn(gpu))
            except Exception:
                traceback.print_exc()
                out_.append({"name": getattr(fn, "__name__", "check"), "ok": False, "failures": ["raised"]})
        return out_

    t0 = time.monotonic()
    results: list[dict] = []
    if n_gpus >= 2:
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(run_lane, lanes[0], "0"), pool.submit(run_lane, lanes[1], "1")]
            for f in futs:
                results += f.result()
    else:
        results += run_lane(lanes[0] + lanes[1], "0")
    if "tp" in wanted:
        if n_gpus >= 2:
            results += run_lane([lambda g: check_tp_identity(model, work, g),
                                 lambda g: check_overlay(model, work, g, tp=2)], "0,1")
        else:
            print("[SKIP] tp: needs 2 GPUs (not counted as passing)", flush=True)
    summary = {"gpus": [torch.cuda.get_device_name(i) for i in range(n_gpus)], "torch": torch.__version__,
               "wall_s": round(time.monotonic() - t0, 1), "results": results,
               "all_ok": all(r["ok"] for r in results)}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for f in work.glob("*.log"):
        shutil.copy(f, logs / f.name)
    print(f"ALL {'PASS' if summary['all_ok'] else 'FAIL'} in {summary['wall_s']} s on {summary['gpus']}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    main()
