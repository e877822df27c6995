"""Statistics of an alternating (ABBA / BAAB) throughput comparison, with its spread.

A block is four rounds, two per engine, in ABBA or BAAB order (blocks alternate), so a
linear drift of the machine over a block hits both engines alike. Per block, the ratio
is mean(shim rounds) / mean(plain rounds); the figure is the median of the block ratios,
with a bootstrap 95 % interval over blocks (resampled with replacement, seeded).
With three engines (plain, shim and the in-process baseline, bench/inproc.py) a block is
a palindrome of six rounds (ABCCBA, then BCAACB, CABBAC): each engine's two rounds sit
symmetrically about the block's middle, so a linear drift still hits every pair alike,
and any pair of engines is compared as above (`summarize(rounds, num, den)`).

The spread reported next to it, so an effect can be told from noise:
- `block_ratio_p10_p90`: where the middle 80 % of block ratios lie;
- `halves`: the median ratio of the first and of the second half of the blocks, and
  their difference (`run_to_run`): what two shorter runs of this bench would disagree by;
- `cv_plain` / `cv_shim`: each engine's round-to-round coefficient of variation.
An effect (1 - ratio) smaller than the interval's half-width or than `run_to_run` is not
one this run can claim.
"""

from __future__ import annotations

import random
import statistics
from typing import Literal


ENGINES = ("plain", "shim")


def block_order(index: int, engines: tuple[str, ...] | list[str] = ENGINES) -> list[str]:
    """Engines of block `index`, in order: the engines rotated by the block index, then back
    (two engines: ABBA, then BAAB, alternating; A = plain, B = shim)."""
    k = index % len(engines)
    ahead = list(engines[k:]) + list(engines[:k])
    return ahead + ahead[::-1]


def _per_block(rounds: list[dict], key: str, num: str, den: str) -> list[tuple[list[float], list[float]]]:
    """(num's values, den's values) of `key` per block where both engines ran both rounds."""
    blocks: dict[int, dict[str, list[float]]] = {}
    for r in rounds:
        if r.get(key) is not None:  # rounds of older runs have no step periods
            blocks.setdefault(r["block"], {}).setdefault(r["engine"], []).append(r[key])
    return [(blocks[b].get(num, []), blocks[b].get(den, [])) for b in sorted(blocks)
            if len(blocks[b].get(num, [])) == 2 and len(blocks[b].get(den, [])) == 2]


# What a round records that a ratio can be taken of: tokens/s (higher is faster), or the engine's
# median step period in ms as its core stamped its outputs (lower is faster; see `step_pace`).
RatioKey = Literal["tok_s", "step_ms"]


def block_ratios(rounds: list[dict], num: str = "shim", den: str = "plain", key: RatioKey = "tok_s") -> list[float]:
    """Per complete block: `num`'s speed over `den`'s: mean tokens/s over mean tokens/s, or for step
    periods the inverse (mean `den` period over mean `num` period), so below 1 means `num` is slower."""
    blocks = _per_block(rounds, key, num, den)
    if key == "step_ms":
        return [statistics.fmean(b) / statistics.fmean(a) for a, b in blocks]
    return [statistics.fmean(a) / statistics.fmean(b) for a, b in blocks]


def step_pace(stamps: list[float]) -> float | None:
    """A round's median engine step period in ms, from the engine core's timestamps of the step
    outputs it produced (one per step): a burst of host CPU steal lengthens a few steps, which a
    median ignores, where it lengthens the whole round's time. None for fewer than 3 steps."""
    if len(stamps) < 3:
        return None
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:])) * 1e3


