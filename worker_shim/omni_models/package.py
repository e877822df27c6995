"""The installed vllm-omni package, imported without its `__init__.py`.

`sys.modules["vllm_omni"]` is set to a bare module whose `__path__` is the installed package
folder: `import vllm_omni.x.y` then runs x's and y's own files (and the `__init__.py` of the
subpackages on the way, which patch nothing) but never the top-level `__init__.py`, the only
importer of `patch.py`. Where the real package is already imported (its `vllm.general_plugins`
entry point, a user's import), it is left as it is and patches.py reports it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

from worker_shim.upstream.compat import VLLM_OMNI_PACKAGE

STAND_IN_MARK = "__omni_sidecar_stand_in__"


def installed_folder() -> Path | None:
    """The folder of the vllm-omni package on sys.path (found without importing it), or None."""
    loaded = sys.modules.get(VLLM_OMNI_PACKAGE)
    if loaded is not None:
        return Path(list(loaded.__path__)[0])
    try:
        spec = importlib.util.find_spec(VLLM_OMNI_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def stand_in_module(folder: Path) -> types.ModuleType:
    """A bare package module for vllm_omni whose submodules load from `folder`."""
    module = types.ModuleType(VLLM_OMNI_PACKAGE, "vllm-omni's package folder, its __init__.py not run")
    module.__path__ = [str(folder)]
    module.__spec__ = importlib.machinery.ModuleSpec(VLLM_OMNI_PACKAGE, None, is_package=True)
    module.__spec__.submodule_search_locations = [str(folder)]
    setattr(module, STAND_IN_MARK, True)
    return module


def is_stand_in(module: types.ModuleType | None) -> bool:
    return module is not None and bool(getattr(module, STAND_IN_MARK, False))


def real_package_loaded() -> bool:
    """Was vllm-omni's own `__init__.py` imported in this process?"""
    module = sys.modules.get(VLLM_OMNI_PACKAGE)
    return module is not None and not is_stand_in(module)


def install_stand_in() -> None:
    """Makes `import vllm_omni.…` load vllm-omni's modules without its `__init__.py` (idempotent)."""
    if VLLM_OMNI_PACKAGE in sys.modules:
        return  # the stand-in already, or the real package (reported by patches.py)
    folder = installed_folder()
    if folder is None:
        raise ImportError(f"vllm-omni is not installed here (no {VLLM_OMNI_PACKAGE} package on sys.path)")
    sys.modules[VLLM_OMNI_PACKAGE] = stand_in_module(folder)
