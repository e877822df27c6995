"""omni-serve without engines: request validation, the WAV/PCM encoding, the payload and the config."""

from __future__ import annotations

import base64
import json
import wave
from io import BytesIO
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from fastapi import WebSocket  # at module level: FastAPI resolves a route's annotations in the module

from omni_serve.api import audio
from omni_serve.api.protocol import Refused
from omni_serve.api.server import speech_input
from omni_serve.config import ConfigError, ServeConfig, StageSpec, load_config
from omni_serve.speech.prompts import TextVoicePrompt
from omni_serve.stages.payload import additional_information

CONFIG = ServeConfig(served_model_name="tts", voices=["a", "b"], max_input_chars=10, speech_prompt="unused",
                     stages={"talker": StageSpec("talker", "m", max_tokens=32),
                             "code2wav": StageSpec("code2wav", "m")})


def text_voice(text: str, voice: int) -> tuple[list[int], dict]:
    return [voice, len(text)], {"text": text}


prompt = TextVoicePrompt(text_voice, CONFIG.voices)


def parse(body) -> object:
    return speech_input(body if isinstance(body, bytes) else json.dumps(body).encode(), CONFIG, prompt)


def refusal(body) -> Refused:
    with pytest.raises(Refused) as caught:
        parse(body)
    return caught.value


def test_a_good_request_becomes_a_job_with_the_voice_and_the_limits():
    got = parse({"model": "tts", "input": " hi ", "voice": "b", "response_format": "pcm", "max_new_tokens": 5,
                 "seed": 3})
    # The input as sent (vllm-omni's talker reads it so), voice index 1.
    assert got.job.prompt_token_ids == [1, 4] and got.job.payload == {"text": " hi "}
    assert (got.job.max_frames, got.job.seed, got.response_format, got.stream) == (5, 3, "pcm", False)
    defaults = parse({"input": "hi"})
    assert defaults.job.prompt_token_ids[0] == 0 and defaults.job.max_frames == 32
    assert defaults.response_format == "wav" and defaults.job.request_id != got.job.request_id
    # vllm-omni's spellings: "speaker" for the voice, a voice object, explicit nulls and falses.
    assert parse({"input": "hi", "speaker": "b"}).job.prompt_token_ids[0] == 1
    assert parse({"input": "hi", "voice": {"id": "b"}}).job.prompt_token_ids[0] == 1
    assert parse({"input": "hi", "instructions": None, "word_timestamps": False, "language": "Auto"}).stream is False
    assert parse({"input": "hi", "x_vector_only_mode": False}).stream is False  # cloning's ICL path: not reached
    streamed = parse({"input": "hi", "stream": True})
    assert streamed.stream and streamed.sse  # vllm-omni's default stream: SSE
    assert not parse({"input": "hi", "stream": True, "stream_format": "audio"}).sse


def test_what_vllm_omnis_own_clients_send_is_served():
    # A stream_format alone streams (vllm-omni's rule; the OpenAI SDK sends no `stream`).
    raw = parse({"input": "hi", "stream_format": "audio"})
    assert (raw.stream, raw.sse) == (True, False)
    sse = parse({"input": "hi", "stream_format": "sse", "stream": False})
    assert (sse.stream, sse.sse) == (True, True)
    # Voices in any case (vllm-omni lowercases them; its client sends "Vivian").
    assert parse({"input": "hi", "voice": "B"}).job.prompt_token_ids[0] == 1
    assert parse({"input": "hi", "speaker": "A"}).job.prompt_token_ids[0] == 0
    # Its examples' explicit defaults: the task this server serves, the language in any case, an empty
    # instruction, speed null, the model's own sample rate.
    got = parse({"input": "hi", "task_type": "CustomVoice", "language": "AUTO", "instructions": "", "speed": None,
                 "sample_rate": CONFIG.sample_rate})
    assert (got.stream, got.job.prompt_token_ids) == (False, [0, 2])
    # vLLM's benchmark client (vllm-omni's speech backend) with --ignore-eos: every frame the talker may make.
    bench = parse({"model": "tts", "input": "hi", "stream": True, "stream_format": "audio", "response_format": "pcm",
                   "ignore_eos": True})
    assert bench.stream and not bench.sse and bench.job.sampling == {"talker": {"ignore_eos": True}}
    assert parse({"input": "hi", "ignore_eos": False}).job.sampling == {}
    # The formats soundfile writes, whole answers only (as vllm-omni).
    assert [parse({"input": "hi", "response_format": f}).response_format for f in ("flac", "mp3", "opus")] == [
        "flac", "mp3", "opus"]


@pytest.mark.parametrize("body, status, param, needle", [
    ({"input": ""}, 400, "input", "input is empty"),
    ({"input": "x" * 11}, 400, "input", "11 characters; at most 10"),
    ({"input": "hi", "voice": "c"}, 400, "voice", "unknown voice 'c'; voices: a, b"),
    ({"input": "hi", "response_format": "aac"}, 400, "response_format", "'aac' is not supported"),
    ({"input": "hi", "response_format": "flac", "stream": True}, 400, "response_format", "a stream is wav or pcm"),
    ({"input": "hi", "response_format": "mp3", "stream_format": "audio"}, 400, "response_format", "for a whole answer"),
    ({"input": "hi", "sample_rate": 8000}, 400, "sample_rate", "this model makes 24000 Hz"),
    ({"input": "hi", "response_format": "opus", "sample_rate": 8000}, 400, "sample_rate", "this model makes"),
    ({"input": "hi", "model": "other"}, 404, "model", "not served here"),
    ({"input": "hi", "speed": 1.5}, 400, "speed", "speed"),
    ({"input": "hi", "speed": 0.1}, 400, "speed", "greater than or equal to 0.25"),
    ({"input": "hi", "language": "French"}, 400, "language", "not supported"),
    ({"input": "hi", "word_timestamps": True}, 400, "word_timestamps", "word_timestamps"),
    ({"input": "hi", "instructions": "slowly"}, 400, "instructions", "not supported by this model"),
    ({"input": "hi", "top_k": 0}, 400, "top_k", "top_k"),
    ({"input": "hi", "task_type": "Base"}, 400, "task_type", "task_type"),
    ({"input": "hi", "x_vector_only_mode": True}, 400, "x_vector_only_mode", "x_vector_only_mode"),
    ({"input": "hi", "non_streaming_mode": False}, 400, "non_streaming_mode", "non_streaming_mode"),
    ({"input": "hi", "initial_codec_chunk_frames": 2}, 400, "initial_codec_chunk_frames", "initial_codec_chunk_frames"),
    ({"input": "hi", "stream_format": "video"}, 400, "stream_format", "'sse' or 'audio'"),
    ({"input": "hi", "max_new_tokens": 33}, 400, "max_new_tokens", "limit of 32"),
    ({"input": "hi", "max_new_tokens": 0}, 400, "max_new_tokens", "greater than or equal to 1"),
    ({"input": 5}, 400, "input", "valid string"),
    ({}, 400, "input", "Field required"),
    (b"{", 400, None, "not valid JSON"),
    (b"\xff\xfe", 400, None, "not valid JSON"),
    (b"[" * 100_000, 400, None, "not valid JSON"),  # nested past the parser's recursion limit
    (b'"text"', 400, None, "JSON object"),
    # Strict JSON: Python's NaN and Infinity are not JSON; a lone surrogate is no text a tokenizer takes.
    (b'{"input": "hi", "speed": NaN}', 400, None, "NaN is not a JSON value"),
    (b'{"input": "hi", "speed": -Infinity}', 400, None, "-Infinity is not a JSON value"),
    (b'{"input": "hi \\ud800"}', 400, "input", "input is not Unicode text: it holds a lone surrogate"),
    (b'{"input": "hi", "instructions": "\\uDFFF!"}', 400, "instructions", "lone surrogate"),
    (b'{"input": "hi", "voice": {"id": ["\\ud9ab"]}}', 400, "voice.id[0]", "lone surrogate"),
    (b'{"input": "hi", "\\udc00": 1}', 400, "'\\udc00'", "lone surrogate"),
    ('{"input": "hi \\ud800"}'.encode("utf-16"), 400, "input", "lone surrogate"),  # json reads UTF-16 and -32 too
    ('{"input": "hi \\ud800"}'.encode("utf-32-le"), 400, "input", "lone surrogate"),
    (b'{"input": "hi", "speed": 1e999}', 400, None, "1e999 is past a float's range"),
])
def test_bad_requests_are_refused_with_one_message(body, status, param, needle):
    refused = refusal(body)
    assert (refused.status, refused.param) == (status, param)
    assert needle in str(refused) and "\n" not in str(refused)


def test_text_outside_the_basic_plane_and_escaped_backslashes_are_text():
    """A surrogate pair's escape is one character, and an escaped backslash before "ud800" is text."""
    assert parse(b'{"input": "hi \\ud83d\\ude00"}').job.payload == {"text": "hi \U0001F600"}
    assert parse(b'{"input": "C:\\\\ud800"}').job.payload == {"text": "C:\\ud800"}


def test_a_max_new_tokens_below_the_talkers_min_tokens_is_refused():
    """vLLM would refuse the talker's sampling once the request was under way; here it is the request's 400."""
    import dataclasses

    talker = dataclasses.replace(CONFIG.stages["talker"], sampling={"min_tokens": 6})
    config = dataclasses.replace(CONFIG, stages={**CONFIG.stages, "talker": talker})
    assert speech_input(b'{"input": "hi", "max_new_tokens": 6}', config, prompt).job.max_frames == 6
    with pytest.raises(Refused, match="max_new_tokens 5 is below the 6 frames this server's talker makes at least") as refused:
        speech_input(b'{"input": "hi", "max_new_tokens": 5}', config, prompt)
    assert refused.value.param == "max_new_tokens"


