"""vllm-omni's own voice store on a directory: its `upload_voice` / `upload_voice_embedding` for the uploads
a plan names, then its `_restore_uploaded_speakers` and loaders over every file there; what it read as JSON
in the result file. Its speech serving module imported with its package's __init__ and patches not run, in a process
of its own (its modules register Prometheus metrics once a process). Beside vLLM 0.26 and vllm-omni 0.26.

Usage: python -m tests.support.uploaded_voices_job DIRECTORY PLAN.json RESULT.json
  PLAN: {"clips": [[file, name, consent, ref_text]], "embeddings": [[name, consent, [floats]]]}
"""

from __future__ import annotations

import asyncio
import importlib
import io
import json
import sys
from pathlib import Path

from tests.support.paired_vllm_omni import VLLM_OMNI
from tests.support.procs import ROOT


def serving_speech_class() -> type:
    from worker_shim.omni_models.package import stand_in_module

    sys.path.insert(0, str(ROOT / "tests" / "support" / "torchaudio_stub"))  # its audio mixin imports torchaudio
    sys.modules["vllm_omni"] = stand_in_module(VLLM_OMNI / "vllm_omni")
    for sub in ("entrypoints", "entrypoints.openai"):  # their __init__s import its whole API server
        module = stand_in_module(VLLM_OMNI / "vllm_omni" / sub.replace(".", "/"))
        module.__name__ = f"vllm_omni.{sub}"
        sys.modules[f"vllm_omni.{sub}"] = module
    return importlib.import_module("vllm_omni.entrypoints.openai.serving_speech").OmniOpenAIServingSpeech


def store(cls: type, directory: Path):
    """vllm-omni's server as far as its voice store goes: the attributes its __init__ sets for it."""
    server = object.__new__(cls)
    server.uploaded_speakers_dir = directory
    server.uploaded_speakers = {}
    server.supported_speakers = set()
    server._last_upload_ts = 0
    server._max_uploaded_speakers = 1000
    server._upload_lock = asyncio.Lock()
    server._ref_audio_data_url_cache = {}
    server._tts_model_type = "qwen3_tts_without_an_engine"  # its embedding width check needs an engine: skipped
    return server


async def upload(server, plan: dict) -> None:
    from starlette.datastructures import Headers, UploadFile

    for file, name, consent, ref_text in plan.get("clips", []):
        clip = UploadFile(io.BytesIO(Path(file).read_bytes()), filename=Path(file).name,
                          headers=Headers({"content-type": "audio/wav"}))
        await server.upload_voice(clip, consent, name, ref_text=ref_text)
    for name, consent, values in plan.get("embeddings", []):
        await server.upload_voice_embedding(json.dumps(values), consent, name)


def main(directory: str, plan_path: str, result_path: str) -> None:
    cls = serving_speech_class()
    asyncio.run(upload(store(cls, Path(directory)), json.loads(Path(plan_path).read_text())))
    reader = store(cls, Path(directory))
    reader._restore_uploaded_speakers()
    read = {}
    for key, info in reader.uploaded_speakers.items():
        entry = {"name": info.get("name"), "ref_text": info.get("ref_text"),
                 "embedding_source": info.get("embedding_source")}
        loaded = reader._load_uploaded_audio(key)
        if loaded is not None:
            entry.update(samples=loaded[0].astype("float32").tolist(), rate=int(loaded[1]))
        embedding = reader._get_uploaded_speaker_embedding(key)
        if embedding is not None:
            entry["embedding"] = embedding
        read[key] = entry
    Path(result_path).write_text(json.dumps(read))


if __name__ == "__main__":
    main(*sys.argv[1:])
