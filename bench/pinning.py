"""CPU pinning for the one-GPU throughput bench (bench/gpu_ab.py), off unless `--pin`.

The idea: on a lent H200 host the same engine's rounds of the same work ranged 2.6
to 4.4 ms per step within seconds, with or without CPU steal; a tiny model's step is all host
Python, so giving each engine's processes (engine core with its worker; the shim's sidecar) cores
no other engine or the driver uses might steady it. Linux pins threads, not processes: every
thread of a process is pinned; threads started later inherit their creator's mask.

What it did on that host: no narrower spread (tiny pass-through, 12 pinned blocks:
95 % CI 0.891..1.004 against 0.951..1.044 unpinned over 22), and on the 1B model with the omni
hooks it made the shim ten times slower: torch's intra-op thread pool (one thread per host CPU)
squeezed onto the sidecar's one core stalls each parallel op for a scheduler slice (plan waits p99
249 ms against 18 ms unpinned). Hence off by default; kept to repeat the experiment.
"""

from __future__ import annotations

import os

import psutil


def child_pids() -> set[int]:
    """This process's descendants now (an engine's processes are those new after it started)."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def pin_process(pid: int, cpus: list[int]) -> int:
    """Every thread of `pid` onto `cpus`; returns how many threads were pinned."""
    pinned = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return pinned


def plan(groups: dict[str, int]) -> dict[str, list[int]] | None:
    """Cores for each group (name -> how many), in order, from this process's allowed CPUs; None
    when there are not enough for every group to have its own."""
    cpus = sorted(os.sched_getaffinity(0))
    if sum(groups.values()) > len(cpus):
        return None
    out, at = {}, 0
    for name, count in groups.items():
        out[name] = cpus[at : at + count]
        at += count
    return out


def pin_all(pids_by_group: dict[str, set[int]], cores: dict[str, list[int]]) -> dict[str, dict]:
    """Pin each group's processes to its cores (the driver: "driver" -> this process); what was done."""
    done = {}
    for name, pids in pids_by_group.items():
        threads = sum(pin_process(pid, cores[name]) for pid in pids)
        done[name] = {"cpus": cores[name], "processes": len(pids), "threads": threads}
    return done