def step_price(rounds: list[dict], num: str, den: str, steps_per_round: float) -> dict:
    """What `num` adds to each engine step over `den`, in µs of wall time: per block, the mean
    round time difference over the round's steps; median, bootstrap interval and halves as for
    the ratio. The engines run the same schedule (same scheduler, same requests), so one step
    count (a mean over rounds; a plain engine counts none) serves both."""
    diffs = [(statistics.fmean(a) - statistics.fmean(b)) / steps_per_round * 1e6
             for a, b in _per_block(rounds, "s", num, den)] if steps_per_round > 0 else []
    if not diffs:
        return {"blocks": 0}
    lo, hi = bootstrap_median(diffs)
    half = len(diffs) // 2
    halves = [statistics.median(diffs[:half]), statistics.median(diffs[half:])] if half else [diffs[0]] * 2
    return {"blocks": len(diffs), "steps_per_round": round(steps_per_round, 2), "us_median": round(statistics.median(diffs), 1),
            "us_ci95": [round(lo, 1), round(hi, 1)], "halves_us": [round(h, 1) for h in halves]}


def bootstrap_median(values: list[float], iters: int = 4000, seed: int = 15) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the median."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(iters))
    return meds[int(0.025 * (iters - 1))], meds[int(0.975 * (iters - 1))]


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


def summarize(rounds: list[dict], num: str = "shim", den: str = "plain", key: RatioKey = "tok_s") -> dict:
    """The figures of one pair of engines (`num` / `den`) from its timed rounds (warm-up rounds
    excluded); the keys name the engines (`plain_tok_s_median`, `cv_shim`, ...). `key="step_ms"`:
    the same from the rounds' median step periods (the ratio still reads as num's speed / den's)."""
    ratios = block_ratios(rounds, num, den, key)
    plain = [r[key] for r in rounds if r["engine"] == den and r.get(key) is not None]
    shim = [r[key] for r in rounds if r["engine"] == num and r.get(key) is not None]
    if not ratios:
        return {"blocks": 0, "rounds": len(rounds)}
    of_medians = statistics.median(shim) / statistics.median(plain)
    lo, hi = bootstrap_median(ratios)
    half = len(ratios) // 2
    halves = [statistics.median(ratios[:half]), statistics.median(ratios[half:])] if half else [ratios[0]] * 2
    med = statistics.median(ratios)
    return {
        "blocks": len(ratios),
        "rounds": len(rounds),
        "ratio_median": round(med, 4),
        "ratio_ci95": [round(lo, 4), round(hi, 4)],
        "ratio_of_medians": round(1 / of_medians if key == "step_ms" else of_medians, 4),
        "block_ratio_p10_p90": [round(_quantile(ratios, 0.1), 4), round(_quantile(ratios, 0.9), 4)],
        "halves": [round(h, 4) for h in halves],
        "run_to_run": round(abs(halves[0] - halves[1]), 4),
        f"{den}_{key}_median": round(statistics.median(plain), 4 if key == "step_ms" else 1),
        f"{num}_{key}_median": round(statistics.median(shim), 4 if key == "step_ms" else 1),
        f"cv_{den}": round(_cv(plain), 4),
        f"cv_{num}": round(_cv(shim), 4),
        "block_ratios": [round(x, 4) for x in ratios],
        "verdict": verdict(med, lo, hi, abs(halves[0] - halves[1]), len(ratios), num, den),
    }


MIN_BLOCKS_TO_RESOLVE = 6  # fewer: the bootstrap has too few values to mean anything


def verdict(med: float, lo: float, hi: float, run_to_run: float, blocks: int, num: str = "shim",
            den: str = "plain") -> str:
    """One line: the effect, and whether this run resolves it."""
    effect = (1.0 - med) * 100
    half_width = (hi - lo) / 2 * 100
    if blocks < MIN_BLOCKS_TO_RESOLVE:
        resolved = f"only {blocks} blocks: not resolved (need >= {MIN_BLOCKS_TO_RESOLVE})"
    elif lo <= 1.0 <= hi:
        resolved = "no cost resolved: the 95 % interval includes 1.0"
    elif half_width >= abs(effect) or run_to_run * 100 >= abs(effect):
        resolved = "effect within the spread: not resolved"
    else:
        resolved = "resolved: the interval excludes 1.0 and the halves agree within the effect"
    return (f"{num} costs {effect:+.2f} % of {den} throughput (95 % CI {(1 - hi) * 100:+.2f} .. "
            f"{(1 - lo) * 100:+.2f} %, halves differ by {run_to_run * 100:.2f} points): {resolved}")