class SpokenPrompt:
    """A SpeechPrompt whose model speaks English and German and takes instructions: it records each call."""

    voices = ["a", "b"]
    languages = ["English", "German"]
    max_instructions_chars = 8
    instructions_required = False
    task_type = "CustomVoice"
    clones_voices = False
    speaker_embedding_size = 0

    def __init__(self, stage: StageSpec | None = None) -> None:
        self.calls: list[tuple] = []

    def __call__(self, text: str, voice: int, language: str, instructions: str,
                 reference: object = None) -> tuple[list[int], dict]:
        assert reference is None  # it clones no voice
        self.calls.append((text, voice, language, instructions))
        return [1, 2], {}

    def text_tokens(self, text: str, instructions: str) -> int:
        return len(text) + len(instructions)

    def max_frames(self, text: str) -> int | None:
        return None

    def reference_tokens(self, reference: object) -> int:
        return 0


def test_a_prompt_that_speaks_languages_and_takes_instructions_gets_them_as_vllm_omni_names_them():
    spoken = SpokenPrompt()
    counted = []
    for body in ({"input": "hi"}, {"input": "hi", "voice": "B", "language": "english", "instructions": "slowly"},
                 {"input": "hi", "language": " GERMAN ", "instructions": ""}, {"input": "hi", "language": "auto"}):
        counted.append(speech_input(json.dumps(body).encode(), CONFIG, spoken).job.input_tokens)
    assert counted == [2, 8, 2, 2]  # the usage's input tokens as the prompt counts them
    assert spoken.calls == [("hi", 0, "Auto", ""), ("hi", 1, "English", "slowly"), ("hi", 0, "German", ""),
                            ("hi", 0, "Auto", "")]
    for body, param, needle in (({"input": "hi", "language": "Klingon"}, "language", "supported: Auto, English, German"),
                                ({"input": "hi", "instructions": "very slowly"}, "instructions", "at most 8")):
        with pytest.raises(Refused) as caught:
            speech_input(json.dumps(body).encode(), CONFIG, spoken)
        assert caught.value.param == param and needle in str(caught.value), str(caught.value)
    assert len(spoken.calls) == 4  # a refused request makes no prompt


class CeilingPrompt(SpokenPrompt):
    """A SpeechPrompt whose model's answers are bounded by their text's length (vllm-omni's Base)."""

    def max_frames(self, text: str) -> int | None:
        return 5 * len(text)


def test_a_prompts_frame_ceiling_bounds_a_request_that_names_no_max_new_tokens():
    """Below the pipeline's limit (32 here); a request's own max_new_tokens is its own (vllm-omni's rule)."""
    frames = {text: speech_input(json.dumps({"input": text}).encode(), CONFIG, CeilingPrompt()).job.max_frames
              for text in ("hi", "x" * 10)}
    assert frames == {"hi": 10, "x" * 10: 32}
    asked = speech_input(json.dumps({"input": "hi", "max_new_tokens": 20}).encode(), CONFIG, CeilingPrompt())
    assert asked.job.max_frames == 20


def test_a_qwen3_tts_base_answer_is_bounded_as_vllm_omni_bounds_it():
    """vllm-omni 0.30's Base ceiling: 12 frames a text token, at least 192; other tasks none."""
    from types import SimpleNamespace

    from omni_serve.speech.qwen3_tts import Qwen3TTSPrompt

    def tokens(text: str) -> list[int]:
        return list(range(len(text.split())))

    base = SimpleNamespace(clones_voices=True, _tokens=tokens)
    assert Qwen3TTSPrompt.max_frames(base, "one two") == 192
    assert Qwen3TTSPrompt.max_frames(base, " ".join(["w"] * 20)) == 240
    assert Qwen3TTSPrompt.max_frames(SimpleNamespace(clones_voices=False, _tokens=tokens), "one") is None


class DescribedVoicePrompt(SpokenPrompt):
    """A SpeechPrompt of vllm-omni's VoiceDesign: no voices, the voice described in the instructions."""

    voices: list[str] = []
    instructions_required = True
    task_type = "VoiceDesign"


def test_a_prompt_whose_voice_is_described_takes_instructions_and_ignores_a_voice():
    described = DescribedVoicePrompt()
    config = ServeConfig(served_model_name="tts", voices=[], speech_prompt="unused", stages=CONFIG.stages)
    for body in ({"input": "hi", "instructions": "warm", "task_type": "VoiceDesign"},
                 {"input": "hi", "instructions": "warm", "voice": "alloy"}):  # the OpenAI SDK always sends one
        speech_input(json.dumps(body).encode(), config, described)
    assert described.calls == [("hi", 0, "Auto", "warm")] * 2
    for body, param, needle in (({"input": "hi"}, "instructions", "instructions are required"),
                                ({"input": "hi", "instructions": " "}, "instructions", "instructions are required"),
                                ({"input": "hi", "instructions": "warm", "task_type": "CustomVoice"}, "task_type",
                                 "it serves 'VoiceDesign'")):
        with pytest.raises(Refused) as caught:
            speech_input(json.dumps(body).encode(), config, described)
        assert caught.value.param == param and needle in str(caught.value), str(caught.value)


def test_an_input_whose_prompt_is_longer_than_the_first_engine_takes_is_refused():
    body = json.dumps({"input": "hi"}).encode()
    assert speech_input(body, CONFIG, prompt, max_prompt_tokens=2).job.prompt_token_ids == [0, 2]
    with pytest.raises(Refused) as caught:
        speech_input(body, CONFIG, prompt, max_prompt_tokens=1)
    assert (caught.value.status, caught.value.param) == (400, "input") and "a prompt of 2 tokens" in str(caught.value)


def test_wav_is_a_16_bit_mono_riff_of_the_samples_clipped():
    samples = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0], dtype=np.float32)
    body = audio.wav(samples, 300)
    with wave.open(BytesIO(body)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.getnframes()) == (1, 2, 300, 7)
        got = np.frombuffer(wav.readframes(7), dtype="<i2")
    assert got.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767]
    assert audio.pcm16(samples) == body[44:]
    assert len(audio.wav(np.zeros(0, np.float32), 300)) == 44


@pytest.mark.parametrize("response_format, lossless", [("flac", True), ("mp3", False), ("opus", False)])
def test_the_soundfile_formats_decode_to_the_samples_at_the_models_rate(response_format, lossless):
    import soundfile

    samples = (0.5 * np.sin(np.arange(4800) / 7)).astype(np.float32)
    assert audio.encoding_problem(response_format, 24000) is None
    decoded, rate = soundfile.read(BytesIO(audio.encoded(samples, response_format, 24000)), dtype="float32")
    assert rate == 24000
    if lossless:  # 16-bit, as vllm-omni writes it: within an LSB of our PCM
        assert np.abs(decoded * 32768 - np.frombuffer(audio.pcm16(samples), "<i2")).max() <= 1
    else:  # lossy: the length, give or take the codec's frames
        assert abs(len(decoded) - len(samples)) < 2000


def test_a_lossy_format_at_a_rate_its_codec_does_not_take_is_named():
    assert "opus takes 8000, 12000, 16000, 24000, 48000 Hz" in audio.encoding_problem("opus", 300)
    assert "for this model's 300 Hz audio" in audio.encoding_problem("mp3", 300)
    assert audio.encoding_problem("flac", 300) is None and audio.encoding_problem("wav", 300) is None


def test_a_streamed_wav_header_reads_as_a_wav_of_whatever_follows():
    body = audio.wav_header(300, None) + audio.pcm16(np.full(5, 0.25, np.float32))
    with wave.open(BytesIO(body)) as wav:  # Python's reader trusts the bytes there are
        assert wav.getframerate() == 300
        assert np.frombuffer(wav.readframes(100), "<i2").tolist() == [8192] * 5


def test_the_payload_is_vllm_omnis_additional_information():
    from omni_sidecar.hook_sets.omni.wire import decode_additional_information

    codes = np.arange(12, dtype=np.int64).reshape(3, 4)
    encoded = additional_information({"codes": {"audio": codes}, "meta": {"codec_next_chunk": 2, "final": True}})
    decoded = decode_additional_information(msgspec.msgpack.decode(msgspec.msgpack.encode(encoded)))
    assert torch.equal(decoded["codes"]["audio"], torch.from_numpy(codes))
    assert decoded["meta"] == {"codec_next_chunk": 2, "final": True}
    with pytest.raises(TypeError):
        additional_information({"x": object()})


@pytest.mark.parametrize("reference_frames", [0, 3, 20])
def test_each_chunks_window_holds_the_chunk_and_the_left_context_before_it_reference_codes_first(reference_frames):
    """What the code2wav hook set decodes of each chunk's window (its ChunkGrid cut) is the chunk's frames
    and, before them, up to the left context of the frames before: the reference codes before the first."""
    from types import SimpleNamespace

    from omni_serve.speech.pipeline import Frames, SpeechPipeline
    from proto.settings import REF_CODE_LEN, REF_CODES
    from omni_sidecar.hook_sets.omni.wire import decode_additional_information
    from proto.chunk_grid import ChunkGrid

    grid, left_context = ChunkGrid(4, initial=1), 6
    frames = Frames()
    reference = np.arange(100, 100 + 2 * reference_frames).reshape(-1, 2)
    # Reference codes a talker published at every step are assembled several times: their length says where they end.
    frames.set_reference({REF_CODES: np.concatenate([reference, reference]), REF_CODE_LEN: np.array([reference_frames])})
    frames.set(np.arange(2 * 14).reshape(14, 2))
    whole = np.concatenate([reference, frames.all()])
    pipeline = SimpleNamespace(chunks=grid, left_context=left_context)
    for k in range(grid.count(14)):
        payload = decode_additional_information(SpeechPipeline._chunk_payload(pipeline, frames, k))
        window, meta = payload["codes"]["audio"].numpy(), payload["meta"]
        cut = ChunkGrid(meta["codec_chunk_frames"], meta["initial_codec_chunk_frames"])
        first, start, end = cut.span(meta["codec_next_chunk"], window.shape[0], meta["codec_left_context_frames"])
        new_start = reference_frames + grid.start(k)
        assert window[start:end].tolist() == whole[new_start:reference_frames + min(14, grid.end(k))].tolist()
        assert window[first:start].tolist() == whole[max(0, new_start - left_context):new_start].tolist()


