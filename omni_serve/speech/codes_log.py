"""`omni-serve --codes-log FILE`: each finished request's codec codes, one JSON line each.

For checking a server's codes against another's or a reference (the speech side by side on the
H200 compares them with vllm-omni's). A line: {"request_id", "frames", "codebooks", "codes"}, the
codes [frames, codebooks] as little-endian int32, row-major, base64: a request's line is written in
microseconds, so logging does not slow the serving it records. A voice-cloning request's line also
has "reference_frames" and "reference": the reference audio's codes, decoded before its answer's.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np


class CodesLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)  # a line at a time: complete lines whenever it is read

    def write(self, request_id: str, codes: np.ndarray, reference: np.ndarray | None = None) -> None:
        frames, codebooks = codes.shape
        line = {"request_id": request_id, "frames": frames, "codebooks": codebooks, "codes": _encoded(codes)}
        if reference is not None:
            line.update(reference_frames=int(reference.shape[0]), reference=_encoded(reference))
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


def _encoded(codes: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(codes, dtype="<i4").tobytes()).decode()


def _decoded(data: str, frames: int, codebooks: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<i4").reshape(frames, codebooks).astype(np.int64)


def read_codes_log(path: Path) -> list[tuple[str, np.ndarray]]:
    """(request id, codes [frames, codebooks]) per line, in the order the requests finished."""
    return [(request_id, codes) for request_id, codes, _ in read_codes_log_references(path)]


def read_codes_log_references(path: Path) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    """(request id, codes, reference codes or None) per line, in the order the requests finished."""
    out = []
    for line in Path(path).read_text().splitlines():
        got = json.loads(line)
        reference = got.get("reference")
        out.append((got["request_id"], _decoded(got["codes"], got["frames"], got["codebooks"]),
                    None if reference is None else _decoded(reference, got["reference_frames"], got["codebooks"])))
    return out
