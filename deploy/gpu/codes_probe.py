"""vllm-omni's speech server's codec codes, for the side by side (deploy/gpu/speech_serving.py).

Its talker hands each chunk of codes to its code2wav through a connector (its deploy config names
it: SharedMemoryConnector); no option or endpoint of its server gives them out. This module is a
vLLM general plugin for its processes only: `probe_site(dir, out)` writes a folder that, on the
server's PYTHONPATH, makes vLLM's plugin loader (which every vLLM process runs) call `register`,
which adds RECORDING_CONNECTOR to vllm-omni's own connector registry
(`OmniConnectorFactory.register_connector`): its SharedMemoryConnector, whose `put` appends the
chunk's codes to OUT, then puts as before. The deploy config names RECORDING_CONNECTOR instead.
Nothing of vllm-omni is changed or replaced.

A line: {"key": put key (`<request id>_<stage>_<chunk>`), "left_context": frames of the window that
an earlier chunk had, "codes": the window's codes, codebook-major [Q * frames], little-endian int64,
base64} (None for a chunk without codes: the finished marker).
`read_probe(out, codebooks)`: each request's codes [frames, Q], in the order the requests began.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

RECORDING_CONNECTOR = "CodesRecordingSharedMemoryConnector"
OUT_ENV = "OMNI_CODES_PROBE_FILE"  # where the plugin appends; unset: the plugin does nothing
ENTRY_POINT = "omni_codes_probe"


def register() -> None:
    """vLLM's general plugin: vllm-omni's registry gets the recording connector (once a process)."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    if RECORDING_CONNECTOR in OmniConnectorFactory.list_registered_connectors():
        return

    def create(config: dict[str, Any]):
        from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

        class CodesRecordingSharedMemoryConnector(SharedMemoryConnector):
            def put(self, from_stage: str, to_stage: str, put_key: str, data: Any):
                record(Path(out), put_key, data)
                return super().put(from_stage, to_stage, put_key, data)

        return CodesRecordingSharedMemoryConnector(config)

    OmniConnectorFactory.register_connector(RECORDING_CONNECTOR, create)


def record(out: Path, key: str, data: Any) -> None:
    codes = getattr(getattr(data, "codes", None), "audio", None)
    meta = getattr(data, "meta", None)
    line = {"key": key, "left_context": int(getattr(meta, "left_context_size", None) or 0), "codes": None}
    if codes is not None and codes.numel():
        line["codes"] = base64.b64encode(codes.detach().cpu().numpy().astype("<i8").tobytes()).decode()
    with open(out, "a") as f:  # one write of one line: whole lines from every process
        f.write(json.dumps(line) + "\n")


def read_probe(out: Path, codebooks: int) -> list[tuple[str, np.ndarray]]:
    """(request id, codes [frames, codebooks]) per request, in the order of its first chunk: each
    chunk's window less its left context (the frames an earlier chunk brought)."""
    requests: dict[str, dict[int, np.ndarray]] = {}
    for text in Path(out).read_text().splitlines():
        line = json.loads(text)
        request_id, _stage, chunk = line["key"].rsplit("_", 2)
        chunks = requests.setdefault(request_id, {})
        if line["codes"] is None:
            continue
        flat = np.frombuffer(base64.b64decode(line["codes"]), dtype="<i8")
        window = flat.reshape(codebooks, -1).T  # codebook-major -> [frames, Q]
        chunks[int(chunk)] = window[line["left_context"]:]
    empty = np.zeros((0, codebooks), dtype=np.int64)
    return [(rid, np.concatenate([c[k] for k in sorted(c)]) if c else empty) for rid, c in requests.items()]


def probe_site(folder: Path, out: Path) -> dict[str, str]:
    """The folder vllm-omni's server finds this plugin in (a distribution's metadata naming it under
    vLLM's `vllm.general_plugins` entry points), and the environment that turns it on."""
    dist = folder / f"{ENTRY_POINT}-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {ENTRY_POINT}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT} = codes_probe:register\n")
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(Path(__file__).resolve().parent)]),
            OUT_ENV: str(out)}
