"""Session 13 device micro-bench: plan read with / without the landing, the StepEnd's slot work, the embeds fill eager / graph."""
import cProfile, pstats, sys, time
import torch
from omni_arena.cuda_ipc import CudaIpcArena
from omni_arena.tensor_tree import ExtStacker
from omni_sidecar.arenas import OutArena
from proto.messages import StepPlan, StepEnd
from proto.codec import Codec
from worker_shim.transfer import read_plan, HiddenSlots
from worker_shim.plan_read import PlanLanding

n = 64
dev = torch.device("cuda", 0)

def timed(label, fn, N=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(N):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    ts.sort()
    print(f"{label:48s} p50 {ts[N//2]*1e6:8.1f} us  p90 {ts[int(N*.9)]*1e6:8.1f}", flush=True)

for hidden in (128, 2048):
    arena = CudaIpcArena.create(1 << 24, dev, 1, name="omni-micro")
    out = OutArena(arena)
    model = torch.nn.Linear(1, 1, device=dev)
    tree = {"runtime_additional_information": [
        {"meta": {"prompt_len": 16, "num_processed_tokens": 40}, "hidden_states": {"last": torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)}}
        for _ in range(n)], "request_token_spans": [[i, i + 1] for i in range(n)]}
    out.reset()
    blob = ExtStacker().store(tree, out.put_whole, out.put_stack, len(out.stacks))
    event = out.seal()
    plan = StepPlan(step=1, extra_kwargs=blob, stacks=out.stacks, event=event)
    land = PlanLanding()
    timed(f"read_plan h{hidden} fresh copy", lambda: read_plan(arena, plan, None, model, None))
    timed(f"read_plan h{hidden} landing", lambda: read_plan(arena, plan, None, model, None, land))
    out.close()

# StepEnd's slot work: hidden rows and two captured layers into a slot of a CUDA IPC arena.
for hidden in (128, 2048):
    rows_bytes = 1024 * hidden * 2
    harena = CudaIpcArena.create(rows_bytes * 3 * 2 + (1 << 20), dev, 2, name="omni-micro-h")
    slots = HiddenSlots(harena, 2)
    hs = torch.randn(1024, hidden, device=dev, dtype=torch.bfloat16)
    layers = {0: torch.randn(1024, hidden, device=dev, dtype=torch.bfloat16)[:n], 8: torch.randn(1024, hidden, device=dev, dtype=torch.bfloat16)[:n]}
    step = [0]
    def one():
        step[0] += 1
        s = slots.claim(step[0], lambda s: None)
        s.put(hs[:n], steady=True); s.put_layers(layers); s.seal()
    timed(f"slot claim+3 puts+seal h{hidden}", one)
    def claim_only():
        step[0] += 1; slots.claim(step[0], lambda s: None)
    timed(f"slot claim only h{hidden}", claim_only)
    src = hs[:n]; dst = torch.empty_like(src)
    timed(f"one D2D copy_ non_blocking h{hidden}", lambda: dst.copy_(src, non_blocking=True))
    timed(f"event record", lambda: harena.mark_ready(0))
    timed(f"stream wait_event", lambda: harena.wait_done(0))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(1000): one()
    pr.disable(); torch.cuda.synchronize()
    if hidden == 2048:
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    harena.close()

codec = Codec()
from proto.messages import PackedLayout
msg = StepEnd(step=5, num_tokens=n, hidden=None)
timed("StepEnd encode (no layout)", lambda: codec.encode(msg))

# The embeds fill: eager lookup + copy into the buffer, against a CUDA graph of the same.
for vocab, hidden in ((384, 128), (32000, 2048)):
    emb = torch.nn.Embedding(vocab, hidden, device=dev, dtype=torch.bfloat16)
    ids_buf = torch.randint(0, vocab, (1024,), device=dev, dtype=torch.int32)
    buf = torch.zeros(1024, hidden, device=dev, dtype=torch.bfloat16)
    def embed(ids):
        return emb(ids.long())
    def eager():
        buf[:n].copy_(embed(ids_buf[:n]))
    timed(f"embeds fill eager v{vocab} h{hidden}", eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): eager()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        eager()
    timed(f"embeds fill graph replay v{vocab} h{hidden}", g.replay)
    ids_buf.random_(0, vocab); g.replay(); want = embed(ids_buf[:n]); torch.cuda.synchronize()
    print("graph fill equals eager:", bool(torch.equal(buf[:n], want)))
