"""The pipeline config: a small TOML file (deploy/speech/*.toml) naming the stages and the speech model.

```toml
served_model_name = "qwen3-tts-tiny"      # what /v1/models lists and requests name
voices = ["default", "vivian"]            # the first is the default voice
max_input_chars = 4096
speech_prompt = "pkg.module:function"     # text + voice -> the talker's prompt ids and payload; or a class
                                          # built with the first stage's spec that reads its model's voices,
                                          # languages and instructions (omni_serve/speech/prompts.py;
                                          # omni_serve.speech.qwen3_tts:Qwen3TTSPrompt): then no voices here
thinker_prompt = "pkg.module:function"    # instead, with a thinker stage: messages + voice -> the thinker's
                                          # prompt ids and payload (`/v1/chat/completions`'s conversation;
                                          # /v1/audio/speech's input is one user message)
register = ["pkg.module:function"]       # run in every vLLM process before a model loads
sample_rate = 24000
talker_prompt = "pkg.module:function"     # with a thinker stage: its ThinkerOutput -> the talker's prompt and payload

[stages.thinker]                          # optional: thinker, talker, code2wav (the demo's shape); thinker_prompt
                                          # then makes the thinker's prompt
[stages.talker]                           # talker, then code2wav (the Qwen3-TTS shape)
model = "path/or/hf-id"
build = "pkg.module:function"             # optional: makes `model` if it is missing (tiny models)
device = 0                                # optional GPU index (CUDA_VISIBLE_DEVICES of its engine)
max_tokens = 64                           # codec frames a request may make at most (a thinker's: its tokens,
                                          # the most a chat request's max_tokens may ask)
engine = { max_model_len = 256 }          # vLLM engine arguments (AsyncEngineArgs fields); hf_overrides
                                          # may name a function ("pkg.module:function") as vLLM takes one
sampling = { temperature = 0.0 }          # SamplingParams fields
sidecar = { hooks = "omni-talker" }       # started here; or endpoint = "ipc://..." + attach = true

[stages.code2wav]
placeholder_token = 1
# the sidecar's hook options, which the server cuts the codes by too: chunk_frames, left_context and
# initial_chunk_frames (a shorter first chunk: the first audio after that many frames)
sidecar = { hooks = "omni-code2wav", options = { chunk_frames = "4", left_context = "8", initial_chunk_frames = "1" } }
```
Relative paths (model, build target) are relative to the config file's directory. A built-in
pipeline is named instead of a file (omni_serve/pipelines/: `qwen3-tts`); `omni-serve --model` puts
every stage on one checkpoint.
`thinker_prompt`'s messages are OpenAI's chat messages with their text only:
`[{"role": "system" | "developer" | "user" | "assistant", "content": "text"}, ...]`; the voice is
its index in `voices`.
"""

from __future__ import annotations

import dataclasses
import importlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

STAGE_ORDERS = (("talker", "code2wav"), ("thinker", "talker", "code2wav"))
PIPELINES = Path(__file__).resolve().parent / "pipelines"  # the built-in ones, by name: qwen3-tts


class ConfigError(ValueError):
    pass


@dataclass
class SidecarSpec:
    hooks: str = ""
    options: dict[str, str] = field(default_factory=dict)
    endpoint: str = ""  # empty: a socket in the server's run directory
    attach: bool = False  # True: one is already running there (compose, systemd): never started or stopped here
    curve_keys: str = ""


@dataclass
class StageSpec:
    name: str
    model: str
    build: str = ""
    device: int | None = None
    max_tokens: int = 64
    placeholder_token: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    sidecar: SidecarSpec = field(default_factory=SidecarSpec)


@dataclass
class ServeConfig:
    served_model_name: str
    stages: dict[str, StageSpec]
    voices: list[str] = field(default_factory=lambda: ["default"])
    max_input_chars: int = 4096
    speech_prompt: str = ""
    thinker_prompt: str = ""
    register: list[str] = field(default_factory=list)
    sample_rate: int = 24000
    talker_prompt: str = ""
    path: Path = Path(".")
    voices_given: bool = True  # False: the file names none (the default, or the speech prompt's own)


