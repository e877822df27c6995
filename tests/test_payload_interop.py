"""Payload interop with vllm-omni 0.30.0's own serializer, both directions.

Its `serialize_payload` -> msgpack -> our decoder, and our encoder -> msgpack ->
its `AdditionalInformationPayload` -> its `deserialize_payload`, on what stages
hand each other: a thinker -> talker hand-over, code2wav codes, scalars, 0-d and
bool tensors. Tensors must match exactly: dtype, shape and every byte.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from omni_sidecar.hook_sets.omni.keys import layer_key
from omni_sidecar.hook_sets.omni.wire import PayloadError, decode_additional_information, encode_additional_information
from tests.support.vllm_omni_payload import as_its_wire, vllm_omni_payload_code

HIDDEN, PROMPT, DECODED = 16, 7, 3


@pytest.fixture(scope="module")
def its():
    with vllm_omni_payload_code() as code:
        yield code


def assert_same(got: Any, want: Any, path: str = "payload") -> None:
    """Equal structure, key types, value types; tensors equal in dtype, shape and bytes."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), path
        raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*raw), f"{path}: tensor bytes differ"
    elif isinstance(want, dict):
        assert sorted(map(repr, got)) == sorted(map(repr, want)), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def thinker_to_talker() -> dict[str, Any]:
    """What a Qwen3-Omni thinker hands its talker, with layers {0, 24} (vllm-omni's names)."""
    prompt_ids = list(range(100, 100 + PROMPT))
    output_ids = [7, 8, 9]
    return {
        "hidden_states": {
            "output": _bf16(PROMPT, HIDDEN, seed=1),
            "layers": {0: _bf16(PROMPT, HIDDEN, seed=2), 24: _bf16(PROMPT, HIDDEN, seed=3)},
        },
        "embed": {
            "prefill": _bf16(PROMPT, HIDDEN, seed=4),
            "decode": _bf16(DECODED, HIDDEN, seed=5),
            "decode_token_start": PROMPT,
            "decode_token_end": PROMPT + DECODED,
            "tts_bos": _bf16(1, HIDDEN, seed=6),
            "tts_eos": _bf16(1, HIDDEN, seed=7),
            "tts_pad": _bf16(1, HIDDEN, seed=8),
        },
        "ids": {"all": prompt_ids + output_ids, "prompt": prompt_ids, "output": output_ids},
        "meta": {
            "finished": torch.tensor(False),
            "num_processed_tokens": PROMPT + DECODED,
            "next_stage_prompt_len": PROMPT,
            "omni_task": ["tts"],
            "req_id": ["req-0"],
            "decode_flag": True,
            "request_id": "req-0",
        },
        "speaker": "Ethan",
        "language": "English",
    }


def code2wav_codes() -> dict[str, Any]:
    seeded = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 2048, (12, 16), generator=seeded, dtype=torch.int64)
    return {
        "codes": {"audio": codes, "ref": codes[:2].clone()},
        "meta": {
            "finished": torch.tensor(True),
            "left_context_size": 25,
            "codec_chunk_frames": 12,
            "chunk_seq": 3,
            "last_chunk": False,
        },
    }


def scalars() -> dict[str, Any]:
    return {
        "meta": {
            "chunk_seq": 0,
            "audio_seed": -(1 << 62),
            "ref_code_len": (1 << 63) - 1,
            "last_chunk": True,
            "height": 512,
            "ref_context_request_id": "",
            "override_keys": [["embed", "prefill"], ["ids", "all"]],
        },
        "generated_len": 41,
        "request_id": "req-7",
        "kv_metadata": {"layers": 2, "scale": 0.125, "names": ["k", "v"]},  # a top-level dict: one entry
        "temperature": 0.7,
    }


def zero_d_and_bool_tensors() -> dict[str, Any]:
    return {
        "meta": {
            "finished": torch.tensor(True),
            "stream_finished": torch.tensor(False),
            "is_segment_finished": torch.tensor([True, False, True]),
            "gen_token_mask": torch.tensor([[True, False], [False, True], [True, True]]),
            "codec_frame_valid": torch.tensor(1.5, dtype=torch.bfloat16),
            "token_role_ids": torch.tensor(3, dtype=torch.int64),
        },
        "latent": torch.tensor(-2.25),
    }


