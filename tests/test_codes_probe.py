"""deploy/gpu/codes_probe.py: vllm-omni's speech server's codes as its talker hands them over, read
back per request; and omni-serve's --codes-log format.

The probe's connector is created through vllm-omni's own registry (the paired vllm-omni, its
package's __init__ not run) and puts through its own SharedMemoryConnector; each put is read back
with its get, so nothing stays in /dev/shm.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "gpu"))

import codes_probe  # noqa: E402

Q = 4


def chunks_as_vllm_omni_cuts_them(codes: np.ndarray, initial: int = 1, size: int = 25, left: int = 72):
    """(window [frames, Q], left context) per chunk: the first `initial` frames, then `size` at a
    time, the last whatever is left; each window with up to `left` frames before it (its
    talker2code2wav_async_chunk)."""
    out, start = [], 0
    bounds = [initial] + list(range(initial + size, codes.shape[0], size)) + [codes.shape[0]]
    for end in sorted(set(bounds)):
        first = max(0, start - left)
        out.append((codes[first:end], start - first))
        start = end
    return out


def lines(request_id: str, codes: np.ndarray) -> list[tuple[str, np.ndarray | None, int]]:
    got = [(f"{request_id}_0_{k}", window, ctx) for k, (window, ctx) in enumerate(chunks_as_vllm_omni_cuts_them(codes))]
    return got + [(f"{request_id}_0_{len(got)}", None, 0)]  # the finished marker: no codes


def test_each_requests_codes_come_back_from_its_chunks_whatever_the_interleaving(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, (48, Q)), rng.integers(0, 64, (30, Q))
    out = tmp_path / "probe.jsonl"
    la, lb = lines("speech-a_1", a), lines("speech-b", b)  # a request id with "_" in it
    for key, window, ctx in [la[0], lb[0], la[1], lb[1], lb[2], la[2], la[3], lb[3]]:
        audio = None if window is None else torch.from_numpy(window.T.reshape(-1))
        data = SimpleNamespace(codes=SimpleNamespace(audio=audio), meta=SimpleNamespace(left_context_size=ctx))
        codes_probe.record(out, key, data)
    got = codes_probe.read_probe(out, Q)
    assert [rid for rid, _ in got] == ["speech-a_1", "speech-b"]
    np.testing.assert_array_equal(got[0][1], a)
    np.testing.assert_array_equal(got[1][1], b)


@pytest.fixture(scope="module")
def vllm_omni_modules():
    """vllm-omni's connector factory and payload structs, its package's __init__ not run; its modules
    gone from sys.modules after. Its connectors import its config, which imports against the vLLM it
    was built for: beside vLLM 0.26 with vllm-omni 0.26 (tests/support/paired_vllm_omni.py), skipped
    elsewhere, saying why."""
    from tests.support.paired_vllm_omni import VLLM_OMNI, skip_unless_paired
    from worker_shim.omni_models.package import stand_in_module

    skip_unless_paired()
    saved = {n: m for n, m in sys.modules.items() if n == "vllm_omni" or n.startswith("vllm_omni.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["vllm_omni"] = stand_in_module(VLLM_OMNI / "vllm_omni")
    try:  # imported once: its modules register their metrics as they load
        yield (importlib.import_module("vllm_omni.distributed.omni_connectors.factory"),
               importlib.import_module("vllm_omni.distributed.omni_connectors.utils.config"),
               importlib.import_module("vllm_omni.distributed.omni_connectors.connectors.shm_connector"),
               importlib.import_module("vllm_omni.data_entry_keys"))
    finally:
        for name in [n for n in sys.modules if n == "vllm_omni" or n.startswith("vllm_omni.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_the_probe_records_what_vllm_omnis_own_connector_puts(vllm_omni_modules, tmp_path, monkeypatch):
    factory, config, shm, keys = vllm_omni_modules
    monkeypatch.setenv(codes_probe.OUT_ENV, str(tmp_path / "probe.jsonl"))
    codes_probe.register()
    codes_probe.register()  # every vLLM process of the server calls it; once is registered
    connector = factory.OmniConnectorFactory.create_connector(
        config.ConnectorSpec(name=codes_probe.RECORDING_CONNECTOR, extra={"stage_id": 0}))
    assert isinstance(connector, shm.SharedMemoryConnector)
    codes = np.random.default_rng(1).integers(0, 64, (48, Q))
    for key, window, ctx in lines("speech-x", codes):
        audio = torch.empty(0, dtype=torch.long) if window is None else torch.from_numpy(window.T.reshape(-1).copy())
        payload = keys.OmniPayloadStruct(codes=keys.CodesStruct(audio=audio),
                                         meta=keys.MetaStruct(left_context_size=ctx,
                                                              finished=torch.tensor(window is None)))
        ok, _, handle = connector.put("0", "1", key, payload)
        assert ok
        got, _ = connector.get("0", "1", key, handle)  # what its code2wav reads: the same payload
        assert torch.equal(got["codes"]["audio"] if isinstance(got, dict) else got.codes.audio, audio)
        connector.cleanup(key)
    assert not list(Path("/dev/shm").glob("*speech-x*"))
    ((rid, back),) = codes_probe.read_probe(tmp_path / "probe.jsonl", Q)
    assert rid == "speech-x"
    np.testing.assert_array_equal(back, codes)


def test_the_probe_site_names_the_plugin_for_vllms_loader(tmp_path):
    import importlib.metadata as md

    env = codes_probe.probe_site(tmp_path / "site", tmp_path / "out.jsonl")
    dists = list(md.distributions(path=[str(tmp_path / "site")]))
    (ep,) = [ep for d in dists for ep in d.entry_points if ep.group == "vllm.general_plugins"]
    assert (ep.name, ep.value) == (codes_probe.ENTRY_POINT, "codes_probe:register")
    assert env[codes_probe.OUT_ENV] == str(tmp_path / "out.jsonl")
    assert str(Path(codes_probe.__file__).parent) in env["PYTHONPATH"].split(":")


def test_omni_serves_codes_log_reads_back_what_it_wrote(tmp_path):
    from omni_serve.speech.codes_log import CodesLog, read_codes_log

    log = CodesLog(tmp_path / "codes.jsonl")
    first, second = np.arange(12).reshape(3, 4), np.full((5, 4), 2047)
    log.write("a", first)
    log.write("b", second)
    log.close()
    got = read_codes_log(tmp_path / "codes.jsonl")
    assert [rid for rid, _ in got] == ["a", "b"]
    np.testing.assert_array_equal(got[0][1], first)
    np.testing.assert_array_equal(got[1][1], second)


def test_the_probe_reads_back_the_codes_vllm_omnis_own_qwen3_tts_hand_over_cuts(vllm_omni_modules, tmp_path):
    """vllm-omni's own talker -> code2wav async-chunk hand-over (its first chunk a frame, then 25, 72
    of left context, as its deploy config sets them), fed the talker's codes a frame a step as its
    chunk adapter feeds it, each chunk put under the adapter's key: the probe's reading gives the
    talker's codes back."""
    from collections import defaultdict

    handover = importlib.import_module("vllm_omni.model_executor.stage_input_processors.qwen3_tts")
    frames = torch.from_numpy(np.random.default_rng(2).integers(1, 64, (48, 16)))
    config = {"extra": {"codec_chunk_frames": 25, "codec_left_context_frames": 72, "initial_codec_chunk_frames": 1}}
    adapter = SimpleNamespace(code_prompt_token_ids=defaultdict(list), put_req_chunk=defaultdict(int),
                              ramp_chunk_count=defaultdict(int), scheduler_max_num_seqs=64,
                              connector=SimpleNamespace(config=config))
    request = SimpleNamespace(external_req_id="speech-7", is_finished=lambda: False, additional_information=None)
    out = tmp_path / "probe.jsonl"
    for i in range(frames.shape[0]):
        payload = handover.talker2code2wav_async_chunk(adapter, {"codes": {"audio": frames[:i + 1]}}, request,
                                                       is_finished=i == frames.shape[0] - 1)
        if payload is not None:
            codes_probe.record(out, f"speech-7_0_{adapter.put_req_chunk['speech-7']}", payload)
            adapter.put_req_chunk["speech-7"] += 1  # as its adapter does after a put
    assert adapter.put_req_chunk["speech-7"] >= 3  # a frame, 25, the rest
    ((rid, back),) = codes_probe.read_probe(out, 16)
    assert rid == "speech-7"
    np.testing.assert_array_equal(back, frames.numpy())
