"""Trees with tensors (proto/plan_trees.py): the one encoder and decoder (omni_arena/tensor_tree.py),
the sidecar's plans built with them, and every mark a peer sends checked."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
import torch

from omni_arena.tensor_tree import TreeDecoder, TreeEncoder, decode_inline, encode_inline
from omni_arena.views import arena_tensor
from omni_sidecar.sessions.arenas import OutArena, SessionArenas
from omni_sidecar.serve.metrics import SidecarMetrics
from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import Hello, MirrorUpdate, StepPlan
from proto.plan_trees import STACK_ROW, STACK_WHOLE, TreeError, decode_tree, encode_tree
from proto.tensors import TensorRef
from proto.version import PROTOCOL_MAJOR
from tests.support.trees import assert_same_tree

ROWS = 8  # requests in the trees below: each per-request tensor a row of one stack


def _hello() -> Hello:
    return Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 4, "float32", 8, [])


def _wire(msg: Any) -> Any:
    """A message as the peer gets it: encoded and decoded by the protocol's codec."""
    codec = Codec()
    return codec.decode(codec.encode(msg))


def _read(arena: Any, data: bytes, stacks: list[TensorRef], own: bool = False, kind: Any = dict[str, Any]) -> Any:
    """A tree as a receiver reads it: each stack out of `arena` (copied: the test then scribbles on it)."""
    return TreeDecoder(len(stacks), lambda k: arena_tensor(arena, stacks[k]).clone(), own=own,
                       copy_budget=sum(ref.nbytes for ref in stacks)).decode(data, kind)


def _kwargs() -> dict:
    return {
        "runtime_additional_information": [
            {"meta": {"prompt_len": 8, "n": i}, "hidden_states": {"last": torch.full((1, 4), float(i))}}
            for i in range(ROWS + 3)
        ],
        "layers": {0: torch.arange(3.0), 7: torch.ones(2, dtype=torch.int32)},  # int keys below the top
        "few": [torch.full((2,), 5.0) for _ in range(3)],
        "empty": torch.zeros(0, 4),
        "spans": [[0, 1], [1, 2]],
        "flag": True,
    }


@pytest.fixture
def arenas():
    a = SessionArenas(1, _hello(), SidecarMetrics())
    a.open(True, 0)
    yield a
    a.close()


def test_a_plans_trees_are_bytes_whose_marks_name_its_stacks(arenas):
    want = _kwargs()
    arenas.out.reset()
    sent = arenas.encode_tree(want)
    # A stack per kind, in the order the tree meets them (a kind met once: a stack of one row); the
    # empty tensor, which no stack can hold, a stack used whole; the tree names them all.
    assert [s.shape for s in arenas.stacks] == [[ROWS + 3, 1, 4], [1, 3], [1, 2], [3, 2], [0, 4]]
    assert arenas.out.stacked_rows == ROWS + 3 + 1 + 1 + 3
    marks = decode_tree(sent)
    assert [d["hidden_states"]["last"] for d in marks["runtime_additional_information"]] == [
        (0, i) for i in range(ROWS + 3)]
    assert marks["empty"] == (4, -1)  # a whole stack
    plan = _wire(StepPlan(step=3, extra_kwargs=sent, stacks=arenas.stacks))
    assert plan.extra_kwargs == sent
    got = _read(arenas.out.arena, plan.extra_kwargs, plan.stacks)
    assert_same_tree(got, want)
    arenas.out.arena.view(TensorRef(0, 0, 4096, [4096], "uint8"))[:] = b"\xff" * 4096
    assert_same_tree(got, want)  # the stacks were copied out, the tree's tensors views of the copies
    assert arenas.encode_tree({}) == b"" and _read(None, b"", []) == {}  # an empty tree travels as no bytes


def _ext(code: int, data: bytes) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, data)