def every_dtype_and_layout() -> dict[str, Any]:
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
    embed = {str(d).removeprefix("torch."): torch.arange(6).view(2, 3).to(d) for d in dtypes}
    embed["empty"] = torch.empty(0, HIDDEN)
    embed["transposed"] = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    return {"embed": embed}


PAYLOADS = {
    "thinker_to_talker": thinker_to_talker,
    "code2wav_codes": code2wav_codes,
    "scalars": scalars,
    "zero_d_and_bool": zero_d_and_bool_tensors,
    "dtypes_and_layouts": every_dtype_and_layout,
}


@pytest.mark.parametrize("make", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_its_serializer_to_our_decoder(its, make):
    payload = make()
    wire = its.data_entry_keys.serialize_payload(payload)
    packed = msgspec.msgpack.encode(wire)  # what crosses a process boundary
    want = its.data_entry_keys.deserialize_payload(wire)
    assert_same(want, payload)  # the payload survives vllm-omni's own round trip
    for form in (packed, msgspec.msgpack.decode(packed), wire):  # bytes, extra_args dict, struct
        assert_same(decode_additional_information(form), want)


@pytest.mark.parametrize("make", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_our_encoder_to_its_deserializer(its, make):
    payload = make()
    ours = encode_additional_information(payload)
    got = its.data_entry_keys.deserialize_payload(as_its_wire(ours, its.engine))
    assert_same(got, payload)
    # Entry for entry what its serializer writes: same keys, same form, same bytes.
    theirs = msgspec.to_builtins(its.data_entry_keys.serialize_payload(payload), builtin_types=(bytes,))
    assert_same(ours["entries"], {k: {f: v for f, v in e.items() if v is not None}
                                  for k, e in theirs["entries"].items()})


def test_hand_over_is_what_its_talker_reads(its):
    """Decoded by either side, the hand-over passes vllm-omni's own payload schema, layers int-keyed."""
    payload = thinker_to_talker()
    ours = decode_additional_information(its.data_entry_keys.serialize_payload(payload))
    assert sorted(ours["hidden_states"]["layers"]) == [0, 24]
    struct = its.data_entry_keys.to_struct(ours)
    assert sorted(struct.hidden_states.layers) == [0, 24]
    wire = as_its_wire(encode_additional_information(payload), its.engine)
    its.data_entry_keys.validate_payload(its.data_entry_keys.deserialize_payload(wire), context="talker input")


def test_captured_layers_decode_into_its_layers(its):
    """Layers a capture assembles per request ({index: rows}) come out as hidden_states['layers']."""
    layers = {n: torch.randn(5, HIDDEN) for n in (0, 3, 24)}
    entries = encode_additional_information({"hidden_states": {"layers": layers}})
    assert set(entries["entries"]) == {layer_key(n) for n in layers} == {
        f"hidden_states.layer_{n}" for n in layers
    }
    got = its.data_entry_keys.deserialize_payload(as_its_wire(entries, its.engine))
    assert_same(got, {"hidden_states": {"layers": layers}})


def test_none_values_and_empty_categories_are_left_out_on_both_sides(its):
    payload = {"embed": {"tts_bos": None, "prefill": torch.ones(1, 2)}, "meta": {}, "speaker": None}
    want = {"embed": {"prefill": torch.ones(1, 2)}}
    ours = as_its_wire(encode_additional_information(payload), its.engine)
    assert_same(its.data_entry_keys.deserialize_payload(ours), want)
    assert_same(decode_additional_information(its.data_entry_keys.serialize_payload(payload)), want)


# -- refusals -------------------------------------------------------------------------


def _entries(**entries: dict[str, Any]) -> dict[str, Any]:
    return {"entries": entries}


T = {"tensor_data": b"\0" * 4, "tensor_shape": [1], "tensor_dtype": "float32"}


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"hidden_states.layer_x": T}, "hidden_states.layer_x: layer index 'x'"),
        ({"hidden_states.layer_03": T}, "hidden_states.layer_03: layer index '03'"),
        ({"hidden_states.layer_-1": T}, "hidden_states.layer_-1: layer index '-1'"),
        ({"hidden_states.layer_2": {"list_data": [1]}}, "hidden_states.layer_2: .* must be a tensor"),
        ({"hidden_states.layers": T}, "hidden_states.layers: layers come one per key"),
        ({"meta": {"scalar_data": 1}}, "meta: a category comes as dotted keys"),
        ({"speaker": {"scalar_data": "a"}, "speaker.x": {"scalar_data": 1}}, "speaker.x: conflicts"),
        ({"meta.": {"scalar_data": 1}}, "meta.: an empty part"),
        ({"codes.audio": {**T, "list_data": [1]}}, "codes.audio: .*exactly one"),
        ({"codes.audio": {}}, "codes.audio: .*exactly one"),
        ({"codes.audio": {**T, "tensor_device": "cuda"}}, "codes.audio: Object contains unknown field"),
        ({"codes.audio": {**T, "tensor_dtype": "complex64"}}, "codes.audio: unsupported dtype"),
        ({"codes.audio": {**T, "tensor_dtype": None}}, "codes.audio: tensor_data needs"),
        ({"codes.audio": {**T, "tensor_shape": [2]}}, "codes.audio: 4 bytes for shape"),
        ({"codes.audio": {**T, "tensor_shape": [-1]}}, "codes.audio: .*non-negative"),
        ({"codes.audio": {**T, "tensor_shape": [1] * 9}}, "codes.audio: .*length <= 8"),
        ({"codes.audio": {**T, "tensor_data": "AAAAAA=="}}, "codes.audio: tensor data must be bytes"),
        ({"ids.all": {"list_data": [1], "tensor_shape": [1]}}, "ids.all: tensor_shape/tensor_dtype without"),
    ],
)
def test_bad_entries_are_payload_errors_naming_the_key(entries, message):
    for form in (_entries(**entries), msgspec.msgpack.encode(_entries(**entries))):
        with pytest.raises(PayloadError, match=message):
            decode_additional_information(form)


