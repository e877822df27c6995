"""The tiny talker on real vLLM V2 + the shim + an omni-talker sidecar, twice in one engine.

Run 1: the requests as they are. Run 2: the same requests again while another thread
hot-upgrades the sidecar once the run is a few steps in. Writes each run's codes
(`codes.audio` from the sidecar), the sidecar state digests, the shim's counters and the
upgrade's outcome to one JSON result.
Usage: python talker_job.py job.json result.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    result: dict = {"ok": False}
    llm = None
    try:
        import msgspec
        from vllm import LLM, SamplingParams

        import tiny_talker
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

        def session_steps(client) -> int:
            return sum(s.steps for s in client.status().sessions)

        upgrades: list[dict] = []

        def upgrade_when(steps: int) -> None:
            with SidecarClient(endpoint) as client:
                while session_steps(client) < steps:
                    time.sleep(0.05)
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", endpoint, "--timeout", "60",
                 "--", "--hooks", job["hooks"]], capture_output=True, text=True)
            upgrades.append({"rc": proc.returncode, "err": proc.stderr[-2000:], "seconds": time.monotonic() - t0,
                             "done_at": time.monotonic()})

        runs = []
        for upgrade in (False, True):
            upgrader = None
            if upgrade:
                with SidecarClient(endpoint) as client:
                    start = session_steps(client)
                upgrader = threading.Thread(target=upgrade_when, args=(start + job["upgrade_after_steps"],))
                upgrader.start()
            outs = llm.generate(prompts, params, use_tqdm=False)
            ended = time.monotonic()
            if upgrader is not None:
                upgrader.join()
            run = {"ended": ended, "tokens": [list(o.outputs[0].token_ids) for o in outs], "codes": [],
                   "digests": []}
            with SidecarClient(endpoint) as client:
                for o in outs:
                    got = client.outputs(o.request_id) or {}
                    codes = got.get("codes.audio")
                    run["codes"].append(codes.tolist() if codes is not None else None)
                    run["digests"].append({k: v.tolist() for k, v in got.items() if k.startswith("state.")})
            runs.append(run)
        result["runs"] = runs
        result["upgrades"] = upgrades
        result["shim_stats"] = llm.collective_rpc("omni_sidecar_stats")
        with SidecarClient(endpoint) as client:
            result["sidecar_status"] = msgspec.to_builtins(client.status())
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        from tests.support.engine_job import record_error

        record_error(result, exc)
    with open(result_path, "w") as f:
        json.dump(result, f)
    if llm is not None:
        from tests.support.engine_job import shutdown_engine

        shutdown_engine(llm)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
