"""One engine of deploy/gpu/async_scheduling.py's tiny-Llama hook sets, in a process of its own.

  python deploy/gpu/async_engines.py job.json result.json

Upstream vLLM V2 + the shim with `async_scheduling` as the job says (`job["async"]`), bf16, CUDA
graphs on, and an `omni-sidecar serve` of the job's hook set at `job["endpoint"]`. The job's
requests (each with its own stop token ids, so some end on a stop token: the case async scheduling
runs once more) are stepped through `LLMEngine.step()`; their tokens, finish reasons and the
sidecar's outputs (.npy files) are the result. Then, once every engine of the run is ready, its
timed rounds of `job["timed_requests"]` (of one length, no stop tokens: every request decodes to
the end) in their turn (talker_engines.Turns): each request's decode time per token as the client
sees it (talker_engines.drive), the same measure with async scheduling on and off, which run
different numbers of forwards and engine steps for the same tokens; each round's forwards (the
shim's count) and engine steps are kept beside it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import talker_engines  # noqa: E402
from talker_engines import Turns, bench_ready, run_job  # noqa: E402


def engine(job: dict) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    settings = dict(model=job["model"], dtype="bfloat16", seed=0, enforce_eager=False, enable_prefix_caching=False,
                    max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 30,
                    gpu_memory_utilization=job["gpu_memory_utilization"], async_scheduling=job["async"],
                    worker_cls="worker_shim.Worker", additional_config={"omni_sidecar": {"endpoint": job["endpoint"]}})
    settings.update(job.get("engine_overrides", {}))  # a CPU try-out: float32, eager
    args = EngineArgs(**settings)
    return LLMEngine.from_engine_args(args)


def requests(specs: list[dict], prefix: str) -> list[tuple[str, dict, Any]]:
    import numpy as np
    import torch
    from vllm import SamplingParams

    from omni_sidecar.payload import sidecar_extra_args

    out = []
    for i, spec in enumerate(specs):
        extra = None
        if "embeds_file" in spec:  # the overlay set: placeholders, the rows from the payload
            embeds = torch.from_numpy(np.load(spec["embeds_file"], allow_pickle=False))
            prompt = {"prompt_token_ids": [3] * embeds.shape[0]}
            extra = sidecar_extra_args(prompt_embeds=embeds)
        else:
            prompt = {"prompt_token_ids": spec["token_ids"]}
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                stop_token_ids=spec.get("stop_token_ids") or None, extra_args=extra)
        out.append((f"{prefix}{i}", prompt, params))
    return out


def drive(llm: Any, reqs: list[tuple[str, dict, Any]]) -> dict:
    """Every request added, then steps until done; then one more request, whose step brings vLLM's
    finish notices of the others to the worker (an engine going idle sends none)."""
    from vllm import SamplingParams

    for rid, prompt, params in reqs:
        llm.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
                reasons[o.request_id] = str(o.outputs[0].finish_reason)
    wall_s = time.perf_counter() - t0
    llm.add_request(f"{reqs[0][0]}-notice", {"prompt_token_ids": [5, 6, 7]},
                    SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    while llm.has_unfinished_requests():
        llm.step()
    ids = [rid for rid, _, _ in reqs]
    return {"ids": ids, "tokens": [tokens.get(r) for r in ids], "finish_reasons": [reasons.get(r) for r in ids],
            "wall_s": wall_s}


def save_outputs(job: dict, ids: list[str]) -> dict[str, dict[str, str]]:
    """Each request's tensor outputs from the sidecar, as .npy files (float32)."""
    import numpy as np
    import torch

    from omni_sidecar.client import SidecarClient

    files: dict[str, dict[str, str]] = {}
    with SidecarClient(job["endpoint"]) as client:
        for rid in ids:
            files[rid] = {}
            for name, value in (client.outputs(rid) or {}).items():
                if isinstance(value, torch.Tensor):
                    path = Path(job["workdir"], f"{job['name']}-{rid}-{name}.npy")
                    np.save(path, value.float().numpy(), allow_pickle=False)
                    files[rid][name] = str(path)
    return files


def timed_round(llm: Any, specs: list[dict], prefix: str) -> dict:
    """The requests through talker_engines.drive (each added with its own prompt and sampling
    params): every request's decode time per token, and the engine steps it took."""
    table = {rid: (prompt, params) for rid, prompt, params in requests(specs, prefix)}
    reqs = [{"rid": rid, "max_tokens": params.max_tokens} for rid, (_, params) in table.items()]
    return talker_engines.drive(llm, lambda req, _params: llm.add_request(req["rid"], *table[req["rid"]]), reqs)


def forwards(llm: Any) -> int:
    """The forwards the shim ran so far (its stats wait for the sidecar's work: read outside the timing)."""
    return llm.collective_rpc("omni_sidecar_stats")[0]["steps"]


def timed_rounds(llm: Any, job: dict) -> tuple[list[dict], int]:
    """The timed requests, each round in its turn; past the run's deadline no round starts.
    Returns the rounds and how many were cut."""
    turns = Turns(job)
    rounds, cut = [], 0
    for spec in job["bench_sets"]:
        for r in range(spec.get("rounds", 1)):
            key = f"{job['name']}|{spec['name']}|{r}"
            waited = turns.take(key)
            if waited is None:  # past the deadline: the others are too, or skip our turns
                cut += 1
                continue
            try:
                before = forwards(llm)
                start_unix = time.time()
                run = timed_round(llm, job["timed_requests"], f"{spec['name']}-{r}-")
                ran = forwards(llm) - before
            finally:
                turns.done(key)
            rounds.append({"decode_s": run["decode_s"], "steps": len(run["step_s"]), "forwards": ran,
                           "wall_s": sum(run["step_s"]), "start_unix": start_unix, "turn_wait_s": waited})
    return rounds, cut


def llama_job(job: dict, result: dict) -> None:
    t0 = time.monotonic()
    llm = engine(job)
    result["start_s"] = time.monotonic() - t0
    result["async_scheduling"] = bool(getattr(llm.vllm_config.scheduler_config, "async_scheduling", False))
    drive(llm, requests(job["requests"], "warm-"))  # compiles and warms what the first round would
    run = drive(llm, requests(job["requests"], "check-"))
    run["outputs"] = save_outputs(job, run["ids"])
    result["run"] = run
    # The timed batch once, short and untimed: its batch sizes met before the rounds.
    timed_round(llm, [{**r, "max_tokens": talker_engines.WARM_SET_TOKENS} for r in job["timed_requests"]], "warm-timed-")
    bench_ready(job)
    result["rounds"], result["bench_rounds_cut"] = timed_rounds(llm, job)
    result["shim_stats"] = llm.collective_rpc("omni_sidecar_stats")


if __name__ == "__main__":
    run_job(sys.argv[1], sys.argv[2], llama_job)
