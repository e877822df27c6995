"""`POST /v1/chat/completions`'s request and answer, without engines: a chat request becomes the
thinker's job (its prompt from the config's thinker_prompt, the voice, the modalities, the limits)
or one clear refusal; the whole and the streamed answers have vllm-omni's shape."""

from __future__ import annotations

import base64
import json
import wave
from io import BytesIO

import numpy as np
import pytest

from omni_serve.api import audio
from omni_serve.api.chat import ChatInput, TextDeltas, chat_input, chat_sse, completion
from omni_serve.api.protocol import Refused
from omni_serve.api.server import one_message
from omni_serve.config import ServeConfig, StageSpec
from omni_serve.speech.pipeline import StageFailed

CONFIG = ServeConfig(served_model_name="omni", voices=["a", "b"], max_input_chars=10, thinker_prompt="unused",
                     stages={"thinker": StageSpec("thinker", "m", max_tokens=8),
                             "talker": StageSpec("talker", "m", max_tokens=32),
                             "code2wav": StageSpec("code2wav", "m")})
RATE = 100


def prompt(messages: list[dict[str, str]], voice: int) -> tuple[list[int], dict]:
    return [voice] + [ord(m["role"][0]) for m in messages], {"texts": [m["content"] for m in messages]}


def parse(body) -> ChatInput:
    return chat_input(body if isinstance(body, bytes) else json.dumps(body).encode(), CONFIG, prompt)


HI = [{"role": "user", "content": "hi"}]


def test_a_chat_request_becomes_the_thinkers_job_with_its_conversation_voice_and_modalities():
    got = parse({"model": "omni", "messages": [{"role": "system", "content": "be"},
                                               {"role": "user", "content": [{"type": "text", "text": "h"},
                                                                            {"type": "text", "text": "i"}]}],
                 "audio": {"voice": "b", "format": "pcm16"}, "max_tokens": 5, "seed": 3})
    assert got.job.prompt_token_ids == [1, ord("s"), ord("u")] and got.job.payload == {"texts": ["be", "h\ni"]}
    assert got.modalities == ("text", "audio") and got.job.speak and got.audio_format == "pcm"
    assert (got.job.max_text_tokens, got.job.max_frames, got.job.seed, got.job.input_tokens) == (5, 32, 3, 3)
    assert got.job.request_id.startswith("chatcmpl-") and not got.stream and not got.include_usage
    defaults = parse({"messages": HI})
    assert defaults.job.prompt_token_ids[0] == 0 and defaults.audio_format == "wav"
    assert defaults.job.max_text_tokens == 8 and defaults.modalities == ("text", "audio")
    assert parse({"messages": HI, "modalities": []}).modalities == ("text", "audio")  # vllm-omni: all
    # vllm-omni's top-level voice (or speaker) before OpenAI's audio.voice.
    assert parse({"messages": HI, "voice": "b", "audio": {"voice": "a"}}).job.prompt_token_ids[0] == 1
    assert parse({"messages": HI, "speaker": "b"}).job.prompt_token_ids[0] == 1
    text_only = parse({"messages": HI, "modalities": ["text"], "audio": {"format": "mp3"}})
    assert not text_only.job.speak  # the thinker alone; no audio, so its format is not looked at
    # vllm-omni's example client: modalities null, an empty mm_processor_kwargs, text parts in a system message.
    example = parse({"messages": [{"role": "system", "content": [{"type": "text", "text": "q"}]}, *HI],
                     "modalities": None, "mm_processor_kwargs": {}})
    assert example.modalities == ("text", "audio") and example.job.payload == {"texts": ["q", "hi"]}
    streamed = parse({"messages": HI, "stream": True, "stream_options": {"include_usage": True},
                      "max_completion_tokens": 2, "n": 1, "user": "u", "logprobs": False})
    assert streamed.stream and streamed.include_usage and streamed.job.max_text_tokens == 2


