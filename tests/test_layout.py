"""Package boundaries and the shim's small pure pieces (no vLLM engine needed)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str | Path) -> set[str]:
    """Top-level names a package imports anywhere (also inside functions, also by import_module)."""
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")):
                names.add(node.args[0].value.split(".")[0])
    return names


@pytest.mark.parametrize("package, forbidden", [
    ("proto", {"vllm", "torch", "worker_shim", "omni_sidecar", "omni_arena"}),
    ("omni_sidecar", {"vllm", "worker_shim"}),
    ("omni_arena", {"vllm", "worker_shim", "omni_sidecar"}),
    ("worker_shim", {"omni_sidecar"}),
])
def test_import_direction(package, forbidden):
    found = _imports(package)
    assert found, "the scan found no imports at all"
    assert not (found & forbidden), f"{package} imports {sorted(found & forbidden)}"


def test_the_import_scan_sees_vllm_where_it_is():
    assert "vllm" in _imports("worker_shim")
    assert {"proto", "omni_arena"} <= _imports("worker_shim")


def test_the_import_scan_sees_every_form_of_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "import os.path as p\n"
        "def f():\n"
        "    from omni_sidecar.client import SidecarClient\n"
        "    import importlib\n"
        "    return importlib.import_module('omni_arena.views'), __import__('zmq')\n"
        "from . import sibling\n"
    )
    assert _imports(tmp_path / "pkg") == {"os", "omni_sidecar", "importlib", "omni_arena", "zmq"}


def test_embeds_buffer_is_on_only_when_hooks_can_overlay():
    from worker_shim.model.embeds import wanted

    assert wanted("auto", "prefill", False) and wanted("auto", "always", False)
    assert not wanted("auto", "never", False)
    assert not wanted("auto", "prefill", True)  # multimodal models, prompt embeds: upstream builds them
    assert wanted("on", "never", False) and not wanted("off", "always", False)


def test_graphs_reading_the_embeds_buffer_get_their_own_compile_cache_key():
    from worker_shim.model.embeds import GRAPH_KEY, mark_compiled_graph

    cfg = SimpleNamespace(additional_config={"omni_sidecar": {"endpoint": "ipc:///x"}})
    mark_compiled_graph(cfg)
    assert cfg.additional_config[GRAPH_KEY] == "inputs_embeds"
    assert cfg.additional_config["omni_sidecar"] == {"endpoint": "ipc:///x"}
    with pytest.raises(RuntimeError, match="additional_config"):
        mark_compiled_graph(SimpleNamespace(additional_config=object()))


def test_shim_config_checks_arena_and_embeds_settings(monkeypatch):
    from worker_shim.config import ShimConfig

    vcfg = SimpleNamespace(additional_config={"omni_sidecar": {"arena": "shm", "embeds_buffer": "on",
                                                               "embeds_graphs": "off"}})
    cfg = ShimConfig.from_vllm(vcfg)
    assert (cfg.arena, cfg.embeds_buffer, cfg.embeds_graphs) == ("shm", "on", "off")
    assert ShimConfig.from_vllm(SimpleNamespace(additional_config={})).embeds_graphs == "auto"
    assert ShimConfig.from_vllm(SimpleNamespace(additional_config={})).talker_mtp_graphs == "auto"
    with pytest.raises(ValueError, match="talker_mtp_graphs 'on': use one of auto, off"):
        ShimConfig.from_vllm(SimpleNamespace(additional_config={"omni_sidecar": {"talker_mtp_graphs": "on"}}))
    with pytest.raises(ValueError, match="embeds_graphs 'eager': use one of auto, off"):
        ShimConfig.from_vllm(SimpleNamespace(additional_config={"omni_sidecar": {"embeds_graphs": "eager"}}))
    assert cfg.ring.enabled  # the environment's default
    ringless = ShimConfig.from_vllm(SimpleNamespace(additional_config={"omni_sidecar": {"ring": 0, "ring_spin_us": 50}}))
    assert (ringless.ring.enabled, ringless.ring.spin_us) == (False, 50)
    monkeypatch.setenv("OMNI_SIDECAR_ARENA", "nvlink")
    with pytest.raises(ValueError, match="auto, shm, cuda_ipc"):
        ShimConfig.from_vllm(SimpleNamespace(additional_config={}))


def test_shim_defaults_are_the_shared_ones(monkeypatch):
    from proto import settings
    from worker_shim.config import RingConfig, ShimConfig

    for name in (settings.ENV_RING, settings.ENV_RING_KIB, settings.ENV_RING_SPIN_US, settings.ENV_RING_SLEEP_MS,
                 "OMNI_SIDECAR_LOSS_POLICY", "OMNI_SIDECAR_HIDDEN_SLOTS"):
        monkeypatch.delenv(name, raising=False)
    ring = RingConfig.from_env({})
    assert (ring.capacity_kib, ring.spin_us, ring.sleep_ms) == (settings.RING_KIB, settings.RING_SPIN_US,
                                                                settings.RING_SLEEP_MS)
    cfg = ShimConfig.from_vllm(SimpleNamespace(additional_config={}))
    assert cfg.ring == RingConfig() == ring
    assert (cfg.loss_policy, cfg.hidden_slots) == ("fail-all", 2)
    with pytest.raises(ValueError, match="fail-payload"):
        ShimConfig.from_vllm(SimpleNamespace(additional_config={"omni_sidecar": {"loss_policy": "fail-some"}}))


def test_the_shim_is_selected_by_its_endpoint_or_its_switch(monkeypatch):
    from worker_shim.config import shim_selected

    monkeypatch.delenv("OMNI_SIDECAR_ENDPOINT", raising=False)
    monkeypatch.delenv("OMNI_SIDECAR", raising=False)
    assert not shim_selected()
    monkeypatch.setenv("OMNI_SIDECAR", "1")
    assert shim_selected()
    monkeypatch.delenv("OMNI_SIDECAR")
    monkeypatch.setenv("OMNI_SIDECAR_ENDPOINT", "ipc:///tmp/x.sock")
    assert shim_selected()


def test_cuda_ipc_is_not_chosen_without_cuda():
    import torch

    from omni_arena.cuda_ipc import check_torch, cuda_ipc_available

    check_torch()  # this torch has every name the arena uses
    assert not cuda_ipc_available(torch.device("cpu"))
