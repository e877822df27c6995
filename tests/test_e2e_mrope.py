"""A multimodal M-RoPE model through the shim: real vLLM V2 (CPU), real sidecars, a tiny Qwen2-VL.

One plain V2 engine and one shim engine (sidecar: an omni hook set capturing layers 0 and
the last, overlaying the last prompt rows of one request) serve the same image prompts
with chunked prefill across the image tokens; the tests compare tokens, captured layers
(against a direct transformers forward, and through vllm-omni 0.30.0's deserializer) and
the overlaid request's embeddings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.procs import SidecarProcess, run_engine

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
BATCHED_TOKENS = 16  # < each image prompt (16 image tokens + text): chunks cut the image span
TAIL = 3  # prompt rows the overlay replaces
PROMPTS = [
    {"text": "the quick brown fox", "image_seed": 0},
    {"text": "a sidecar hosts the omni hooks"},
    {"text": "thinker talker code", "image_seed": 1},
]


@pytest.fixture(scope="module")
def vl_model(e2e_dir) -> str:
    from tests.support.vl_model import ARCH
    from tests.tiny_models.vl import build_tiny_vl

    return str(build_tiny_vl(e2e_dir / "tiny-vl", architecture=ARCH))


def _job(model: str, prompts: list[dict], **extra) -> dict:
    return {"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS, "register_vl_model": True,
            "llm_kwargs": {"max_num_batched_tokens": BATCHED_TOKENS, "max_model_len": 256, "max_num_seqs": 4,
                           "enable_prefix_caching": False, "limit_mm_per_prompt": {"image": 1},
                           "kv_cache_memory_bytes": 32 << 20}, **extra}


def _with_sidecar(work, hooks: str, options: list[str], job: dict, e2e_dir, name: str) -> dict:
    endpoint = f"ipc://{work}/{name}.sock"
    sidecar = SidecarProcess(endpoint, hooks, work / f"{name}.log", options=options)
    try:
        res = run_engine({**job, "shim": True, "endpoint": endpoint}, e2e_dir, name)
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    return res


@pytest.fixture(scope="module")
def runs(vl_model, e2e_dir, tmp_path_factory):
    """Plain V2; the shim with a pass-through sidecar; the shim with the tail-overlay hooks
    (layers 0 and the last captured)."""
    from tests.tiny_models.vl import TEXT_CONFIG

    plain = run_engine(_job(vl_model, PROMPTS), e2e_dir, "mrope-plain")
    assert plain["ok"], plain.get("traceback")
    work = tmp_path_factory.mktemp("mrope")
    passthrough = _with_sidecar(work, "passthrough", [], _job(vl_model, PROMPTS), e2e_dir, "mrope-passthrough")
    tail = (np.random.default_rng(5).standard_normal((TAIL, TEXT_CONFIG["hidden_size"])) * 0.5).astype(np.float32)
    np.save(work / "tail.npy", tail, allow_pickle=False)
    overlaid = {**PROMPTS[0], "payload": {"model_intermediate_buffer": {"embed": {"tail": {"npy": str(work / "tail.npy")}}}}}
    last = TEXT_CONFIG["num_hidden_layers"] - 1
    shim = _with_sidecar(work, "tests.support.tail_overlay_hooks:TailOverlayHooks", [f"hidden_layers=0,{last}"],
                         _job(vl_model, PROMPTS + [overlaid], fetch_outputs=True), e2e_dir, "mrope-shim")
    outputs = [{k: torch.from_numpy(np.load(p, allow_pickle=False)) for k, p in shim["outputs"][rid].items()}
               for rid in shim["request_ids"]]
    return {"plain": plain, "passthrough": passthrough, "shim": shim, "outputs": outputs,
            "tail": torch.from_numpy(tail), "last": last}


@pytest.fixture(scope="module")
def direct(vl_model, runs):
    """transformers' forward over each request's prompt and generated tokens (fp32)."""
    from transformers import Qwen2VLForConditionalGeneration

    from tests.tiny_models.vl import image_only_processor_class, tiny_image

    model = Qwen2VLForConditionalGeneration.from_pretrained(vl_model, dtype=torch.float32).eval()
    images = image_only_processor_class().from_pretrained(vl_model).image_processor
    shim = runs["shim"]
    hidden = []
    for prompt, ids, out in zip(PROMPTS, shim["prompt_token_ids"], shim["tokens"]):
        seq = torch.tensor([ids + out[:-1]])
        extra = {}
        if "image_seed" in prompt:  # M-RoPE positions come from the image rows and their grid
            extra = dict(images([tiny_image(prompt["image_seed"])], return_tensors="pt"),
                         mm_token_type_ids=(seq == model.config.image_token_id).long())
        with torch.no_grad():
            res = model(input_ids=seq, attention_mask=torch.ones_like(seq), output_hidden_states=True, **extra)
        hidden.append([h[0] for h in res.hidden_states])
    return hidden


def test_tokens_equal_plain_v2_with_chunked_prefill_across_the_image(runs):
    from tests.tiny_models.vl import IMAGE_TOKENS

    plain, passthrough, shim = runs["plain"], runs["passthrough"], runs["shim"]
    assert passthrough["tokens"] == plain["tokens"]
    assert passthrough["prompt_token_ids"] == plain["prompt_token_ids"]
    (stats,) = passthrough["shim_stats"]
    assert stats["request_errors"] == {} and stats["steps"] > len(PROMPTS) and stats["blocking_exchanges"] == 0
    # Next to an overlaid request, with layers captured, the others' tokens do not change either.
    assert shim["tokens"][: len(PROMPTS)] == plain["tokens"]
    assert shim["shim_stats"][0]["request_errors"] == {}
    # The image prompts were prefilled in chunks; chunks ended inside image spans (rows 1..16).
    cuts = []
    for i in (0, 2, 3):
        ids = shim["prompt_token_ids"][i]
        assert ids.count(ids[1]) == IMAGE_TOKENS and len(ids) > BATCHED_TOKENS
        trace = runs["outputs"][i]["processed_trace"]
        cuts += [end for end in (trace[:, 0] + trace[:, 1]).tolist() if 1 < end < 1 + IMAGE_TOKENS]
    assert cuts, "no prefill chunk ended inside an image"


def test_captured_layers_equal_a_direct_forward_and_decode_in_vllm_omni(runs, direct):
    from omni_sidecar.hook_sets.omni.keys import layer_key, unflatten
    from omni_sidecar.hook_sets.omni.wire import encode_additional_information
    from tests.support.vllm_omni_payload import as_its_wire, vllm_omni_payload_code

    layers = [0, runs["last"]]
    with vllm_omni_payload_code() as its:
        for i in range(len(PROMPTS)):
            outputs = runs["outputs"][i]
            nested = unflatten({layer_key(n): outputs[layer_key(n)] for n in layers})
            wire = as_its_wire(encode_additional_information(nested), its.engine)
            got = its.data_entry_keys.deserialize_payload(wire)["hidden_states"]["layers"]
            assert sorted(got) == layers
            for n in layers:
                torch.testing.assert_close(got[n], direct[i][n], atol=2e-4, rtol=2e-4)


def test_overlay_changes_only_the_overlaid_rows(runs, direct):
    shim, outputs = runs["shim"], runs["outputs"]
    plain_rows, overlaid_rows = outputs[0]["hidden_states.layer_0"], outputs[3]["hidden_states.layer_0"]
    prompt_len = len(shim["prompt_token_ids"][3])
    assert shim["prompt_token_ids"][3] == shim["prompt_token_ids"][0]
    keep = prompt_len - TAIL
    # Image and other text rows: what plain V2 builds (encoder rows merged), equal to the direct forward.
    assert torch.equal(overlaid_rows[:keep], plain_rows[:keep])
    torch.testing.assert_close(overlaid_rows[:keep], direct[0][0][:keep], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(overlaid_rows[keep:prompt_len], runs["tail"])
    assert not torch.allclose(plain_rows[keep:prompt_len], runs["tail"])
