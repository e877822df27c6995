"""The Qwen3-Omni code predictor's sampling setting (worker_shim/omni_models/qwen3_omni/code_predictor.py),
which both Qwen3-Omni parity pipelines call in their talker's worker.

On fakes: the load format that sets it (vLLM's default loader, then greedy), and what the
read-back says, greedy in effect or not (not where a runner replays talker_mtp from a CUDA graph
captured before a setting made after the load: vllm-omni's graph wrapper, or the shim's own graphs).
Beside vllm-omni 0.26 on vLLM 0.26 (skipped elsewhere, saying why): vllm-omni's own
`Qwen3OmniMoeTalkerCodePredictor` on CPU (tests/support/qwen3_omni_code_predictor_job.py), with one
step whose codes all tie. As vllm-omni leaves it (top-k 50 / top-p 0.8 from the global random
generator), another random state gives other codes; top-k 1 alone still draws among the tied codes;
greedy gives the same codes whatever the random state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.support.paired_vllm_omni import build_tiny_qwen3_omni, paired_pythonpath, skip_unless_paired
from tests.support.procs import child_env
from worker_shim.omni_models.qwen3_omni.code_predictor import (GREEDY, GREEDY_LOAD_FORMAT, code_predictor_sampling,
                                                               register_greedy_load_format)


class FakePredictor:
    """The attributes of vllm-omni's CodePredictorWrapper the setting reads and sets."""

    def __init__(self) -> None:
        self._top_k, self._top_p = 50, 0.8
        self._wrapper_config = SimpleNamespace(sampling_mode="stored")

    def set_sampling_params(self, top_k: int = 50, top_p: float = 0.8) -> None:
        self._top_k, self._top_p = top_k, top_p


def worker(model, load_format="auto", runner=None):
    return SimpleNamespace(get_model=lambda: model, model_runner=runner or SimpleNamespace(),
                           vllm_config=SimpleNamespace(load_config=SimpleNamespace(load_format=load_format)))


def outer(predictor):
    return SimpleNamespace(talker=SimpleNamespace(code_predictor=predictor))  # vllm-omni's outer class


def test_the_greedy_load_format_loads_as_vllms_default_then_sets_greedy(monkeypatch, tmp_path):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    assert register_greedy_load_format() == GREEDY_LOAD_FORMAT == register_greedy_load_format()
    loader = get_model_loader(LoadConfig(load_format=GREEDY_LOAD_FORMAT))
    assert isinstance(loader, DefaultModelLoader) and loader.load_config.load_format == "auto"
    predictor = FakePredictor()
    monkeypatch.setattr(DefaultModelLoader, "load_model", lambda self, *a, **k: outer(predictor))
    assert loader.load_model(vllm_config=None, model_config=None).talker.code_predictor is predictor
    assert (predictor._top_k, predictor._top_p) == (GREEDY["top_k"], GREEDY["top_p"])


def test_sampling_read_back_and_when_greedy_is_in_effect():
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    own = code_predictor_sampling(worker(outer(FakePredictor())))
    assert own == {"top_k": 50, "top_p": 0.8, "mode": "stored", "load_format": "auto", "talker_mtp_graphed": False,
                   "greedy_in_effect": False}
    greedy = FakePredictor()
    greedy.set_sampling_params(**GREEDY)
    assert code_predictor_sampling(worker(outer(greedy)))["greedy_in_effect"]  # no graph: set whenever
    # A talker model itself (no outer class) has the code predictor directly.
    assert code_predictor_sampling(worker(SimpleNamespace(code_predictor=greedy)))["top_k"] == 1
    captured = SimpleNamespace(talker_mtp=CUDAGraphWrapper.__new__(CUDAGraphWrapper))  # vllm-omni's FULL graph
    shim = SimpleNamespace(omni_bridge=SimpleNamespace(mtp_graphs=object()))  # the shim's own talker_mtp graphs
    for runner in (captured, shim):
        late = code_predictor_sampling(worker(outer(greedy), "auto", runner))
        assert late["talker_mtp_graphed"] and not late["greedy_in_effect"]  # set after the capture, if at all
        assert code_predictor_sampling(worker(outer(greedy), GREEDY_LOAD_FORMAT, runner))["greedy_in_effect"]


def test_refuses_a_model_without_code_predictor():
    with pytest.raises(TypeError, match="code predictor"):
        code_predictor_sampling(worker(SimpleNamespace(talker=SimpleNamespace())))


def test_vllm_omni_code_predictor_is_greedy_whatever_the_random_state(tmp_path):
    skip_unless_paired()
    model = build_tiny_qwen3_omni(tmp_path / "model")
    result_path = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "-m", "tests.support.qwen3_omni_code_predictor_job", str(model),
                           str(result_path)], env=child_env(PYTHONPATH=paired_pythonpath()), timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    own, top_k_1, greedy = (result[k]["codes"] for k in ("vllm-omni", "top_k_1", "greedy"))
    assert result["vllm-omni"]["setting"] == {"top_k": 50, "top_p": 0.8}  # read back from vllm-omni's wrapper
    assert result["greedy"]["setting"] == GREEDY
    # Each setting: rows of [layer-0 code, then codebooks 1..15] per seed; the layer-0 code is the input's.
    for codes in (own, top_k_1, greedy):
        assert codes["0"][0][0] == codes["1"][0][0] and len(codes["0"][0]) == 16
    assert own["0"] != own["1"]  # vllm-omni's sampling follows the random state
    # top-k 1 keeps every tied code of the zero head's step; the noise picks one.
    assert [row[1] for row in top_k_1["0"]] != [row[1] for row in top_k_1["1"]]
    assert greedy["0"] == greedy["1"]
    assert len({row[1] for row in greedy["0"]}) == 1  # the tied step: one code (the sorted row's first), every row
