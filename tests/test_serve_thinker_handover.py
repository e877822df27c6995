"""The thinker -> talker hand-over of omni-serve, without engines.

- the pipeline's thinker stage hands `talker_prompt` one `ThinkerOutput`: its sidecar's assembled
  outputs (every captured layer), its prompt as the engine ran it and every token it generated;
  a thinker short of rows, or a hand-over that refuses, fails the stage;
- the talker's frames keep only those in the codec's codebook (a stop frame is no audio);
- vllm-omni's Qwen3-Omni hand-over (worker_shim/omni_models/qwen3_omni/handover.py, omni-serve's
  `talker_prompt`): vllm-omni's own `thinker2talker_full_payload` on fake layers gives the keys and
  shapes its talker's prefill reads, the prompt as long as vllm-omni computes it, the speaker; the
  tts embeddings are the checkpoint's rows (one file or shards); its payload encodes as
  `additional_information`. Those need vllm-omni's stage input processors to import here
  (vllm-omni 0.26 beside vLLM 0.26, else the project's vllm-omni where its processors import;
  skipped, saying why, where none does);
- a job not spoken (a chat answer in text only) ends with the thinker, its tokens handed on as they come;
- the tiny Qwen3-Omni's thinker prompt is what its tokenizer and the published chat layout give.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_serve.speech.handover import HIDDEN, ThinkerOutput

H = 8  # the fake thinker's width


class ThinkerEngine:
    """A thinker engine that makes `tokens` one a step (DELTA outputs), its prompt expanded by one."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    async def generate(self, prompt, params, request_id):
        self.params = params
        ran = prompt["prompt_token_ids"] + [99]  # as a multimodal placeholder would expand it
        for i, token in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            yield SimpleNamespace(finished=last, prompt_token_ids=ran,
                                  outputs=[SimpleNamespace(token_ids=[token], finish_reason="length" if last else None)])


class FinishedLink:
    """A thinker sidecar that has finished the request with these outputs."""

    def __init__(self, values: dict) -> None:
        self.values = values

    async def outputs(self, request_id):
        from omni_serve.stages.link import Followed

        return self.values, Followed([], True, True)

    async def follow(self, request_id, cursor):
        from omni_serve.stages.link import Followed

        return Followed([], True, True), cursor

    async def forget(self, request_id):
        pass


def thinker_pipeline(values: dict, tokens: list[int], talker_prompt):
    from omni_serve.speech.pipeline import SpeechPipeline, Stage, ThinkerStage
    from proto.chunk_grid import ChunkGrid

    thinker = ThinkerStage(Stage("thinker", ThinkerEngine(tokens), FinishedLink(values)), len(tokens), talker_prompt,
                           "/models/thinker")
    return SpeechPipeline(Stage("talker", None, FinishedLink({})), Stage("code2wav", None, FinishedLink({})),
                          chunks=ChunkGrid(4), left_context=0, placeholder_token=0, thinker=thinker)


def run_thinker(pipeline, job):
    """The thinker's request, then the talker's job made from it."""
    async def run():
        try:
            made = await pipeline._run_thinker(job, pipeline.thinker)
            return await pipeline._talker_job(job, made, pipeline.thinker)
        finally:
            await pipeline.close()

    return asyncio.run(run())


def test_the_talker_prompt_gets_every_captured_layer_and_the_ids_the_engine_ran():
    from omni_serve.speech.pipeline import SpeechJob

    prompt, tokens = [1, 2, 3], [7, 8, 9]
    rows = len(prompt) + 1 + len(tokens) - 1  # the expanded prompt, then every token but the last
    values = {"hidden_states.layer_0": np.ones((rows, H), np.float32),
              "hidden_states.layer_24": np.full((rows, H), 2.0, np.float32),
              "processed_trace": np.zeros((rows, 2), np.int64), "prompt_len": 4}
    seen: list[ThinkerOutput] = []

    def talker_prompt(thinker: ThinkerOutput):
        seen.append(thinker)
        return [0] * 5, {"ids": {"prompt": thinker.prompt_ids}}

    job = SpeechJob("r1", prompt, {"speaker": ["ethan"]}, max_frames=16, seed=3)
    talker_job = run_thinker(thinker_pipeline(values, tokens, talker_prompt), job)
    (got,) = seen
    assert got.prompt_ids == [1, 2, 3, 99] and got.output_ids == tokens
    assert sorted(got.layers) == [0, 24] and float(got.layers[24][0, 0]) == 2.0
    assert sorted(got.rows()) == ["hidden_states.layer_0", "hidden_states.layer_24"]  # token rows, floats only
    assert got.model == "/models/thinker" and got.payload == {"speaker": ["ethan"]}
    assert (talker_job.request_id, talker_job.prompt_token_ids, talker_job.max_frames, talker_job.seed) == \
        ("r1", [0] * 5, 16, 3)
    assert talker_job.payload == {"ids": {"prompt": [1, 2, 3, 99]}}


