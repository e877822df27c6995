"""kill -9 the sidecar in the middle of a batch, N times, inside one live vLLM engine.

Each round: start a sidecar, generate a batch of short requests (finish before the
kill) and long ones (still running at the kill), SIGKILL the sidecar mid-batch,
then read what the shim says. Writes one JSON result.
Usage: python kill_loop_job.py MODEL ENDPOINT ROUNDS OUT_JSON WORKDIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("OMNI_SIDECAR_STEP_TIMEOUT", "2")


def main() -> None:
    model, endpoint, rounds, out_path, workdir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    from vllm import LLM, SamplingParams

    from omni_sidecar.client import SidecarClient, wait_ready

    def start_sidecar(i: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks", "capture"],
            stdout=open(os.path.join(workdir, f"sidecar-{i}.log"), "w"), stderr=subprocess.STDOUT,
        )
        wait_ready(endpoint, 60, proc)
        return proc

    sidecar = start_sidecar(0)
    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=256,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, worker_cls="worker_shim.Worker",
              additional_config={"omni_sidecar": {"endpoint": endpoint, "connect_timeout_s": 30}})
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    results = []
    prev_long: list[str] = []
    for i in range(rounds):
        if i:
            sidecar = start_sidecar(i)
        prompts = [{"prompt_token_ids": [4 + (i + j) % 300] * 8} for j in range(8)]
        params = [short] * 4 + [long] * 4
        # Mid-batch: the short requests (2 tokens) are done, the long ones (64) are not.
        killer = threading.Timer(KILL_AT_S, lambda p=sidecar: os.kill(p.pid, signal.SIGKILL))
        seen_failed: list[str] = []

        def ask_new_sidecar(ids=list(prev_long)) -> None:
            # The previous round's killed requests, as clients see them on the new sidecar.
            from omni_sidecar.client import RequestFailed

            # The shim reports them on its first step with the new sidecar: ask until then
            # (a loaded machine reconnects later), but before this round's kill.
            deadline = time.monotonic() + KILL_AT_S - ASK_FROM_S - 0.1
            pending = list(ids)
            with SidecarClient(endpoint, timeout_s=2) as client:
                while pending and time.monotonic() < deadline:
                    for rid in list(pending):
                        try:
                            client.outputs(rid)
                        except RequestFailed as exc:
                            seen_failed.append(exc.message)
                            pending.remove(rid)
                    time.sleep(0.02)

        asker = threading.Timer(ASK_FROM_S, ask_new_sidecar)
        asker.start()
        before = llm.collective_rpc("omni_sidecar_stats")[0]
        t0 = time.monotonic()
        killer.start()
        outs = llm.generate(prompts, params, use_tqdm=False)
        took = time.monotonic() - t0
        killer.join()
        asker.join()
        sidecar.wait(10)
        stats = llm.collective_rpc("omni_sidecar_stats")[0]
        results.append({
            "round": i,
            "seconds": took,
            "lengths": [len(o.outputs[0].token_ids) for o in outs],
            "errors": {o.request_id: stats["request_errors"].get(_internal(stats, o.request_id))
                       for o in outs},
            "reconnects": stats["reconnects"] - before["reconnects"],
            "losses": stats["losses"] - before["losses"],
            "killed_rc": sidecar.returncode,
            "prev_failed_seen_by_clients": seen_failed,
            "prev_asked": len(prev_long),
        })
        prev_long = [o.request_id for o in outs[4:]]
        print(json.dumps(results[-1]), flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)
    from tests.support.engine_job import shutdown_engine

    shutdown_engine(llm)  # the shim's rings and arenas too: a forked job has no resource tracker of its own
    sys.stdout.flush()
    os._exit(0)


KILL_AT_S = 1.0
ASK_FROM_S = 0.2


def _internal(stats: dict, client_id: str) -> str | None:
    for req_id in stats["request_errors"]:
        if req_id.rsplit("-", 1)[0] == client_id:
            return req_id
    return None


if __name__ == "__main__":
    main()
