"""Statistics of an alternating (ABBA / BAAB) throughput comparison, with its spread.

A block is four rounds, two per engine, in ABBA or BAAB order (blocks alternate), so a
linear drift of the machine over a block hits both engines alike. Per block, the ratio
is mean(shim rounds) / mean(plain rounds); the figure is the median of the block ratios,
with a bootstrap 95 % interval over blocks (resampled with replacement, seeded).

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


def block_order(index: int) -> list[str]:
    """Engines of block `index`, in order: ABBA, then BAAB, alternating (A = plain, B = shim)."""
    return ["plain", "shim", "shim", "plain"] if index % 2 == 0 else ["shim", "plain", "plain", "shim"]


def block_ratios(rounds: list[dict]) -> list[float]:
    """Per complete block: mean shim tokens/s over mean plain tokens/s."""
    blocks: dict[int, dict[str, list[float]]] = {}
    for r in rounds:
        blocks.setdefault(r["block"], {"plain": [], "shim": []})[r["engine"]].append(r["tok_s"])
    out = []
    for b in sorted(blocks):
        plain, shim = blocks[b]["plain"], blocks[b]["shim"]
        if len(plain) == 2 and len(shim) == 2:
            out.append(statistics.fmean(shim) / statistics.fmean(plain))
    return out


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


def summarize(rounds: list[dict]) -> dict:
    """The figures of one configuration from its timed rounds (warm-up rounds excluded)."""
    ratios = block_ratios(rounds)
    plain = [r["tok_s"] for r in rounds if r["engine"] == "plain"]
    shim = [r["tok_s"] for r in rounds if r["engine"] == "shim"]
    if not ratios:
        return {"blocks": 0, "rounds": len(rounds)}
    lo, hi = bootstrap_median(ratios)
    half = len(ratios) // 2
    halves = [statistics.median(ratios[:half]), statistics.median(ratios[half:])] if half else [ratios[0]] * 2
    med = statistics.median(ratios)
    return {
        "blocks": len(ratios),
        "rounds": len(rounds),
        "ratio_median": round(med, 4),
        "ratio_ci95": [round(lo, 4), round(hi, 4)],
        "ratio_of_medians": round(statistics.median(shim) / statistics.median(plain), 4),
        "block_ratio_p10_p90": [round(_quantile(ratios, 0.1), 4), round(_quantile(ratios, 0.9), 4)],
        "halves": [round(h, 4) for h in halves],
        "run_to_run": round(abs(halves[0] - halves[1]), 4),
        "plain_tok_s_median": round(statistics.median(plain), 1),
        "shim_tok_s_median": round(statistics.median(shim), 1),
        "cv_plain": round(_cv(plain), 4),
        "cv_shim": round(_cv(shim), 4),
        "block_ratios": [round(x, 4) for x in ratios],
        "verdict": verdict(med, lo, hi, abs(halves[0] - halves[1]), len(ratios)),
    }


MIN_BLOCKS_TO_RESOLVE = 6  # fewer: the bootstrap has too few values to mean anything


def verdict(med: float, lo: float, hi: float, run_to_run: float, blocks: int) -> str:
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
    return (f"shim costs {effect:+.2f} % of plain throughput (95 % CI {(1 - hi) * 100:+.2f} .. "
            f"{(1 - lo) * 100:+.2f} %, halves differ by {run_to_run * 100:.2f} points): {resolved}")