def test_a_text_only_job_ends_with_the_thinker_its_tokens_handed_on_as_they_come():
    from omni_serve.speech.pipeline import SpeechJob

    def never(thinker: ThinkerOutput):
        raise AssertionError("no hand-over for a job not spoken")

    pipeline = thinker_pipeline({}, [7, 8, 9], never)  # a sidecar with no rows: none are read
    deltas: list[list[int]] = []
    job = SpeechJob("r1", [1, 2], {}, max_frames=4, speak=False, max_text_tokens=2, on_text=deltas.append)

    async def run():
        try:
            return [chunk async for chunk in pipeline.synthesize(job)]
        finally:
            await pipeline.close()

    assert asyncio.run(run()) == []
    assert deltas == [[7], [8], [9]] and job.text_ids == [7, 8, 9] and job.text_finish == "length"
    assert pipeline.thinker.stage.in_flight == 0 and job.frames == 0
    assert pipeline.thinker.stage.engine.params.max_tokens == 2  # the job's limit, not the stage's 3


def test_a_thinker_short_of_prompt_rows_or_a_refused_hand_over_fails_the_thinker_stage():
    from omni_serve.speech.pipeline import SpeechJob, StageFailed

    job = SpeechJob("r1", [1, 2, 3], {}, max_frames=4)
    short = {HIDDEN: np.ones((2, H), np.float32)}  # 2 rows for a prompt of 4
    with pytest.raises(StageFailed, match="thinker: its sidecar has no hidden rows for the request's 4 prompt"):
        run_thinker(thinker_pipeline(short, [5], lambda t: ([0], {})), job)

    def refuses(thinker):
        raise ValueError("no layer 24")

    enough = {HIDDEN: np.ones((4, H), np.float32)}
    with pytest.raises(StageFailed, match="thinker: its hand-over to the talker failed: no layer 24"):
        run_thinker(thinker_pipeline(enough, [5], refuses), job)


def test_the_tiny_thinkers_hand_over_reads_its_last_layer_rows():
    from tests.tiny_models.talker import CODEC_BOS_ID, CODEC_PAD_ID, TALKER_CONFIG, thinker_talker_prompt

    width = TALKER_CONFIG["thinker_hidden_size"]
    rows = np.arange(5 * (width + 3), dtype=np.float32).reshape(5, width + 3)
    prompt_ids, payload = thinker_talker_prompt(ThinkerOutput({HIDDEN: rows}, [1, 2, 3], [4, 5, 6], "m"))
    assert prompt_ids == [CODEC_BOS_ID, CODEC_PAD_ID, CODEC_PAD_ID]
    np.testing.assert_array_equal(payload["hidden_states"]["output"], rows[:, :width])
    np.testing.assert_allclose(payload["embed"]["tts_pad"], rows[:3, :width].mean(axis=0, keepdims=True))


def test_frames_outside_the_codebook_are_no_audio():
    from omni_serve.speech.pipeline import Frames

    codes = np.array([[1, 2], [2150, 5], [3, 4], [5, -1]])
    frames = Frames(codebook_size=2048)
    frames.set(codes[:2])
    assert frames.count == 1
    frames.set(codes)
    np.testing.assert_array_equal(frames.all(), [[1, 2], [3, 4]])
    unchecked = Frames()
    unchecked.set(codes)
    assert unchecked.count == 4


