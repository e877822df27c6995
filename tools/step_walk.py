"""Count the code one StepBegin -> StepPlan round trip walks through.

A real sidecar (`SidecarServer` with the builtin "overlay" hook set, which needs
a blocking exchange before every prefill forward) serves in a thread; a real
shim link connects to it and runs `pre_forward` on a fake vLLM input batch
(no vLLM is imported). Calls are counted with sys.setprofile / threading.setprofile,
only for frames whose file lies in the product packages.

The shim's side is the runner's entry to the step (`SidecarLink.pre_forward`, worker_shim/step/link.py)
over a real `SidecarConnection` (worker_shim/wire/connection.py), as the shim worker builds them.

Shim side: every call inside `pre_forward` (entry to return).
Sidecar side: every call subtree of the server thread, started during the round
trip, that handles the StepBegin (a subtree whose calls receive a StepBegin or a
StepPlan as an argument); loop turns that only polled are left out.

Reported per side and in total: calls (Python frames entered), distinct functions,
distinct files, moves between files (calls whose calling project frame lies in
another file), and distinct call edges (caller function -> function; a wait loop's
repeats count once, which makes it the length of the walk a reader follows). Calls vary with the wait (a spinning wait polls more often), so the
minimum and median over the measured round trips are given; the distinct counts are
the union over them.

    PYTHONPATH=$PWD python tools/step_walk.py [--rounds 20] [--ring 1] [--json out.json]

To measure a link built another way, pass
`--link-factory module:function` (called as function(endpoint) -> (link, close)),
or adapt `default_link_factory` below; the measured call is `--entry` (default
pre_forward) called as entry(input_batch, model, embeds).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proto", "worker_shim", "omni_sidecar", "omni_arena")
ROOMS = tuple(str(ROOT / p) + os.sep for p in PACKAGES)
HIDDEN = 64
PROMPT_LEN = 48
CHUNK = 8  # tokens per step: the prompt stays in prefill for PROMPT_LEN / CHUNK steps


def _first(*candidates: str) -> Any:
    """The first importable `module:attr` of the candidates."""
    errors = []
    for spec in candidates:
        module, _, attr = spec.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError) as exc:
            errors.append(f"{spec}: {exc}")
    raise SystemExit("step_walk: none of these names exist:\n  " + "\n  ".join(errors))


# -- the sidecar ----------------------------------------------------------------------

def start_sidecar(endpoint: str, hooks_name: str, ring: bool) -> tuple[Any, threading.Thread]:
    from omni_sidecar.hook_api.loader import load_hooks
    from omni_sidecar.serve.config import ServeConfig
    from omni_sidecar.serve.server import SidecarServer

    server = SidecarServer(ServeConfig(endpoint=endpoint, hooks=hooks_name, arena_mib=4, ring=ring),
                           load_hooks(hooks_name, {}))
    server.bind()
    thread = threading.Thread(target=server.serve_forever, kwargs={"install_signals": False},
                              name="step-walk-sidecar", daemon=True)
    return server, thread


# -- the shim -------------------------------------------------------------------------

def default_link_factory(endpoint: str, ring: bool) -> tuple[Any, Callable[[], None]]:
    """A SidecarLink over a real SidecarConnection, built the way the shim worker builds it."""
    from proto.endpoint import pid_namespace
    from proto.messages import Hello
    from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR

    conn_cls = _first("worker_shim.wire.connection:SidecarConnection")
    link_cls = _first("worker_shim.step.link:SidecarLink")
    ring_cls = _first("worker_shim.config:RingConfig")
    hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "step-walk", "none", "cpu", 0, 1, "fake-model",
                  HIDDEN, "float32", 64, [], pid=os.getpid(), pid_namespace=pid_namespace())

    def connect(endpoint: str = endpoint, resume_token: str = "") -> Any:
        return conn_cls(endpoint, 10.0, hello, 1 << 20, 2, arena_prefix="omni-step-walk",
                        ring=ring_cls(enabled=ring))

    first = connect()
    first.connect(10.0)
    try:  # the batch read as on a vLLM whose InputBatch has its own prefill flags (FakeBatch below)
        batches = _first("worker_shim.step.batch:BatchReader")(own_prefill_flags=True)
        link = link_cls(connect, first, batches=batches)
    except SystemExit:
        link = link_cls(connect, first)
    return link, link.close


class FakeBatch:
    """The fields of vLLM's V2 InputBatch that the shim reads."""

    def __init__(self, req_ids: list[str], computed: list[int], scheduled: list[int]) -> None:
        import numpy as np
        import torch

        n = len(req_ids)
        self.req_ids = list(req_ids)
        self.num_computed_tokens_np = np.array(computed, dtype=np.int32)
        self.prefill_len_np = np.array([PROMPT_LEN] * n, dtype=np.int32)
        self.is_prefilling_np = self.num_computed_tokens_np < self.prefill_len_np
        self.query_start_loc_np = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        self.num_tokens = int(sum(scheduled))
        self.num_tokens_after_padding = self.num_tokens
        self.input_ids = torch.full((self.num_tokens,), 5, dtype=torch.int64)


