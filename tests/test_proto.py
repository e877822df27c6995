"""Wire schema, codec bounds, tensor-ref checks and shared-memory arenas."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from proto.arena import ArenaError, ShmArena, SlotRing
from proto.codec import Codec, FrameError
from proto.messages import (
    ArenaInfo,
    Hello,
    HookNeeds,
    NewRequest,
    StepBegin,
    StepEnd,
    Welcome,
)
from proto.packed import packed_layout
from proto.tensors import TensorRef, TensorRefError, check_ref
from proto.version import PROTOCOL_MAJOR


def _hello(**kw) -> Hello:
    base = dict(
        protocol_major=PROTOCOL_MAJOR, protocol_minor=0, shim_version="0.1.0", vllm_version="0.32.0",
        platform="cpu", rank=0, world_size=1, model="m", hidden_size=128, dtype="float32",
        max_num_tokens=64, arenas=[ArenaInfo("shm", "a", 4096)],
    )
    base.update(kw)
    return Hello(**base)


def test_every_message_round_trips():
    codec = Codec()
    layout = packed_layout(["a", "b"], [0, 3, 4], [0, 10], [3, 12])
    msgs = [
        _hello(),
        Welcome(PROTOCOL_MAJOR, 0, "0.1.0", "capture", HookNeeds(hidden_states=True), 7),
        StepBegin(3, layout, [NewRequest("a", 3, [1, 2, 3], {"prompt_embeds": {"data": b"\0" * 4}})], ["z"]),
        StepEnd(3, hidden=TensorRef(0, 64, 2048, [4, 128], "float32"), num_tokens=4, preempted=["q"]),
    ]
    for msg in msgs:
        assert codec.decode(codec.encode(msg)) == msg


def test_codec_rejects_oversized_malformed_and_unknown_frames():
    codec = Codec(max_frame_bytes=1024)
    with pytest.raises(FrameError) as e:
        codec.decode(b"\x00" * 1025)
    assert e.value.code == "frame_too_large"
    with pytest.raises(FrameError) as e:
        codec.decode(b"\xc1garbage")
    assert e.value.code == "malformed_frame"
    with pytest.raises(FrameError) as e:
        codec.decode(msgspec.msgpack.encode({"type": "launch_missiles"}))
    assert e.value.code == "invalid_message"
    with pytest.raises(FrameError) as e:  # wrong type inside a known message
        codec.decode(msgspec.msgpack.encode({"type": "ping", "nonce": "x"}))
    assert e.value.code == "invalid_message"


def test_tensor_refs_are_bounds_and_size_checked():
    check_ref(TensorRef(0, 0, 16, [2, 2], "float32"), 16)
    check_ref(TensorRef(0, 8, 8, [4], "bfloat16"), 16)
    with pytest.raises(TensorRefError, match="outside"):
        check_ref(TensorRef(0, 8, 16, [2, 2], "float32"), 16)
    with pytest.raises(TensorRefError, match="needs"):
        check_ref(TensorRef(0, 0, 12, [2, 2], "float32"), 64)
    with pytest.raises(TensorRefError, match="unknown dtype"):
        check_ref(TensorRef(0, 0, 4, [1], "float128"), 64)
    # Negative offsets never decode.
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([0, -8, 4, [1], "float32", "cpu"]), type=TensorRef)


def test_shm_arena_is_private_shared_and_leaves_nothing_behind():
    arena = ShmArena.create(4096)
    path = f"/dev/shm/{arena.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    peer = ShmArena.attach(arena.info())
    assert not os.path.exists(path)  # the peer unlinked the name once mapped
    ref = TensorRef(0, 128, 4, [4], "uint8")
    arena.view(ref)[:] = b"omni"
    assert bytes(peer.view(ref)) == b"omni"
    with pytest.raises(TensorRefError):
        peer.view(TensorRef(0, 4094, 4, [4], "uint8"))
    peer.close()
    arena.close()


def test_shm_arena_attach_refuses_bad_names_and_sizes():
    with pytest.raises(ArenaError, match="invalid arena name"):
        ShmArena.attach(ArenaInfo("shm", "../etc/passwd", 10))
    with pytest.raises(ArenaError, match="not found"):
        ShmArena.attach(ArenaInfo("shm", "omni-does-not-exist", 10))
    arena = ShmArena.create(1024)
    with pytest.raises(ArenaError, match="announced"):
        ShmArena.attach(ArenaInfo("shm", arena.name, 1 << 20), unlink=False)
    arena.close()


def test_slot_ring_round_robin():
    ring = SlotRing(4096, 2)
    assert ring.slot_size == 2048
    assert [ring.slot_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert ring.offset(1) == 2048


def test_sweep_removes_only_arenas_of_dead_creators(tmp_path):
    from proto.arena import PID_NAMESPACE, sweep_stale

    ns = PID_NAMESPACE
    live = tmp_path / f"omni-shim-r0-n{ns}-{os.getpid()}-0123456789ab"
    dead = tmp_path / f"omni-shim-r0-n{ns}-999999-0123456789ab"
    # Another PID namespace (a container sharing /dev/shm): its pid 999999 may be alive there.
    elsewhere = tmp_path / f"omni-shim-r0-n{ns + 1}-999999-0123456789ab"
    other = tmp_path / "psm_0123"
    for p in (live, dead, elsewhere, other):
        p.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == [dead.name]
    assert live.exists() and elsewhere.exists() and other.exists() and not dead.exists()


def test_arena_names_carry_the_pid_namespace():
    from proto.arena import PID_NAMESPACE, ShmArena

    arena = ShmArena.create(4096, prefix="omni-test-ns")
    try:
        assert arena.name.startswith(f"omni-test-ns-n{PID_NAMESPACE}-{os.getpid()}-")
        assert PID_NAMESPACE == os.stat("/proc/self/ns/pid").st_ino
    finally:
        arena.close()
