"""Runs the tiny talker in a plain vLLM V2 engine (no shim, no hooks) and writes its tokens.

Without the hook bridge each prompt id is just embedded as a code-0 token, so
this checks that vLLM loads the checkpoint into the model class and generates.
Usage: python talker_plain_job.py job.json result.json
job: {"model": dir, "prompts": [[ids]...], "max_tokens": n, "mp": 0|1}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from tests.support.engine_job import exit_with
from tests.tiny_models.talker import CODEC_EOS_ID, register

# vLLM's CPU platform starts its engine and worker processes with `spawn`, which re-imports
# this script in each of them: registering at import puts the talker in every ModelRegistry.
register()


def main(job_path: str, result_path: str) -> int:
    job = json.loads(open(job_path).read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(job.get("mp", 0))
    result: dict = {}
    llm = None
    t0 = time.monotonic()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=job["model"], dtype="float32", max_model_len=512, max_num_batched_tokens=64,
                  max_num_seqs=16, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
                  skip_tokenizer_init=True, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, stop_token_ids=[CODEC_EOS_ID],
                                detokenize=False, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        # the sampled token's logprob per step: compared with a direct forward's to see vLLM's numerics
        result["logprobs"] = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                              for o in outs]
        result["ok"] = True
    except Exception:
        result["ok"] = False
        result["traceback"] = traceback.format_exc()
    exit_with(result, result_path, t0, llm)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
