"""Qwen2-VL's torchvision-only image module, pointed at its PIL twin, in every process that has
this folder on sys.path (Python imports `sitecustomize` at start-up).

The CPU venv has no torchvision (a CUDA torchvision does not load against CPU torch), and vLLM's
qwen2_vl, which its Qwen2.5-Omni and Qwen3-Omni thinkers import, takes `smart_resize` from
transformers' `image_processing_qwen2_vl`, which imports torchvision; the PIL module defines the
same function (tests/support/vl_model.py does this in one process). vLLM imports it in processes
of its own too (the registry's inspection subprocess, spawned engines), hence a start-up hook.
Nothing is imported until something asks for that module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIAS = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
TARGET = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilTwin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != ALIAS or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(TARGET)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _PilTwin())
