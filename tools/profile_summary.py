"""Summarize a py-spy profile of every process of a bench run (what a step still waits for).

On the GPU host, with py-spy's wheel carried in (pip download py-spy; no network there), sample the bench
and all its children without pausing them, then summarize there: the raw file of a whole `bench.gpu` run
is tens of MB, more than a device call brings back.

    py-spy record --pid $BENCH_PID --subprocesses --nonblocking --threads -r 40 -f raw -o /tmp/prof.txt
    python3 tools/profile_summary.py /tmp/prof.txt $OUT/prof.sum          # + $OUT/prof.sum.compact.gz
    python3 tools/profile_summary.py --tree $OUT/prof.sum.compact.gz PID "Session.step_end" [--depth 3]

The summary lists each process (samples, command line), its busiest threads, and for the busiest thread
the functions by inclusive and by own samples. `--tree` prints what runs under one function of one process
(the first frame whose name starts with ROOT), `--depth` levels down, with sample counts. A function's
time per step is samples x (1 / rate) / steps; the bench's JSON has the steps (shim_stats.steps).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re

_LINE_NO = re.compile(r":\d+\)$")
_PROCESS = re.compile(r'process (\d+):"(.*?)";', re.S)
_RECORD = re.compile(r"(?:^|\n)(process .*?) (\d+)(?=\n|$)", re.S)  # a command line may span lines


def summarize(raw_path: str, out_path: str, top: int = 90) -> None:
    procs: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    names: dict[str, str] = {}
    own: dict = collections.defaultdict(collections.Counter)
    inclusive: dict = collections.defaultdict(collections.Counter)
    compact: collections.Counter = collections.Counter()
    with open(raw_path, errors="replace") as f:
        text = f.read()
    for match in _RECORD.finditer(text):
        stack, count = match.group(1), int(match.group(2))
        heads = list(_PROCESS.finditer(stack))
        if not heads:
            continue
        last = heads[-1]  # a child's stack starts with its parents' process frames
        pid = last.group(1)
        names[pid] = last.group(2)[:100].replace("\n", " ")
        rest = stack[last.end():].split(";")
        thread = rest[0] if rest and rest[0].startswith("thread") else ""
        frames = [_LINE_NO.sub(")", fr) for fr in (rest[1:] if thread else rest) if fr]
        thread = thread.split(":", 1)[1].strip() if ":" in thread else thread
        procs[pid] += count
        threads[pid, thread] += count
        if frames:
            own[pid, thread][frames[-1]] += count
        for frame in set(frames):
            inclusive[pid, thread][frame] += count
        compact[";".join([pid, thread, *frames])] += count
    with open(out_path, "w") as out:
        for pid, n in procs.most_common():
            out.write(f"\n##### {n:7d} pid {pid} {names[pid]}\n")
            mine = [(t, c) for (p, t), c in threads.items() if p == pid]
            for t, c in sorted(mine, key=lambda x: -x[1]):
                if c > n * 0.02:
                    tops = "; ".join(f"{k} {v}" for k, v in own[pid, t].most_common(4))
                    out.write(f"  thread {t} {c}: {tops}\n")
            busiest, samples = max(mine, key=lambda x: x[1])
            out.write(f"  -- inclusive top {top}, busiest thread {busiest} ({samples})\n")
            for k, v in inclusive[pid, busiest].most_common(top):
                out.write(f"  {v:7d} {v / samples:6.1%} {k}\n")
            out.write(f"  -- own top {top // 2}, that thread\n")
            for k, v in own[pid, busiest].most_common(top // 2):
                out.write(f"  {v:7d} {v / samples:6.1%} {k}\n")
    with gzip.open(out_path + ".compact.gz", "wt", compresslevel=9) as z:
        for k, v in compact.items():
            z.write(f"{k} {v}\n")


def tree(compact_path: str, pid: str, root: str, depth: int) -> None:
    counts: collections.Counter = collections.Counter()
    total = 0
    with gzip.open(compact_path, "rt") as f:
        for line in f:
            stack, n = line.rstrip("\n").rsplit(" ", 1)
            frames = stack.split(";")
            if frames[0] != pid:
                continue
            frames = frames[2:]
            at = next((i for i, fr in enumerate(frames) if fr.startswith(root)), None)
            if at is None:
                continue
            total += int(n)
            below = tuple(frames[at + 1 : at + 1 + depth])
            for d in range(1, len(below) + 1):
                counts[below[:d]] += int(n)
    print(f"{total} samples under {root} in pid {pid}")
    for path, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if n >= max(3, total * 0.01):
            print(f"{n:6d} {'  ' * (len(path) - 1)}{path[-1][:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="RAW OUT, or with --tree: COMPACT_GZ PID ROOT")
    ap.add_argument("--tree", action="store_true", help="what runs under ROOT in process PID")
    ap.add_argument("--depth", type=int, default=3)
    args = ap.parse_args()
    if args.tree:
        if len(args.paths) != 3:
            ap.error("--tree takes COMPACT_GZ PID ROOT")
        tree(*args.paths, args.depth)
    elif len(args.paths) == 2:
        summarize(*args.paths)
    else:
        ap.error("give RAW OUT (a py-spy raw file, the summary to write)")


if __name__ == "__main__":
    main()
