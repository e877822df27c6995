"""Data contracts of the omni hook set (docs/ARCHITECTURE.md, "vllm-omni semantics")."""

from __future__ import annotations

import pytest
import torch

from omni_sidecar.hook_api.hook_set import HookErrors, RequestInfo, StepBatch
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
from omni_sidecar.hook_sets.omni.keys import flatten, unflatten
from omni_sidecar.hook_sets.omni.outputs import accumulate, slice_per_request
from omni_sidecar.hook_sets.omni.state import IntermediateBuffer, StateError
from omni_sidecar.hook_sets.omni.wire import (
    PayloadError,
    decode_additional_information,
    decode_plain_buffer,
    decode_tensor_spec,
    encode_additional_information,
    encode_tensor_spec,
)
from proto.packed import StepLayout


# -- dotted keys -------------------------------------------------------------------


def test_flatten_unflatten_round_trip_with_layer_keys():
    # vllm-omni's rules: layers are int-keyed under hidden_states["layers"], only
    # the five categories expand, other top-level dicts stay whole.
    out, layer0, layer24 = torch.zeros(2), torch.ones(2), torch.full((2,), 24.0)
    nested = {
        "hidden_states": {"output": out, "layers": {24: layer24, 0: layer0}},
        "codes": {"audio": [1, 2]},
        "meta": {"a.b": 3},
        "flat": "x",
        "kv_metadata": {"x": 1},
    }
    flat = flatten(nested)
    assert set(flat) == {
        "hidden_states.output", "hidden_states.layer_24", "hidden_states.layer_0",
        "codes.audio", "meta.a.b", "flat", "kv_metadata",
    }
    assert flat["hidden_states.layer_24"] is layer24 and flat["kv_metadata"] == {"x": 1}
    back = unflatten(flat)
    assert back["hidden_states"]["layers"] == {24: layer24, 0: layer0}
    assert back["hidden_states"]["output"] is out
    assert {k: back[k] for k in ("codes", "meta", "flat", "kv_metadata")} == {
        k: nested[k] for k in ("codes", "meta", "flat", "kv_metadata")
    }


def test_unflatten_rejects_conflicts_and_bad_keys():
    with pytest.raises(PayloadError, match="conflicts"):
        unflatten({"a": 1, "a.b": 2})
    with pytest.raises(PayloadError, match="empty part"):
        unflatten({".b": 1})
    with pytest.raises(PayloadError, match="with a dot"):
        flatten({"a.b": 1})
    with pytest.raises(PayloadError, match=r"hidden_states.layer_24: .*\['layers'\]"):
        flatten({"hidden_states": {"layer_24": torch.zeros(1)}})


# -- payload wire format --------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 7),  # empty
        torch.arange(24, dtype=torch.float16).view(4, 6).t(),  # non-contiguous
        torch.arange(6, dtype=torch.int64).view(2, 3),
    ],
    ids=["bf16", "bool", "0d", "empty", "noncontig", "int64"],
)
def test_tensor_round_trips_through_both_formats(tensor):
    back = decode_tensor_spec(encode_tensor_spec(tensor))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)
    info = decode_additional_information(encode_additional_information({"embed": {"prefill": tensor}}))
    assert torch.equal(info["embed"]["prefill"], tensor) and info["embed"]["prefill"].dtype == tensor.dtype


def test_additional_information_lists_scalars_and_nesting():
    info = encode_additional_information(
        {"ids": {"prompt": [1, 2, 3]}, "meta": {"finished": False, "resumable": True}, "speaker": "a"}
    )
    assert set(info["entries"]) == {"ids.prompt", "meta.finished", "meta.resumable", "speaker"}
    assert decode_additional_information(info) == {
        "ids": {"prompt": [1, 2, 3]}, "meta": {"finished": False, "resumable": True}, "speaker": "a"
    }


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"tensor_data": b"\0" * 7, "tensor_shape": [2], "tensor_dtype": "float32"}, "need 8"),
        ({"tensor_data": b"\0" * 4, "tensor_shape": [1], "tensor_dtype": "complex32x"}, "unsupported dtype"),
        ({"tensor_data": b"", "tensor_shape": [-1], "tensor_dtype": "float32"}, "non-negative"),
        ({"list_data": [1], "scalar_data": 2}, "exactly one"),
        ({}, "exactly one"),
        ({"tensor_data": "not bytes", "tensor_shape": [1], "tensor_dtype": "uint8"}, "bytes"),
    ],
)
def test_bad_entries_are_clear_errors(entry, message):
    with pytest.raises(PayloadError, match=message) as e:
        decode_additional_information({"entries": {"embed.prefill": entry}})
    assert "embed.prefill" in str(e.value) or message == "exactly one"


def test_plain_buffer_decodes_tensor_specs_inside():
    t = torch.randn(2, 3)
    buf = decode_plain_buffer({"embed": {"prefill": encode_tensor_spec(t)}, "meta": {"x": 1}})
    assert torch.equal(buf["embed"]["prefill"], t) and buf["meta"] == {"x": 1}


# -- per-request state ------------------------------------------------------------------


