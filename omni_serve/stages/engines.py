"""A stage's engine: upstream `AsyncLLM` (Model Runner V2) with the shim as its worker.

Async scheduling as vLLM defaults it (vLLM turns it off on CPU by itself). GPU placement per
stage: the engine core process starts with `CUDA_VISIBLE_DEVICES` set to the stage's device;
without one (or on CPU) nothing is set.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.logger import init_logger
from vllm.v1.engine.async_llm import AsyncLLM

from omni_serve.config import StageSpec, load_callable
from proto.capabilities import HookNeeds

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL
# Where a stage's hooks pass extra forward kwargs or capture layers, a FULL CUDA graph's replay would
# lose them and the shim refuses FULL graphs: such a stage runs piecewise graphs unless its config
# chooses (enforce_eager, or compilation_config's cudagraph_mode).
PIECEWISE_GRAPHS = "PIECEWISE"


@contextlib.contextmanager
def visible_device(device: int | None) -> Iterator[None]:
    """The engine core process is started inside: it inherits the stage's device."""
    if device is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def graphs_for(spec: StageSpec, needs: HookNeeds | None) -> dict[str, Any]:
    """The stage's compilation config: piecewise graphs where its hooks need them and its config
    left the choice open, else as configured."""
    compilation = dict(spec.engine.get("compilation_config", {}))
    chosen = spec.engine.get("enforce_eager") or "cudagraph_mode" in compilation
    if needs is None or chosen or not (needs.extra_kwargs or needs.hidden_layers):
        return compilation
    logger.info("%s: its hooks pass extra forward kwargs or capture layers, which FULL CUDA graph replay "
                "would drop: piecewise CUDA graphs (set the stage's engine.compilation_config.cudagraph_mode "
                "or enforce_eager to choose)", spec.name)
    return {**compilation, "cudagraph_mode": PIECEWISE_GRAPHS}


def engine_args(spec: StageSpec, endpoint: str, curve_keys: str = "",
                needs: HookNeeds | None = None) -> AsyncEngineArgs:
    kwargs: dict[str, Any] = {"skip_tokenizer_init": True, "enable_prefix_caching": False, **spec.engine}
    if isinstance(kwargs.get("hf_overrides"), str):  # vLLM takes a function of the loaded config too
        kwargs["hf_overrides"] = load_callable(kwargs["hf_overrides"])
    compilation = graphs_for(spec, needs)
    if compilation:
        kwargs["compilation_config"] = compilation
    additional = dict(kwargs.get("additional_config", {}))
    # The shim's own settings from the config (subtalker_sampling, ...) stay; where its sidecar is, is ours.
    sidecar: dict[str, Any] = {**additional.get("omni_sidecar", {}), "endpoint": endpoint}
    if curve_keys:
        sidecar["curve_keys"] = curve_keys
    kwargs["additional_config"] = {**additional, "omni_sidecar": sidecar}
    return AsyncEngineArgs(model=spec.model, worker_cls="worker_shim.Worker", **kwargs)


def start_engine(spec: StageSpec, endpoint: str, curve_keys: str = "", needs: HookNeeds | None = None) -> AsyncLLM:
    with visible_device(spec.device):
        engine = AsyncLLM.from_engine_args(engine_args(spec, endpoint, curve_keys, needs))
    logger.info("%s engine up: %s%s", spec.name, spec.model, f" on GPU {spec.device}" if spec.device is not None else "")
    return engine
