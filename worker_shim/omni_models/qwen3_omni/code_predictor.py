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

The one setting is the wrapper's own `set_sampling_params(top_k, top_p)`, which nothing in
vllm-omni calls. GREEDY makes the codes the argmax chain whatever the random state: top-k 1 keeps
the largest logits, and a top-p below any probability then left keeps only the first code of the
sorted row, so that bf16 logits that tie give one code too (with top-k 1 alone, the noise would pick
among them).

The sampling is read when the code predictor runs, so a CUDA graph of `talker_mtp` keeps the one it
was captured with, and vllm-omni's runner captures one at start unless the engine is eager (its
gpu_model_runner `_init_talker_mtp` wraps talker_mtp in a FULL graph for a model with a separate
talker; gpu_ar_model_runner's `_capture_talker_mtp_graphs`). So the setting is made as the model
loads, before any warm-up or capture, through vLLM's own seam for that: the load format
GREEDY_LOAD_FORMAT (`register_model_loader`), vLLM's default loader and then the setting, the same
in vllm-omni's engine (V1) and in the shim's (V2), in the process that loads the model.
`code_predictor_sampling` reads back, in a talker's worker, what its code predictor samples with.
"""

from __future__ import annotations

from typing import Any

# top_p: any value in (0, 1 / vocabulary] keeps one code (a tie of m codes leaves each 1 / m).
GREEDY = {"top_k": 1, "top_p": 1e-6}
GREEDY_LOAD_FORMAT = "qwen3_omni_greedy_code_predictor"  # lower case: vLLM lowers a load format
CHOICES = ("greedy", "vllm-omni")  # vllm-omni: its own sampling as it is
_registered: list[type] = []  # the loader class, once registered in this process


def code_predictor(model: Any) -> Any:
    """The Qwen3-Omni talker's code predictor of a loaded model (vllm-omni's outer class, or its talker)."""
    talker = getattr(model, "talker", None)
    found = getattr(model if talker is None else talker, "code_predictor", None)
    if found is None or not callable(getattr(found, "set_sampling_params", None)):
        raise TypeError(f"{type(model).__name__} has no Qwen3-Omni code predictor with set_sampling_params")
    return found


def register_greedy_load_format() -> str:
    """GREEDY_LOAD_FORMAT as a vLLM load format in this process (once); returns its name."""
    if _registered:
        return GREEDY_LOAD_FORMAT
    import copy

    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register_model_loader(GREEDY_LOAD_FORMAT)
    class GreedyCodePredictorLoader(DefaultModelLoader):
        """vLLM's default loader ("auto": its files and checks by that name), then the Qwen3-Omni
        code predictor set GREEDY."""

        def __init__(self, load_config: Any) -> None:
            load_config = copy.copy(load_config)
            load_config.load_format = "auto"
            super().__init__(load_config)

        def load_model(self, *args: Any, **kwargs: Any) -> Any:
            model = super().load_model(*args, **kwargs)
            code_predictor(model).set_sampling_params(**GREEDY)
            return model

    _registered.append(GreedyCodePredictorLoader)
    return GREEDY_LOAD_FORMAT


def talker_mtp_graphed(runner: Any) -> bool:
    """Does the runner replay the model's talker_mtp from a CUDA graph: vllm-omni's runner (its
    `talker_mtp`, a graph wrapper) or the shim's (its bridge's `mtp_graphs`)?"""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    if isinstance(getattr(runner, "talker_mtp", None), CUDAGraphWrapper):
        return True
    return getattr(getattr(runner, "omni_bridge", None), "mtp_graphs", None) is not None


def code_predictor_sampling(worker: Any) -> dict[str, Any]:
    """In a talker's worker (`collective_rpc`): what its code predictor samples with, read back from
    vllm-omni's wrapper, and whether greedy is in effect (set, and at load where talker_mtp replays
    from a CUDA graph)."""
    predictor = code_predictor(worker.get_model())
    sampling = {"top_k": getattr(predictor, "_top_k", None), "top_p": getattr(predictor, "_top_p", None)}
    load_format = str(worker.vllm_config.load_config.load_format)
    graphed = talker_mtp_graphed(worker.model_runner)
    return {**sampling, "mode": getattr(getattr(predictor, "_wrapper_config", None), "sampling_mode", None),
            "load_format": load_format, "talker_mtp_graphed": graphed,
            "greedy_in_effect": sampling == GREEDY and (load_format == GREEDY_LOAD_FORMAT or not graphed)}