def test_every_mark_a_peer_sends_is_checked():
    arena = ShmArena.create(4096, prefix="omni-test-trees")
    try:
        out = OutArena(arena)
        rows = out.put_stack([torch.full((2,), float(i)) for i in range(ROWS)])
        whole = out.put_whole(torch.arange(3.0))
        stacks = out.stacks
        row = struct.Struct("<II").pack

        def read(tree, tree_stacks=stacks, raw=None):
            data = raw if raw is not None else msgspec.msgpack.encode(tree)
            return TreeDecoder(len(tree_stacks), lambda k: arena_tensor(arena, tree_stacks[k])).decode(data)

        good = read({"r": _ext(STACK_ROW, row(rows, 2)), "w": _ext(STACK_WHOLE, struct.pack("<I", whole))})
        assert good["r"].tolist() == [2.0, 2.0] and good["w"].tolist() == [0.0, 1.0, 2.0]
        cases = {
            "unknown extension value": ({"x": _ext(9, b"\0" * 8)},),
            "unknown extension value ": ({"x": _ext(STACK_ROW, b"\0" * 4)},),  # a row mark of the wrong length
            "stack 5 of a message with 2": ({"x": _ext(STACK_ROW, row(5, 0))},),
            "stack 7 of a message with 2": ({"x": _ext(STACK_WHOLE, struct.pack("<I", 7))},),
            f"row {ROWS} of stack 0": ({"x": _ext(STACK_ROW, row(0, ROWS))},),
            "no rows or bytes": ({"x": _ext(STACK_ROW, row(0, 0))}, [TensorRef(0, 0, 4, [], "float32")]),
            "no rows or bytes ": ({"x": _ext(STACK_ROW, row(0, 0))}, [TensorRef(0, 0, 0, [1 << 40, 0], "float32")]),
            "malformed tree": (None, stacks, b"\xc1"),  # not msgpack
            "malformed tree ": ({1: 2},),  # keyword arguments are named by strings
            "outside": ({"x": _ext(STACK_ROW, row(0, 0))}, [TensorRef(0, 4000, 400, [100], "float32")]),
        }
        for message, args in cases.items():
            with pytest.raises(Exception, match=message.strip()) as info:
                read(*args)
            assert "\n" not in str(info.value)
            assert info.type.__name__ in ("TreeError", "TensorRefError")
        # A stack with more rows than the tree has room to name: indexed row by row (no view per row
        # of a stack a hostile peer made huge); the rows named read right.
        big = [TensorRef(0, stacks[rows].offset, stacks[rows].nbytes, stacks[rows].shape, "float32")]
        decoder = TreeDecoder(1, lambda k: arena_tensor(arena, big[k]))
        assert decoder.decode(msgspec.msgpack.encode({"a": _ext(STACK_ROW, row(0, 3))}))["a"].tolist() == [3.0, 3.0]
        assert type(decoder.rows[0]) is torch.Tensor
    finally:
        out.close()


def test_a_tree_the_sender_cannot_encode_fails_where_it_is_built(arenas):
    """A hook's value msgpack cannot carry fails the plan's encode in the sidecar (the requests'
    error), never a frame the receiver would have to refuse."""
    with pytest.raises(TypeError, match="cannot hold a object"):
        encode_tree({"x": object()})
    arenas.out.reset()
    with pytest.raises(TypeError, match="cannot hold a object"):
        arenas.encode_tree({"x": [torch.zeros(2), object()]})
    assert arenas.stacks == []  # nothing of it went into the arena
    with pytest.raises(TypeError, match="9 dimensions"):  # a stack of it could not be sent either
        arenas.encode_tree({"x": torch.zeros([1] * 9)})
    deep = TreeEncoder().encode({"x": torch.zeros([1] * 8)}, lambda t: 0, lambda rows: 1 / 0)  # 8 dims: used whole
    assert decode_tree(deep) == {"x": (0, -1)}


def test_a_hook_set_without_an_arena_sends_trees_without_tensors():
    a = SessionArenas(1, _hello(), SidecarMetrics())
    a.open(False, 0)
    try:
        assert decode_tree(a.encode_tree({"k": [1, "x"]})) == {"k": [1, "x"]}
        with pytest.raises(RuntimeError, match="no arena"):
            a.encode_tree({"k": torch.zeros(1)})
    finally:
        a.close()