def test_the_config_names_its_stages_in_order_and_refuses_unknown_keys(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('served_model_name = "m"\nspeech_prompt = "a:b"\n'
                    '[stages.talker]\nmodel = "./t"\ndevice = 1\n'
                    '[stages.code2wav]\nmodel = "org/c"\nsidecar = { hooks = "omni-code2wav", options = { chunk_frames = 4 } }\n')
    config = load_config(good)
    assert list(config.stages) == ["talker", "code2wav"]
    assert config.stages["talker"].model == str(tmp_path / "t") and config.stages["talker"].device == 1
    assert config.stages["code2wav"].model == "org/c"  # not a path: a model id, left as it is
    assert config.stages["code2wav"].sidecar.options == {"chunk_frames": "4"}
    three = tmp_path / "three.toml"
    three.write_text('served_model_name = "m"\nthinker_prompt = "a:b"\ntalker_prompt = "a:c"\n'
                     '[stages.thinker]\nmodel = "org/h"\nmax_tokens = 6\n[stages.talker]\nmodel = "org/t"\n'
                     '[stages.code2wav]\nmodel = "org/c"\n')
    config = load_config(three)
    assert list(config.stages) == ["thinker", "talker", "code2wav"] and config.talker_prompt == "a:c"
    assert config.thinker_prompt == "a:b" and not config.speech_prompt
    assert config.stages["thinker"].max_tokens == 6
    for text, needle in [
        ('served_model_name = "m"\nspeech_prompt = "a:b"\n[stages.code2wav]\nmodel = "c"\n[stages.talker]\nmodel = "t"\n',
         "talker then code2wav"),
        ('served_model_name = "m"\nspeech_prompt = "a:b"\n[stages.talker]\nmodel = "t"\ngpu = 1\n'
         '[stages.code2wav]\nmodel = "c"\n', "unknown key(s) ['gpu']"),
        ('served_model_name = "m"\n[stages.talker]\nmodel = "t"\n[stages.code2wav]\nmodel = "c"\n', "required"),
        ("served_model_name = \n", "Invalid"),
        ('served_model_name = "m"\nthinker_prompt = "a:b"\n[stages.thinker]\nmodel = "h"\n[stages.talker]\nmodel = "t"\n'
         '[stages.code2wav]\nmodel = "c"\n', "talker_prompt is required with a thinker stage"),
        # One prompt function: the thinker's with a thinker stage (both endpoints use it), else speech_prompt.
        ('served_model_name = "m"\nspeech_prompt = "a:b"\ntalker_prompt = "a:c"\n[stages.thinker]\nmodel = "h"\n'
         '[stages.talker]\nmodel = "t"\n[stages.code2wav]\nmodel = "c"\n', "this one takes thinker_prompt"),
        ('served_model_name = "m"\nspeech_prompt = "a:b"\nthinker_prompt = "a:b"\n[stages.talker]\nmodel = "t"\n'
         '[stages.code2wav]\nmodel = "c"\n', "this one takes speech_prompt"),
        ('served_model_name = "m"\nspeech_prompt = "a:b"\ntalker_prompt = "a:c"\n[stages.talker]\nmodel = "t"\n'
         '[stages.code2wav]\nmodel = "c"\n', "and only with one"),
        ('served_model_name = "m"\nspeech_prompt = "a:b"\nvoices = ["Vivian", "vivian"]\n[stages.talker]\nmodel = "t"\n'
         '[stages.code2wav]\nmodel = "c"\n', "name one voice twice"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            load_config(bad)


def test_a_stages_engine_keeps_the_configs_shim_settings_next_to_its_sidecar(monkeypatch):
    from types import SimpleNamespace

    from omni_serve.stages import engines

    monkeypatch.setattr(engines, "AsyncEngineArgs", lambda **kwargs: SimpleNamespace(**kwargs))  # no model lookup

    spec = StageSpec("talker", "m", engine={"max_model_len": 64, "additional_config": {
        "omni_sidecar": {"subtalker_sampling": {"do_sample": False}, "endpoint": "ipc:///elsewhere"}, "other": 1}})
    args = engines.engine_args(spec, "ipc:///run/talker.sock", curve_keys="keys")
    assert args.additional_config == {"other": 1, "omni_sidecar": {
        "subtalker_sampling": {"do_sample": False}, "endpoint": "ipc:///run/talker.sock", "curve_keys": "keys"}}
    assert args.max_model_len == 64 and args.worker_cls == "worker_shim.Worker"
    assert spec.engine["additional_config"]["omni_sidecar"]["endpoint"] == "ipc:///elsewhere"  # the spec untouched


def test_a_stages_hf_overrides_may_name_a_function(monkeypatch):
    from types import SimpleNamespace

    from omni_serve.stages import engines
    from worker_shim.omni_models.qwen3_omni.config import talker_stage_config

    monkeypatch.setattr(engines, "AsyncEngineArgs", lambda **kwargs: SimpleNamespace(**kwargs))  # no model lookup
    named = StageSpec("talker", "m", engine={
        "hf_overrides": "worker_shim.omni_models.qwen3_omni.config:talker_stage_config"})
    assert engines.engine_args(named, "ipc:///s").hf_overrides is talker_stage_config
    table = StageSpec("code2wav", "m", engine={"hf_overrides": {"architectures": ["X"]}})
    assert engines.engine_args(table, "ipc:///s").hf_overrides == {"architectures": ["X"]}
    with pytest.raises(ConfigError, match="no_such_function"):
        engines.engine_args(StageSpec("talker", "m", engine={"hf_overrides": "omni_serve.config:no_such_function"}),
                            "ipc:///s")


def test_a_stage_whose_hooks_pass_kwargs_gets_piecewise_graphs_unless_its_config_chose(monkeypatch):
    from types import SimpleNamespace

    from omni_serve.config import StageSpec
    from omni_serve.stages import engines
    from proto.capabilities import HookNeeds

    monkeypatch.setattr(engines, "AsyncEngineArgs", lambda **kwargs: SimpleNamespace(**kwargs))  # no model lookup
    kwargs, layers, plain = HookNeeds(extra_kwargs=True), HookNeeds(hidden_states=True, hidden_layers=[0, 2]), HookNeeds()

    def mode(engine, needs):
        args = engines.engine_args(StageSpec("code2wav", "m", engine=engine), "ipc:///s", needs=needs)
        return str(getattr(args, "compilation_config", {}).get("cudagraph_mode"))

    assert "PIECEWISE" in mode({}, kwargs) and "PIECEWISE" in mode({}, layers)
    assert "PIECEWISE" not in mode({}, plain) and "PIECEWISE" not in mode({}, None)  # vLLM's default stays
    assert "FULL_DECODE_ONLY" in mode({"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}, kwargs)
    eager = engines.engine_args(StageSpec("code2wav", "m", engine={"enforce_eager": True}), "ipc:///s", needs=kwargs)
    assert eager.enforce_eager and "PIECEWISE" not in mode({"enforce_eager": True}, kwargs)


def test_the_shims_vllm_plugin_calls_the_model_registrations_it_is_given(monkeypatch):
    from tests.support import registrations
    from worker_shim import plugin

    monkeypatch.setenv(plugin.REGISTER_ENV, "tests.support.registrations:note,tests.support.registrations:note")
    registrations.CALLS.clear()
    plugin.register_models()
    assert registrations.CALLS == ["called", "called"]
    monkeypatch.delenv(plugin.REGISTER_ENV)
    plugin.register_models()
    assert len(registrations.CALLS) == 2  # none named: none called


def test_output_tensors_are_read_by_their_dtype_and_shape_and_malformed_ones_refused():
    from omni_serve.stages.link import RequestRejected, blob_array
    from proto.messages import TensorBlob

    wave = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert np.array_equal(blob_array(TensorBlob([3, 2], "float32", wave.tobytes())), wave)
    bf16 = torch.tensor([1.5, -2.0]).to(torch.bfloat16)
    assert blob_array(TensorBlob([2], "bfloat16", bf16.view(torch.int16).numpy().tobytes())).tolist() == [1.5, -2.0]
    for bad in (TensorBlob([4, 2], "float32", wave.tobytes()), TensorBlob([3], "complex64", b"")):
        with pytest.raises(RequestRejected):
            blob_array(bad)


def test_a_reply_names_the_query_it_answers():
    from omni_serve.stages.link import answers
    from proto.messages import OutputsQuery, OutputsReply, Ping, Pong

    assert answers(OutputsQuery("a"), OutputsReply("a", True)) and not answers(OutputsQuery("a"), OutputsReply("b", True))
    assert answers(Ping(1), Pong(1)) and not answers(Ping(1), Pong(2))


def test_a_query_cancelled_before_its_reply_leaves_no_reply_for_the_next(tmp_path):
    """A request's task stopped while its query waited: the reply that still comes is never read as
    the next query's (which would hand one request's outputs to another)."""
    import asyncio
    import threading

    import zmq

    from omni_serve.stages.link import AsyncSidecarClient
    from proto.codec import Codec
    from proto.messages import OutputsReply

    endpoint = f"ipc://{tmp_path}/sidecar.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    asked: list[str] = []
    release, stop = threading.Event(), threading.Event()

    def sidecar() -> None:  # one query at a time, answered with the request it names; "a" once released
        codec = Codec()
        while not stop.is_set():
            if not router.poll(20):
                continue
            ident, frame = router.recv_multipart()
            query = codec.decode(frame)
            asked.append(query.req_id)
            if query.req_id == "a" and len(asked) == 1:
                release.wait(5)
            reply = OutputsReply(query.req_id, found=True, values={"for": query.req_id, "query": len(asked)})
            router.send_multipart([ident, codec.encode(reply)])

    thread = threading.Thread(target=sidecar)
    thread.start()

    async def run() -> dict:
        link = AsyncSidecarClient(endpoint, timeout_s=5.0)
        try:
            first = asyncio.create_task(link.outputs("a"))
            while not asked:
                await asyncio.sleep(0.01)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            again = asyncio.create_task(link.outputs("a"))  # the same request asked again, before the old reply
            await asyncio.sleep(0.05)  # sent: it waits on the socket behind the first
            release.set()  # the first a's reply goes out before the second a's and b's queries are read
            values, _ = await link.outputs("b")
            return (await again)[0], values
        finally:
            link.close()

    try:
        assert asyncio.run(run()) == ({"for": "a", "query": 2}, {"for": "b", "query": 3})
        assert asked == ["a", "a", "b"]  # each asked once: the cancelled query's reply was read by no other
    finally:
        stop.set()
        thread.join()
        router.close(0)


def test_outputs_queries_are_in_flight_together_and_each_gets_its_own_reply(tmp_path):
    """Many streams' outputs queries go out at once (the sidecar holds 8 before answering any, last
    first), each reply reaching the query of the request it names; a reply to nothing asked is dropped."""
    import asyncio
    import threading

    import zmq

    from omni_serve.stages.link import AsyncSidecarClient
    from proto.codec import Codec
    from proto.messages import OutputsReply

    endpoint = f"ipc://{tmp_path}/sidecar.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    stop = threading.Event()
    held: list[tuple[bytes, str]] = []

    def sidecar() -> None:
        codec = Codec()
        while not stop.is_set():
            if not router.poll(20):
                continue
            ident, frame = router.recv_multipart()
            held.append((ident, codec.decode(frame).req_id))
            if len(held) == 8:
                router.send_multipart([ident, codec.encode(OutputsReply("never-asked", found=True))])
                for who, req_id in reversed(held):
                    router.send_multipart([who, codec.encode(OutputsReply(req_id, found=True, values={"for": req_id}))])

    thread = threading.Thread(target=sidecar)
    thread.start()

    async def run() -> list[dict]:
        link = AsyncSidecarClient(endpoint, timeout_s=5.0)
        try:
            got = await asyncio.gather(*(link.outputs(f"r{i}") for i in range(8)))
            return [values for values, _ in got]
        finally:
            link.close()

    try:
        assert asyncio.run(run()) == [{"for": f"r{i}"} for i in range(8)]
        assert sorted(req_id for _, req_id in held) == [f"r{i}" for i in range(8)]  # each asked once
    finally:
        stop.set()
        thread.join()
        router.close(0)


class FakeEngine:
    """A stage engine that ends each request with one finished output, or holds it until closed."""

    def __init__(self, finish: bool = True) -> None:
        self.finish = finish
        self.done: list[str] = []  # request ids whose generator ran out
        self.closed: list[str] = []  # request ids whose generator was closed (the engine aborts those)

    async def generate(self, prompt, params, request_id):
        import asyncio
        from types import SimpleNamespace

        try:
            if not self.finish:
                await asyncio.Event().wait()
            yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(finish_reason="length")],
                                  prompt_token_ids=prompt["prompt_token_ids"])
            self.done.append(request_id)
        finally:
            self.closed.append(request_id)


class ForgetfulLink:
    """A sidecar started again: it never heard of the request."""

    async def outputs(self, request_id):
        from omni_serve.stages.link import Followed

        return {}, Followed()

    async def follow(self, request_id, cursor):
        from omni_serve.stages.link import Followed

        return Followed(), cursor

    async def forget(self, request_id):
        pass


def speech_pipeline(talker_engine: FakeEngine):
    from omni_serve.speech.pipeline import SpeechPipeline, Stage
    from proto.chunk_grid import ChunkGrid

    return SpeechPipeline(Stage("talker", talker_engine, ForgetfulLink()), Stage("code2wav", FakeEngine(), ForgetfulLink()),
                          chunks=ChunkGrid(4), left_context=0, placeholder_token=0)


class FinishedOutputsLink(ForgetfulLink):
    """A sidecar that has finished every request with the same assembled outputs."""

    def __init__(self, values: dict) -> None:
        self.values = values

    async def outputs(self, request_id):
        from omni_serve.stages.link import Followed

        return dict(self.values), Followed(found=True, finished=True)


@pytest.mark.parametrize("frames, grid, chunks", [
    (10, (4, 1), 4),  # 1 + 4 + 4 + 1 frames: four code2wav requests
    (3, (4, 0), 1),  # shorter than a chunk: its one chunk is there when the talker has finished
])
def test_each_stage_reports_its_share_of_a_requests_first_audio_once(frames, grid, chunks):
    """The talker's start to its first chunk's frames and code2wav's first chunk request to its
    waveform: once a request, however many chunks it has (the metrics' where-the-time-goes)."""
    import asyncio

    import numpy as np

    from omni_serve.speech.pipeline import CODES, WAVEFORM, SpeechJob, SpeechPipeline, Stage
    from proto.chunk_grid import ChunkGrid

    codes = np.arange(frames * 2, dtype=np.int64).reshape(frames, 2) % 7
    shares: list[tuple[str, float]] = []
    pipeline = SpeechPipeline(Stage("talker", FakeEngine(), FinishedOutputsLink({CODES: codes})),
                              Stage("code2wav", FakeEngine(), FinishedOutputsLink({WAVEFORM: np.ones((4, 1), np.float32)})),
                              chunks=ChunkGrid(*grid), left_context=0, placeholder_token=0,
                              first_audio_share=lambda stage, seconds: shares.append((stage, seconds)))

    async def run() -> int:
        got = [c async for c in pipeline.synthesize(SpeechJob("r1", [1, 2], {}, max_frames=frames))]
        await pipeline.close()
        return len(got)

    assert asyncio.run(run()) == ChunkGrid(*grid).count(frames) == chunks
    assert sorted(stage for stage, _ in shares) == ["code2wav", "talker"]
    assert all(seconds >= 0 for _, seconds in shares)


def test_a_talker_request_that_cannot_start_fails_its_speech_at_once():
    """The talker's sampling refused as the request starts (here a min_tokens above its frames): the
    speech fails with vLLM's reason, and the code2wav side, waiting on the talker's frames, stops too."""
    import asyncio

    from omni_serve.speech.pipeline import SpeechJob, StageFailed

    engine = FakeEngine()
    pipeline = speech_pipeline(engine)

    async def run() -> None:
        job = SpeechJob("r1", [1, 2], {}, max_frames=4, sampling={"talker": {"min_tokens": 6}})
        try:
            with pytest.raises(StageFailed, match="talker: its sampling was refused: min_tokens must be less than "
                                                  "or equal to max_tokens=4"):
                await asyncio.wait_for(_drained(pipeline.synthesize(job)), 5.0)
        finally:
            await pipeline.close()

    asyncio.run(run())
    assert engine.closed == [] and pipeline.talker.in_flight == 0


async def _drained(chunks) -> list:
    return [chunk async for chunk in chunks]


def test_a_batch_items_check_that_fails_otherwise_is_that_items_error():
    import asyncio

    from omni_serve.api.server import _checked_or_refused

    async def broken(body):
        raise KeyError("a fault of the check's own")

    got = asyncio.run(_checked_or_refused(broken, {"input": "x"}))
    assert isinstance(got, Refused) and got.status == 500 and "KeyError" in str(got)
    assert "a fault of the check's own" not in str(got)  # the log has it, the client not


def test_a_stream_message_is_strict_json_and_its_text_unicode():
    from omni_serve.api.speech_stream import _parse

    assert _parse('{"type": "input.text", "text": "hi \\ud83d\\ude00"}')["text"] == "hi \U0001F600"
    for raw, needle in (('{"type": "input.text", "text": "hi \\ud800"}', "text is not Unicode text"),
                        ('{"type": "session.config", "speed": NaN}', "NaN is not a JSON value"),
                        ('["input.done"]', "must be a JSON object")):
        with pytest.raises(Refused, match=needle):
            _parse(raw)


@pytest.mark.parametrize("engine_finished", [True, False])
def test_a_lost_sidecar_fails_its_stages_requests_at_once_and_aborts_them_in_the_engine(engine_finished):
    """Whether its engine had finished the request (its last step's results died with the sidecar:
    the one started again never hears of it) or was still running it: the request fails now, naming
    the stage and why, not when the wait on the sidecar gives up (FOLLOW_TIMEOUT_S)."""
    import asyncio

    from omni_serve.speech.pipeline import FOLLOW_TIMEOUT_S, SpeechJob, StageFailed

    engine = FakeEngine(finish=engine_finished)
    pipeline = speech_pipeline(engine)

    async def run() -> tuple[StageFailed, float]:
        async def speech() -> list:
            return [c async for c in pipeline.synthesize(SpeechJob("r1", [1, 2], {}, max_frames=8))]

        task = asyncio.create_task(speech())
        while pipeline.talker.in_flight == 0 or (engine_finished and not engine.done):  # waiting on its sidecar
            await asyncio.sleep(0.01)
        lost = asyncio.get_running_loop().time()
        pipeline.talker.fail_served("its sidecar exited")
        with pytest.raises(StageFailed) as failed:
            await asyncio.wait_for(task, FOLLOW_TIMEOUT_S / 3)
        took = asyncio.get_running_loop().time() - lost
        await asyncio.sleep(0.05)  # the cancelled work closes its engine generator
        await pipeline.close()
        return failed.value, took

    failed, took = asyncio.run(run())
    assert str(failed) == "talker: its sidecar exited" and failed.stage == "talker"
    assert took < 1.0
    assert engine.closed == ["r1"] and engine.done == (["r1"] if engine_finished else [])
    assert pipeline.talker.in_flight == 0


def test_a_lost_sidecar_fails_only_what_its_stage_serves_now():
    import asyncio

    from omni_serve.speech.pipeline import Stage, StageFailed

    talker, code2wav = Stage("talker", None, ForgetfulLink()), Stage("code2wav", None, ForgetfulLink())

    async def run() -> None:
        release = asyncio.Event()

        async def work(value: str) -> str:
            await release.wait()
            return value

        talker_work = asyncio.create_task(talker.serve(work("talker")))
        code2wav_work = asyncio.create_task(code2wav.serve(work("code2wav")))
        await asyncio.sleep(0.01)
        talker.fail_served("its sidecar exited")
        with pytest.raises(StageFailed, match="^talker: its sidecar exited$"):
            await talker_work
        later = asyncio.create_task(talker.serve(work("later")))  # a request after the loss is served
        release.set()
        assert await code2wav_work == "code2wav"
        assert await later == "later"

    asyncio.run(run())


def test_a_supervised_sidecar_found_dead_fails_its_stages_requests_before_it_is_started_again(tmp_path, monkeypatch):
    import asyncio
    import subprocess
    import sys

    from omni_serve.config import SidecarSpec
    from omni_serve.stages.sidecars import SidecarProcess

    sidecar = SidecarProcess("talker", SidecarSpec(hooks="unused"), tmp_path)
    sidecar.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    sidecar.proc.wait()  # killed
    happened: list[str] = []

    async def no_successor() -> int:
        return 0

    def spawn() -> None:
        happened.append("started again")
        sidecar.stopping = True  # one round

    async def ready(timeout_s: float = 0) -> None:
        happened.append("answers")

    monkeypatch.setattr(sidecar, "_successor", no_successor)
    monkeypatch.setattr(sidecar, "_spawn", spawn)
    monkeypatch.setattr(sidecar, "wait_ready", ready)
    sidecar.on_lost = happened.append
    asyncio.run(asyncio.wait_for(sidecar._supervise(), 10))
    pid = sidecar.proc.pid
    assert happened == [f"its sidecar exited (pid {pid}, status 0) with the request in flight; it is being started again",
                        "started again", "answers"]


def test_an_attached_sidecar_that_stops_answering_fails_its_requests_and_is_taken_up_when_back(tmp_path, monkeypatch):
    import asyncio

    from omni_serve.config import SidecarSpec
    from omni_serve.stages import sidecars

    answers = iter([True, False, False, True, False, False, False, True])  # two misses are no loss; three are
    happened: list[str] = []
    sidecar = sidecars.SidecarProcess("code2wav", SidecarSpec(endpoint="ipc:///nowhere", attach=True), tmp_path)

    async def ping(self) -> bool:
        up = next(answers)
        happened.append(f"alive={sidecar.alive}")
        return up

    async def back() -> None:
        happened.append("reconnect")
        sidecar.stopping = True

    monkeypatch.setattr(sidecars, "CHECK_EVERY_S", 0)
    monkeypatch.setattr(sidecars.AsyncSidecarClient, "ping", ping)
    sidecar.on_lost = happened.append
    sidecar.on_restart = back
    asyncio.run(asyncio.wait_for(sidecar._watch_attached(), 10))
    assert happened == ["alive=True"] * 7 + ["its sidecar stopped answering with the request in flight",
                                             "alive=False", "reconnect"]
    assert sidecar.alive and sidecar.restarts == 1


class TokenEngine:
    """A talker engine: one token an output (`tokens` of them, then a finished output), the count
    kept for its sidecar stand-in; a code2wav engine: one finished output a request."""

    def __init__(self, tokens: int = 0) -> None:
        self.tokens, self.made, self.requests = tokens, 0, []

    async def generate(self, prompt, params, request_id):
        import asyncio
        from types import SimpleNamespace

        self.requests.append((request_id, params))
        for _ in range(self.tokens):
            await asyncio.sleep(0)
            self.made += 1
            yield SimpleNamespace(finished=False, outputs=[SimpleNamespace(token_ids=[0], finish_reason=None)])
        yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=[], finish_reason="length")])