def test_its_deserializer_fails_too_on_a_bad_layer_key(its):
    wire = as_its_wire(_entries(**{"hidden_states.layer_x": T}), its.engine)
    with pytest.raises(ValueError):
        its.data_entry_keys.deserialize_payload(wire)


@pytest.mark.parametrize(
    "obj, message",
    [
        ([1, 2], "additional_information must be"),
        ({"entries": {}, "extra": 1}, "additional_information must be"),
        ({"entries": {f"meta.k{i}": {"scalar_data": i} for i in range(4097)}}, "additional_information must be"),
        (b"\xc1", "additional_information must be"),
    ],
    ids=["not_a_dict", "unknown_field", "too_many_entries", "bad_msgpack"],
)
def test_bad_envelopes_are_payload_errors(obj, message):
    with pytest.raises(PayloadError, match=message):
        decode_additional_information(obj)


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"hidden_states": {"layers": {"24": torch.ones(1)}}}, "layer index '24'"),
        ({"hidden_states": {"layers": {-1: torch.ones(1)}}}, "layer index -1"),
        ({"hidden_states": {"layers": {True: torch.ones(1)}}}, "layer index True"),
        ({"hidden_states": {"layers": [torch.ones(1)]}}, "hidden_states.layers: must be a dict"),
        ({"hidden_states": {"layers": {0: [1.0]}}}, "hidden_states.layer_0: .* must be a tensor"),
        ({"hidden_states": {"layer_24": torch.ones(1)}}, "hidden_states.layer_24: vllm-omni reads"),
        ({"meta": 3}, "meta: a category must be a dict"),
        ({"meta": {7: 1}}, "meta: key 7"),
        ({"a.b": 1}, "a.b: a top-level key with a dot"),
        ({"model_outputs": [torch.ones(1)]}, "model_outputs: a Tensor cannot travel"),
        ({"kv_metadata": {"t": torch.ones(1)}}, "kv_metadata: a Tensor cannot travel"),
        ({"meta": {"code_flat_numel": 1 << 64}}, "meta.code_flat_numel: int .* 64 bits"),
    ],
)
def test_what_would_not_come_back_is_refused_on_encoding(payload, message):
    with pytest.raises(PayloadError, match=message):
        encode_additional_information(payload)
