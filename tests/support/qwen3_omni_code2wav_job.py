"""omni-serve's code2wav hand-over on vllm-omni's Qwen3-Omni code2wav stage: one process, run by
tests/test_e2e_serve_qwen3_omni.py beside vllm-omni 0.26 on vLLM 0.26.

The stage as omni-serve starts it (its sidecar through `SidecarProcess`, its engine through
`start_engine`, deploy/speech/qwen3-omni-gpu.toml's stage sized for CPU) and the pipeline's own
code2wav part (`SpeechPipeline._run_code2wav`: one one-step request per chunk, each a window of the
frames with its left context) on the given codes, as if a talker had made them; writes each chunk's
waveform.
Usage: python -m tests.support.qwen3_omni_code2wav_job job.json result.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path


async def run(job: dict) -> list[list[float]]:
    import numpy as np

    from omni_serve.config import SidecarSpec, StageSpec
    from omni_serve.speech.pipeline import Frames, SpeechJob, SpeechPipeline, Stage
    from omni_serve.stages.engines import start_engine
    from omni_serve.stages.link import AsyncSidecarClient
    from omni_serve.stages.sidecars import SidecarProcess
    from proto.chunk_grid import ChunkGrid

    options = {"chunk_frames": str(job["chunk_frames"]), "left_context": str(job["left_context"]),
               "initial_chunk_frames": str(job["initial_chunk_frames"]), "codebook_size": "2048"}
    spec = StageSpec("code2wav", job["model"], engine=job["engine"],
                     sidecar=SidecarSpec(hooks="omni-code2wav", options=options))
    with tempfile.TemporaryDirectory() as run_dir:
        sidecar = SidecarProcess("code2wav", spec.sidecar, Path(run_dir))
        await sidecar.start()
        engine = None
        try:
            engine = await asyncio.to_thread(start_engine, spec, sidecar.endpoint, "", await sidecar.needs())
            link = AsyncSidecarClient(sidecar.endpoint)
            pipeline = SpeechPipeline(Stage("talker", None, link), Stage("code2wav", engine, link),
                                      ChunkGrid(job["chunk_frames"], job["initial_chunk_frames"]), job["left_context"],
                                      placeholder_token=0, codebook_size=2048)
            frames = Frames(codebook_size=2048)
            frames.set(np.asarray(job["codes"], dtype=np.int64))
            frames.ended = True
            talker = asyncio.create_task(asyncio.sleep(0))  # the talker has finished
            await talker
            try:
                chunks = [c.tolist() async for c in pipeline._run_code2wav(SpeechJob("r0", [0], {}, 0), frames, talker)]
            finally:
                await pipeline.close()
                link.close()
            return chunks
        finally:
            if engine is not None:
                engine.shutdown()
            await sidecar.stop()


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    result: dict = {}
    try:
        result["chunks"] = asyncio.run(run(job))
    except Exception as exc:  # the test reads it
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
