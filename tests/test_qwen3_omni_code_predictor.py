"""The Qwen3-Omni code predictor's sampling setting (worker_shim/omni_models/qwen3_omni/code_predictor.py),
which both Qwen3-Omni parity pipelines call in their talker's worker.

On fakes: what it sets and reads back, and whether it says the setting is in effect (not where a
runner replays talker_mtp from a CUDA graph: vllm-omni's graph wrapper, or the shim's own graphs).
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
from worker_shim.omni_models.qwen3_omni.code_predictor import GREEDY, set_code_predictor_sampling


class FakePredictor:
    """The attributes of vllm-omni's CodePredictorWrapper the setting reads and sets."""

    def __init__(self) -> None:
        self._top_k, self._top_p = 50, 0.8
        self._wrapper_config = SimpleNamespace(sampling_mode="stored")

    def set_sampling_params(self, top_k: int = 50, top_p: float = 0.8) -> None:
        self._top_k, self._top_p = top_k, top_p


def worker(model, runner=None):
    return SimpleNamespace(get_model=lambda: model, model_runner=runner or SimpleNamespace())


def test_greedy_is_set_on_the_talkers_code_predictor_and_read_back():
    predictor = FakePredictor()
    outer = SimpleNamespace(talker=SimpleNamespace(code_predictor=predictor))  # vllm-omni's outer class
    got = set_code_predictor_sampling(worker(outer), "greedy")
    assert (predictor._top_k, predictor._top_p) == (GREEDY["top_k"], GREEDY["top_p"])
    assert got == {"choice": "greedy", **GREEDY, "mode": "stored", "talker_mtp_graphed": False, "in_effect": True}
    # A talker model itself (no outer class) has the code predictor directly.
    assert set_code_predictor_sampling(worker(SimpleNamespace(code_predictor=FakePredictor())), "greedy")["top_k"] == 1


def test_vllm_omni_choice_leaves_its_sampling():
    predictor = FakePredictor()
    got = set_code_predictor_sampling(worker(SimpleNamespace(talker=SimpleNamespace(code_predictor=predictor))),
                                      "vllm-omni")
    assert (predictor._top_k, predictor._top_p) == (50, 0.8)
    assert got["top_k"] == 50 and got["top_p"] == 0.8 and got["in_effect"]


def test_not_in_effect_where_a_graph_replays_talker_mtp():
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    model = SimpleNamespace(talker=SimpleNamespace(code_predictor=FakePredictor()))
    captured = CUDAGraphWrapper.__new__(CUDAGraphWrapper)  # vllm-omni's runner: talker_mtp in a FULL graph
    got = set_code_predictor_sampling(worker(model, SimpleNamespace(talker_mtp=captured)), "greedy")
    assert got["talker_mtp_graphed"] and not got["in_effect"]
    shim = SimpleNamespace(omni_bridge=SimpleNamespace(mtp_graphs=object()))  # the shim's own talker_mtp graphs
    assert not set_code_predictor_sampling(worker(model, shim), "greedy")["in_effect"]
    eager = SimpleNamespace(talker_mtp=lambda *rows: rows, omni_bridge=SimpleNamespace(mtp_graphs=None))
    assert set_code_predictor_sampling(worker(model, eager), "greedy")["in_effect"]


def test_refuses_an_unknown_choice_and_a_model_without_code_predictor():
    with pytest.raises(ValueError, match="greedy"):
        set_code_predictor_sampling(worker(SimpleNamespace()), "random")
    with pytest.raises(TypeError, match="code predictor"):
        set_code_predictor_sampling(worker(SimpleNamespace(talker=SimpleNamespace())), "greedy")


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
    assert result["vllm-omni"]["setting"]["top_k"] == 50 and result["vllm-omni"]["setting"]["top_p"] == 0.8
    assert result["greedy"]["setting"] == {"choice": "greedy", **GREEDY, "mode": "stored",
                                           "talker_mtp_graphed": False, "in_effect": True}
    # Each setting: rows of [layer-0 code, then codebooks 1..15] per seed; the layer-0 code is the input's.
    for codes in (own, top_k_1, greedy):
        assert codes["0"][0][0] == codes["1"][0][0] and len(codes["0"][0]) == 16
    assert own["0"] != own["1"]  # vllm-omni's sampling follows the random state
    # top-k 1 keeps every tied code of the zero head's step; the noise picks one.
    assert [row[1] for row in top_k_1["0"]] != [row[1] for row in top_k_1["1"]]
    assert greedy["0"] == greedy["1"]
    assert len({row[1] for row in greedy["0"]}) == 1  # the tied step: one code (the sorted row's first), every row