class FakeModel:
    def __init__(self) -> None:
        import torch

        self.weight = torch.zeros(HIDDEN)

    def parameters(self):
        yield self.weight

    def embed_input_ids(self, ids):
        import torch

        return torch.zeros((ids.shape[0], HIDDEN))


def new_request(req_id: str) -> Any:
    import torch

    from omni_sidecar.payload import sidecar_extra_args

    embeds = torch.randn(PROMPT_LEN, HIDDEN)
    params = SimpleNamespace(extra_args=sidecar_extra_args(prompt_embeds=embeds))
    return SimpleNamespace(req_id=req_id, prompt_len=PROMPT_LEN, prompt_token_ids=[3] * PROMPT_LEN,
                           sampling_params=params)


def note_new(link: Any, reqs: list[Any]) -> None:
    for name in ("note_new", "note_new_requests", "add_requests"):
        fn = getattr(link, name, None)
        if fn is not None:
            fn(reqs)
            return
    tracker = getattr(link, "payloads", None) or getattr(link, "tracker", None)
    if tracker is not None and hasattr(tracker, "note_new"):
        tracker.note_new(reqs)
        return
    raise SystemExit("step_walk: cannot tell the link about new requests (adapt note_new)")


# -- counting -------------------------------------------------------------------------

def _room(filename: str) -> str | None:
    return filename[len(str(ROOT)) + 1:] if filename.startswith(ROOMS) else None


class Recorder:
    """Call events per thread while `active`; each with its file, function and repo caller."""

    def __init__(self) -> None:
        self.active = False
        self.events: dict[int, list[tuple]] = {}
        self._lock = threading.Lock()

    def profile(self, frame, event, arg):  # sys.setprofile signature
        if event != "call" or not self.active:
            return
        room = _room(frame.f_code.co_filename)
        if room is None:
            return
        caller = frame.f_back
        while caller is not None and _room(caller.f_code.co_filename) is None:
            caller = caller.f_back
        step_msg = any(type(v).__name__ in ("StepBegin", "StepPlan") for v in frame.f_locals.values())
        code = frame.f_code
        ident = threading.get_ident()
        with self._lock:
            self.events.setdefault(ident, []).append((
                id(frame), id(caller) if caller is not None else None, room,
                f"{room}:{code.co_qualname}:{code.co_firstlineno}",
                _room(caller.f_code.co_filename) if caller is not None else None, step_msg,
                f"{_room(caller.f_code.co_filename)}:{caller.f_code.co_qualname}" if caller is not None else "",
            ))


def _serving_subtrees(events: list[tuple]) -> list[tuple]:
    """Calls of the server thread under a root (a call whose caller began before the window)
    whose subtree touched a StepBegin/StepPlan; polling turns are dropped."""
    root_of: dict[int, int] = {}  # frame id -> its tree (ids of dead frames get reused: the latest wins)
    roots: list[list[tuple]] = []
    for ev in events:
        frame, caller = ev[0], ev[1]
        if caller in root_of:
            root = root_of[caller]
        else:
            root = len(roots)
            roots.append([])
        root_of[frame] = root
        roots[root].append(ev)
    return [ev for tree in roots if any(e[5] for e in tree) for ev in tree]


def summarize(events: list[tuple]) -> dict[str, Any]:
    return {
        "calls": len(events),
        "functions": sorted({e[3] for e in events}),
        "files": sorted({e[2] for e in events}),
        "file_moves": sum(1 for e in events if e[4] is not None and e[4] != e[2]),
        "edges": {(e[6], e[3]) for e in events},
    }


