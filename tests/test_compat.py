"""The shim's start-up check against vLLM's seams, on fakes (no engine, no real vLLM import).

A fake `vllm` package is built from worker_shim/upstream/compat.py's own lists, so every
seam the shim declares is present unless a test takes one away.
"""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from proto.messages import HookNeeds
from worker_shim.upstream import compat
from worker_shim.upstream.compat import ShimCompatError, check_upstream
from worker_shim.upstream import runner as runner_module
from worker_shim.upstream.runner import SidecarRunnerMixin, swap_class
from worker_shim.upstream.worker import ShimWorkerMixin

RECORD_FIELDS = {
    "InputBatch": ("__dataclass_fields__", compat.INPUT_BATCH_FIELDS),
    "ExecuteModelState": ("_fields", compat.EXECUTE_MODEL_STATE_FIELDS),
    "SchedulerOutput": ("__dataclass_fields__", compat.SCHEDULER_OUTPUT_FIELDS),
}


class FakeVllm:
    """Fake modules in sys.modules for every (module, dotted name) the shim declares."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
        self.monkeypatch = monkeypatch
        self.modules: dict[str, types.ModuleType] = {}
        for module, dotted in (compat.UPSTREAM_NAMES + compat.VLLM_OMNI_LOADER_NAMES + compat.CPU_NAMES
                               + compat.CUDA_NAMES):
            self._define(module, dotted)
        self.modules["vllm"].__version__ = version
        for name, mod in self.modules.items():
            monkeypatch.setitem(sys.modules, name, mod)

    def _define(self, module: str, dotted: str) -> None:
        obj = self.modules.setdefault(module, types.ModuleType(module))
        *owners, last = dotted.split(".")
        for part in owners:
            if not hasattr(obj, part):
                setattr(obj, part, type(part, (), self._record(part)))
            obj = getattr(obj, part)
        if not hasattr(obj, last):
            setattr(obj, last, type(last, (), self._record(last)))

    @staticmethod
    def _record(name: str) -> dict:
        kind, fields = RECORD_FIELDS.get(name, (None, []))
        if kind == "_fields":
            return {"_fields": tuple(fields)}
        return {"__dataclass_fields__": dict.fromkeys(fields)} if kind else {}

    def drop(self, module: str, dotted: str) -> None:
        *owners, last = dotted.split(".")
        obj = self.modules[module]
        for part in owners:
            obj = getattr(obj, part)
        delattr(obj, last)

    def drop_field(self, record: str, module: str, field: str) -> None:
        cls = getattr(self.modules[module], record)
        kind, fields = RECORD_FIELDS[record]
        remaining = [f for f in fields if f != field]
        setattr(cls, kind, tuple(remaining) if kind == "_fields" else dict.fromkeys(remaining))


@pytest.fixture
def fake_vllm(monkeypatch):
    return lambda version="0.32.0": FakeVllm(monkeypatch, version)


def test_every_declared_seam_present_passes_without_a_warning(fake_vllm, caplog):
    fake_vllm("0.29.0")
    with caplog.at_level(logging.WARNING, logger="vllm.omni_sidecar.shim.compat"):
        check_upstream("cpu")
    assert caplog.records == []


@pytest.mark.parametrize("module, dotted", compat.UPSTREAM_NAMES[1:] + compat.VLLM_OMNI_LOADER_NAMES + compat.CPU_NAMES)
def test_a_missing_upstream_name_is_refused_naming_it_and_the_version(fake_vllm, module, dotted):
    fake_vllm("0.30.0").drop(module, dotted)
    with pytest.raises(ShimCompatError) as err:
        check_upstream("cpu")
    assert f"{module}.{dotted}" in str(err.value) and "vLLM 0.30.0" in str(err.value)


@pytest.mark.parametrize("record, module, field", [
    ("InputBatch", "vllm.v1.worker.gpu.input_batch", "prefill_len_np"),
    ("ExecuteModelState", "vllm.v1.worker.gpu.model_runner", "hidden_states"),
    ("SchedulerOutput", "vllm.v1.core.sched.output", "preempted_req_ids"),
])
def test_a_missing_record_field_is_refused_naming_it(fake_vllm, record, module, field):
    fake_vllm("0.27.1").drop_field(record, module, field)
    with pytest.raises(ShimCompatError) as err:
        check_upstream("cpu")
    assert f"{record}.{field}" in str(err.value) and "vLLM 0.27.1" in str(err.value)


def test_a_newer_vllm_whose_seams_check_out_runs_with_a_warning_naming_the_last_tested(fake_vllm, caplog):
    fake_vllm("0.35.1")
    with caplog.at_level(logging.WARNING, logger="vllm.omni_sidecar.shim.compat"):
        check_upstream("cpu")
    (record,) = caplog.records
    newest = "{}.{}".format(*compat.TESTED["cpu"][1])
    assert "0.35.1" in record.getMessage() and f"... {newest}" in record.getMessage()


def test_on_cuda_a_minor_past_the_gpu_tested_one_warns_naming_it(fake_vllm, caplog):
    fake_vllm("0.30.0")
    with caplog.at_level(logging.WARNING, logger="vllm.omni_sidecar.shim.compat"):
        check_upstream("cuda")
    (record,) = caplog.records
    gpu_last = "{}.{}".format(*compat.TESTED["cuda"][1])
    assert "0.30.0" in record.getMessage() and f"cuda ({gpu_last};" in record.getMessage()


def test_a_newer_vllm_lacking_seams_is_refused_with_the_missing_names(fake_vllm):
    fake = fake_vllm("0.35.1")
    fake.drop("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens")
    fake.drop_field("InputBatch", "vllm.v1.worker.gpu.input_batch", "query_start_loc_np")
    with pytest.raises(ShimCompatError) as err:
        check_upstream("cpu")
    msg = str(err.value)
    assert "GPUModelRunner.sample_tokens" in msg and "newer than the last tested" in msg and "0.35.1" in msg


def test_the_worker_refuses_before_upstream_builds_anything(fake_vllm):
    fake_vllm("0.31.0").drop("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.add_requests")
    built = []

    class UpstreamWorker:
        def init_device(self) -> None:
            built.append(True)

    worker = type("Worker", (ShimWorkerMixin, UpstreamWorker), {})()
    with pytest.raises(ShimCompatError, match="GPUModelRunner.add_requests"):
        worker.init_device()
    assert built == []


# The live runner and model state, checked in load_model (start-up), not on the first step.


class UpstreamModelState:
    def prepare_inputs(self, input_batch, req_states):
        return {}

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        return {}


class StateWithoutDummyInputs:
    def prepare_inputs(self, input_batch, req_states):
        return {}


class UpstreamRunner:
    """What load_model leaves behind, minus what a test leaves out."""

    def __init__(self, state_cls=UpstreamModelState, leave_out: str = "") -> None:
        self.loaded = False
        self._state_cls, self._leave_out = state_cls, leave_out
        for name in compat.RUNNER_INIT_ATTRS:
            if name != leave_out:
                setattr(self, name, SimpleNamespace(model_config=SimpleNamespace()))

    def load_model(self, *args, **kwargs) -> None:
        self.loaded = True
        after = {"model_state": self._state_cls(), "model": object(), "execute_model_state": None,
                 "req_states": object()}
        for name, value in after.items():
            if name != self._leave_out:
                setattr(self, name, value)


@pytest.fixture(autouse=True)
def plain_model_class(monkeypatch):
    """The fakes carry no real model config: the model class is a plain one (no vllm-omni hooks)."""
    monkeypatch.setattr(runner_module, "model_class_has_hooks", lambda vllm_config: False)


def shimmed(runner: UpstreamRunner) -> UpstreamRunner:
    runner.omni_link = SimpleNamespace(embeds_setting="off", needs=HookNeeds())
    swap_class(runner, SidecarRunnerMixin)
    return runner


@pytest.fixture
def version_031(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.31.0")


def test_a_model_state_lacking_a_seam_is_refused_at_load_model(version_031):
    runner = shimmed(UpstreamRunner(StateWithoutDummyInputs))
    with pytest.raises(ShimCompatError) as err:
        runner.load_model()
    assert "model_state.prepare_dummy_inputs" in str(err.value) and "vLLM 0.31.0" in str(err.value)


@pytest.mark.parametrize("attr", compat.RUNNER_ATTRS)
def test_a_runner_lacking_a_seam_is_refused_at_load_model(version_031, attr):
    runner = shimmed(UpstreamRunner(leave_out=attr))
    with pytest.raises(ShimCompatError) as err:
        runner.load_model()
    assert f"GPUModelRunner.{attr}" in str(err.value) and "vLLM 0.31.0" in str(err.value)
    # What the runner has before upstream loads is checked before upstream loads.
    assert runner.loaded == (attr not in compat.RUNNER_INIT_ATTRS)


def test_a_complete_runner_loads_and_its_model_state_is_intercepted(version_031):
    runner = shimmed(UpstreamRunner())
    runner.load_model()
    assert runner.loaded and isinstance(runner.model_state, UpstreamModelState)
    assert type(runner.model_state).__name__ == "OmniUpstreamModelState"


# What differs between the minors, read through compat only.


def test_dummy_runs_are_recognised_by_keyword_or_position():
    assert compat.is_dummy_run((None, True), {})
    assert compat.is_dummy_run((), {"dummy_run": True, "context_len": 5})
    assert not compat.is_dummy_run((None,), {"randomize_inputs": True})
    assert not compat.is_dummy_run((), {})


def test_prompt_len_before_and_after_upstream_had_the_property():
    assert compat.prompt_len_of(SimpleNamespace(prompt_len=7, prompt_token_ids=None)) == 7  # 0.29+
    assert compat.prompt_len_of(SimpleNamespace(prompt_token_ids=[1, 2, 3])) == 3  # 0.26-0.28
    embeds_only = SimpleNamespace(prompt_token_ids=None, prompt_embeds=np.zeros((11, 4)))
    assert compat.prompt_len_of(embeds_only) == 11


def test_prefill_flags_from_upstream_or_derived():
    """Chosen once at start-up: upstream's own array when its InputBatch has one, else derived."""
    from worker_shim.step.batch import BatchReader

    derived = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_np=np.array([0, 5, 9]),
                              prefill_len_np=np.array([4, 5, 9]))
    assert BatchReader(own_prefill_flags=False).prefilling(derived).tolist() == [True, False]
    own = SimpleNamespace(**vars(derived), is_prefilling_np=np.array([False, True]))
    assert BatchReader(own_prefill_flags=True).prefilling(own).tolist() == [False, True]
    assert compat.has_own_prefill_flags()  # the installed vLLM's InputBatch carries them


def test_v2_prompt_embeds_from_0_29():
    assert not compat.v2_takes_prompt_embeds("0.28.0")
    assert compat.v2_takes_prompt_embeds("0.29.0") and compat.v2_takes_prompt_embeds("0.32.0")
    assert compat.v2_takes_prompt_embeds("0.33.0.dev12+gabc")


def test_every_check_the_compat_matrix_runs_names_a_test_that_exists():
    """`make compat` runs these node ids on every vLLM release: a renamed test must not leave a cell that fails
    for a missing test."""
    import ast
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("compat_tool", root / "tools" / "compat.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    node_ids = [n for ids in tool.CHECKS.values() for n in ids]
    assert node_ids
    for node_id in node_ids:
        path, _, name = node_id.partition("::")
        tree = ast.parse((root / path).read_text())
        names = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        assert name.split("[")[0] in names, node_id


@pytest.mark.parametrize("module, dotted", compat.QWEN3_OMNI_PARITY_NAMES)
def test_the_parity_drivers_upstream_names_resolve_in_the_installed_vllm(module, dotted):
    assert compat._resolve(module, dotted) is not None  # raises ImportError / AttributeError where missing
