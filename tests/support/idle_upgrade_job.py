"""Hot upgrades of a sidecar under an idle vLLM engine, then alternating idle and busy ones.

Part 1: `omni-sidecar upgrade` 5 times while the engine runs nothing (each timed; the
first sidecar keeps a warm spare),
then one batch: which hook set serves it. Part 2: 10 upgrades, alternately
between batches (idle) and during one (busy). Tokens are compared with a run
before any upgrade. Writes one JSON result.
Usage: python idle_upgrade_job.py MODEL ENDPOINT OUT_JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from proto.endpoint import ipc_path  # noqa: E402
from tests.support.state_hooks import StateCheckHooks  # noqa: E402

HOOKS = "tests.support.state_hooks:StateCheckHooks"


class LastHooks(StateCheckHooks):
    """The last idle upgrade's hook set: its name shows who serves the batch after it."""

    name = "state-check-last"


def upgrade(endpoint: str, hooks: str) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", endpoint, "--timeout", "30",
         "--", "--hooks", hooks],
        capture_output=True, text=True,
    )
    return {"rc": proc.returncode, "out": proc.stdout.strip(), "err": proc.stderr[-2000:],
            "seconds": time.monotonic() - t0}


def main() -> None:
    model, endpoint, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    from vllm import LLM, SamplingParams

    from omni_sidecar.client import SidecarClient, SidecarUnavailable

    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=256,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, worker_cls="worker_shim.Worker",
              enable_prefix_caching=False,
              additional_config={"omni_sidecar": {"endpoint": endpoint, "connect_timeout_s": 30}})
    prompts = [{"prompt_token_ids": [4 + (7 * j) % 300 for _ in range(8)]} for j in range(6)]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = generate()
    spare = ipc_path(endpoint) + ".spare"  # the first sidecar runs with --warm-spare
    deadline = time.monotonic() + 120
    while not os.path.exists(spare) and time.monotonic() < deadline:
        time.sleep(0.1)
    idle = [upgrade(endpoint, HOOKS) for _ in range(4)] + [upgrade(endpoint, "tests.support.idle_upgrade_job:LastHooks")]
    try:
        with SidecarClient(endpoint, timeout_s=15) as client:
            status_before = client.status()
    except SidecarUnavailable as exc:
        raise SystemExit(f"{exc}\nafter the idle upgrades: {json.dumps(idle)}") from None
    after_idle = generate()
    (stats_after_idle,) = llm.collective_rpc("omni_sidecar_stats")

    alternating, tokens = [], []
    for k in range(10):
        if k % 2 == 0:
            alternating.append(dict(upgrade(endpoint, HOOKS), busy=False))
            continue
        busy: list[dict] = []
        upgrader = threading.Thread(target=lambda: busy.append(upgrade(endpoint, HOOKS)))
        upgrader.start()
        tokens.append(generate())  # the upgrade's switch lands mid-batch (or once it is idle again)
        upgrader.join()
        alternating.append(dict(busy[0], busy=True))
    (stats,) = llm.collective_rpc("omni_sidecar_stats")
    with open(out_path, "w") as f:
        json.dump({"ref": ref, "after_idle": after_idle, "tokens": tokens, "idle": idle,
                   "alternating": alternating, "status_before_batch": status_before.hook_set,
                   "stats_after_idle": stats_after_idle, "stats": stats}, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
