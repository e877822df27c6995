import sys, time, tempfile, statistics
from pathlib import Path
sys.path.insert(0, '.')
from bench.step_cost import ShimUnderTest, decode_state, _forward
d = Path(tempfile.mkdtemp(prefix='ptb', dir='/tmp'))
s = ShimUnderTest(d, 'pt', 'passthrough', 64)
link = s.link
rec = link.recovery
parts = {k: [] for k in ['note_finished', 'begin_step', 'pre_forward', 'end_step', 'at_step_start', 'by_length', 'tick']}
import worker_shim.recovery as R
orig_at = rec.at_step_start
def at(step):
    t = time.perf_counter_ns(); orig_at(step); parts['at_step_start'].append(time.perf_counter_ns() - t)
rec.at_step_start = at
orig_bl = link.finishes.by_length
def bl(b):
    t = time.perf_counter_ns(); r = orig_bl(b); parts['by_length'].append(time.perf_counter_ns() - t); return r
link.finishes.by_length = bl
orig_tick = link._send_step_tick
def tk(c, n):
    t = time.perf_counter_ns(); orig_tick(c, n); parts['tick'].append(time.perf_counter_ns() - t)
link._send_step_tick = tk
for i in range(3000):
    st = decode_state(s.req_ids, i, s.hidden)
    t0 = time.perf_counter_ns(); link.note_finished(set(), None); t1 = time.perf_counter_ns()
    link.begin_step(); t2 = time.perf_counter_ns()
    link.pre_forward(st.input_batch, s.model); t3 = time.perf_counter_ns()
    _forward(0.0005, True)
    t4 = time.perf_counter_ns(); link.end_step(st); t5 = time.perf_counter_ns()
    if i > 500:
        parts['note_finished'].append(t1 - t0); parts['begin_step'].append(t2 - t1); parts['pre_forward'].append(t3 - t2); parts['end_step'].append(t5 - t4)
for k, v in parts.items():
    v = v[-2000:]
    print(f"{k:14s} p50 {statistics.median(v)/1000:6.2f} us")
s.close()
