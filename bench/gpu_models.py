"""Models and engine settings for the one-GPU throughput bench (bench/gpu_ab.py).

Models are random-weight Llamas built at run time: a config.json only, loaded with
vLLM's `load_format="dummy"` (vLLM fills the weights from a fixed seed, the same for
every engine that loads the directory), token-id prompts and `skip_tokenizer_init`, so
nothing is downloaded and a 1B model costs no weight files.

Their architecture is `BenchKwargsLlamaForCausalLM`: upstream Llama whose forward also
takes vllm-omni's extra kwargs (`runtime_additional_information`, `request_token_spans`)
and only counts the steps that brought them (no device sync; one file written the first
time, as proof they arrived: the bench measures the hooks' cost, not the model's bookkeeping). Plain and shim engines load the
same class, so they run the same forward.

vLLM resolves the architecture in every process: the driver registers it directly,
engine-core processes (forked or spawned) through a `vllm.general_plugins` entry point
that `install_plugin` puts on PYTHONPATH as a one-file distribution (no install).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ARCH = "BenchKwargsLlamaForCausalLM"
PLUGIN_DIST = "omni_bench_kwargs_llama-0.0.dist-info"
KWARGS_MARK_ENV = "OMNI_BENCH_KWARGS_MARK"  # file the model writes when extra kwargs first reach it
GC_PROBE_ENV = "OMNI_BENCH_GC_FILE"  # file where the model's process keeps its cycle collector's counts
GC_PROBE_WRITE_S = 1.0  # how often the forward rewrites it (the bench waits this long before reading)

# name -> Llama shape. "tiny": the tests' tiny Llama (tests/tiny_models/llama.py TINY_CONFIG, 0.1 M params, the
# per-step host cost as visible as it gets); "1b": Llama-1B-shaped (1.1 B params, a realistic
# step). "mid" stands in for "1b" in --smoke (CPU: head_dim >= 32).
SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "mid": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
}


def param_count(shape: dict) -> int:
    h, i, n, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return v * h * (1 if shape["tie_word_embeddings"] else 2) + n * per_layer + h


def build_model_dir(root: Path, name: str) -> Path:
    """A directory vLLM loads with load_format="dummy": config.json (+ generation_config.json)."""
    path = Path(root) / f"model-{name}"
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCH], "model_type": "llama", "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **SHAPES[name],
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def install_plugin(root: Path) -> Path:
    """Put a `vllm.general_plugins` entry point for `register` on PYTHONPATH (this process and
    its children) and register in this process too."""
    site = Path(root) / "bench-plugin"
    dist = site / PLUGIN_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-bench-kwargs-llama\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nomni_bench_kwargs_llama = "
                                           "bench.gpu_models:register\n")
    repo = str(Path(__file__).resolve().parents[1])
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([repo, str(site), *[p for p in parts if p not in (repo, str(site))]])
    if str(site) not in sys.path:
        sys.path.append(str(site))
    register()
    return site


def register() -> None:
    """vLLM plugin: the bench's kwargs-taking Llama (the class itself: a lazy "module:Class"
    entry would be inspected in a subprocess of its own, seconds per engine)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, globals().get(ARCH) or __getattr__(ARCH))


def __getattr__(name: str):
    if name == ARCH:  # defined on first use: importing this module must not import vLLM
        cls = _define()
        globals()[ARCH] = cls
        return cls
    raise AttributeError(name)


def _define() -> type:
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class BenchKwargsLlamaForCausalLM(LlamaForCausalLM):
        """Upstream Llama taking vllm-omni's extra forward kwargs; counts the steps that had them."""

        kwargs_steps = 0
        gc_probe: "GcProbe | None" = None

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                    runtime_additional_information=None, request_token_spans=None, **_: object):
            probe = self.gc_probe
            if probe is None and os.environ.get(GC_PROBE_ENV):
                probe = self.gc_probe = GcProbe(Path(os.environ[GC_PROBE_ENV]))
            if probe is not None:
                probe.forward()
            if runtime_additional_information is not None:
                self.kwargs_steps += 1
                if self.kwargs_steps == 1 and os.environ.get(KWARGS_MARK_ENV):  # once: proof they arrived
                    Path(os.environ[KWARGS_MARK_ENV]).write_text(json.dumps(
                        {"rows": len(runtime_additional_information), "spans": request_token_spans}))
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    BenchKwargsLlamaForCausalLM.__module__ = __name__
    BenchKwargsLlamaForCausalLM.__qualname__ = ARCH
    return BenchKwargsLlamaForCausalLM


class GcProbe:
    """The engine process's cycle collections (by generation) and their pauses, over the engine's life
    (warm-up included, the same for every engine), rewritten to a file at most every GC_PROBE_WRITE_S
    by the forward: what the collector costs each engine per step, plain's included (its worker is
    vLLM's own, which no bench call reaches; the model is the bench's in every engine)."""

    def __init__(self, path: Path) -> None:
        import gc
        import time

        self.path = path
        self.collections = [0, 0, 0]
        self.pause_us = [0.0, 0.0, 0.0]
        self.forwards = 0
        # Bound now: the callback also runs while the interpreter shuts down, when imports fail.
        self._clock, self._monotonic = time.perf_counter, time.monotonic
        self._started: float | None = None
        self._write_due = 0.0
        gc.callbacks.append(self._collected)

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            generation = int(info.get("generation", 2))
            self.collections[generation] += 1
            self.pause_us[generation] += (self._clock() - self._started) * 1e6
            self._started = None

    def forward(self) -> None:
        self.forwards += 1
        now = self._monotonic()
        if now >= self._write_due:
            self._write_due = now + GC_PROBE_WRITE_S
            self.path.write_text(json.dumps({"forwards": self.forwards, "collections": self.collections,
                                             "pause_us": [round(us, 1) for us in self.pause_us]}))


def read_gc_probe(path: Path) -> dict | None:
    """An engine's collector figures per forward (None where its probe wrote nothing)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    forwards = max(1, int(raw["forwards"]))
    return {"forwards": raw["forwards"], "collections": raw["collections"], "pause_us": raw["pause_us"],
            "per_1000_forwards": [round(1000 * n / forwards, 2) for n in raw["collections"]],
            "pause_us_per_forward": round(sum(raw["pause_us"]) / forwards, 2)}


def engine_kwargs(model_dir: Path, *, smoke: bool, graphs: str, num_seqs: int) -> dict:
    """LLM(...) arguments; the same for plain and shim except the worker and the graph mode."""
    common = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, seed=0,
                  max_model_len=512, max_num_seqs=num_seqs, enable_prefix_caching=False)
    if smoke:  # CPU: V2's kernels in Triton's interpreter
        return {**common, "dtype": "float32", "enforce_eager": True, "max_num_batched_tokens": 64,
                "kv_cache_memory_bytes": 64 << 20}
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if s <= num_seqs]
    return {**common, "dtype": "bfloat16", "max_num_batched_tokens": 1024,
            # Both engines share one GPU: each asks a share (vLLM checks free memory >= share at start)
            # and a fixed KV cache, the same for both.
            "gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 2 << 30,
            "compilation_config": {"cudagraph_mode": graphs, "cudagraph_capture_sizes": sizes}}


def omni_hook_options(name: str) -> list[str]:
    """The omni hook set working every step: extra kwargs (a blocking plan each step), hidden
    states and two captured layers per token, prefill overlays (the requests' prompt_embeds)."""
    layers = SHAPES[name]["num_hidden_layers"]
    return ["extra_kwargs=1", f"hidden_layers=0,{layers // 2}"]