def test_two_level_merge_in_place():
    buf = IntermediateBuffer()
    buf.create("r", {"meta": {"a": 1, "b": 2}, "flat": 1})
    buf.merge("r", {"meta": {"b": 3, "c": 4}, "flat": 2, "ids": {"all": [1]}})
    assert buf.get("r") == {"meta": {"a": 1, "b": 3, "c": 4}, "flat": 2, "ids": {"all": [1]}}


def test_unknown_request_and_empty_update_are_no_ops():
    buf = IntermediateBuffer()
    buf.merge("nobody", {"meta": {"a": 1}})
    assert "nobody" not in buf and len(buf) == 0
    buf.create("r", {"meta": {"a": 1}})
    buf.merge("r", {})
    buf.merge("r", None)
    assert buf.get("r") == {"meta": {"a": 1}}


def test_replace_keeps_only_processed_tokens_and_resumable():
    buf = IntermediateBuffer()
    buf.create("r", {"meta": {"num_processed_tokens": 7, "resumable": True, "other": 1}, "codes": {"audio": 1}})
    buf.merge("r", {"ids": {"output": [4]}}, replace=True)
    assert buf.get("r") == {"meta": {"num_processed_tokens": 7, "resumable": True}, "ids": {"output": [4]}}


def test_device_resident_keys_stay_others_go_to_host():
    # "meta" stands in for the host here so the move is observable on a CPU-only machine.
    buf = IntermediateBuffer(resident_keys={("hidden_states", "last")}, host_device="meta")
    buf.create("r")
    buf.merge("r", {"hidden_states": {"last": torch.ones(2), "output": torch.ones(2)}})
    state = buf.get("r")
    assert state["hidden_states"]["last"].device.type == "cpu"
    assert state["hidden_states"]["output"].device.type == "meta"


def _decode_update(rows: torch.Tensor, start: int, end: int | None = None) -> dict:
    embed = {"decode": rows, "decode_token_start": start}
    if end is not None:
        embed["decode_token_end"] = end
    return {"embed": embed}


def test_decode_span_merge_append_trim_and_gap():
    buf = IntermediateBuffer()
    buf.create("r")
    buf.merge("r", _decode_update(torch.full((1, 2), 3.0), 3, 4))
    buf.merge("r", _decode_update(torch.tensor([[4.0, 4], [5, 5], [6, 6]]), 4, 7))  # contiguous
    e = buf.get("r")["embed"]
    assert (e["decode_token_start"], e["decode_token_end"]) == (3, 7)
    assert e["decode"][:, 0].tolist() == [3, 4, 5, 6]
    buf.merge("r", _decode_update(torch.tensor([[50.0, 5], [60, 6], [7, 7]]), 5, 8))  # overlap trimmed
    e = buf.get("r")["embed"]
    assert (e["decode_token_start"], e["decode_token_end"]) == (3, 8)
    assert e["decode"][:, 0].tolist() == [3, 4, 5, 6, 7]
    buf.merge("r", _decode_update(torch.ones(2, 2), 4, 6))  # fully covered: no change
    assert buf.get("r")["embed"]["decode"][:, 0].tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(StateError, match="gap"):
        buf.merge("r", _decode_update(torch.ones(1, 2), 9, 10))
    with pytest.raises(StateError, match="rows but its span"):
        buf.merge("r", _decode_update(torch.ones(2, 2), 8, 9))


def test_state_memory_is_capped_with_a_clear_error():
    buf = IntermediateBuffer(max_bytes_per_request=1024)
    buf.create("r")
    buf.merge("r", {"codes": {"audio": torch.zeros(200, dtype=torch.int8)}})
    with pytest.raises(StateError, match="over the cap of 1024"):
        buf.merge("r", {"hidden_states": {"output": torch.zeros(300, dtype=torch.float32)}})
    with pytest.raises(StateError, match="over the cap"):
        buf.create("big", {"x": {"y": torch.zeros(2048, dtype=torch.uint8)}})
    assert "big" not in buf


def test_a_refused_replace_leaves_the_state_and_an_empty_category_update_makes_the_category():
    """Merges check everything before writing (no snapshot to restore): a replace that would go over
    the cap leaves every category and the size as they were."""
    buf = IntermediateBuffer(max_bytes_per_request=1024)
    buf.create("r", {"meta": {"num_processed_tokens": 3, "x": 1}, "codes": {"audio": torch.zeros(100, dtype=torch.int8)}})
    state, size = buf.get("r"), buf.nbytes("r")
    codes = state["codes"]
    with pytest.raises(StateError, match="over the cap"):
        buf.merge("r", {"hidden_states": {"output": torch.zeros(300, dtype=torch.float32)}}, replace=True)
    assert buf.get("r") is state and state["codes"] is codes and buf.nbytes("r") == size == 100
    assert state == {"meta": {"num_processed_tokens": 3, "x": 1}, "codes": {"audio": codes["audio"]}}
    buf.merge("r", {"ids": {}, "flat": 2})
    assert state["ids"] == {} and state["flat"] == 2
    buf.merge("r", {"flat": {"now": 1}})  # a plain value the category's dict replaces
    assert state["flat"] == {"now": 1} and buf.nbytes("r") == 100


