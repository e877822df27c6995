"""Start-up check: nothing vllm-omni's patches replace in vLLM comes from vllm_omni here.

Run in every process where the shim runs code (the plugin at start-up, the worker before and
after it loads the model). It works whatever the import order was: it asks each object where
it comes from (its `__module__`) rather than comparing it with a snapshot. Only modules already
loaded are read: a module loaded later comes from upstream's file, and patch.py imports every
module it patches, so a patch that ran leaves them loaded (and `vllm_omni.patch` with them).
The list of targets is compat.py's.
"""

from __future__ import annotations

import sys
from typing import Any

from worker_shim.upstream.compat import (VLLM_OMNI_PACKAGE, VLLM_OMNI_PATCH_ENTRIES, VLLM_OMNI_PATCH_MODULE,
                                         VLLM_OMNI_PATCH_TARGETS, VLLM_OMNI_REBOUND_NAMES, VLLM_OMNI_REQUEST_STATUS,
                                         ShimCompatError)
from worker_shim.omni_models.package import real_package_loaded

MESSAGE_ENTRIES = 8  # the error names this many (patches_applied() has them all)


def patches_applied() -> list[str]:
    """What of vllm-omni's patches is in this process, one entry each; [] when upstream is untouched."""
    found: list[str] = []
    if real_package_loaded():
        found.append(f"{VLLM_OMNI_PACKAGE}/__init__.py ran")
    if VLLM_OMNI_PATCH_MODULE in sys.modules:
        found.append(f"{VLLM_OMNI_PATCH_MODULE} imported")
    for module_name, dotted in VLLM_OMNI_PATCH_TARGETS:
        target = _loaded_attr(module_name, dotted)
        if target is not None and _from_vllm_omni(target):
            found.append(f"{module_name}.{dotted}")
    for module_name, dict_name, key in VLLM_OMNI_PATCH_ENTRIES:
        table = _loaded_attr(module_name, dict_name)
        if isinstance(table, dict) and key in table and _from_vllm_omni(table[key]):
            found.append(f"{module_name}.{dict_name}[{key!r}]")
    module_name, enum_name, members = VLLM_OMNI_REQUEST_STATUS
    enum = _loaded_attr(module_name, enum_name)
    if enum is not None:
        found += [f"{module_name}.{enum_name}.{m}" for m in members if m in getattr(enum, "__members__", {})]
    found += _rebound_names()
    return found


def require_unpatched(where: str) -> None:
    """Raises, in one line, if vllm-omni's patches are in this process."""
    found = patches_applied()
    if found:
        shown = ", ".join(found[:MESSAGE_ENTRIES]) + (f" and {len(found) - MESSAGE_ENTRIES} more"
                                                      if len(found) > MESSAGE_ENTRIES else "")
        raise ShimCompatError(
            f"omni-sidecar's shim runs on unmodified vLLM, but vllm-omni's patches are applied in this process "
            f"({where}): {shown}. vllm-omni's vllm.general_plugins entry point imports its package "
            "(and patch.py) in every vLLM process: start vLLM with VLLM_PLUGINS=omni_sidecar_shim (the shim "
            "then loads vllm-omni's model classes without the patches), and import nothing of vllm_omni "
            "yourself in the engine's processes.")


def _rebound_names() -> list[str]:
    """Loaded vLLM modules where one of the names patch.py rebinds holds a vllm_omni class."""
    out = []
    for module_name, module in list(sys.modules.items()):
        if "vllm" not in module_name or module_name.startswith(VLLM_OMNI_PACKAGE) or module is None:
            continue
        namespace = getattr(module, "__dict__", {})
        out += [f"{module_name}.{n}" for n in VLLM_OMNI_REBOUND_NAMES if n in namespace
                and _from_vllm_omni(namespace[n])]
    return out


def _loaded_attr(module_name: str, dotted: str) -> Any:
    obj: Any = sys.modules.get(module_name)
    for part in dotted.split("."):
        if obj is None:
            return None
        try:
            obj = getattr(obj, part, None)
        except Exception:  # a lazy attribute that fails to resolve holds no replacement
            return None
    return obj


def _from_vllm_omni(obj: Any) -> bool:
    """Defined in vllm_omni: the object itself, or the function a cached_property wraps."""
    try:
        modules = (getattr(obj, "__module__", None), getattr(getattr(obj, "func", None), "__module__", None))
    except Exception:  # an object whose attributes raise is not one of vllm-omni's replacements
        return False
    return any(isinstance(m, str) and m.startswith(VLLM_OMNI_PACKAGE) for m in modules)