class TrailingCodesLink(ForgetfulLink):
    """A talker sidecar whose frames trail the engine's tokens by one (a frame is whole a step
    after its first code), all of them once the engine has finished; its queries counted."""

    def __init__(self, engine: TokenEngine, codes: np.ndarray) -> None:
        self.engine, self.codes, self.queries = engine, codes, 0

    async def outputs(self, request_id):
        from omni_serve.speech.pipeline import CODES
        from omni_serve.stages.link import Followed

        self.queries += 1
        finished = self.engine.made == self.engine.tokens
        return {CODES: self.codes[:self.engine.made if finished else max(0, self.engine.made - 1)]}, \
            Followed(found=True, finished=finished)


def test_the_talkers_sidecar_is_asked_for_frames_only_when_a_chunk_can_be_whole():
    """Not once per engine output: from the output whose tokens reach the next chunk's end until its
    frames are there; each chunk's code2wav request starts on the output its frames came with,
    holding the frames the sidecar has (the same windows as reading after every output)."""
    import asyncio

    from omni_serve.speech.pipeline import WAVEFORM, SpeechJob, SpeechPipeline, Stage
    from proto.chunk_grid import ChunkGrid

    frames, grid = 10, ChunkGrid(4, 1)
    codes = np.arange(frames * 2, dtype=np.int64).reshape(frames, 2) % 7
    talker, code2wav = TokenEngine(frames), TokenEngine()
    link = TrailingCodesLink(talker, codes)
    pipeline = SpeechPipeline(Stage("talker", talker, link),
                              Stage("code2wav", code2wav, FinishedOutputsLink({WAVEFORM: np.ones((4, 1), np.float32)})),
                              chunks=grid, left_context=0, placeholder_token=0)

    async def run() -> int:
        got = [c async for c in pipeline.synthesize(SpeechJob("r1", [1, 2], {}, max_frames=frames))]
        await pipeline.close()
        return len(got)

    assert asyncio.run(run()) == grid.count(frames) == 4
    # Chunks 0, 1, 2 (frames 1, 5, 9): asked at their end's token and the next one; chunk 3 at the end.
    assert link.queries == 2 * 3 + 1 < frames
    windows = []
    for _, params in code2wav.requests:
        entry = params.extra_args["omni_sidecar"]["additional_information"]["entries"]["codes.audio"]
        windows.append(np.frombuffer(entry["tensor_data"], np.int64).reshape(entry["tensor_shape"]))
    assert [w.tolist() for w in windows] == [codes[grid.start(k):grid.end(k)].tolist() for k in range(4)]


