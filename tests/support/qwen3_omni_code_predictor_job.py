"""vllm-omni 0.26's Qwen3-Omni code predictor on CPU under each sampling setting and two random states,
run by tests/test_qwen3_omni_code_predictor.py beside vllm-omni 0.26 on vLLM 0.26.

vllm-omni's own class (`Qwen3OmniMoeTalkerCodePredictor`) on the tiny checkpoint's talker config,
its weights random and its first residual head zero (every code of that step ties, as bf16 logits
can), its sampling set by its `set_sampling_params` (GREEDY of worker_shim/omni_models/qwen3_omni/
code_predictor.py, which the parity drivers' load format sets; top-k 1 alone); the same inputs, the global random generator
seeded with each seed before the call, eager on the shim's CPU platform for vllm-omni
(worker_shim/omni_models/cpu_platform.py, found through vllm-omni's platform plugins).
Writes {setting: {seed: codes}}.
Usage: python -m tests.support.qwen3_omni_code_predictor_job model_dir result.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

SEEDS = (0, 1)
ROWS = 3  # one batch: rows draw from one generator


def code_predictor(model_dir: str, init_dir: str):
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    vllm_config = VllmConfig()
    vllm_config.model_config = SimpleNamespace(hf_config=AutoConfig.from_pretrained(model_dir).talker_config,
                                               is_moe=False)
    with set_current_vllm_config(vllm_config):
        # Its embeddings are vLLM's VocabParallelEmbedding: a tensor-parallel group of one.
        init_distributed_environment(1, 0, f"file://{init_dir}/init", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_code_predictor_mtp import (
            Qwen3OmniMoeTalkerCodePredictor)

        return Qwen3OmniMoeTalkerCodePredictor(vllm_config=vllm_config, prefix="code_predictor")


def main(model_dir: str, result_path: str) -> None:
    import torch

    from worker_shim.omni_models.package import install_stand_in

    install_stand_in()  # vllm-omni's platform is then the shim's CPU one (its platform plugin)
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    from worker_shim.omni_models.qwen3_omni.code_predictor import GREEDY

    with tempfile.TemporaryDirectory() as init_dir:
        predictor = code_predictor(model_dir, init_dir).to(torch.bfloat16)
        try:
            torch.manual_seed(3)
            with torch.no_grad():
                for p in predictor.parameters():
                    p.normal_(0, 0.2)
                predictor.lm_head[0].weight.zero_()
            hidden = predictor.config.hidden_size
            g = torch.Generator().manual_seed(100)
            layer0 = torch.randint(0, predictor.config.vocab_size, (ROWS, 1), generator=g)
            embed = torch.randn(ROWS, 1, hidden, generator=g).to(torch.bfloat16)
            talker_hidden = torch.randn(ROWS, 1, hidden, generator=g).to(torch.bfloat16)
            result: dict = {}

            def codes() -> dict[int, list]:
                out = {}
                for seed in SEEDS:
                    torch.manual_seed(seed)
                    found, _ = predictor(layer0, embed, talker_hidden)
                    out[seed] = found.reshape(ROWS, -1).tolist()
                return out

            def setting() -> dict:
                return {"top_k": predictor._top_k, "top_p": predictor._top_p}

            result["vllm-omni"] = {"setting": setting(), "codes": codes()}
            predictor.set_sampling_params(top_k=1, top_p=1.0)
            result["top_k_1"] = {"codes": codes()}
            predictor.set_sampling_params(**GREEDY)
            result["greedy"] = {"setting": setting(), "codes": codes()}
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