def test_two_trees_of_one_plan_name_their_own_stacks(arenas):
    """Model states and extra kwargs go into one plan's stacks: the second tree's marks start after
    the first's stacks, and each reads back as it was sent."""
    arenas.out.reset()
    states = {f"r{i}": {"codes": torch.full((3,), i), "meta": {"i": i}} for i in range(4)}
    sent_states = arenas.encode_tree(states)
    kwargs = {"info": [{"last": torch.full((1, 2), -float(i))} for i in range(5)], "codes": torch.arange(3)}
    sent_kwargs = arenas.encode_tree(kwargs)
    assert [s.shape for s in arenas.stacks] == [[4, 3], [5, 1, 2], [1, 3]]
    assert decode_tree(sent_kwargs)["codes"] == (2, 0)  # its own kind's stack, after the states' one
    plan = _wire(StepPlan(step=0, extra_kwargs=sent_kwargs, model_states=sent_states, stacks=arenas.stacks))
    assert_same_tree(_read(arenas.out.arena, plan.model_states, plan.stacks, own=True), states)
    assert_same_tree(_read(arenas.out.arena, plan.extra_kwargs, plan.stacks), kwargs)


def test_aliased_stacks_cannot_multiply_the_rows_a_small_tree_makes():
    """Stacks may overlap in the arena: a hostile tree naming row 0 of many stacks that alias the
    same large bytes must not make a view per row of each (one budget of rows for the whole tree,
    from its size); and copies a tree asks for (model states) are bounded by the stacks' bytes."""
    arena = ShmArena.create(1 << 16, prefix="omni-test-trees")
    try:
        rows = 4096
        alias = [TensorRef(0, 0, rows * 4, [rows, 4], "uint8") for _ in range(16)]
        tree = {f"s{k}": _ext(STACK_ROW, struct.pack("<II", k, 0)) for k in range(16)}
        tree["pad"] = "x" * (rows * 12)  # room, by size, to name every row of one stack, not of 16
        decoder = TreeDecoder(16, lambda k: arena_tensor(arena, alias[k]))
        got = decoder.decode(msgspec.msgpack.encode(tree))
        assert sum(type(r) is tuple for r in decoder.rows.values()) == 1  # one unbound, the rest indexed
        assert all(got[f"s{k}"].shape == (4,) for k in range(16))
        small = [TensorRef(0, 0, 8 * 4 * 4, [8, 4], "float32")]
        twice = {"a": _ext(STACK_WHOLE, struct.pack("<I", 0)), "b": _ext(STACK_WHOLE, struct.pack("<I", 0))}
        with pytest.raises(TreeError, match="more bytes than"):
            _read(arena, msgspec.msgpack.encode({"r": twice}), small, own=True)
        once = _read(arena, msgspec.msgpack.encode({"r": {"a": twice["a"]}}), small, own=True)
        assert once["r"]["a"].shape == (8, 4)
    finally:
        arena.close()


def test_a_mirror_update_carries_its_tree_and_tensors_inline():
    """MirrorUpdate: the same tree form, its stacks as blobs in the message itself; each tensor the
    shim gets is its own (a mirror keeps it past the message)."""
    entries = {"embed": {"decode": torch.arange(6.0).view(3, 2), "decode_token_start": 2, "decode_token_end": 5},
               "meta": {"tags": ["a"]}, "flags": torch.tensor([True, False]), "none": torch.zeros(0, 2)}
    tree, blobs = encode_inline(entries)
    update = _wire(MirrorUpdate(seq=1, req_id="t", entries=tree, blobs=blobs))
    got = decode_inline(update.entries, update.blobs)
    assert_same_tree(got, entries)
    assert got["embed"]["decode"].untyped_storage().data_ptr() != got["flags"].untyped_storage().data_ptr()
    with pytest.raises(TreeError, match="bad inline tensor"):
        decode_inline(update.entries, [msgspec.structs.replace(b, data=b"\0") for b in update.blobs])


def test_zero_dim_tensors_are_rows_of_a_stack_and_read_back_as_zero_dim(arenas):
    """vllm-omni kwargs may hold scalars as 0-d tensors (a temperature): each is a row of a 1-d
    stack, counted as a stacked row, and reads back 0-d."""
    arenas.out.reset()
    kwargs = {"temperature": torch.tensor(0.7), "per_request": [{"t": torch.tensor(float(i))} for i in range(ROWS)]}
    sent = arenas.encode_tree(kwargs)
    assert [s.shape for s in arenas.stacks] == [[ROWS + 1]] and arenas.out.stacked_rows == ROWS + 1
    got = _read(arenas.out.arena, sent, arenas.stacks)
    assert got["temperature"].shape == () and got["temperature"].item() == pytest.approx(0.7)
    assert_same_tree(got, kwargs)