class CountingFinishedLink(FinishedOutputsLink):
    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.followed: list[str] = []
        self.forgotten: list[str] = []

    async def follow(self, request_id, cursor):
        self.followed.append(request_id)
        return await super().follow(request_id, cursor)

    async def forget(self, request_id):
        self.forgotten.append(request_id)


def test_a_chunk_read_finished_is_dropped_from_its_sidecar_without_asking_first():
    """Its waveform was read finished: one query drops it (a release that asks whether it has
    finished first is for requests that may still run there: the talker's, an aborted chunk); the
    speech request's own id, which code2wav never ran, is not asked after there."""
    import asyncio

    from omni_serve.speech.pipeline import CODES, WAVEFORM, SpeechJob, SpeechPipeline, Stage
    from proto.chunk_grid import ChunkGrid

    frames, grid = 10, ChunkGrid(4, 1)
    code2wav = CountingFinishedLink({WAVEFORM: np.ones((4, 1), np.float32)})
    pipeline = SpeechPipeline(Stage("talker", FakeEngine(), FinishedOutputsLink({CODES: np.zeros((frames, 2), np.int64)})),
                              Stage("code2wav", FakeEngine(), code2wav), chunks=grid, left_context=0,
                              placeholder_token=0)

    async def run() -> None:
        assert len([c async for c in pipeline.synthesize(SpeechJob("r1", [1, 2], {}, max_frames=frames))]) == 4
        await asyncio.sleep(0.01)  # the releases run on their own
        await pipeline.close()

    asyncio.run(run())
    chunks = [f"r1-c{k}" for k in range(4)]
    assert sorted(code2wav.forgotten) == chunks  # and nothing of the speech request's own id: it never ran there
    assert code2wav.followed == []


def test_the_heap_start_up_made_is_frozen_before_the_first_request():
    """The collector never walks what start-up made while serving (vLLM's API server freezes it too):
    after the app's start, the objects of start-up are in the permanent generation."""
    import gc
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from omni_serve.api.server import build_app

    made = []

    async def start() -> None:
        made.extend([{"i": i} for i in range(1000)])  # start-up's objects, tracked by the collector

    async def stop() -> None:
        pass

    server = SimpleNamespace(config=CONFIG, start=start, stop=stop,
                             health=lambda: {"status": "ok"})
    gc.unfreeze()
    try:
        with TestClient(build_app(server)) as client:
            frozen = gc.get_freeze_count()
            assert client.get("/health").status_code == 200
        assert frozen >= len(made)
    finally:
        gc.unfreeze()


def test_api_keys_guard_the_v1_routes_as_vllm_serve_does(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from omni_serve.api.server import require_api_keys
    from omni_serve.cli import api_keys

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(None) == [] and api_keys(["k1", "k2"]) == ["k1", "k2"]
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert api_keys(None) == ["env-key"] and api_keys(["k1"]) == ["k1"]  # the option first, as in vLLM

    app = FastAPI()
    app.get("/v1/models")(lambda: {"ok": 1})
    app.get("/health")(lambda: {"ok": 1})

    @app.websocket("/v1/audio/speech/stream")
    async def stream(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json({"ok": 1})
        await websocket.close()

    require_api_keys(app, ["k1", "k2"])
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).json() == {"error": "Unauthorized"}
    assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).json() == {"ok": 1}
    assert client.get("/health").status_code == 200  # probes need no key
    with client.websocket_connect("/v1/audio/speech/stream", headers={"Authorization": "Bearer k1"}) as ws:
        assert ws.receive_json() == {"ok": 1}
    from starlette.testclient import WebSocketDenialResponse

    with pytest.raises(WebSocketDenialResponse) as denied:
        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            ws.receive_json()
    assert denied.value.status_code == 401