def test_the_speech_endpoints_input_is_one_user_message_of_the_same_prompt():
    assert one_message(prompt, "hi", 1) == prompt(HI, 1)


@pytest.mark.parametrize("body, status, param, needle", [
    ({"messages": []}, 400, "messages", "messages is empty"),
    ({}, 400, "messages", "Field required"),
    ({"messages": [{"role": "user", "content": " "}]}, 400, "messages", "hold no text"),
    ({"messages": [{"role": "user", "content": "x" * 11}]}, 400, "messages", "11 characters; at most 10"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role", "Input should be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content", "only text parts"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, 400, "messages.0.name", "messages.0.name"),
    ({"messages": HI, "modalities": ["image", "text"]}, 400, "modalities", "unsupported output modalities image"),
    ({"messages": HI, "modalities": "audio"}, 400, "modalities", "valid list"),
    ({"messages": HI, "voice": "c"}, 400, "voice", "unknown voice 'c'; voices: a, b"),
    ({"messages": HI, "audio": {"format": "aac"}}, 400, "audio.format", "'aac' is not supported"),
    ({"messages": HI, "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"messages": HI, "top_k": -5}, 400, "top_k", "greater than or equal to -1"),
    ({"messages": HI, "stop_token_ids": [2**64]}, 400, "stop_token_ids.0", "less than or equal to"),
    ({"messages": HI, "sampling_params_list": [{}, {}, {}, {}]}, 400, "sampling_params_list",
     "4 entries; this pipeline has 3 stages (thinker, talker, code2wav)"),
    ({"messages": HI, "sampling_params_list": [{"bogus": 1}]}, 400, "sampling_params_list.0.bogus",
     "Extra inputs are not permitted"),
    ({"messages": HI, "sampling_params_list": [{"logprobs": 2}]}, 400, "sampling_params_list.0.logprobs",
     "Extra inputs are not permitted"),
    ({"messages": HI, "sampling_params_list": [{}, {"temperature": -2}]}, 400, "sampling_params_list.1.temperature",
     "greater than or equal to 0"),
    ({"messages": HI, "sampling_params_list": [{"n": 2}]}, 400, "sampling_params_list.0.n", "less than or equal to 1"),
    ({"messages": HI, "sampling_params_list": [{"seed": "x"}]}, 400, "sampling_params_list.0.seed", "valid integer"),
    ({"messages": HI, "sampling_params_list": [{"max_tokens": 0}]}, 400, "sampling_params_list.0.max_tokens",
     "greater than or equal to 1"),
    ({"messages": HI, "sampling_params_list": [{"min_tokens": 9}]}, 400, "sampling_params_list.0",
     "the thinker's sampling: min_tokens"),
    ({"messages": HI, "min_tokens": 9}, 400, "min_tokens", "the thinker's sampling: min_tokens"),
    ({"messages": HI, "stop": ["x"]}, 400, "stop", "not supported by this server: stop"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, 400, "stream_options", "needs stream=true"),
    ({"messages": HI, "stream": True, "stream_options": {"include_usage": True, "chunk_usage": True}}, 400,
     "stream_options.chunk_usage", "not supported by this server: stream_options.chunk_usage"),
    (b"{", 400, None, "not valid JSON"),
    (b"[]", 400, None, "JSON object"),
])
def test_bad_chat_requests_are_refused_with_one_message(body, status, param, needle):
    with pytest.raises(Refused) as caught:
        parse(body)
    assert (caught.value.status, caught.value.param) == (status, param)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_sampling_fields_are_the_thinkers_over_the_pipeline_files_as_vllm_omni_takes_them():
    got = parse({"messages": HI, "temperature": 1, "top_p": 0.5, "top_k": 3, "presence_penalty": 0.5,
                 "stop_token_ids": [], "min_tokens": 8, "seed": 7})
    assert got.job.sampling == {"thinker": {"temperature": 1, "top_p": 0.5, "top_k": 3, "presence_penalty": 0.5,
                                            "min_tokens": 8}}
    assert got.job.seed == 7 and parse({"messages": HI}).job.sampling == {}


def test_vllm_omnis_sampling_params_list_is_each_stages_in_order():
    # As vllm-omni's Qwen3-Omni example client sends it: its model's lengths, capped at this server's.
    got = parse({"messages": HI, "sampling_params_list": [
        {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 2048, "seed": 42, "detokenize": True,
         "repetition_penalty": 1.05},
        {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
         "repetition_penalty": 1.05, "stop_token_ids": [2150]},
        {"temperature": 0.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True,
         "repetition_penalty": 1.1}]})
    assert got.job.sampling == {
        "thinker": {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "seed": 42, "repetition_penalty": 1.05},
        "talker": {"temperature": 0.9, "top_k": 50, "seed": 42, "repetition_penalty": 1.05, "stop_token_ids": [2150]}}
    assert (got.job.max_text_tokens, got.job.max_frames) == (8, CONFIG.stages["talker"].max_tokens)
    # An entry over the top-level fields, its max_tokens too (vllm-omni reads only the list then).
    fewer = parse({"messages": HI, "max_tokens": 5, "temperature": 0.5, "top_k": 2,
                   "sampling_params_list": [{"max_tokens": 3, "temperature": 0.1}, {"max_tokens": 2}]})
    assert (fewer.job.max_text_tokens, fewer.job.max_frames) == (3, 2)
    assert fewer.job.sampling == {"thinker": {"temperature": 0.1, "top_k": 2}}


def test_openais_audio_voice_is_ours_only_when_it_names_one_of_ours():
    assert parse({"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}).job.prompt_token_ids[0] == 0
    assert parse({"messages": HI, "audio": {"voice": "B", "format": "wav"}}).job.prompt_token_ids[0] == 1
    assert parse({"messages": HI, "voice": "a", "audio": {"voice": "b"}}).job.prompt_token_ids[0] == 0
    assert parse({"messages": HI, "voice": " B "}).job.prompt_token_ids[0] == 1  # stripped, as vllm-omni
    assert parse({"messages": HI, "voice": "  "}).job.prompt_token_ids[0] == 0


def test_a_prompt_longer_than_the_thinker_takes_is_refused_not_failed_in_its_engine():
    body = json.dumps({"messages": [*HI, {"role": "assistant", "content": "yo"}, *HI]}).encode()
    assert chat_input(body, CONFIG, prompt, max_prompt_tokens=4).job.prompt_token_ids == [0, *b"uau"]
    with pytest.raises(Refused) as caught:
        chat_input(body, CONFIG, prompt, max_prompt_tokens=3)
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert "a prompt of 4 tokens" in str(caught.value) and "at most 3" in str(caught.value)


def answered(modalities: list[str], fmt: str = "wav") -> ChatInput:
    got = parse({"messages": HI, "modalities": modalities, "audio": {"format": fmt}})
    got.job.text_ids, got.job.text_finish = [5, 6, 7], "length"
    return got


def test_a_whole_answer_is_a_text_choice_then_an_audio_choice_as_vllm_omni_gives_them():
    samples = np.linspace(-1, 1, 50, dtype=np.float32)
    body = completion(answered(["text", "audio"]), "hey", samples, "omni", RATE)
    assert body["object"] == "chat.completion" and body["model"] == "omni" and body["id"].startswith("chatcmpl-")
    said, spoken = body["choices"]
    assert said == {"index": 0, "message": {"role": "assistant", "content": "hey"}, "logprobs": None,
                    "finish_reason": "length", "stop_reason": None}
    assert spoken["index"] == 0 and spoken["finish_reason"] == "stop" and spoken["message"]["content"] is None
    clip = spoken["message"]["audio"]
    assert clip["id"].startswith("audio-") and clip["transcript"] == "" and clip["expires_at"] > body["created"]
    with wave.open(BytesIO(base64.b64decode(clip["data"]))) as wav:
        assert wav.getframerate() == RATE
        assert wav.readframes(wav.getnframes()) == audio.pcm16(samples)
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert [c["message"]["content"] for c in completion(answered(["text"]), "hey", None, "omni", RATE)["choices"]] \
        == ["hey"]
    only_audio = completion(answered(["audio"], "pcm"), None, samples, "omni", RATE)["choices"]
    assert len(only_audio) == 1 and base64.b64decode(only_audio[0]["message"]["audio"]["data"]) == audio.pcm16(samples)


class Letters:
    """A tokenizer of one letter per id (a..z), with 100 and 101 the two UTF-8 bytes of "é"."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        raw = b"".join(b"\xc3" if i == 100 else b"\xa9" if i == 101 else bytes([ord("a") + i]) for i in token_ids)
        return raw.decode("utf-8", errors="replace")


def test_text_deltas_add_up_to_the_whole_text_and_never_split_a_character():
    deltas = TextDeltas(Letters())
    sent = [deltas.add([0]), deltas.add([1, 100]), deltas.add([101]), deltas.add([2]), deltas.add([100])]
    assert sent == ["a", "", "bé", "c", ""] and deltas.rest() == "\ufffd"  # "b" waits with the half "é"
    assert "".join(sent) + "\ufffd" == Letters().decode([0, 1, 100, 101, 2, 100])


async def parts(*items, fail: bool = False):
    for item in items:
        yield item
    if fail:
        raise StageFailed("talker", "its sidecar was lost")


def events(got: ChatInput, items: list, fail: bool = False) -> list:
    async def run() -> list[str]:
        return [e async for e in chat_sse(got, items[0], parts(*items[1:], fail=fail), TextDeltas(Letters()),
                                          "omni", RATE)]

    import asyncio

    out = asyncio.run(run())
    assert out[-1] == "data: [DONE]\n\n" and all(e.startswith("data: ") and e.endswith("\n\n") for e in out)
    return [json.loads(e[6:]) for e in out[:-1]]


def test_a_streamed_answer_is_text_deltas_then_audio_chunks_the_last_with_the_finish_reason():
    one, two = np.full(4, 0.5, np.float32), np.full(6, -0.25, np.float32)
    got = answered(["text", "audio"], "pcm")
    got.include_usage = True
    sent = events(got, [[0, 1], [2], one, np.zeros(0, np.float32), two])
    assert [e.get("modality") for e in sent] == ["text", "text", "text", "audio", "audio", None]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == got.job.request_id for e in sent)
    deltas = [e["choices"][0]["delta"] for e in sent[:-1]]
    assert deltas[:3] == [{"role": "assistant", "content": ""}, {"content": "ab"}, {"content": "c"}]
    assert [d["role"] for d in deltas[3:]] == ["assistant"] * 2  # vllm-omni's audio deltas carry the role
    assert [base64.b64decode(d["content"]) for d in deltas[3:]] == [audio.pcm16(one), audio.pcm16(two)]
    assert [e["choices"][0]["finish_reason"] for e in sent[:-1]] == [None, None, None, None, "stop"]
    assert sent[3]["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    assert sent[-1]["choices"] == [] and sent[-1]["usage"]["completion_tokens"] == 3
    # Text only: its last delta carries the thinker's finish reason; no usage chunk unless asked.
    text = events(answered(["text"]), [[0], [1]])
    assert [e["choices"][0]["delta"].get("content") for e in text] == ["", "a", "b"]
    assert [e["choices"][0]["finish_reason"] for e in text] == [None, None, "length"]
    # Audio only: the thinker's deltas are not sent; each chunk a WAV of its own (vllm-omni's).
    spoken = events(answered(["audio"]), [[0], one])
    assert [e["modality"] for e in spoken] == ["audio"] and spoken[0]["choices"][0]["finish_reason"] == "stop"
    assert base64.b64decode(spoken[0]["choices"][0]["delta"]["content"]) == audio.wav(one, RATE)


def test_continuous_usage_gives_every_text_chunk_the_tokens_so_far_as_vllm_omnis_benchmark_asks():
    # vllm-omni's chat benchmark client sends exactly these stream options.
    got = parse({"messages": HI, "temperature": 0.0, "max_tokens": 3, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert got.include_usage and got.continuous_usage and got.job.sampling == {"thinker": {"temperature": 0.0}}
    got.job.text_ids, got.job.text_finish = [0, 1, 2], "length"
    sent = events(got, [[0, 1], [2], np.full(4, 0.5, np.float32)])
    text = [e for e in sent if e.get("modality") == "text"]
    assert [e["usage"]["completion_tokens"] for e in text] == [0, 2, 3]
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in text)
    assert sent[-1]["choices"] == [] and sent[-1]["usage"]["completion_tokens"] == 3
    # Without include_usage it asks for nothing (vLLM's rule).
    assert not parse({"messages": HI, "stream": True, "stream_options": {"continuous_usage_stats": True}}
                     ).continuous_usage


def test_a_stage_failing_mid_stream_ends_it_with_an_error_event_then_done():
    sent = events(answered(["text", "audio"]), [[0], np.ones(2, np.float32)], fail=True)
    assert sent[-1]["error"]["code"] == 503 and "its sidecar was lost" in sent[-1]["error"]["message"]
    assert [e.get("modality") for e in sent[:-1]] == ["text", "text", "audio"]  # what was made, then why it ended
    assert [e["choices"][0]["finish_reason"] for e in sent[:-1]] == [None, None, None]


def test_stop_token_ids_outside_a_stages_vocabulary_are_refused_not_failed_in_its_engine():
    """vLLM's engine refuses them once the request runs (a 503, or an error mid-stream for the talker's);
    here they are the request's 400, checked against each stage engine's vocabulary."""
    vocab = {"thinker": 384, "talker": 3072}
    for body, param in (({"messages": HI, "stop_token_ids": [383, 384]}, "stop_token_ids"),
                        ({"messages": HI, "sampling_params_list": [{}, {"stop_token_ids": [3072]}]},
                         "sampling_params_list.1")):
        request = json.dumps(body).encode()
        assert chat_input(request, CONFIG, prompt).job  # unchecked without the engines' vocabularies
        with pytest.raises(Refused, match="stop_token_ids \\[(384|3072)\\] are outside its vocabulary") as caught:
            chat_input(request, CONFIG, prompt, vocab_sizes=vocab)
        assert (caught.value.status, caught.value.param) == (400, param)
    ok = json.dumps({"messages": HI, "stop_token_ids": [383]}).encode()
    assert chat_input(ok, CONFIG, prompt, vocab_sizes=vocab).job.sampling["thinker"]["stop_token_ids"] == [383]


def test_a_stages_max_tokens_below_its_min_tokens_is_refused_even_with_no_other_field():
    """`sampling_params_list: [{}, {"max_tokens": 1}]` sets the talker's limit alone: still checked against the
    pipeline's min_tokens (else the talker's request fails once the thinker has answered)."""
    import dataclasses

    talker = dataclasses.replace(CONFIG.stages["talker"], sampling={"min_tokens": 2})
    config = dataclasses.replace(CONFIG, stages={**CONFIG.stages, "talker": talker})
    body = {"messages": HI, "sampling_params_list": [{}, {"max_tokens": 2}]}
    assert chat_input(json.dumps(body).encode(), config, prompt).job.max_frames == 2
    body["sampling_params_list"][1]["max_tokens"] = 1
    with pytest.raises(Refused, match="the talker's sampling: min_tokens must be less than or equal to") as caught:
        chat_input(json.dumps(body).encode(), config, prompt)
    assert caught.value.param == "sampling_params_list.1"