def test_the_tiny_qwen3_omni_thinker_prompt_is_its_tokenizers_text_in_the_published_chat_layout(tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_models.qwen3_omni import NEWLINE_ID, SPEAKER_IDS, TOP, text_ids, thinker_prompt, write_tokenizer

    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello, wörld!\n"
    assert text_ids(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, payload = thinker_prompt([{"role": "user", "content": text}], 1)
    assert ids[:3] == [TOP["im_start_token_id"], TOP["user_token_id"], NEWLINE_ID]
    assert ids[3:-5] == text_ids(text)
    assert ids[-5:] == [TOP["im_end_token_id"], NEWLINE_ID, TOP["im_start_token_id"], TOP["assistant_token_id"],
                        NEWLINE_ID]
    assert payload == {"speaker": [list(SPEAKER_IDS)[1]]}
    # A conversation: each turn with its role's id, then the assistant's opening.
    turns, _ = thinker_prompt([{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                               {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}], 0)
    roles = [turns[i + 1] for i, t in enumerate(turns) if t == TOP["im_start_token_id"]]
    assert roles == [TOP["system_token_id"], TOP["user_token_id"], TOP["assistant_token_id"], TOP["user_token_id"],
                     TOP["assistant_token_id"]]
    assert turns[:6] == [TOP["im_start_token_id"], TOP["system_token_id"], NEWLINE_ID, *text_ids("a"),
                         TOP["im_end_token_id"], NEWLINE_ID]


# ---- vllm-omni's Qwen3-Omni hand-over ----

def _vllm_omni_folder() -> Path | None:
    """The vllm-omni paired with this venv's vLLM: 0.26's beside vLLM 0.26, else the project's."""
    from tests.support.paired_vllm_omni import VLLM_OMNI
    from tests.support.vllm_omni_payload import INSTALLED_AT

    return next((folder for folder in (VLLM_OMNI, INSTALLED_AT) if (folder / "vllm_omni").is_dir()), None)


@pytest.fixture
def handover(monkeypatch):
    """worker_shim/omni_models/qwen3_omni/handover.py with this venv's vllm-omni stood in; sys.modules
    restored after (the stand-in must not outlive the test)."""
    folder = _vllm_omni_folder()
    if folder is None:
        pytest.skip(f"no vllm-omni installed beside this venv ({sys.prefix}/vllm-omni-<version>)")
    monkeypatch.syspath_prepend(str(folder))
    ours = ("vllm_omni", "worker_shim.omni_models.qwen3_omni.handover")
    before = {name for name in sys.modules if name.startswith(ours)}
    try:
        try:
            from worker_shim.omni_models.qwen3_omni import handover as module
        except ImportError as exc:  # vllm-omni's stage input processors against another vLLM than theirs
            pytest.skip(f"vllm-omni's Qwen3-Omni stage input processors do not import here: "
                        f"{type(exc).__name__}: {exc}")
        yield module
    finally:
        for name in [n for n in sys.modules if n.startswith(ours) and n not in before]:
            del sys.modules[name]


def write_checkpoint(path: Path, sharded: bool) -> torch.Tensor:
    """A config with the published tts token ids and a thinker embedding table (bf16), as one file or
    as shards with their index."""
    from safetensors.torch import save_file

    from tests.tiny_models.qwen3_omni import TOP

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**{k: v for k, v in TOP.items() if k.endswith("_token_id")},
                                                  "talker_config": {"accept_hidden_layer": 24}}))
    table = torch.randn(152064, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    other = {"thinker.lm_head.weight": torch.zeros(2, H)}
    if sharded:
        save_file({"thinker.model.embed_tokens.weight": table}, str(path / "model-00002-of-00002.safetensors"))
        save_file(other, str(path / "model-00001-of-00002.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "thinker.model.embed_tokens.weight": "model-00002-of-00002.safetensors",
            "thinker.lm_head.weight": "model-00001-of-00002.safetensors"}}))
    else:
        save_file({**other, "thinker.model.embed_tokens.weight": table}, str(path / "model.safetensors"))
    return table


@pytest.mark.parametrize("sharded", [False, True])
def test_the_tts_embeddings_are_the_thinkers_rows_of_the_configs_tts_tokens(handover, tmp_path, sharded):
    from tests.tiny_models.qwen3_omni import TOP

    table = write_checkpoint(tmp_path / "ckpt", sharded)
    got = handover.tts_embeddings(tmp_path / "ckpt")
    assert sorted(got) == ["embed.tts_bos", "embed.tts_eos", "embed.tts_pad"]
    for name in ("tts_bos", "tts_eos", "tts_pad"):
        assert got[f"embed.{name}"].shape == (1, 1, H) and got[f"embed.{name}"].dtype == torch.bfloat16
        assert torch.equal(got[f"embed.{name}"].reshape(-1), table[TOP[f"{name}_token_id"]])
    assert handover.tts_embeddings(tmp_path / "ckpt", torch.float32)["embed.tts_pad"].dtype == torch.float32


def thinker_layers(prompt: list[int], output: list[int]) -> dict[str, torch.Tensor]:
    rows = len(prompt) + len(output)  # vllm-omni's accumulated rows; its hand-over drops the last
    g = torch.Generator().manual_seed(1)
    return {"hidden_states.layer_0": torch.randn(rows, H, generator=g),
            "hidden_states.layer_24": torch.randn(rows, H, generator=g)}