def test_every_shipped_pipeline_file_loads():
    """deploy/speech/*.toml as omni-serve reads them: keys known, stages in order, a prompt named."""
    from omni_serve.config import PIPELINES, load_callable

    shipped = sorted((Path(__file__).resolve().parents[1] / "deploy" / "speech").glob("*.toml"))
    shipped += sorted(PIPELINES.glob("*.toml"))
    assert len(shipped) >= 7
    for path in shipped:
        config = load_config(path)
        assert list(config.stages)[-2:] == ["talker", "code2wav"], path
        named = config.speech_prompt or config.thinker_prompt
        assert named.startswith(("omni_serve.", "tests.")), (path, named)
    qwen3_tts = load_config(PIPELINES / "qwen3-tts.toml")
    assert not qwen3_tts.voices_given  # the checkpoint's speakers
    assert load_callable(qwen3_tts.speech_prompt).__name__ == "Qwen3TTSPrompt"


def test_a_speech_prompt_class_takes_the_voices_and_a_file_that_also_names_voices_is_refused(tmp_path):
    from omni_serve.speech.prompts import load_speech_prompt

    body = ('served_model_name = "m"\nspeech_prompt = "tests.test_serve_units:SpokenPrompt"\n{voices}'
            '[stages.talker]\nmodel = "x"\n[stages.code2wav]\nmodel = "x"\n')
    (tmp_path / "a.toml").write_text(body.format(voices=""))
    prompt = load_speech_prompt(load_config(tmp_path / "a.toml"))
    assert prompt.voices == ["a", "b"] and prompt.languages == ["English", "German"]
    (tmp_path / "b.toml").write_text(body.format(voices='voices = ["a"]\n'))
    with pytest.raises(ConfigError, match="remove the file's voices"):
        load_speech_prompt(load_config(tmp_path / "b.toml"))


def test_a_built_in_pipeline_by_name_and_model_puts_every_stage_on_one_checkpoint(tmp_path):
    from omni_serve.config import PIPELINES, pipeline_file, with_model

    assert pipeline_file("qwen3-tts") == PIPELINES / "qwen3-tts.toml"
    assert pipeline_file("deploy/speech/tiny.toml") == Path("deploy/speech/tiny.toml")
    with pytest.raises(ConfigError, match=r"built-in pipelines: qwen3-tts"):
        load_config("qwen3-tss")  # a name mistyped: the names it could be
    shipped = load_config("qwen3-tts")
    hub = with_model(shipped, "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    assert hub.served_model_name == "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
    assert {s.model for s in hub.stages.values()} == {"Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"}
    assert hub.stages["code2wav"].engine == shipped.stages["code2wav"].engine  # only the checkpoint changes
    local = with_model(shipped, str(tmp_path), "tts")
    assert local.served_model_name == "tts" and {s.model for s in local.stages.values()} == {str(tmp_path.resolve())}


def test_omni_serve_keeps_vllm_omnis_entry_point_out_unless_told_otherwise(monkeypatch, tmp_path):
    """With vllm-omni installed and VLLM_PLUGINS unset, vLLM would load vllm-omni's patches in every process:
    omni-serve lets in the shim's plugins alone; a VLLM_PLUGINS the user set, or no vllm-omni, is left as is."""
    import os

    from omni_serve import cli
    from worker_shim.omni_models import package

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(package, "installed_folder", lambda: None)
    assert cli.plugin_defaults() is None and "VLLM_PLUGINS" not in os.environ
    monkeypatch.setattr(package, "installed_folder", lambda: tmp_path)
    assert cli.plugin_defaults() == "omni_sidecar_shim" == os.environ["VLLM_PLUGINS"]
    monkeypatch.setenv("VLLM_PLUGINS", "omni_sidecar_shim,my_platform")
    assert cli.plugin_defaults() is None and os.environ["VLLM_PLUGINS"] == "omni_sidecar_shim,my_platform"


def test_a_reference_is_read_as_vllm_omni_reads_it_mono_at_its_own_rate():
    import soundfile

    from omni_serve.speech.reference import BadReference, References

    reference_audio = References().audio
    stereo = np.stack([np.linspace(-0.5, 0.5, 16000 * 2), np.full(16000 * 2, 0.25)], axis=1).astype(np.float32)
    out = BytesIO()
    soundfile.write(out, stereo, 16000, format="FLAC")
    samples, rate = reference_audio("data:audio/flac;base64," + base64.b64encode(out.getvalue()).decode())
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == (32000,)
    np.testing.assert_allclose(samples, stereo.mean(axis=1), atol=1e-4)  # FLAC's 16 bits
    long = BytesIO()
    soundfile.write(long, np.zeros(16000 * 40, np.float32), 16000, format="FLAC")  # a few KiB for 40 s
    for uri, needle in (("file:///tmp/x.wav", "--allowed-local-media-path"), ("ftp://x/y.wav", "base64 data URL"),
                        ("data:audio/wav,abc", "not base64"),
                        ("http://127.0.0.1:9/x.wav", "cannot fetch"),
                        ("data:audio/flac;base64," + base64.b64encode(long.getvalue()).decode(), "40.00 s long"),
                        ("http://[::1/x.wav", "not a URL this server reads: Invalid IPv6 URL")):
        with pytest.raises(BadReference, match=needle):
            reference_audio(uri)
    for uri, needle in (("file://[/x.wav", "not a URL this server reads"),
                        ("file:///tmp/a%00b.wav", "not a path: embedded null byte")):
        with pytest.raises(BadReference, match=needle):
            References(Path("/tmp")).audio(uri)
    # A float file may hold NaN or Inf: no voice to take from it.
    broken = np.linspace(-0.5, 0.5, 16000 * 2).astype(np.float32)
    for bad in (np.nan, np.inf):
        broken[100] = bad
        out = BytesIO()
        soundfile.write(out, broken, 16000, format="WAV", subtype="FLOAT")
        with pytest.raises(BadReference, match="not finite"):
            reference_audio("data:audio/wav;base64," + base64.b64encode(out.getvalue()).decode())


def _clip(seconds: float = 1.5, rate: int = 16000, seed: int = 0) -> bytes:
    import soundfile

    out = BytesIO()
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * rate)).astype(np.float32)
    soundfile.write(out, noise, rate, format="WAV", subtype="FLOAT")
    return out.getvalue()


