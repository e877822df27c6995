"""The tiny code2wav on real vLLM V2 + the shim + an omni-code2wav sidecar, stepped by hand.

Every request is one placeholder token with max_tokens = its number of chunks and
ignore_eos (generation-only: the sampled tokens are a clock). After each engine step
the job asks the sidecar how many waveform samples each live request has so far (the
stream growing per step); at the end it takes each request's assembled waveform and
its per-step chunks (`SidecarClient.stream`), the shim's counters, and writes JSON.
Usage: python code2wav_job.py job.json result.json
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from tests.support.engine_job import exit_with, record_error  # noqa: E402  (numpy only; vLLM comes later)


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    result: dict = {"ok": False}
    llm, t0 = None, time.monotonic()
    try:
        from vllm import LLM, SamplingParams

        from tests.tiny_models import code2wav as tiny_code2wav
        from omni_sidecar.client import SidecarClient
        from tests.support.code2wav_payload import code2wav_request

        tiny_code2wav.register()
        endpoint = job["endpoint"]
        llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
                  skip_tokenizer_init=True, worker_cls="worker_shim.Worker", kv_cache_memory_bytes=16 << 20,
                  additional_config={"omni_sidecar": {"endpoint": endpoint}}, **job["llm_kwargs"])
        engine = llm.llm_engine
        ids = [f"c2w{i}" for i in range(len(job["requests"]))]
        for req_id, spec in zip(ids, job["requests"]):
            req = code2wav_request(**spec)
            engine.add_request(req_id, {"prompt_token_ids": req["prompt_token_ids"]},
                               SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True,
                                              detokenize=False,
                                              extra_args={"omni_sidecar": {"additional_information": req["payload"]}}))
        growth: dict[str, list[int]] = {r: [] for r in ids}  # samples held after each step, while live
        tokens: dict[str, list[int]] = {}
        with SidecarClient(endpoint) as client:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
                for req_id in ids:
                    if req_id not in tokens:
                        got = client.outputs(req_id) or {}
                        wave = got.get("waveform")
                        growth[req_id].append(0 if wave is None else int(wave.shape[0]))
            finals, streams = [], []
            for req_id in ids:
                got = client.outputs(req_id) or {}
                wave = got.get("waveform")
                finals.append({"waveform": None if wave is None else wave.reshape(-1).tolist(),
                               "sr": int(got["sr"]) if "sr" in got else None})
                streams.append([c["waveform"].reshape(-1).tolist() for c in client.stream(req_id, timeout_s=30)])
        result.update(finals=finals, streams=streams, growth=[growth[r] for r in ids],
                      tokens=[tokens[r] for r in ids], shim_stats=llm.collective_rpc("omni_sidecar_stats"))
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        record_error(result, exc)
    exit_with(result, result_path, t0, llm)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
