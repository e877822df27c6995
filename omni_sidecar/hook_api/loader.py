"""Resolve `--hooks` into a hook set instance: a built-in name or `module:Class`."""

from __future__ import annotations

import importlib

from omni_sidecar.errors import OmniSidecarError
from omni_sidecar.hook_sets.reference import builtin_hooks
from omni_sidecar.serve.config import BUILTIN_NAMES
from omni_sidecar.hook_api.hook_set import OmniHooks


class HookLoadError(OmniSidecarError, RuntimeError):
    pass


def parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise HookLoadError(f"--hook-option {pair!r}: expected key=value")
        options[key.replace("-", "_")] = value
    return options


def load_hooks(spec: str, options: dict[str, str] | None = None) -> OmniHooks:
    options = options or {}
    if spec in BUILTIN_NAMES:
        return _instantiate(spec, builtin_hooks()[spec], options)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HookLoadError(
            f"--hooks {spec!r}: give a built-in set ({', '.join(BUILTIN_NAMES)}) "
            "or module:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookLoadError(f"--hooks {spec!r}: cannot import {module_name!r}: {exc}") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, OmniHooks)):
        raise HookLoadError(f"--hooks {spec!r}: {attr!r} is not an OmniHooks subclass")
    return _instantiate(spec, cls, options)


def _instantiate(spec: str, cls: type[OmniHooks], options: dict[str, str]) -> OmniHooks:
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise HookLoadError(f"--hooks {spec!r} with options {options}: {exc}") from exc
