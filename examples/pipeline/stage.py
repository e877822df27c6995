"""One stage of the pipeline in its own process: `python -m examples.pipeline.stage NAME CONFIG`.

`CONFIG` (JSON, written by examples/demo.py) names the run directory, the mode (`stream`:
stages run at once and stream into each other; `by-hand`: each waits for the previous one
to finish and takes its whole output), each stage's model and sidecar endpoint, the
requests and their sizes. The stage writes `NAME.MODE.json` into the run directory (and the
code2wav stage a WAV per request).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from examples.pipeline.common import (INPUT_POLL_S, Appends, Progress, StepTimes, finish, gated_step, make_engine,
                                      set_environment, shim_figures, wait_for_go, write_result)
from examples.pipeline.feeds import Feed, pull_all, wait_ended


def run_thinker(config: dict[str, Any]) -> None:
    from vllm import SamplingParams

    from tests.support.vl_model import register
    from tests.tiny_models.vl import tiny_image, vl_prompt

    register()
    llm = make_engine(config, "thinker", max_num_batched_tokens=config["batched_tokens"], max_num_seqs=8,
                      limit_mm_per_prompt={"image": 1})
    engine, times = llm.llm_engine, StepTimes()
    params = SamplingParams(max_tokens=config["thinker_max_tokens"], temperature=0.0, ignore_eos=True)
    go = wait_for_go(config, "thinker")
    for req in config["requests"]:
        engine.add_request(req["id"], {"prompt": vl_prompt(req["text"]),
                                       "multi_modal_data": {"image": tiny_image(req["image_seed"])}}, params)
    done: dict[str, Any] = {}
    delay = float(config.get("thinker_delay_s", 0.0))
    while engine.has_unfinished_requests():
        if delay:  # a thinker as much slower than its talker as a real one is
            time.sleep(delay)
        for out in times.step(engine):
            if out.finished:
                print(f"[thinker +{time.time() - go:7.3f}s] {out.request_id} finished", flush=True)
                done[out.request_id] = {"text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids),
                                        "prompt_len": len(out.prompt_token_ids), "finished_s": time.time() - go}
    write_result(config, "thinker", {"steps": times.summary(), "shim": shim_figures(llm), "requests": done})
    finish(llm)


def talker_inputs(feed: Feed, width: int, whole: bool) -> tuple[list[int], dict[str, Any]]:
    """The talker's prompt (one codec row per thinker prompt row) and payload: the thinker's prompt
    rows (`whole`: all its rows) cut to the width the talker reads, and `tts_pad` from the prompt."""
    from tests.tiny_models.talker import CODEC_BOS_ID, CODEC_PAD_ID

    prompt_len = int(feed.values["prompt_len"])
    rows = feed.all_rows()[:, :width].contiguous()
    text = rows if whole else rows[:prompt_len]
    info = {"hidden_states": {"output": text}, "embed": {"tts_pad": rows[:prompt_len].mean(dim=0, keepdim=True)}}
    return [CODEC_BOS_ID] + [CODEC_PAD_ID] * (prompt_len - 1), info


def run_talker(config: dict[str, Any]) -> None:
    from vllm import SamplingParams

    from tests.tiny_models import talker as tiny_talker
    from omni_sidecar.client import SidecarClient

    tiny_talker.register()
    width = tiny_talker.TALKER_CONFIG["thinker_hidden_size"]
    llm = make_engine(config, "talker", skip_tokenizer_init=True, max_num_batched_tokens=config["batched_tokens"],
                      max_num_seqs=8)
    engine, times = llm.llm_engine, StepTimes()
    stream = config["mode"] == "stream"
    go = wait_for_go(config, "talker")
    added, ended, appended = {}, {}, {}  # seconds from the start: added here, finished here; appends sent
    progress = Progress("talker", go)
    feeds = {r["id"]: Feed(r["id"], "hidden_states", source_id=r.get("thinker_id", r["id"]))
             for r in config["requests"]}
    appends = Appends(config["endpoints"]["talker"], llm)
    with SidecarClient(config["endpoints"]["thinker"]) as previous, SidecarClient(config["endpoints"]["talker"]) as own:
        if not stream:
            wait_ended(list(feeds.values()), previous, INPUT_POLL_S)

        def add(feed: Feed) -> None:
            prompt, info = talker_inputs(feed, width, whole=not stream)
            engine.add_request(feed.req_id, {"prompt_token_ids": prompt}, SamplingParams(
                max_tokens=config["talker_max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                extra_args={"omni_sidecar": {"additional_information": encode(info)}}))
            feed.added = True
            feed.sent = feed.count - len(prompt) if not stream else 0
            added[feed.req_id] = time.time() - go
            progress.note(f"{feed.req_id} added: {len(prompt)} prompt rows, {feed.count} thinker rows in")

        def feed_rows(feed: Feed) -> None:
            """Thinker rows past the prompt not sent yet: appended as `embed.decode` rows."""
            past = feed.all_rows()[int(feed.values["prompt_len"]):, :width].contiguous()
            if past.shape[0] > feed.sent:
                appends.send(feed.req_id, {"embed": {"decode": past[feed.sent:], "decode_token_start": feed.sent}})
                appended[feed.req_id] = appended.get(feed.req_id, 0) + 1
                feed.sent = int(past.shape[0])

        def ready(feed: Feed) -> bool:
            """Its next step reads thinker row `generated - 1` past the prompt (none while prefilling)."""
            return feed.generated == 0 or feed.ended or feed.generated - 1 < feed.sent

        while not all(f.finished for f in feeds.values()):
            if stream:
                if pull_all([f for f in feeds.values() if not f.finished], previous):
                    progress.note()
                for feed in feeds.values():
                    if not feed.added and "prompt_len" in feed.values and feed.count >= feed.values["prompt_len"]:
                        add(feed)
                    elif feed.live and feed.admitted_by(own):
                        feed_rows(feed)
            else:
                for feed in feeds.values():
                    if not feed.added:
                        add(feed)
            done = gated_step(engine, feeds, ready, times, appends, progress, lambda r: (
                f"{r} finished: {feeds[r].generated} tokens, {appended.get(r, 0)} appends of thinker rows"))
            ended.update({req_id: time.time() - go for req_id in done or []})
        appends.close()
        codes = {r: own.outputs(r)["codes.audio"].tolist() for r in feeds}
    write_result(config, "talker", {"steps": times.summary(), "shim": shim_figures(llm), "codes": codes,
                                    "added_s": added, "finished_s": ended, "appends": appended})
    finish(llm)


def run_code2wav(config: dict[str, Any]) -> None:
    from vllm import SamplingParams

    from tests.tiny_models import code2wav as tiny_code2wav
    from omni_sidecar.client import SidecarClient
    from omni_sidecar.hook_sets.omni.code2wav import num_chunks

    tiny_code2wav.register()
    chunk = config["chunk_frames"]
    # Eager on a GPU too: its forward decodes each request's chunk from the step's runtime info in
    # Python (shapes vary per chunk); a CUDA graph replay would not run that code again.
    llm = make_engine(config, "code2wav", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=8,
                      max_num_batched_tokens=64, enforce_eager=True)
    engine, times = llm.llm_engine, StepTimes()
    stream = config["mode"] == "stream"
    go = wait_for_go(config, "code2wav")
    feeds = {r["id"]: Feed(r["id"], "codes.audio") for r in config["requests"]}
    audio = {r: Feed(r, "waveform") for r in feeds}  # this stage's own output, followed for the first audio
    first_audio: dict[str, float] = {}
    added, ended, appended, whole_at_add = {}, {}, {}, {}
    progress = Progress("code2wav", go)
    appends = Appends(config["endpoints"]["code2wav"], llm)
    with SidecarClient(config["endpoints"]["talker"]) as previous, SidecarClient(config["endpoints"]["code2wav"]) as own:
        if not stream:
            wait_ended(list(feeds.values()), previous, INPUT_POLL_S)

        def add(feed: Feed) -> None:
            frames = feed.all_rows()
            # Streaming: the clock covers as many frames as the talker can make (its max_tokens).
            clock = num_chunks(config["talker_max_tokens"] if stream else int(frames.shape[0]), chunk)
            meta = {"codec_streaming": True, "codec_final": feed.ended} if stream else {}
            engine.add_request(feed.req_id, {"prompt_token_ids": [tiny_code2wav.PLACEHOLDER_TOKEN]}, SamplingParams(
                max_tokens=clock, temperature=0.0, ignore_eos=True, detokenize=False,
                extra_args={"omni_sidecar": {"additional_information": encode(
                    {"codes": {"audio": frames}, "meta": meta})}}))
            feed.added, feed.sent = True, int(frames.shape[0])
            added[feed.req_id] = time.time() - go
            whole_at_add[feed.req_id] = feed.ended
            progress.note(f"{feed.req_id} added: {feed.sent} frames in, clock {clock} chunks")
            feed.values["final_sent"] = feed.ended or not stream

        def feed_frames(feed: Feed) -> None:
            update: dict[str, Any] = {}
            if feed.count > feed.sent:
                update["codes"] = {"audio": feed.all_rows()}  # replaces the frames so far
            if feed.ended and not feed.values.get("final_sent"):
                update["meta"] = {"codec_final": True}
            if update:
                appends.send(feed.req_id, update)
                appended[feed.req_id] = appended.get(feed.req_id, 0) + 1
                feed.sent = feed.count
                feed.values["final_sent"] = feed.ended

        def ready(feed: Feed) -> bool:
            """Its next step decodes chunk `generated`: all its frames there, or the frames final."""
            return bool(feed.values.get("final_sent")) or feed.sent >= (feed.generated + 1) * chunk

        while not all(f.finished for f in feeds.values()):
            pending = [f for f in feeds.values() if not f.finished]
            if stream and pull_all(pending, previous):
                progress.note()
            for feed in pending:
                if not feed.added and (feed.count >= chunk or (feed.ended and feed.count)):
                    add(feed)
                elif feed.live and feed.admitted_by(own):
                    feed_frames(feed)
                elif feed.ended and not feed.count:
                    feed.finished = True  # the talker made no frames: nothing to decode
            done = gated_step(engine, feeds, ready, times, appends, progress, lambda r: (
                f"{r} finished: {feeds[r].count} frames decoded in {feeds[r].generated} steps"))
            if done is None:
                continue
            ended.update({req_id: time.time() - go for req_id in done})
            for req_id in [f.req_id for f in feeds.values() if f.added and f.req_id not in first_audio]:
                audio[req_id].pull(own)
                if audio[req_id].count:
                    first_audio[req_id] = time.time() - go
                    progress.note(f"{req_id} first audio")
        appends.close()
        waves = {}
        for req_id in feeds:
            got = own.outputs(req_id) or {}
            wave = got.get("waveform")
            waves[req_id] = {"waveform": [] if wave is None else wave.reshape(-1).tolist(),
                             "sr": int(got["sr"]) if "sr" in got else None}
    for req_id, got in waves.items():
        if got["waveform"]:
            write_wav(Path(config["run_dir"]) / f"{req_id}.{config['mode']}.wav", got["waveform"], got["sr"])
    write_result(config, "code2wav", {"steps": times.summary(), "shim": shim_figures(llm), "audio": waves,
                                      "first_audio_s": first_audio, "wall_s": time.time() - go,
                                      "added_s": added, "finished_s": ended, "appends": appended,
                                      "whole_at_add": whole_at_add})
    finish(llm)


def encode(info: dict[str, Any]) -> dict[str, Any]:
    from omni_sidecar.hook_sets.omni.wire import encode_additional_information

    return encode_additional_information(info)


def write_wav(path: Path, samples: list[float], rate: int) -> None:
    """16-bit mono PCM, peak-normalised (random weights give no meaningful level)."""
    import wave

    import numpy as np

    data = np.asarray(samples, dtype=np.float32)
    peak = float(np.abs(data).max()) or 1.0
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(int(rate))
        out.writeframes((data / peak * 32767).astype("<i2").tobytes())


RUNNERS = {"thinker": run_thinker, "talker": run_talker, "code2wav": run_code2wav}


def main(name: str, config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    set_environment(bool(config.get("cuda")))
    try:
        RUNNERS[name](config)
    except BaseException as exc:  # the demo reads it from the result file
        import traceback

        write_result(config, name, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
