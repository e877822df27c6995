"""vllm-omni's `embed.decode` span merge (payload_span.py), one implementation for both sides.

Streamed payloads carry decode rows with `embed.decode_token_start/end`: a contiguous append
concatenates, an overlap is trimmed, a gap is an error. The sidecar merges them into its state
(omni_sidecar/hook_sets/omni/state.py) and the shim into its state mirror (worker_shim/model/state_mirror.py);
both apply the same trimmed delta (`span_delta`), so both hold the same rows.
"""

from __future__ import annotations

from typing import Any

import torch

SPAN_KEYS = ("decode", "decode_token_start", "decode_token_end")


class SpanError(ValueError):
    pass


def has_span(category: str, value: Any) -> bool:
    return category == "embed" and isinstance(value, dict) and "decode" in value and "decode_token_start" in value


def span_delta(current: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """The rows of `update`'s span past `current`'s (`{}`: already covered); SpanError on a gap."""
    new = update["decode"]
    start = int(update["decode_token_start"])
    end = int(update.get("decode_token_end", start + new.shape[0]))
    if end - start != new.shape[0]:
        raise SpanError(f"embed.decode has {new.shape[0]} rows but its span is [{start}, {end})")
    if current.get("decode") is None:
        return {"decode": new, "decode_token_start": start, "decode_token_end": end}
    old_start, old_end = int(current["decode_token_start"]), int(current["decode_token_end"])
    if start > old_end:
        raise SpanError(f"embed.decode span [{start}, {end}) leaves a gap after [{old_start}, {old_end})")
    if end <= old_end:
        return {}
    fresh = new[old_end - start :] if start < old_end else new
    return {"decode": fresh, "decode_token_start": old_end, "decode_token_end": end}


def merge_decode_span(current: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Span-merge `embed.decode` rows [start, end) of `update` into `current`: the new span keys."""
    delta = span_delta(current, update)
    old = current.get("decode")
    if old is None or not delta:
        return delta
    merged = torch.cat([old, delta["decode"].to(old.device, old.dtype)], dim=0)
    return {"decode": merged, "decode_token_start": int(current["decode_token_start"]),
            "decode_token_end": delta["decode_token_end"]}


def merge_category(slot: dict[str, Any], category: str, value: dict[str, Any]) -> dict[str, Any]:
    """`value` with its decode span merged against `slot` (other qualifiers as they are)."""
    if not has_span(category, value):
        return value
    others = {k: v for k, v in value.items() if k not in SPAN_KEYS}
    return {**others, **merge_decode_span(slot, value)}
