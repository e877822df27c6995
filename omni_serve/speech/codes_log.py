"""`omni-serve --codes-log FILE`: each finished request's codec codes, one JSON line each.

For checking a server's codes against another's or a reference (the speech side by side on the
H200 compares them with vllm-omni's). A line: {"request_id", "frames", "codebooks", "codes"}, the
codes [frames, codebooks] as little-endian int32, row-major, base64: a request's line is written in
microseconds, so logging does not slow the serving it records.
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

    def write(self, request_id: str, codes: np.ndarray) -> None:
        frames, codebooks = codes.shape
        data = base64.b64encode(np.ascontiguousarray(codes, dtype="<i4").tobytes()).decode()
        self._file.write(json.dumps({"request_id": request_id, "frames": frames, "codebooks": codebooks,
                                     "codes": data}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_codes_log(path: Path) -> list[tuple[str, np.ndarray]]:
    """(request id, codes [frames, codebooks]) per line, in the order the requests finished."""
    out = []
    for line in Path(path).read_text().splitlines():
        got = json.loads(line)
        codes = np.frombuffer(base64.b64decode(got["codes"]), dtype="<i4").reshape(got["frames"], got["codebooks"])
        out.append((got["request_id"], codes.astype(np.int64)))
    return out