def test_local_and_fetched_references_are_kept_to_what_the_operator_allows(tmp_path):
    """vLLM's --allowed-local-media-path and --allowed-media-domains, as its MediaConnector applies them: a
    file:// reference only under the directory (links resolved first), http(s) only from the hosts named,
    a redirect as well."""
    from omni_serve.speech.reference import BadReference, References
    from tests.support.web import QuietHandler, web_server

    root, outside = tmp_path / "media", tmp_path / "private"
    root.mkdir(), outside.mkdir()
    (root / "voice.wav").write_bytes(_clip())
    (outside / "secret.wav").write_bytes(_clip(seed=1))
    (root / "link.wav").symlink_to(outside / "secret.wav")
    local = References(root)
    samples, rate = local.audio((root / "voice.wav").as_uri())
    assert rate == 16000 and samples.shape == (24000,)
    for uri, needle in (((outside / "secret.wav").as_uri(), "is not under --allowed-local-media-path"),
                        ((root / "link.wav").as_uri(), "is not under --allowed-local-media-path"),
                        ((root / ".." / "private" / "secret.wav").as_uri(), "is not under"),
                        ((root / "absent.wav").as_uri(), "cannot read"),
                        ("file://elsewhere/media/voice.wav", "another host")):
        with pytest.raises(BadReference, match=needle):
            local.audio(uri)

    clip = _clip(seed=2)

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            if self.path == "/away":  # to the same server under another name
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/clip.wav")
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(clip)

    with web_server(Handler) as url:
        port = url.rsplit(":", 1)[1]
        kept = References(domains=("127.0.0.1",))
        assert kept.audio(f"http://127.0.0.1:{port}/clip.wav")[0].shape == (24000,)
        with pytest.raises(BadReference, match="'localhost' is not one this server fetches from"):
            kept.audio(f"http://localhost:{port}/clip.wav")
        with pytest.raises(BadReference, match="'localhost' is not one"):
            kept.audio(f"{url}/away")
        assert References().audio(f"{url}/away")[0].shape == (24000,)  # no list: any host

    # Requests naming one URL at once (a batch's shared reference) wait for one fetch.
    import threading
    import time

    fetches = []

    class Slow(QuietHandler):
        def do_GET(self) -> None:
            fetches.append(self.path)
            time.sleep(0.3)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(clip)

    shared = References()
    with web_server(Slow) as url:
        got = []
        readers = [threading.Thread(target=lambda: got.append(shared.audio(f"{url}/shared.wav"))) for _ in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(10)
    assert fetches == ["/shared.wav"] and len(got) == 4 and all(g is got[0] for g in got)


def test_uploaded_voices_are_kept_as_vllm_omni_keeps_them_and_restored(tmp_path):
    """One safetensors file a voice (`audio`, the details as header strings, vllm-omni's layout), written
    whole, replaced by name, restored by a new store; vllm-omni's own files (a stereo clip, an embedding
    voice) read too; the limit and the names vllm-omni refuses."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from omni_serve.speech.reference import BadReference
    from omni_serve.speech.voices import BadUpload, UploadedVoices

    store = UploadedVoices(tmp_path / "voices", limit=2)
    assert store.restore() == (0, []) and not store.directory.exists()  # made on the first upload only
    voice = store.add("Narrator", "consent 1", _clip(), "n.wav", "application/octet-stream", " Hello. ", "warm")
    assert (voice.name, voice.sample_rate, voice.ref_text, voice.mime_type) == ("Narrator", 16000, "Hello.", "audio/wav")
    [path] = store.directory.glob("*.safetensors")
    assert path.name == f"Narrator_consent_1_{voice.created_at}.safetensors"
    with safe_open(str(path), framework="numpy") as file:
        header = file.metadata()
        assert file.get_tensor("audio").shape == (24000,)
    assert header["voice_name_lower"] == "narrator" and header["created_at"] == str(voice.created_at)
    assert header["ref_text"] == "Hello." and header["speaker_description"] == "warm" and "file_path" not in header
    samples, rate = store.clip(store.get("NARRATOR"))
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == (24000,)

    again = store.add("narrator", "consent 2", _clip(seed=3), "n.flac", "audio/wav")  # replaces, any case
    assert again.created_at > voice.created_at and len(list(store.directory.glob("*.safetensors"))) == 1
    with pytest.raises(BadReference, match="deleted or replaced"):
        store.clip(voice)
    # vllm-omni's own files: a stereo clip (it keeps what soundfile read) and a voice stored as an embedding.
    stereo = np.stack([np.full(16000, 0.5), np.full(16000, -0.1)], axis=1).astype(np.float32)
    save_file({"audio": stereo}, str(store.directory / "duo_c_5.safetensors"),
              metadata={"name": "Duo", "voice_name_lower": "duo", "consent": "c", "created_at": "5",
                        "sample_rate": "16000", "mime_type": "audio/wav", "file_size": "9", "embedding_source": "audio"})
    save_file({"speaker_embedding": np.zeros(8, np.float32)}, str(store.directory / "vec_c_6.safetensors"),
              metadata={"name": "vec", "consent": "c", "created_at": "6", "embedding_source": "direct",
                        "embedding_dim": "8"})
    (store.directory / "broken.safetensors").write_bytes(b"not safetensors")
    restored = UploadedVoices(store.directory, limit=2)
    count, skipped = restored.restore()
    assert count == 3 and len(skipped) == 1 and skipped[0].startswith("broken.safetensors")
    assert [v.name for v in restored.all()] == ["Duo", "narrator", "vec"]
    duo = restored.clip(restored.get("duo"))
    np.testing.assert_allclose(duo[0], np.full(16000, 0.2), atol=1e-6)
    assert restored.get("vec").embedding_dim == 8
    with pytest.raises(BadReference, match="uploaded as a speaker embedding"):
        restored.clip(restored.get("vec"))
    np.testing.assert_array_equal(restored.embedding(restored.get("vec")), np.zeros(8, np.float32))
    with pytest.raises(BadUpload, match="3 voices are uploaded"):
        restored.add("fourth", "c", _clip(), "x.wav", "audio/wav")
    assert restored.add("duo", "c", _clip(), "x.wav", "audio/wav").name == "duo"  # a replacement is no new voice
    for name, data, mime, needle in (("a/b", _clip(), "audio/wav", "not a voice name"),
                                     ("..", _clip(), "audio/wav", "not a voice name"),
                                     ("ok", _clip(), "text/plain", "not audio this server takes"),
                                     ("ok", _clip(0.5), "audio/wav", "0.50 s long")):
        with pytest.raises(BadUpload, match=needle):
            UploadedVoices(tmp_path / "other", limit=5).add(name, "c", data, "x.wav", mime)
    assert restored.remove("DUO") and not restored.remove("duo")
    assert not list(store.directory.glob(".upload-*")) and not (store.directory / "duo_c_5.safetensors").exists()


def test_a_voice_file_half_written_leaves_the_old_voice_and_no_file(tmp_path, monkeypatch):
    """A write that fails (a full disk) keeps the voice as it was and leaves no temporary file; on restore,
    of two files of one voice the later upload is the voice, and a crash's old temporary file is removed."""
    import dataclasses
    import os

    import safetensors.numpy
    from safetensors.numpy import save_file

    from omni_serve.speech.voices import UploadedVoices

    store = UploadedVoices(tmp_path, limit=5)
    first = store.add("x", "a", _clip(), "x.wav", "audio/wav", "Old words.")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        store.add("x", "b", _clip(seed=1), "x.wav", "audio/wav", "New words.")
    monkeypatch.undo()
    assert store.get("x") == first and [p.name for p in tmp_path.iterdir()] == [f"x_a_{first.created_at}.safetensors"]

    # A crash between a replacement's rename and the old file's removal leaves both files: the older one,
    # whose name sorts last here, is not the voice.
    older = dataclasses.replace(first, consent="z", created_at=first.created_at - 100, ref_text="Older words.")
    save_file({"audio": np.zeros(16000, np.float32)}, str(tmp_path / f"x_z_{older.created_at}.safetensors"),
              metadata=older.header())
    stale = tmp_path / ".upload-crashed.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (0, 0))
    restored = UploadedVoices(tmp_path, limit=5)
    count, skipped = restored.restore()
    assert count == 1 and restored.get("x") == first, restored.get("x")
    assert skipped == [f"x_z_{older.created_at}.safetensors: an earlier upload of voice 'x' than "
                       f"x_a_{first.created_at}.safetensors"]
    assert not stale.exists()


def test_of_two_uploads_of_one_name_at_once_the_later_is_the_voice(tmp_path, monkeypatch):
    """The earlier upload's write finishing last neither replaces the later one nor leaves its file."""
    import threading

    import safetensors.numpy

    from omni_serve.speech.voices import UploadedVoices

    store = UploadedVoices(tmp_path, limit=5)
    save_file, release, writing = safetensors.numpy.save_file, threading.Event(), threading.Event()

    def slow_for_the_first(tensors, path, metadata=None):
        if metadata["consent"] == "first":
            writing.set()
            release.wait(10)
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", slow_for_the_first)
    first = threading.Thread(target=store.add, args=("x", "first", _clip(), "x.wav", "audio/wav", "First."))
    first.start()
    assert writing.wait(10)
    later = store.add("x", "later", _clip(seed=1), "x.wav", "audio/wav", "Later.")
    release.set()
    first.join(10)
    assert store.get("x") == later and store.clip(later)[1] == 16000
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [f"x_later_{later.created_at}.safetensors"]


def test_a_fetch_is_bounded_and_kept_to_http(tmp_path):
    """A file that declares more samples than the server decodes is refused before they are read; a redirect
    to another scheme is not followed; an embedding upload's JSON holds numbers a float holds."""
    import soundfile

    from omni_serve.api.protocol import Refused
    from omni_serve.api.server import uploaded_embedding
    from omni_serve.speech.reference import BadReference, References, decoded
    from tests.support.web import QuietHandler, web_server

    many = BytesIO()
    soundfile.write(many, np.zeros((96000 * 8, 8), np.int16), 96000, format="FLAC")  # 8 s, 8 channels: 6.1 M samples
    with pytest.raises(BadReference, match="8 channels at 96000 Hz"):
        decoded(many.getvalue())

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/clip.wav")
            self.end_headers()

    with web_server(Handler) as url:
        with pytest.raises(BadReference, match="led to a ftp URL"):
            References().audio(f"{url}/away")
    with pytest.raises(BadReference, match="credentials or a backslash"):
        References(domains=("allowed.example",)).audio("http://evil.example\\@allowed.example/x.wav")
    assert uploaded_embedding("[1, 2.5, -3, 0]", 4).tolist() == [1, 2.5, -3, 0]
    for text, needle in (("[true, 1, 2, 3]", "JSON list"), ("[[1, 2, 3, 4]]", "JSON list"), ("[1, 2]", "2 dimensions"),
                         (f"[{10 ** 400}, 1, 2, 3]", "a float holds"), ('{"a": 1}', "JSON list"), ("[1,", "must be JSON")):
        with pytest.raises(Refused, match=needle):
            uploaded_embedding(text, 4)


class CloningPrompt(SpokenPrompt):
    """A SpeechPrompt of vllm-omni's Base: no voices, each request's voice its reference (or embedding)."""

    voices: list[str] = []
    task_type = "Base"
    clones_voices = True
    speaker_embedding_size = 4

    def __call__(self, text: str, voice: int, language: str, instructions: str,
                 reference: object = None) -> tuple[list[int], dict]:
        self.calls.append((text, reference))
        return [1, 2], {}

    def reference_tokens(self, reference: object) -> int:
        return 7


def test_a_requests_reference_is_fetched_off_the_event_loop_once_its_cheaper_checks_pass():
    """A request refused for anything else is refused before its reference is fetched; the fetch runs in a
    worker thread, once; what was fetched is what the prompt gets."""
    import asyncio
    import threading

    from omni_serve.api.server import speech_input_fetched
    from omni_serve.speech.reference import BadReference

    config = ServeConfig(served_model_name="tts", voices=[], speech_prompt="unused", stages=CONFIG.stages)
    prompt, threads = CloningPrompt(), []

    def references(source):
        threads.append(threading.get_ident())
        if source == "data:bad":
            raise BadReference("not audio")
        return np.ones(3, np.float32), 8000

    def checked(**fields):
        body = json.dumps({"input": "hi", "ref_text": "Its words.", **fields}).encode()
        return asyncio.run(speech_input_fetched(body, config, prompt, None, references, None))

    for fields, param in (({"ref_audio": "data:good", "response_format": "aiff"}, "response_format"),
                          ({"ref_audio": "data:good", "max_new_tokens": 99}, "max_new_tokens"),
                          ({"ref_audio": "data:good", "speaker_embedding": [1, 2, 3, 4]}, "speaker_embedding")):
        with pytest.raises(Refused) as refused:
            checked(**fields)
        assert refused.value.param == param
    assert threads == [] and prompt.calls == []
    from omni_serve.api.server import usage

    job = checked(ref_audio="data:good").job
    assert len(threads) == 1 and threads[0] != threading.get_ident()
    # vllm-omni's usage: the reference's codec frames are input tokens too (the text's here: len("hi")).
    assert usage(job)["input_tokens"] == 9 and usage(job)["input_token_details"] == {"text_tokens": 2,
                                                                                     "audio_tokens": 7}
    assert prompt.calls[0][1].sample_rate == 8000 and prompt.calls[0][1].text == "Its words."
    with pytest.raises(Refused, match="not audio") as refused:
        checked(ref_audio="data:bad")
    assert refused.value.param == "ref_audio" and len(threads) == 2 and len(prompt.calls) == 1


def test_an_uploaded_voice_replaced_while_its_request_is_read_is_refused(tmp_path):
    import asyncio

    from omni_serve.api.server import speech_input_fetched
    from omni_serve.speech.voices import UploadedVoices

    config = ServeConfig(served_model_name="tts", voices=[], speech_prompt="unused", stages=CONFIG.stages)
    store = UploadedVoices(tmp_path, limit=5)
    store.add("narrator", "c", _clip(), "x.wav", "audio/wav", "Its words.")

    def replaced_meanwhile(source):
        clip = store.clip(source)
        store.add("narrator", "c", _clip(seed=1), "x.wav", "audio/wav", "Other words.")
        return clip

    body = json.dumps({"input": "hi", "voice": "narrator"}).encode()
    with pytest.raises(Refused, match="changed while the request was read") as refused:
        asyncio.run(speech_input_fetched(body, config, CloningPrompt(), None, replaced_meanwhile, store))
    assert refused.value.param == "voice"


def test_a_base_request_names_its_voice_by_reference_audio_or_an_upload(tmp_path):
    """vllm-omni's Base rules: inline ref_audio first (a voice then ignored), else the uploaded voice the
    request names, its transcript unless the request gives one, the embedding alone without one."""
    from omni_serve.api.protocol import Refused, SpeechRequest
    from omni_serve.api.server import voice_reference
    from omni_serve.speech.voices import UploadedVoices

    store = UploadedVoices(tmp_path, limit=5)
    store.add("told", "c", _clip(), "x.wav", "audio/wav", "Its words.")
    store.add("silent", "c", _clip(seed=1), "x.wav", "audio/wav")
    fetched = []

    def references(source):
        fetched.append(source)
        return (np.zeros(4, np.float32), 8000) if isinstance(source, str) else store.clip(source)

    def reference(**fields):
        return voice_reference(SpeechRequest(input="hi", **fields), references, store, 4)

    inline = reference(ref_audio="data:x", ref_text="Mine.", voice="told")
    assert (inline.sample_rate, inline.text, inline.x_vector_only, fetched[-1]) == (8000, "Mine.", False, "data:x")
    told = reference(voice="Told")
    assert (told.sample_rate, told.text, told.x_vector_only) == (16000, "Its words.", False)
    assert reference(voice="told", ref_text="Other words.").text == "Other words."
    assert reference(voice="told", x_vector_only_mode=True).x_vector_only
    silent = reference(voice="silent")
    assert silent.x_vector_only and silent.text == ""
    # The voice as its speaker embedding: given, or uploaded as one (vllm-omni's precomputed voices).
    given = reference(speaker_embedding=[0.5, 1, -2, 0], voice="told")
    assert given.audio is None and given.x_vector_only and given.speaker_embedding.tolist() == [0.5, 1, -2, 0]
    store.add_embedding("vector", "c", np.arange(4))
    named = reference(voice="Vector")
    assert named.audio is None and named.x_vector_only and named.speaker_embedding.tolist() == [0, 1, 2, 3]
    store.add_embedding("narrow", "c", np.arange(3))  # another model's width
    for fields, param, needle in (({"voice": "silent", "x_vector_only_mode": False}, "ref_text", "ref_text"),
                                  ({"voice": "nobody"}, "voice", "uploaded: narrow, silent, told, vector"),
                                  ({}, "ref_audio", "ref_audio is required"),
                                  ({"speaker_embedding": [1, 2, 3]}, "speaker_embedding", "3 dimensions; this model's is 4"),
                                  ({"speaker_embedding": [[1, 2, 3, 4]]}, "speaker_embedding", "flat list"),
                                  ({"speaker_embedding": [1, 2, 3, 4], "ref_audio": "data:x"}, "speaker_embedding",
                                   "give one"),
                                  ({"voice": "narrow"}, "voice", "3 dimensions")):
        with pytest.raises(Refused, match=needle) as refused:
            reference(**fields)
        assert refused.value.param == param


# librosa.filters.mel(sr=24000, n_fft=64, n_mels=4, fmin=0, fmax=12000), rounded to 8 places: Slaney's
# filters by an independent implementation (librosa is not a dependency of these tests).
LIBROSA_MEL_4x33 = [
    [0.0, 0.00075577, 0.00125331, 0.00058692] + [0.0] * 29,
    [0.0, 0.0, 7.798e-05, 0.00050744, 0.000859, 0.00063531, 0.00041163, 0.00018794] + [0.0] * 25,
    [0.0] * 4 + [1.343e-05, 0.00012607, 0.00023871, 0.00035135, 0.00043707, 0.00038132, 0.00032556, 0.00026981,
                 0.00021406, 0.0001583, 0.00010255, 4.68e-05] + [0.0] * 17,
    [0.0] * 8 + [4.41e-06, 3.201e-05, 5.96e-05, 8.72e-05, 0.0001148, 0.00014239, 0.00016999, 0.00019759, 0.00021856,
                 0.0002049, 0.00019124, 0.00017758, 0.00016392, 0.00015026, 0.0001366, 0.00012294, 0.00010928,
                 9.562e-05, 8.196e-05, 6.83e-05, 5.464e-05, 4.098e-05, 2.732e-05, 1.366e-05, 0.0],
]


def test_the_torchaudio_stand_ins_mel_filters_are_librosas():
    """The CPU tests' torchaudio stand-in computes the mel filters of vllm-omni's speaker encoder (voice cloning)."""
    import importlib.util

    stub = Path(__file__).parent / "support" / "torchaudio_stub" / "torchaudio" / "functional.py"
    spec = importlib.util.spec_from_file_location("torchaudio_stand_in_functional", stub)
    functional = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(functional)
    filters = functional.melscale_fbanks(33, 0.0, 12000.0, 4, 24000, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(filters.T.numpy(), np.array(LIBROSA_MEL_4x33), atol=1e-8)
    with pytest.raises(NotImplementedError):
        functional.melscale_fbanks(33, 0.0, 12000.0, 4, 24000)  # torchaudio's HTK default: not stood in


def test_a_batch_items_failure_is_its_own():
    """A stage's failure or any other error in one item is that item's result; the others are answered."""
    import asyncio
    from types import SimpleNamespace

    from omni_serve.api.server import SpeechInput, _batch
    from omni_serve.speech.pipeline import StageFailed

    async def audio(job, arrived):
        if job.request_id == "stage":
            raise StageFailed("talker", "its engine failed the request")
        if job.request_id == "bug":
            raise RuntimeError("something else")
        yield np.full(4, 0.5, np.float32)

    class Client:
        async def is_disconnected(self) -> bool:
            return False

    server = SimpleNamespace(config=SimpleNamespace(sample_rate=300), audio=audio)
    items = [SpeechInput(SimpleNamespace(request_id=rid, input_tokens=2, reference_tokens=0, frames=1), "pcm", False, False)
             for rid in ("ok", "stage", "bug")]
    answer = json.loads(asyncio.run(_batch(Client(), server, [*items, Refused("bad voice")], 0.0)).body)
    assert [r["status"] for r in answer["results"]] == ["success", "error", "error", "error"]
    assert (answer["succeeded"], answer["failed"]) == (1, 3)
    assert "its engine failed" in answer["results"][1]["error"] and answer["results"][2]["error"] == "something else"
    assert answer["results"][3] == {"index": 3, "status": "error", "error": "bad voice"}
    assert np.frombuffer(base64.b64decode(answer["results"][0]["audio_data"]), "<i2").tolist() == [16384] * 4


def test_a_batch_whose_client_went_away_aborts_every_item():
    """Every item's stream closed (the pipeline aborts a request whose stream is closed), a 499."""
    import asyncio
    from types import SimpleNamespace

    from omni_serve.api.server import SpeechInput, _batch

    closed = []

    async def audio(job, arrived):
        try:
            await asyncio.sleep(3600)
            yield np.zeros(1, np.float32)
        finally:
            closed.append(job.request_id)

    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    server = SimpleNamespace(config=SimpleNamespace(sample_rate=300), audio=audio)
    items = [SpeechInput(SimpleNamespace(request_id=f"r{i}"), "pcm", False, False) for i in range(3)]
    answer = asyncio.run(_batch(GoneClient(), server, [*items, Refused("bad")], 0.0))
    assert answer.status_code == 499 and sorted(closed) == ["r0", "r1", "r2"]


def test_vllms_ipc_sockets_go_in_a_directory_of_the_servers(monkeypatch, tmp_path):
    """vLLM leaves its IPC sockets in $VLLM_RPC_BASE_PATH (the temporary directory by default): the server
    gives it a directory of its own to remove on exit, one short enough for a socket's address."""
    import os
    import tempfile

    from omni_serve import cli

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/chosen/by/the/operator")
    assert cli.vllm_rpc_dir() is None and os.environ["VLLM_RPC_BASE_PATH"] == "/chosen/by/the/operator"
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    short = Path(tempfile.mkdtemp(prefix="s-", dir="/tmp"))
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    made = []
    try:
        for tmpdir, parent in ((short, short), (deep, Path("/tmp"))):
            monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
            monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
            made.append(Path(cli.vllm_rpc_dir()))
            assert made[-1].parent == parent and made[-1].is_dir()
            assert os.environ["VLLM_RPC_BASE_PATH"] == str(made[-1])
            assert len(f"{made[-1]}/{'u' * cli.UUID_CHARS}") <= cli.MAX_SOCKET_PATH
        assert list(deep.iterdir()) == []  # the long one's directory not left behind
    finally:
        for path in made:
            path.rmdir()
        short.rmdir()