def test_vllm_omnis_hand_over_gives_the_keys_and_rows_its_talker_prefill_reads(handover):
    from tests.tiny_models.qwen3_omni import chat_prompt

    prompt, output = chat_prompt([40, 41, 42, 43]), [500, 501, 502]
    layers = thinker_layers(prompt, output)
    tts = {f"embed.{n}": torch.full((1, 1, H), float(i)) for i, n in enumerate(("tts_bos", "tts_eos", "tts_pad"))}
    talker_ids, payload = handover.talker_input({**tts, **layers}, prompt, output, "r1", speaker="ethan")
    # The user turn (<|im_start|>user\n TEXT <|im_end|>\n: 3 + 4 + 2 ids), then 9 rows for the assistant's.
    assert talker_ids == [handover.TALKER_PLACEHOLDER] * (3 + 4 + 2 + 9)
    assert torch.equal(payload["embed"]["prefill"], layers["hidden_states.layer_0"][:-1])
    assert torch.equal(payload["hidden_states"]["output"], layers["hidden_states.layer_24"][:-1])
    assert payload["ids"] == {"all": prompt + output, "prompt": prompt}
    assert [float(payload["embed"][n].reshape(-1)[0]) for n in ("tts_bos", "tts_eos", "tts_pad")] == [0.0, 1.0, 2.0]
    assert bool(payload["meta"]["finished"]) and payload["speaker"] == "ethan"
    assert handover.talker_input(tts, prompt, output) is None  # no layers: vllm-omni withholds the payload


def test_vllm_omnis_talker_to_code2wav_keeps_the_rows_its_output_ids_vouch_for(handover):
    codes = torch.tensor([[0] * 4, [10, 11, 12, 13], [20, 21, 22, 23], [2150, 0, 0, 0]])  # a prompt row, 2 frames, the EOS
    flat = handover.codec_codes(codes, [10, 20, 2150])
    assert flat == [10, 20, 11, 21, 12, 22, 13, 23]  # codebook-major
    assert handover.codec_codes(codes[:1], []) is None


def test_omni_serves_qwen3_omni_talker_prompt_is_vllm_omnis_payload_as_numpy(handover, tmp_path):
    from omni_serve.speech import qwen3_omni
    from omni_serve.stages.payload import additional_information
    from tests.tiny_models.qwen3_omni import chat_prompt

    table = write_checkpoint(tmp_path / "ckpt", sharded=False)
    prompt, output = chat_prompt([40, 41]), [500, 501]
    layers = {k: v.numpy() for k, v in thinker_layers(prompt, output).items()}
    record = ThinkerOutput({**layers, "processed_trace": np.zeros((4, 2), np.int64)}, prompt, output,
                           str(tmp_path / "ckpt"), {"speaker": ["aiden"]})
    talker_ids, payload = qwen3_omni.talker_prompt(record)
    assert len(talker_ids) == 3 + 2 + 2 + 9
    assert payload["embed"]["prefill"].dtype == np.float32
    np.testing.assert_array_equal(payload["hidden_states"]["output"], layers["hidden_states.layer_24"][:-1])
    np.testing.assert_array_equal(payload["embed"]["tts_pad"].reshape(-1),
                                  table[151671].float().numpy())  # bf16 widened exactly
    assert payload["speaker"] == "aiden" and payload["ids"]["prompt"] == prompt
    entries = additional_information(payload)["entries"]
    assert {"embed.prefill", "embed.tts_bos", "embed.tts_eos", "embed.tts_pad", "hidden_states.output", "ids.all",
            "ids.prompt", "meta.finished", "speaker"} == set(entries)
    assert entries["meta.finished"]["tensor_dtype"] == "bool" and entries["ids.all"]["list_data"] == prompt + output
    with pytest.raises(ValueError, match="no layers 0 and 24 among"):
        qwen3_omni.talker_prompt(ThinkerOutput({HIDDEN: layers["hidden_states.layer_0"]}, prompt, output,
                                               str(tmp_path / "ckpt")))


def test_the_qwen3_omni_gpu_config_names_the_shims_stage_classes_and_the_checkpoints_ids():
    from omni_serve.config import load_callable, load_config
    from tests.tiny_models.qwen3_omni import CODEC_IDS, SPEAKER_IDS
    from worker_shim.omni_models.qwen3_omni.config import talker_stage_config
    from worker_shim.omni_models.registration import QWEN3_OMNI_STAGES

    config = load_config(Path(__file__).resolve().parents[1] / "deploy" / "speech" / "qwen3-omni-gpu.toml")
    assert list(config.stages) == ["thinker", "talker", "code2wav"] and config.voices == list(SPEAKER_IDS)
    for stage in ("thinker", "code2wav"):
        assert config.stages[stage].engine["hf_overrides"] == {"architectures": [QWEN3_OMNI_STAGES[stage]]}
    assert load_callable(config.stages["talker"].engine["hf_overrides"]) is talker_stage_config
    assert config.stages["talker"].sampling["stop_token_ids"] == [CODEC_IDS["codec_eos_token_id"]]
    assert config.stages["code2wav"].sidecar.options["codebook_size"] == "2048"
    assert load_callable(config.talker_prompt).__module__ == "omni_serve.speech.qwen3_omni"
    assert load_callable(config.thinker_prompt)([{"role": "user", "content": "hi"}], 2)[1] == {"speaker": ["aiden"]}
