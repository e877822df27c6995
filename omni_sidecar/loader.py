"""Resolve `--hooks` into a hook set instance: a built-in name or `module:Class`."""

from __future__ import annotations

import importlib

from omni_sidecar.builtin_hooks import BUILTIN_HOOKS
from omni_sidecar.hooks import OmniHooks


class HookLoadError(RuntimeError):
    pass


def load_hooks(spec: str) -> OmniHooks:
    if spec in BUILTIN_HOOKS:
        return BUILTIN_HOOKS[spec]()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HookLoadError(
            f"--hooks {spec!r}: give a built-in set ({', '.join(BUILTIN_HOOKS)}) "
            "or module:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookLoadError(f"--hooks {spec!r}: cannot import {module_name!r}: {exc}") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, OmniHooks)):
        raise HookLoadError(f"--hooks {spec!r}: {attr!r} is not an OmniHooks subclass")
    return cls()