# -- multimodal outputs ----------------------------------------------------------------


def test_token_aligned_slicing_and_per_request_lists():
    qsl = [0, 3, 4, 6]
    hidden = torch.arange(6).view(6, 1).float()
    per_req = slice_per_request(
        {"hidden": hidden, "per_req": ["a", None, "c"], "batch_scalar": torch.tensor(1.0), "odd": torch.ones(5)},
        qsl, 3,
    )
    assert [r["hidden"][:, 0].tolist() for r in per_req] == [[0, 1, 2], [3], [4, 5]]
    assert [r.get("per_req") for r in per_req] == ["a", None, "c"]
    assert all("batch_scalar" not in r and "odd" not in r for r in per_req)


def test_accumulation_concatenates_2d_and_keeps_latest_low_dim():
    chunks = [
        {"codes": torch.zeros(2, 4), "score": torch.tensor(1.0), "vec": torch.ones(3), "tag": "a"},
        {"codes": torch.ones(1, 4), "score": torch.tensor(2.0), "vec": torch.zeros(3), "tag": "b"},
    ]
    out = accumulate(chunks)
    assert out["codes"].shape == (3, 4) and out["codes"][2].sum() == 4
    assert out["score"].item() == 2.0 and out["vec"].sum() == 0 and out["tag"] == "b"


# -- the hook set: preemption policy, per-request errors, state visible next step --------


def _batch(step, req_ids, qsl, computed, prefill_lens):
    return StepBatch(step, StepLayout(req_ids, qsl, computed, prefill_lens), [])


def test_preempted_request_keeps_state_finished_frees_it():
    hooks = OmniStateHooks()
    hooks.on_new_requests([RequestInfo("r", 2, [1, 2])])
    hooks.process_model_output(_batch(0, ["r"], [0, 2], [0], [2]), torch.ones(2, 4))
    hooks.on_preempted(["r"])
    # vLLM V2 re-adds a resumed request as new; its state and outputs survive.
    hooks.on_new_requests([RequestInfo("r", 3, [1, 2, 9])])
    assert hooks.state.get("r")["meta"]["num_processed_tokens"] == 2
    hooks.process_model_output(_batch(1, ["r"], [0, 1], [2], [2]), torch.ones(1, 4))
    assert hooks.get_outputs("r")["hidden_states"].shape == (3, 4)
    hooks.on_finished(["r"])
    assert hooks.state.get("r") is None and hooks.get_outputs("r") is None


def test_postprocess_update_is_visible_on_the_next_step():
    hooks = OmniStateHooks()
    hooks.on_new_requests([RequestInfo("a", 5, [1] * 5), RequestInfo("b", 1, [2])])
    hooks.process_model_output(_batch(0, ["b", "a"], [0, 1, 4], [0, 0], [1, 5]), torch.ones(4, 4))
    hooks.process_model_output(_batch(1, ["b", "a"], [0, 1, 3], [1, 3], [1, 5]), torch.ones(3, 4))
    hooks.process_model_output(_batch(2, ["b", "a"], [0, 1, 2], [2, 5], [1, 5]), torch.ones(2, 4))
    assert hooks.get_outputs("a")["processed_trace"].tolist() == [[0, 3], [3, 2], [5, 1]]
    assert hooks.get_outputs("b")["processed_trace"].tolist() == [[0, 1], [1, 1], [2, 1]]


def test_bad_payloads_fail_only_their_requests():
    hooks = OmniStateHooks(state_cap_mib="0.001")
    good = {"model_intermediate_buffer": {"meta": {"tag": "ok"}}}
    bad_entry = {"additional_information": {"entries": {"embed.prefill": {"list_data": [1], "scalar_data": 1}}}}
    too_big = {"model_intermediate_buffer": {"codes": {"audio": encode_tensor_spec(torch.zeros(4096))}}}
    with pytest.raises(HookErrors) as e:
        hooks.on_new_requests([
            RequestInfo("good", 1, [1], good), RequestInfo("bad", 1, [1], bad_entry),
            RequestInfo("big", 1, [1], too_big),
        ])
    assert set(e.value.errors) == {"bad", "big"}
    assert "exactly one" in e.value.errors["bad"] and "cap" in e.value.errors["big"]
    assert hooks.state.get("good")["meta"]["tag"] == "ok"


def test_extra_kwargs_are_per_request_in_batch_order():
    hooks = OmniStateHooks(extra_kwargs="1")
    hooks.on_new_requests([RequestInfo(r, 1, [1], {"model_intermediate_buffer": {"meta": {"tag": r}}}) for r in "xyz"])
    kw = hooks.build_extra_kwargs(_batch(0, ["z", "x", "y"], [0, 1, 3, 4], [0, 0, 0], [1, 1, 1]))
    assert [i["meta"]["tag"] for i in kw["runtime_additional_information"]] == ["z", "x", "y"]
    assert kw["request_token_spans"] == [[0, 1], [1, 3], [3, 4]]