def measure(rounds: int, ring: bool, link_factory: Callable | None, entry: str) -> dict[str, Any]:
    import torch

    workdir = tempfile.mkdtemp(prefix="omni-step-walk-")
    atexit.register(shutil.rmtree, workdir, True)  # its socket: nothing left behind
    endpoint = f"ipc://{workdir}/sidecar.sock"
    recorder = Recorder()
    threading.setprofile(recorder.profile)  # the server thread starts after this
    server, thread = start_sidecar(endpoint, "overlay", ring)
    thread.start()
    link, close = (link_factory or default_link_factory)(endpoint, ring)
    pre_forward = getattr(link, entry)
    end_step = _first_attr(link, "end_step", "finish_step", "after_forward")
    begin_step = _first_attr(link, "begin_step", "start_step", "before_step")
    model = FakeModel()
    per_round: list[dict[str, Any]] = []
    try:
        step = 0
        for r in range((rounds + 1) * 2):
            req_id = f"req-{r // (PROMPT_LEN // CHUNK)}"
            computed = (r % (PROMPT_LEN // CHUNK)) * CHUNK
            if computed == 0:
                note_new(link, [new_request(req_id)])
            batch = FakeBatch([req_id], [computed], [CHUNK])
            embeds = torch.zeros(batch.num_tokens, HIDDEN)
            begin_step()
            measured = r >= 2 and computed > 0  # steady state: no new request rides along
            if measured:
                recorder.events.clear()
                sys.setprofile(recorder.profile)
                recorder.active = True
            extra = pre_forward(batch, model, embeds)
            if measured:
                recorder.active = False
                sys.setprofile(None)
                me = threading.get_ident()
                shim = recorder.events.get(me, [])
                side = [ev for t, evs in recorder.events.items() if t != me for ev in evs]
                # The window closes when the reply is back: the server's turn stops at the reply.
                per_round.append({"shim": shim, "sidecar": _serving_subtrees(side)})
                if "inputs_embeds" not in extra:
                    raise SystemExit("step_walk: the sidecar sent no overlay; the walk is not the one measured")
            end_step(SimpleNamespace(input_batch=batch, hidden_states=None))
            flush = getattr(link, "flush", None)
            if flush is not None:
                flush()  # the StepEnd's turn is over before the next window opens
            step += 1
            if len(per_round) >= rounds:
                break
    finally:
        threading.setprofile(None)
        close()
        server.request_stop()
        thread.join(5)
    return _report(per_round, ring)


def _first_attr(obj: Any, *names: str) -> Callable:
    for name in names:
        fn = getattr(obj, name, None)
        if fn is not None:
            return fn
    raise SystemExit(f"step_walk: the link has none of {names}")


def _report(per_round: list[dict[str, Any]], ring: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"ring": ring, "rounds": len(per_round), "packages": list(PACKAGES)}
    for side in ("shim", "sidecar", "total"):
        sums = [summarize(r["shim"] + r["sidecar"] if side == "total" else r[side]) for r in per_round]
        functions = sorted(set().union(*(s["functions"] for s in sums)))
        files = sorted(set().union(*(s["files"] for s in sums)))
        calls = [s["calls"] for s in sums]
        moves = [s["file_moves"] for s in sums]
        edges = [s["edges"] for s in sums]
        edge_moves = [sum(1 for a, b in es if a and a.split(":")[0] != b.split(":")[0]) for es in edges]
        out[side] = {
            "calls_min": min(calls), "calls_median": statistics.median(calls),
            "distinct_functions": len(functions), "distinct_files": len(files),
            "file_moves_min": min(moves), "file_moves_median": statistics.median(moves),
            # Repeats of a wait loop counted once: the walk a reader follows.
            "call_edges_max": max(len(e) for e in edges), "cross_file_edges_max": max(edge_moves),
            "files": files,
            "functions": functions,
        }
    return out


# What each file a StepBegin -> StepPlan walks through owns: the closing note's rooms, one line each.
ROOM_NOTES = {
    "worker_shim/step/link.py": "the runner's side of a step: vLLM's hooks call in here; protocol, port and recovery",
    "worker_shim/step/protocol.py": "the step protocol: which message a step point sends and waits for (pure); notices",
    "worker_shim/step/batch.py": "vLLM's InputBatch read as this vLLM lays it out (prefill flags, layout arrays)",
    "worker_shim/step/discards.py": "forwards whose samples vLLM discarded under async scheduling: finish notices held a step",
    "worker_shim/step/plan_read.py": "a plan landed: its tensors out of the sidecar's arena, overlays into the embeds",
    "worker_shim/wire/connection.py": "the sidecar port over a sidecar process: what it has seen, its arenas",
    "worker_shim/wire/channel.py": "the shim's end of the connection: sends, waiting for a reply, results stashed",
    "omni_sidecar/serve/server.py": "the serving loop: its turns, each message routed to the room that answers it",
    "omni_sidecar/serve/peers.py": "the shim connections: each one's session and transport; their rings served",
    "omni_sidecar/serve/listener.py": "the ROUTER socket: frames in and out, peer credentials, disconnects",
    "omni_sidecar/sessions/session.py": "one shim connection's requests and the hook calls of each step",
    "omni_sidecar/sessions/arenas.py": "a session's arenas: a plan's tensors written, a StepEnd's read",
    "omni_sidecar/hook_api/hook_set.py": "the hook API: the batch as hooks read it (StepBatch) and the OmniHooks base",
    "omni_sidecar/hook_sets/reference.py": "the built-in reference hook sets (the walk's: overlay)",
    "omni_sidecar/upgrade/handing_over.py": "hot upgrade, the handing-over side",
    "omni_sidecar/upgrade/taking_over.py": "hot upgrade, the taking-over side",
    "omni_sidecar/sessions/appends.py": "streamed payloads and mirrored-state updates between steps",
    "proto/packed.py": "the batch layout's packed wire form (u32 arrays), unpacked lazily by the sidecar",
    "proto/codec.py": "msgpack encoding and decoding of messages, the frame cap, bad frames as FrameError",
    "proto/transport.py": "a connection's routing (ring, marked, socket), send queue and wait policy, both sides",
    "proto/shmring.py": "the shared-memory single-producer/single-consumer ring: records, indices, MARKs",
    "proto/arena.py": "shared-memory arenas: created, attached, mapped; alignment",
    "proto/tensors.py": "tensor refs and their checks against an arena (a peer's refs are untrusted)",
    "omni_arena/views.py": "torch views of arena memory and the wire's dtype table",
}


def _rooms(files: list[str]) -> dict[str, list[str]]:
    """The files of a side by the folder they lie in (a package's subfolder: its room)."""
    rooms: dict[str, list[str]] = {}
    for path in files:
        room, _, name = path.rpartition("/")
        rooms.setdefault(room, []).append(name)
    return rooms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--ring", type=int, choices=(0, 1), default=None,
                    help="measure only with (1) or without (0) the shared-memory ring; default both")
    ap.add_argument("--link-factory", default="", help="module:function(endpoint, ring) -> (link, close)")
    ap.add_argument("--entry", default="pre_forward")
    ap.add_argument("--json", default="", help="write the full report here")
    args = ap.parse_args(argv)
    factory = _first(args.link_factory) if args.link_factory else None
    rings = [bool(args.ring)] if args.ring is not None else [True, False]
    report = {"ring" if r else "socket": measure(args.rounds, r, factory, args.entry) for r in rings}
    for name, rep in report.items():
        print(f"== {name} path, {rep['rounds']} round trips")
        for side in ("shim", "sidecar", "total"):
            s = rep[side]
            print(f"  {side:8s} calls min {s['calls_min']:4d} median {s['calls_median']:6.1f}  "
                  f"functions {s['distinct_functions']:3d}  files {s['distinct_files']:2d}  "
                  f"file moves min {s['file_moves_min']:3d} median {s['file_moves_median']:5.1f}  "
                  f"distinct call edges {s['call_edges_max']:3d} (cross-file {s['cross_file_edges_max']:2d})")
        print("  files:", ", ".join(rep["total"]["files"]))
        for side in ("shim", "sidecar"):
            print(f"  {side} side, by room:")
            for room, names in _rooms(rep[side]["files"]).items():
                print(f"    {room + '/':26s} {', '.join(names)}")
        print("  the rooms, one line each:")
        for path in rep["total"]["files"]:
            print(f"    {path:38s} {ROOM_NOTES.get(path, '(no note: add one to ROOM_NOTES)')}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
