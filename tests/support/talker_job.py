"""The tiny talker on real vLLM V2 + the shim + an omni-talker sidecar, twice in one engine.

Run 1: the requests as they are. Run 2: the same requests again, stepped by hand, with a
hot upgrade of the sidecar a few steps in (while every request is live). Run 3 (on the
successor): one request, stepped by hand; a client appends `meta.probe` mid-stream and the
model's own hook records, per decode row, the shim's step and the probe its state held. Writes
each run's codes (`codes.audio` from the sidecar), the sidecar state digests, the shim's
counters, the upgrade's outcome and the append's to one JSON result.
Usage: python talker_job.py job.json result.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    result: dict = {"ok": False}
    llm = None
    try:
        import msgspec
        from vllm import LLM, SamplingParams

        from tests.tiny_models import talker as tiny_talker
        from omni_sidecar.client import SidecarClient
        from tests.support.engine_job import shutdown_engine
        from tests.support.talker_payload import encoded_payload, talker_request

        tiny_talker.register()
        endpoint = job["endpoint"]
        llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
                  skip_tokenizer_init=True, worker_cls="worker_shim.Worker", kv_cache_memory_bytes=64 << 20,
                  additional_config={"omni_sidecar": {"endpoint": endpoint}}, **job["llm_kwargs"])
        prompts, params = [], []
        for spec in job["requests"]:
            req = talker_request(spec["prompt_len"], spec["text_len"], spec["seed"], spec["max_tokens"])
            prompts.append({"prompt_token_ids": req["prompt_token_ids"]})
            params.append(SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                                         detokenize=False, extra_args={"omni_sidecar": {"additional_information":
                                                                      encoded_payload(req["info"])}}))

        def collect(outs, ended: float) -> dict:
            run = {"ended": ended, "tokens": [list(o.outputs[0].token_ids) for o in outs], "codes": [],
                   "digests": []}
            with SidecarClient(endpoint) as client:
                for o in outs:
                    got = client.outputs(o.request_id) or {}
                    codes = got.get("codes.audio")
                    run["codes"].append(codes.tolist() if codes is not None else None)
                    run["digests"].append({k: v.tolist() for k, v in got.items() if k.startswith("state.")})
            return run

        runs = [collect(llm.generate(prompts, params, use_tqdm=False), time.monotonic())]
        result["upgrade"] = upgrade = {}
        runs.append(collect(_generate_across_upgrade(llm, prompts, params, job, upgrade), time.monotonic()))
        result["shim_stats"] = llm.collective_rpc("omni_sidecar_stats")
        result["append"] = appended = {}
        runs.append(collect(_append_mid_stream(llm, prompts[0], params[0], job, appended), time.monotonic()))
        result["runs"] = runs
        with SidecarClient(endpoint) as client:
            result["sidecar_status"] = msgspec.to_builtins(client.status())
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        from tests.support.engine_job import record_error

        record_error(result, exc)
    with open(result_path, "w") as f:
        json.dump(result, f)
    if llm is not None:
        shutdown_engine(llm)
    sys.stdout.flush()
    os._exit(0)


def _generate_across_upgrade(llm, prompts, params, job: dict, upgrade: dict) -> list:
    """The requests again, stepped by hand: after a few steps the sidecar is hot-upgraded, and no
    step runs until the old sidecar accepted the successor's takeover, so every request is live
    (mid-stream) when the shim switches at its next step boundary."""
    engine = llm.llm_engine
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"up{i}", prompt, param)
    done: dict[str, object] = {}
    steps = 0
    proc = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == job["upgrade_after_steps"]:
            upgrade["live_at_takeover"] = len(prompts) - len(done)
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", job["endpoint"], "--timeout",
                 "120", "--", "--hooks", job["hooks"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while "takeover accepted" not in open(job["sidecar_log"]).read():
                if proc.poll() is not None or time.monotonic() - t0 > 120:
                    break
                time.sleep(0.1)
            upgrade["accepted_s"] = time.monotonic() - t0
    if proc is not None:
        _, err = proc.communicate(timeout=120)
        upgrade.update(rc=proc.returncode, err=err[-2000:])
    return [done[f"up{i}"] for i in range(len(prompts))]


def _append_mid_stream(llm, prompt, param, job: dict, appended: dict) -> list:
    """One request stepped by hand; after `append_after_steps` steps a client thread appends
    `meta.probe` (its reply comes once the shim applied it, while the engine keeps stepping)."""
    import threading

    from tests.tiny_models import talker as tiny_talker
    from omni_sidecar.client import SidecarClient
    from worker_shim.step.link import SidecarLink

    step_now = [-1]
    seen = appended["seen"] = []  # [shim step, probe] per decode row the model's own hook read
    begin_step, next_text_step = SidecarLink.begin_step, tiny_talker.TalkerHeads.next_text_step

    def begin(link):
        step_now[0] = link.step
        begin_step(link)

    def text_step(heads, info):
        seen.append([step_now[0], info.get("meta", {}).get("probe")])
        return next_text_step(heads, info)

    def send():
        try:
            with SidecarClient(job["endpoint"]) as client:
                appended["after_step"] = client.append("ap", {"meta": {"probe": 7}})
        except Exception as exc:  # the test reads it
            appended["error"] = repr(exc)

    SidecarLink.begin_step, tiny_talker.TalkerHeads.next_text_step = begin, text_step
    engine, thread, steps, done = llm.llm_engine, threading.Thread(target=send), 0, []
    try:
        engine.add_request("ap", prompt, param)
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
            steps += 1
            if steps == job["append_after_steps"]:
                appended["sent_at_step"] = step_now[0]
                thread.start()
        thread.join(timeout=60)
    finally:
        SidecarLink.begin_step, tiny_talker.TalkerHeads.next_text_step = begin_step, next_text_step
    return done


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