def load_callable(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{spec!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{spec!r}: {exc}") from None


def _fields(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def check_voices(voices: list[str], where: str) -> None:
    """A request names a voice in any case: two voices differing only in case would be one."""
    if len({v.lower() for v in voices}) != len(voices):
        raise ConfigError(f"{where}: voices {voices} name one voice twice (voices match in any case)")


def pipeline_file(named: str) -> Path:
    """A pipeline file's path, or a built-in pipeline's name (omni_serve/pipelines/NAME.toml)."""
    built_in = PIPELINES / f"{named}.toml"
    return built_in if _a_name(named) and built_in.is_file() else Path(named)


def _a_name(named: str) -> bool:
    return "/" not in named and not named.endswith(".toml")


def built_in_pipelines() -> list[str]:
    return sorted(p.stem for p in PIPELINES.glob("*.toml"))


def with_model(config: ServeConfig, model: str, served_model_name: str | None = None) -> ServeConfig:
    """Every stage on `model` (one checkpoint holds them all, as a Qwen3-TTS or Qwen3-Omni one does),
    served under its name unless another is given (as `vllm serve MODEL` serves it)."""
    local = Path(model).expanduser()
    path = str(local.resolve()) if local.exists() else model
    stages = {name: dataclasses.replace(stage, model=path, build="") for name, stage in config.stages.items()}
    return dataclasses.replace(config, stages=stages, served_model_name=served_model_name or model)


def load_config(path: str | Path) -> ServeConfig:
    named, path = str(path), pipeline_file(str(path)).resolve()
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        hint = f" (built-in pipelines: {', '.join(built_in_pipelines())})" if _a_name(named) else ""
        raise ConfigError(f"{path}: {exc}{hint}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    top = {"served_model_name", "voices", "max_input_chars", "speech_prompt", "thinker_prompt", "register",
           "sample_rate", "stages", "talker_prompt"}
    _fields(raw, top, str(path))
    stages_raw = raw.get("stages", {})
    if tuple(stages_raw) not in STAGE_ORDERS:
        orders = " or ".join(" then ".join(order) for order in STAGE_ORDERS)
        raise ConfigError(f"{path}: [stages] must be {orders} (got {list(stages_raw)})")
    if ("thinker" in stages_raw) != bool(raw.get("talker_prompt")):
        raise ConfigError(f"{path}: talker_prompt is required with a thinker stage, and only with one")
    # One prompt function per pipeline: the first stage's.
    first_prompt = "thinker_prompt" if "thinker" in stages_raw else "speech_prompt"
    other_prompt = "speech_prompt" if "thinker" in stages_raw else "thinker_prompt"
    if other_prompt in raw:
        raise ConfigError(f"{path}: {other_prompt} is for a pipeline {'without' if 'thinker' in stages_raw else 'with'} "
                          f"a thinker stage; this one takes {first_prompt}")
    stages = {}
    for name, table in stages_raw.items():
        _fields(table, set(StageSpec.__dataclass_fields__) - {"name"}, f"{path} [stages.{name}]")
        sidecar = dict(table.get("sidecar", {}))
        _fields(sidecar, set(SidecarSpec.__dataclass_fields__), f"{path} [stages.{name}.sidecar]")
        sidecar["options"] = {k: str(v) for k, v in sidecar.get("options", {}).items()}
        if "model" not in table:
            raise ConfigError(f"{path} [stages.{name}]: no model")
        model = table["model"]
        if model.startswith((".", "/")) or (path.parent / model).exists():
            model = str((path.parent / model).resolve())
        stages[name] = StageSpec(name=name, **{**table, "model": model, "sidecar": SidecarSpec(**sidecar)})
    voices = [str(v) for v in raw.get("voices", ["default"])]
    if not voices:
        raise ConfigError(f"{path}: voices must name at least one voice")
    check_voices(voices, str(path))
    if "served_model_name" not in raw or first_prompt not in raw:
        raise ConfigError(f"{path}: served_model_name and {first_prompt} are required")
    return ServeConfig(served_model_name=raw["served_model_name"], stages=stages, voices=voices,
                       max_input_chars=int(raw.get("max_input_chars", 4096)),
                       speech_prompt=raw.get("speech_prompt", ""), thinker_prompt=raw.get("thinker_prompt", ""),
                       register=list(raw.get("register", [])), sample_rate=int(raw.get("sample_rate", 24000)),
                       talker_prompt=raw.get("talker_prompt", ""), path=path, voices_given="voices" in raw)
