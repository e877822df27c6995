"""How vllm-omni's Qwen3-Omni code predictor samples codebooks 1..15, and the one setting it has.

vllm-omni 0.26's Qwen3-Omni talker predicts the residual codebooks with its shared
`CodePredictorWrapper` in "stored" sampling mode (model_executor/models/qwen3_omni/
qwen3_omni_moe_code_predictor_mtp.py): top-k 50, then top-p 0.8, then Gumbel-max noise drawn from
the device's global random generator (model_executor/models/common/qwen3_code_predictor.py,
`forward` and `_sample_codes_gumbel`). Nothing of a request or of the configuration reaches it: its
`talker_mtp` (qwen3_omni.py) calls `talker.code_predictor_forward` without the sampling keywords and
per-request generators the runner passes, and that calls the code predictor without them; stored
mode would ignore them anyway. So neither `subtalker_sampling_params` nor a request's
`tts_local_seed` changes Qwen3-Omni's codes, and the checkpoint has no field the code predictor
reads. Two pipelines that draw from their random generators differently (another runner, other
batches) give other codes, and, as each talker step reads the codes it sampled, other talker tokens.

The setting there is is the wrapper's own `set_sampling_params(top_k, top_p)`, which nothing in
vllm-omni calls. GREEDY makes the codes the argmax chain whatever the random state: top-k 1 keeps
the largest logits, and a top-p below any probability then left keeps only the first code of the
sorted row, so that bf16 logits that tie give one code too (with top-k 1 alone, the noise would pick
among them).

`set_code_predictor_sampling` runs in the talker's worker (`collective_rpc`), the same call in
vllm-omni's own engine and in the shim's. The sampling is read when the code predictor runs, so a
CUDA graph of `talker_mtp` captured before the call keeps the one it was captured with: vllm-omni's
runner captures one at start unless the engine is eager (its gpu_model_runner `_init_talker_mtp`
wraps talker_mtp in a FULL graph for a model with a separate talker, and gpu_ar_model_runner's
`_capture_talker_mtp_graphs` captures it); the answer says whether that is so.
"""

from __future__ import annotations

from typing import Any

# top_p: any value in (0, 1 / vocabulary] keeps one code (a tie of m codes leaves each 1 / m).
GREEDY = {"top_k": 1, "top_p": 1e-6}
CHOICES = ("greedy", "vllm-omni")  # vllm-omni: leave its own sampling as it is


def code_predictor(model: Any) -> Any:
    """The Qwen3-Omni talker's code predictor of a loaded model (vllm-omni's outer class, or its talker)."""
    talker = getattr(model, "talker", None)
    found = getattr(model if talker is None else talker, "code_predictor", None)
    if found is None or not callable(getattr(found, "set_sampling_params", None)):
        raise TypeError(f"{type(model).__name__} has no Qwen3-Omni code predictor with set_sampling_params")
    return found


def talker_mtp_graphed(runner: Any) -> bool:
    """Does the runner replay the model's talker_mtp from a CUDA graph: vllm-omni's runner (its
    `talker_mtp`, a graph wrapper) or the shim's (its bridge's `mtp_graphs`)?"""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    if isinstance(getattr(runner, "talker_mtp", None), CUDAGraphWrapper):
        return True
    return getattr(getattr(runner, "omni_bridge", None), "mtp_graphs", None) is not None


def set_code_predictor_sampling(worker: Any, choice: str) -> dict[str, Any]:
    """In the talker's worker: the code predictor's sampling set to `choice` (CHOICES), and what it
    samples with then. `in_effect` is false where a CUDA graph captured earlier replays talker_mtp."""
    if choice not in CHOICES:
        raise ValueError(f"code predictor sampling {choice!r}: one of {', '.join(CHOICES)}")
    predictor = code_predictor(worker.get_model())
    if choice == "greedy":
        predictor.set_sampling_params(**GREEDY)
    graphed = talker_mtp_graphed(worker.model_runner)
    # vllm-omni's attributes, read back: what its forward samples with.
    return {"choice": choice, "top_k": getattr(predictor, "_top_k", None), "top_p": getattr(predictor, "_top_p", None),
            "mode": getattr(getattr(predictor, "_wrapper_config", None), "sampling_mode", None),
            "talker_mtp_graphed": graphed,
            "in_effect": choice == "vllm-omni" or not graphed}
